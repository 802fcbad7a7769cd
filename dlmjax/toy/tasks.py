"""Seeded toy tasks with exact scorers, and GSM8K final-answer handling.

Two tasks, both written in the character tokenizer's alphabet (``chr(32..126)`` and newline):

``toy-arith``
    Multi-step chain arithmetic in GSM8K style. The prompt is an expression, the target works it
    out one operation per line and ends with a ``#### N`` answer line::

        prompt  "7+12-5\\n"
        target  "7+12=19\\n19-5=14\\n#### 14"

    Expressions are evaluated strictly LEFT TO RIGHT, with no operator precedence (``2+3*4`` is
    ``(2+3)*4 = 20``); every intermediate value stays in ``[0, max_value]`` (a step that would leave
    the range is resampled). The scorer checks only the number on the first ``####`` line.

``toy-constraint``
    Give ``k`` distinct digits that sum to a target::

        prompt  "4 distinct digits, sum 17\\n"
        target  "3 5 9 0"

    Most prompts have many valid answers (several digit sets, in any order), and the tokens are
    jointly constrained: each digit is only right given the others. A verifier scores any answer.

Why toy-constraint exists: toy-arith is deterministic (one answer per prompt), so a model that has
learnt it can commit many tokens per step at little cost. Methods that commit tokens in parallel
(and the accelerators that decide how many to commit) only show their failure mode on a task where
independently chosen positions conflict: picking every digit at once from its own marginal yields
repeated digits or a wrong sum. Its training targets are uniformly random valid answers, so the
training data holds many answers per prompt.

Each task has ``name``, ``sample(rng)``, ``generate(n, seed)`` (deterministic per seed, never global
random state) and ``score(example, completion)``. ``TASKS``/``get_task`` look them up by name.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

from dlmjax.validation import InputError

__all__ = [
    "ArithConfig", "ArithTask", "ConstraintConfig", "ConstraintTask", "Example", "TASKS", "Task",
    "extract_final_number", "get_task", "gsm8k_correct", "numbers_in", "plain_numbers",
]


@dataclass(frozen=True)
class Example:
    """One problem: the prompt, a training completion (no EOS) and task-specific facts for scoring."""

    prompt: str
    target: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Example: ...

    def generate(self, n: int, seed: int) -> list[Example]: ...

    def score(self, example: Example, completion: str) -> bool: ...


class _Generate:
    def sample(self, rng: random.Random) -> Example:  # pragma: no cover - overridden
        raise NotImplementedError

    def generate(self, n: int, seed: int) -> list[Example]:
        """``n`` examples drawn from ``random.Random(seed)``: the same seed gives the same list."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]


def _first_line_after(text: str, marker: str) -> str | None:
    if marker not in text:
        return None
    return text.split(marker, 1)[1].split("\n", 1)[0].strip()


# ---------------------------------------------------------------------------------------------- arith

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithConfig:
    """toy-arith parameters. ``*`` (off by default) takes its right operand from ``[0, mul_max_operand]``."""

    max_operand: int = 20
    min_ops: int = 2
    max_ops: int = 3
    ops: tuple[str, ...] = ("+", "-")
    max_value: int = 99
    mul_max_operand: int = 5

    def __post_init__(self) -> None:
        if not self.ops or any(op not in _APPLY for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {sorted(_APPLY)}, got {self.ops!r}")
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if not 0 <= self.max_operand <= self.max_value or self.mul_max_operand < 0:
            raise ValueError("need 0 <= max_operand <= max_value and mul_max_operand >= 0")


@dataclass(frozen=True)
class ArithTask(_Generate):
    """Chain arithmetic, evaluated left to right (no precedence), intermediates in ``[0, max_value]``."""

    config: ArithConfig = ArithConfig()
    name: str = "toy-arith"

    def sample(self, rng: random.Random) -> Example:
        cfg = self.config
        value = rng.randint(0, cfg.max_operand)
        expr, lines, values = str(value), [], [value]
        for _ in range(rng.randint(cfg.min_ops, cfg.max_ops)):
            while True:  # resample the step until it stays in range; "+0" always does, so this ends
                op = rng.choice(cfg.ops)
                operand = rng.randint(0, cfg.mul_max_operand if op == "*" else cfg.max_operand)
                new = _APPLY[op](value, operand)
                if 0 <= new <= cfg.max_value:
                    break
            lines.append(f"{value}{op}{operand}={new}")
            expr += f"{op}{operand}"
            value = new
            values.append(value)
        lines.append(f"#### {value}")
        return Example(prompt=expr + "\n", target="\n".join(lines),
                       meta={"answer": value, "expression": expr, "values": values})

    def score(self, example: Example, completion: str) -> bool:
        """True iff the first ``####`` line holds exactly the true answer (the chain is not checked)."""
        answer = _first_line_after(completion, "####")
        return answer is not None and re.fullmatch(r"-?\d+", answer) is not None \
            and int(answer) == example.meta["answer"]


# ------------------------------------------------------------------------------------------ constraint


@dataclass(frozen=True)
class ConstraintConfig:
    """toy-constraint parameters: ``k`` in ``[min_digits, max_digits]``; targets are only the sums
    reachable by at least ``min_solution_sets`` different sets of ``k`` distinct digits."""

    min_digits: int = 3
    max_digits: int = 4
    min_solution_sets: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 10:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 10, got {self.min_digits}, "
                             f"{self.max_digits}")
        if self.min_solution_sets < 1:
            raise ValueError("min_solution_sets must be >= 1")


