"""Reading a compiled program's text (XLA's optimised HLO) in tests."""

import math
import re


def first_program(monkeypatch, owner, name: str, run):
    """(optimised HLO text, args, kwargs) of the first call `run()` makes to `owner.name` (a
    `dlmjax.arithmetic.jit` function)."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    run()
    args, kwargs = calls[0]
    return real.lower(*args, **kwargs).compile().as_text(), args, kwargs


def program_under_kernels(mode: str, owner, name: str, run):
    """(optimised HLO text, what `run()` returned) of the first call `run()` makes to `owner.name`
    with the kernels in `mode` (`dlmjax.kernels.use`)."""
    import pytest

    from dlmjax import kernels

    got = []
    with kernels.use(mode), pytest.MonkeyPatch.context() as patch:
        hlo, _, _ = first_program(patch, owner, name, lambda: got.append(run()))
    return hlo, got[0]


def loop_copies(hlo_text: str, shape: str) -> int:
    """Copy instructions of arrays `shape` (e.g. "f32[3,24,2,16]") in a compiled program's
    computations other than its entry: what runs again in every round of a decode loop."""
    copies, in_entry = 0, False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            in_entry = line.startswith("ENTRY")
        elif not in_entry and f"= {shape}{{" in line and " copy(" in line:
            copies += 1
    return copies


def logits_rows(hlo_text: str, config) -> list[int]:
    """How many positions' logits a compiled program makes at once: for every float32 array whose
    last axis is the model's vocabulary, the product of its other axes (sorted, one per shape),
    the lm_head [D, V] left out."""
    found = re.findall(rf"f32\[([0-9,]+),{config.vocab_size}\]", hlo_text)
    shapes = {tuple(int(d) for d in dims.split(",")) for dims in found} - {(config.hidden_size,)}
    return sorted(math.prod(shape) for shape in shapes)
