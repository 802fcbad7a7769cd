"""Pallas kernels behind one switch, each with a pure-jnp reference and a logged fallback.

    with dlmjax.kernels.use("off"):          # references only
        ...
    DLMJAX_KERNELS=interpret python ...     # Pallas kernels in interpret mode (any device; tests)

Modes:
- "auto" (default): each kernel on the accelerators in `AUTO`: flash attention on GPU (measured to
  pay) and TPU, residual_argmax on TPU (the TPU entries are expected to pay, not yet timed on a
  TPU); elsewhere, and on CPU, the reference (the XLA code) runs.
- "on": the kernels wherever they are supported (on CPU that means nowhere: the reference runs,
  with the reason logged).
- "interpret": the kernels in Pallas interpret mode on any device (slow; tests on CPU).
- "off": the references everywhere.

Each kernel lives in its own folder (`residual_argmax/`, `attention/`, `grouped_matmul/`) as
`reference.py` (pure jnp, the definition), `kernel.py` (Pallas for GPU, through Triton, and for
interpret mode), `kernel_tpu.py` (Pallas for TPU, in the block shapes Mosaic compiles; none for
grouped_matmul, as TPU computes ragged_dot grouped) and `__init__.py` (the dispatcher). A real kernel call is compile-probed once per shape first. A dispatcher runs
the reference, and logs why once per reason (logger "dlmjax.kernels"), when the mode, the
device, the numerics or the shapes rule the kernel out. In the batch-invariant numerics mode
(`dlmjax.numerics(invariant=True)`) the references run: their fixed-tile paths are what the
invariance tests prove.

The mode is read when a function is traced; `dlmjax.arithmetic.jit` keys its compiled programs by
it, so switching never reuses a program traced under another mode. DLMJAX_KERNELS is read then too
(not at import): a value outside MODES is an InputError naming them, and `dlmjax --help` still runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

MODES = ("auto", "on", "interpret", "off")
ACCELERATORS = ("gpu", "tpu")
# Where "auto" runs each kernel: on GPU where its measured cost beats the reference's
# (benchmarks/decode_gpu.py); on TPU where the kernels are expected to (Mosaic TPU's flash
# attention and the fused vocabulary scan), not yet timed on a TPU. On an H200, residual_argmax's
# Triton kernel took 1.5 to 2.3x the XLA path's time at 64 to 1,024 positions of a 151,936-column
# vocabulary, while flash attention was 1.1 to 2.5x faster (benchmarks/results/decode_gpu/gpu-h200.md); on GPU "on" still runs both.
# grouped_matmul (the MoE layer's experts) has not been timed on a device yet: "on" runs it.
AUTO = {"attention": ("gpu", "tpu"), "residual_argmax": ("tpu",), "grouped_matmul": ()}

log = logging.getLogger("dlmjax.kernels")


def _env_mode() -> str:
    raw = os.environ.get("DLMJAX_KERNELS", "auto")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        from dlmjax.validation import InputError

        raise InputError(f"DLMJAX_KERNELS={raw!r} is not a kernel mode; set it to one of {', '.join(MODES)} "
                         "(or unset it: auto)")
    return mode


# The mode set by `use`; None outside any `use`: DLMJAX_KERNELS (default "auto") decides.
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("dlmjax_kernels", default=None)


def current() -> str:
    """The kernel mode in force ("auto", "on", "interpret" or "off"): the innermost `use`, else
    DLMJAX_KERNELS."""
    mode = _MODE.get()
    return _env_mode() if mode is None else mode


@contextlib.contextmanager
def use(mode: str):
    """Run the code inside under kernel `mode` (one of MODES)."""
    if mode not in MODES:
        from dlmjax.validation import InputError

        raise InputError(f"kernels={mode!r}; choose one of {', '.join(MODES)}")
    token = _MODE.set(mode)
    try:
        yield mode
    finally:
        _MODE.reset(token)


_LOGGED: set[tuple[str, str, int]] = set()


def fallback(kernel: str, reason: str) -> None:
    """Log (once per kernel and reason) that `kernel` runs its reference because of `reason`: a
    warning where the kernel was asked for (--kernels on or interpret, which a user should see
    go unheeded), else at INFO (auto picks the reference where it pays)."""
    level = logging.WARNING if current() in ("on", "interpret") else logging.INFO
    if (kernel, reason, level) not in _LOGGED:
        _LOGGED.add((kernel, reason, level))
        log.log(level, "%s: reference path (%s)", kernel, reason)


def choose(kernel: str, unsupported: str | None = None) -> str | None:
    """How `kernel` runs now: "kernel", "interpret", or None for the reference (the reason
    logged). `unsupported`: the dispatcher's own reason to refuse these shapes, if any."""
    import jax

    from dlmjax import arithmetic

    mode = current()
    backend = jax.default_backend()
    if mode == "off":
        return None  # asked for: nothing to log
    if arithmetic.current().invariant:
        fallback(kernel, "batch-invariant numerics keep their fixed-tile reference paths")
        return None
    if mode != "interpret" and backend not in ACCELERATORS:
        if mode == "on":
            fallback(kernel, f"no Pallas kernel on {backend}")
        return None
    if mode == "auto" and backend not in AUTO[kernel.split("/")[0]]:
        why = "measured faster" if AUTO[kernel.split("/")[0]] else "runs until a device times the kernel"
        fallback(kernel, f"on {backend} the reference {why} (kernels.AUTO); --kernels on runs the kernel")
        return None
    if unsupported is not None:
        fallback(kernel, unsupported)
        return None
    return "interpret" if mode == "interpret" else "kernel"


_COMPILES: dict[tuple, str | None] = {}


def refusals(kernel: str) -> list[str]:
    """Why the device refused to compile `kernel` (or a variant of it, as "attention/cudnn"), one
    reason per refused shape so far: where the dispatcher chose the kernel but the reference ran."""
    return [reason for key, reason in _COMPILES.items() if key[0].startswith(kernel) and reason is not None]


def compile_error(kernel: str, fn, *args) -> str | None:
    """Why `fn(*args)` (a jitted kernel call, its static options bound) does not compile on this
    device, or None when it does. Checked once per kernel, shapes and dtypes and cached: a kernel the
    device's Pallas lowering refuses then falls back at trace time instead of failing the whole
    program when it is compiled. Only for real kernels: interpret mode compiles everywhere."""
    import jax

    specs = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    key = (kernel, getattr(fn, "func", fn), getattr(fn, "keywords", None) and tuple(sorted(fn.keywords.items())),
           tuple(None if s is None else (s.shape, str(s.dtype)) for s in specs))
    if key not in _COMPILES:
        try:
            jax.jit(fn).lower(*specs).compile()
            _COMPILES[key] = None
        except Exception as error:  # the lowering's own message says what it refused
            _COMPILES[key] = f"does not compile here: {type(error).__name__}: {error}"[:300]
    return _COMPILES[key]
