"""MATH-style answers: the last \\boxed{...} of a completion, and equivalence of common LaTeX forms.

`normalize` rewrites an answer into one spelling: no `$`, spaces, `\\left`/`\\right`, thin
spaces, `\\displaystyle`; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\frac12` -> `\\frac{1}{2}`;
`\\frac\\pi2` -> `\\frac{\\pi}{2}`; `\\sqrt2` -> `\\sqrt{2}`; `{5}` -> `5`; `\\mathbf{5}` -> `5`; trailing unit
words in `\\text{...}`/`\\mbox{...}` (not any word: `5\\text{ million}` stays), degrees (`^\\circ`,
`^{\\circ}`, `degrees`), `\\%`, a leading `\\$`, a leading `x =`, thousands separators
(`1,000`, `1{,}000`) and a trailing period dropped; a unit word after a number (`12 inches`),
`°`, and a leading `x \\in` dropped; `\\text{(C)}` and `(C)` -> `C` (a multiple-choice letter);
`1 \\text{ and } 2` -> `1,2`; a top-level `a/b` of single terms -> `\\frac{a}{b}` (`\\pi/2`, not `1+\\pi/2`); the minus sign
U+2212 -> `-`. `equivalent` compares the normal forms (plain words regardless of case), and
else compares numbers exactly as fractions (`0.5`, `1/2`, `\\frac{1}{2}` and `\\frac12` are all
one half; `1\\frac{4}{5}` is a mixed number; `50\\%` is 50, as MATH writes percentages),
element by element for tuples and intervals, and in any order for sets (`\\{1,2\\}`) and bare
lists (`1, 2`; a comma with three digits and no space after it, `1,100`, is a thousands
separator). It does no algebra: `2\\sqrt{2}` and `\\sqrt{8}`, `10^{3}` and `1000` are different
answers here.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
# unit words a number may carry in a boxed answer (as lm-eval's minerva_math strips such words)
_UNITS = ("inches", "inch", "feet", "foot", "ft", "yards", "yard", "miles", "mile", "mph", "cm", "mm", "km", "m",
          "meters", "meter", "metres", "metre", "seconds", "second", "sec", "s", "minutes", "minute", "min", "hours",
          "hour", "days", "day", "weeks", "week", "years", "year", "dollars", "dollar", "cents", "cent", "pounds",
          "pound", "lbs", "ounces", "ounce", "grams", "gram", "g", "kg", "liters", "liter", "litres", "litre", "km/h",
          "m/s", "square", "sq", "cubic", "units", "unit", "degrees", "degree", "ways", "points", "people", "students")
_UNIT = "(?:" + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True)) + r")(?:\^\{?\d\}?)?"
_UNIT_AFTER_NUMBER = re.compile(r"(?<=[\d}])(?:\s+" + _UNIT + ")+$")  # `12 inches`, `6 square units`; not `3m`
# a trailing unit in \text{...}: unit words only (`10\text{ million}` is not 10), squared or cubed too
_TEXT_UNIT = re.compile(r"(?<=\S)\s*\\(?:text|mbox|textbf)\{\s*" + _UNIT + r"(?:\s+" + _UNIT + r")*\s*\}(?:\^\{?\d\}?)?$",
                        re.IGNORECASE)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the {...} group opening at `start`, and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], i + 1
    return None  # unbalanced: a truncated completion


def last_boxed(text: str) -> str | None:
    """The argument of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`."""
    found = None
    for match in _BOX.finditer(text):
        group = _braced(text, match.end())
        if group is not None:
            found = group[0]
        elif text[match.end():match.end() + 1] == "{":  # unclosed: a truncated last answer is no answer
            found = None
        else:  # `\boxed 5`
            bare = re.match(r"[^\s$]+", text[match.end():])
            found = bare.group().rstrip(".") if bare else found
    return found


def _unwrap(answer: str, command: str) -> str:
    """`\\command{x}` -> `x` everywhere (braces matched)."""
    out, i = [], 0
    needle = "\\" + command + "{"
    while (j := answer.find(needle, i)) >= 0:
        group = _braced(answer, j + len(needle) - 1)
        if group is None:
            break
        out.append(answer[i:j] + group[0])
        i = group[1]
    return "".join(out) + answer[i:]


# one argument of a LaTeX command: a brace group without braces inside, a command (`\\pi`) or one character
_ARGUMENT = r"(\{[^{}]*\}|\\[a-zA-Z]+|[0-9a-zA-Z])"


def _short_args(answer: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}` -> `\\frac{1}{x}`, `\\frac\\pi2` -> `\\frac{\\pi}{2}`,
    `\\sqrt3` -> `\\sqrt{3}` (no spaces left by then)."""
    def braced(argument: str) -> str:
        return argument if argument.startswith("{") else "{" + argument + "}"
    answer = re.sub(r"\\frac" + _ARGUMENT + _ARGUMENT, lambda m: "\\frac" + braced(m[1]) + braced(m[2]), answer)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", answer)


def normalize(answer: str) -> str:
    """One spelling for the common ways of writing the same answer (see the module docstring)."""
    a = answer.strip().rstrip(".").strip().strip("$").strip().replace("{,}", ",").replace("\u2212", "-")
    a = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", a)
    a = re.sub(r",\\!\s*", ",", a)  # `11,\! 111`: a thousands separator, its space included
    a = re.sub(r"(\\\\)|\\(?:displaystyle|!|,|;|:| )|~", r"\1", a)  # spacing; a row break `\\` stays
    a = a.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^{\\circ}", "").replace("^\\circ", "")
    a = a.replace("\\%", "").replace("%", "").replace("\\$", "").replace("°", "")
    a = re.sub(r"(?:,\s*)?\\text\{\s*and\s*\}", ",", a)  # `1 \text{ and } 2`, `1, 2, \text{ and } 3`: a list
    a = re.sub(r",\s*and\s+", ",", a)  # `1, 2, and 3`
    # a trailing unit, squared or cubed too (`864 \mbox{ inches}^2`, `60 \text{ km/h}`)
    a = _TEXT_UNIT.sub("", a)
    for command in ("text", "textbf", "mbox", "mathrm", "mathbf"):
        a = _unwrap(a, command)
    a = _UNIT_AFTER_NUMBER.sub("", a.strip())
    a = re.sub(r"^[a-zA-Z]\s*(?:=|\\in(?![a-zA-Z]))\s*(?=\S)", "", a)  # "x = 5" -> "5", "x \in [1,2]" -> "[1,2]"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", a):  # `1,100` is a number; `1, 100` two answers
        a = a.replace(",", "")
    a = re.sub(r"\s+", "", a)
    a = _short_args(a)
    a = re.sub(r"^\(([A-Z])\)$", r"\1", a)  # a multiple-choice letter: (C) -> C
    while (group := _braced(a, 0)) is not None and group[1] == len(a):  # `{5}` -> `5`
        a = group[0]
    return _slash_as_frac(a.rstrip("."))


def _one_term(text: str) -> bool:
    """No `+` or `-` outside brackets, but for a leading sign: `\\pi` or `-3\\sqrt{2}`, not `1+\\pi`."""
    depth = 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch in "+-" and depth == 0 and i > 0:
            return False
    return True


def _slash_as_frac(a: str) -> str:
    """A top-level `a/b` (one slash outside any bracket, no comma, one term on each side) as
    `\\frac{a}{b}`: `\\pi/2`; `1+\\pi/2` stays (it is not `\\frac{1+\\pi}{2}`)."""
    depth, slashes = 0, []
    for i, ch in enumerate(a):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "/" and depth == 0:
            slashes.append(i)
    if len(slashes) != 1 or "," in a:
        return a
    top, bottom = a[:slashes[0]], a[slashes[0] + 1:]
    if not (top and bottom and _one_term(top) and _one_term(bottom)):
        return a
    sign, top = ("-", top[1:]) if top.startswith("-") else ("", top)
    return f"{sign}\\frac{{{top}}}{{{bottom}}}"


def _number(text: str) -> Fraction | None:
    """An integer, decimal, `a/b` or `\\frac{a}{b}` (signed) as an exact fraction, else None."""
    sign = -1 if text.startswith("-") else 1
    text = text[1:] if text[:1] in "-+" else text
    frac = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text) or re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", text)
    mixed = re.fullmatch(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}", text)  # `1\frac{4}{5}`: one and four fifths
    try:
        if mixed and int(mixed[2]) < int(mixed[3]):
            return sign * (int(mixed[1]) + Fraction(int(mixed[2]), int(mixed[3])))
        if frac:
            return sign * Fraction(frac.group(1)) / Fraction(frac.group(2))
        if re.fullmatch(r"\d*\.?\d+", text):
            return sign * Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _wrapped(text: str) -> bool:
    """Whether the bracket the first character opens closes at the last: `(1,2)`, `[0,1)`; not
    `(1,2),(3,4)`."""
    depth = 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if depth == 0:
            return i > 0 and i == len(text) - 1 and text[0] in "([{"
    return False


def _split_top(text: str) -> list[str]:
    """`(1,\\frac{1}{2})` -> ["(", "1", "\\frac{1}{2}", ")"]: the brackets and top-level parts."""
    inner = text[1:-1] if _wrapped(text) else text
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return [text[0], *parts, text[-1]] if inner is not text else parts


def _unordered(text: str) -> list[str] | None:
    """The elements of an answer whose order means nothing, a set `\\{a,b\\}` or a bare list `a,b`
    (MATH's "enter all the solutions, separated by commas"); None for anything else (a tuple or
    an interval keeps its order)."""
    if text.startswith("\\{") and text.endswith("\\}"):
        inside = text[2:-2]
        return [inside] if _wrapped(inside) else _split_top(inside)
    parts = [] if _wrapped(text) else _split_top(text)
    return parts if len(parts) > 1 else None


def _same(a: str, b: str) -> bool:
    if a == b or a.isalpha() and a.lower() == b.lower():  # a plain word: `\text{East}` is `east`
        return True
    x, y = _number(a), _number(b)
    return x is not None and x == y


def _same_answer(a: str, b: str) -> bool:
    """Normal forms of one answer: `_same`, sets and lists with the same elements in any order,
    tuples and intervals the same element by element."""
    if _same(a, b):
        return True
    xs, ys = _unordered(a), _unordered(b)
    if xs is not None and ys is not None:
        return len(xs) == len(ys) and _pairs_up(xs, ys)
    pa, pb = _split_top(a), _split_top(b)
    return len(pa) == len(pb) > 1 and all(_same(x, y) for x, y in zip(pa, pb))


def _pairs_up(xs: list[str], ys: list[str]) -> bool:
    """Each of `xs` is the same answer as its own one of `ys`."""
    left = list(ys)
    for x in xs:
        match = next((i for i, y in enumerate(left) if _same_answer(x, y)), None)
        if match is None:
            return False
        del left[match]
    return True


def equivalent(predicted: str | None, reference: str) -> bool:
    """Whether two answers are the same after `normalize` (numbers compared exactly)."""
    return predicted is not None and _same_answer(normalize(predicted), normalize(reference))


def math_correct(completion: str, reference: str) -> bool:
    """A completion is right when its last boxed answer is equivalent to the reference answer."""
    return equivalent(last_boxed(completion), reference)
