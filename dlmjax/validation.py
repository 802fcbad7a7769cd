"""One validation layer for everything a user types or points at.

`InputError` is the one error type for a mistake in user input; every input kind has its own
subclass (decoder specs: `DecoderSpecError`, config.json: `ConfigError`, YAML run configs:
`RunConfigError`, checkpoint files: `CheckpointError`, tokenizers: `TokenizerError`, data files:
`DatasetError`, lengths and layouts: `LayoutError`, ...). Its message names the input and the
fix. The CLI prints it in one line and exits 2; any other exception is a bug in dlmjax and keeps
its traceback (`dlmjax.cli.main`).

Typed, ranged options: a dataclass lists the range or the choices of its fields in a class
attribute `limits` ({field: Range | OneOf}, merged along the class's bases), and its
`__post_init__` calls `check_fields`, which checks every field's type against its annotation and
its limit. Decoders, `ModelConfig` and the run-config sections all work this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """A mistake in something the user typed or pointed at; the message names the input and the fix."""


@dataclass(frozen=True)
class Range:
    """A numeric range: `low` and `high` (None: unbounded), each closed unless `*_open`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def refusal(self, name: str, value) -> str:
        return f"{name}={value!r} must be {self}"

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class OneOf:
    """A value from a fixed set."""

    choices: tuple

    def __contains__(self, value) -> bool:
        return any(value == choice and type(value) is type(choice) for choice in self.choices)

    def refusal(self, name: str, value) -> str:
        return f"{name}={value!r}; {self}"

    def __str__(self) -> str:
        return "choose one of " + ", ".join(map(str, self.choices))


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)
PROBABILITY = Range(0, 1)  # [0, 1]
OPEN_UNIT = Range(0, 1, low_open=True)  # (0, 1]: thresholds where 0 would commit everything
STRICT_UNIT = Range(0, 1, low_open=True, high_open=True)  # (0, 1): fractions, and thresholds where 1 is out too
UNIT_BELOW_1 = Range(0, 1, high_open=True)  # [0, 1): a margin between probabilities (1 or more: none passes)
STEPS = Range(1, 65536)  # denoising steps per block: a schedule is built step by step on the host

_KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "tuple": lambda v: isinstance(v, tuple),
    "None": lambda v: v is None,
}
_KIND_NAMES = {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false",
               "list": "a list", "dict": "a mapping", "tuple": "a tuple", "None": "unset"}


def annotation_kinds(annotation) -> list[str]:
    """`"int | None"` -> ["int", "None"]; `tuple[int, ...]` -> ["tuple"]; unknown names are kept."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return [part.strip().split("[")[0] for part in text.split("|")]


def matches(value, annotation) -> bool:
    """Whether `value` has a type the annotation allows (unknown annotation names allow anything)."""
    return any(_KINDS.get(kind, lambda v: True)(value) for kind in annotation_kinds(annotation))


def describe(annotation) -> str:
    return " or ".join(_KIND_NAMES.get(kind, kind) for kind in annotation_kinds(annotation))


def check_value(name: str, value, annotation="Any", limit: Range | OneOf | None = None, *, error=InputError):
    """`value` if it has the annotation's type and lies within `limit`, else `error` naming both."""
    if not matches(value, annotation):
        raise error(f"{name}={value!r} must be {describe(annotation)}")
    if limit is not None and value is not None and value not in limit:
        raise error(limit.refusal(name, value))
    return value


def limits_of(cls) -> dict[str, Range | OneOf]:
    """The `limits` of a class and of its bases (a subclass's entry wins)."""
    merged: dict = {}
    for base in reversed(cls.__mro__):
        merged.update(vars(base).get("limits", {}))
    return merged


def check_fields(obj, prefix: str, *, error=InputError) -> None:
    """Every dataclass field of `obj` against its annotation and its entry in `limits`; errors
    read `{prefix}name=value must be ...` (prefix e.g. "threshold: " or "train.")."""
    limits = limits_of(type(obj))
    for f in dataclasses.fields(obj):
        check_value(f"{prefix}{f.name}", getattr(obj, f.name), f.type, limits.get(f.name), error=error)


def is_count(value) -> bool:
    """Whether `value` is a Python integer >= 0 (not a bool): a size, offset or stride read from a file."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


INT32_MAX = 2**31 - 1  # the largest value of the int32 a decoder option or a row id is traced as


def python_int(value):
    """`value` as a Python int where it is another kind of integer scalar (numpy's, a 0-d jax
    array); anything else as it is, for the type check to refuse."""
    if isinstance(value, int):  # (a bool too: the check refuses it)
        return value
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return int(value) if kind in ("i", "u") and getattr(value, "ndim", None) == 0 else value


def positive_int(name: str, value, *, error=InputError) -> int:
    """A count the user gives in Python (tokens, prompts, rows): an integer >= 1, as a Python int."""
    return check_value(name, python_int(value), "int", AT_LEAST_1, error=error)


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def at_least_0_arg(text: str) -> int:
    """argparse type for an integer >= 0 (argparse reports anything else, exit 2)."""
    value = _int_arg(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def count_arg(text: str) -> int:
    """argparse type for counts: an integer >= 1 (argparse reports anything else, exit 2)."""
    value = _int_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


SEED_LIMIT = 2**32  # jax.random.key keeps the low 32 bits of a seed: larger seeds would repeat smaller ones


SEED_RANGE = Range(0, SEED_LIMIT - 1)


def check_seed(value, name: str = "seed") -> int:
    """A seed given in Python: an integer in [0, 2**32) (see SEED_LIMIT), as a Python int."""
    return check_value(name, python_int(value), "int", SEED_RANGE)


def seed_arg(text: str) -> int:
    """argparse type for --seed: an integer in [0, 2**32) (argparse reports anything else, exit 2)."""
    value = _int_arg(text)
    if value not in SEED_RANGE:
        raise argparse.ArgumentTypeError(f"{value} must be {SEED_RANGE} (jax keeps a seed's low 32 bits, so "
                                         "a larger one would repeat a smaller one's samples)")
    return value


def read_json_file(path: str | Path, *, error=InputError, fix: str = "fix or re-create the file") -> Any:
    """The parsed JSON of `path`; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); {fix}") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}; {fix}") from None