def digit_sets(k: int) -> dict[int, list[tuple[int, ...]]]:
    """Every set of ``k`` distinct digits (sorted tuples), grouped by their sum."""
    by_sum: dict[int, list[tuple[int, ...]]] = {}
    for combo in itertools.combinations(range(10), k):
        by_sum.setdefault(sum(combo), []).append(combo)
    return by_sum


@dataclass(frozen=True)
class ConstraintTask(_Generate):
    """``k`` distinct digits summing to a target; answers are digits separated by single spaces."""

    config: ConstraintConfig = ConstraintConfig()
    name: str = "toy-constraint"
    _targets: dict[int, dict[int, list[tuple[int, ...]]]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        targets = {}
        for k in range(self.config.min_digits, self.config.max_digits + 1):
            eligible = {s: sets for s, sets in sorted(digit_sets(k).items())
                        if len(sets) >= self.config.min_solution_sets}
            if not eligible:
                raise ValueError(f"no sum of {k} distinct digits has {self.config.min_solution_sets} "
                                 "solution sets")
            targets[k] = eligible
        object.__setattr__(self, "_targets", targets)

    def sample(self, rng: random.Random) -> Example:
        k = rng.randint(self.config.min_digits, self.config.max_digits)
        total = rng.choice(list(self._targets[k]))
        sets = self._targets[k][total]
        digits = list(rng.choice(sets))  # every set has k! orders, so this is uniform over answers
        rng.shuffle(digits)
        num_solutions = len(sets) * math.factorial(k)
        return Example(prompt=f"{k} distinct digits, sum {total}\n", target=" ".join(map(str, digits)),
                       meta={"k": k, "sum": total, "num_sets": len(sets), "num_solutions": num_solutions})

    def score(self, example: Example, completion: str) -> bool:
        """Verifier on the first line: ``k`` single digits separated by spaces, distinct, right sum."""
        line = completion.split("\n", 1)[0].strip()
        if re.fullmatch(r"\d( \d)*", line) is None:
            return False
        digits = [int(d) for d in line.split(" ")]
        return len(digits) == example.meta["k"] and len(set(digits)) == len(digits) \
            and sum(digits) == example.meta["sum"]


TASKS: dict[str, Task] = {"toy-arith": ArithTask(), "toy-constraint": ConstraintTask()}


def get_task(name: str) -> Task:
    """The registered task called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise InputError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}") from None


# --------------------------------------------------------------------------------------------- GSM8K

# A minus counts only when it is not a binary operator ("16-3" is 16 and 3, "-5" is -5); ".5" is a half.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:\d+(?:,\d{3})*(?!\d)(?:\.\d+)?|(?<![\d.])\.\d+)")
# LaTeX thousands separators (`1{,}234`, `1,\!234`, `1\,234`) and the minus sign U+2212, as plain text writes them
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\,)(?=\d{3}(?!\d))")


def plain_numbers(text: str) -> str:
    """`text` with LaTeX thousands separators as commas and U+2212 as `-`."""
    return _LATEX_THOUSANDS.sub(",", text.replace("\u2212", "-"))


def numbers_in(text: str) -> list[str]:
    """The numbers of `text` as written (after `plain_numbers`), in order."""
    return _NUMBER.findall(plain_numbers(text))


def _canonical(number: str) -> str | None:
    text = number.replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return "0" if value == 0 else format(value.normalize(), "f")


# GSM8K's answer line: `#### N`, the number right after the marker (a markdown heading such as
# `#### Step 2: ...` or a numbered one, `#### 1. Compute ...`, is not one)
_ANSWER_LINE = re.compile(r"####[ \t]*(" + _NUMBER.pattern + r")(?![.)][ \t]+[A-Za-z])")


def marked_number(text: str) -> str | None:
    """The canonical number of the last ``#### N`` line, None if there is none."""
    marked = _ANSWER_LINE.findall(plain_numbers(text))
    return _canonical(marked[-1]) if marked else None


def extract_final_number(text: str) -> str | None:
    """The canonical number of the last ``#### N`` line if there is one, else the last number in ``text``.

    Canonical: no thousands commas or ``$``, a leading minus kept, no trailing period, decimals
    normalised (``"3.50"`` -> ``"3.5"``, ``"4.0"`` -> ``"4"``). None if there is no number.
    """
    marked = _ANSWER_LINE.findall(plain_numbers(text))
    numbers = marked or numbers_in(text)
    return _canonical(numbers[-1]) if numbers else None


def gsm8k_correct(completion: str, reference_answer_text: str) -> bool:
    """Whether ``completion``'s final number equals the reference's (GSM8K ``answer`` ending ``#### N``)."""
    reference = extract_final_number(reference_answer_text)
    predicted = extract_final_number(completion)
    return reference is not None and predicted == reference
