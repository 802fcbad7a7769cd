"""How the forward computes (`dlmjax.numerics`): matmul precision and the batch-invariant mode.

    with dlmjax.numerics(precision="highest", invariant=True):
        dlmjax.generate(model, prompts, decoder="psd")

- `precision`: "default" lets the accelerator round fp32 matmuls through TF32 (GPU) or bf16
  passes (TPU), which is fast and off by ~1e-2 from PyTorch's fp32; "highest" computes them in
  full fp32. It sets jax's own `default_matmul_precision`; unset (None), jax's setting stands
  (its default, or JAX_DEFAULT_MATMUL_PRECISION). On CPU both are exact fp32.
- `invariant`: every reduction a row's logits depend on is computed at a shape that does not
  depend on the batch size, on how many candidate copies are packed beside it, or on the other
  rows' values. Matmuls run over fixed tiles of `row_tile` rows (one compiled dot, whatever the
  batch); attention over tiles of rows, queries and `key_tile` keys folded in order, each packed
  copy's keys on their own (`layers.attention`). A row then has
  bitwise the same logits alone, in a batch of N and as one of N packed copies, so PSD equals its
  policy and mrp-spec equals static on accelerators too, where the fast mode lets near-ties flip.
  DLMJAX_INVARIANT=1 in the environment turns it on for the whole process.

The setting is read when a function is traced. `arithmetic.jit` (used by the decoding entry points
in place of `jax.jit`) makes it part of the compiled function's cache key, so switching it never
reuses a program traced under the other setting.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from dlmjax import sharding
from dlmjax.validation import InputError

PRECISIONS = ("default", "highest")


@dataclass(frozen=True)
class Numerics:
    precision: str | None = None  # None: jax's own default_matmul_precision stands
    invariant: bool = False
    row_tile: int = 128  # rows per matmul tile in invariant mode
    query_tile: int = 16  # queries per attention tile (per row) in invariant mode
    sequence_tile: int = 4  # batch rows per attention tile in invariant mode
    key_tile: int = 64  # keys per attention tile in invariant mode
    min_tiles: int = 2  # iterations a tile loop runs at least in invariant mode (see `row_tiles`)

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISIONS:
            raise InputError(f"precision={self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        sizes = dict(row_tile=self.row_tile, query_tile=self.query_tile, sequence_tile=self.sequence_tile,
                     key_tile=self.key_tile, min_tiles=self.min_tiles)
        bad = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if bad:
            raise InputError(f"{', '.join(bad)}: tile sizes and counts must be >= 1")


# The numerics set by `numerics`; None outside any: DLMJAX_INVARIANT (default off) decides.
_CURRENT: contextvars.ContextVar[Numerics | None] = contextvars.ContextVar("dlmjax_numerics", default=None)
_SWITCH = {"": False, "0": False, "false": False, "off": False, "no": False,
           "1": True, "true": True, "on": True, "yes": True}


@functools.lru_cache(maxsize=8)
def _numerics_for(raw: str) -> Numerics:
    """DLMJAX_INVARIANT's value as numerics (cached: every jitted call reads it)."""
    if raw.strip().lower() not in _SWITCH:
        raise InputError(f"DLMJAX_INVARIANT={raw!r} is not a switch; set it to 1 (on) or 0 (off), or unset it")
    return Numerics(invariant=_SWITCH[raw.strip().lower()])


def current() -> Numerics:
    """The numerics in force: the innermost `numerics`, else DLMJAX_INVARIANT's (read when asked,
    so a bad value is an input error where it is used, not at import)."""
    setting = _CURRENT.get()
    return _numerics_for(os.environ.get("DLMJAX_INVARIANT", "")) if setting is None else setting


@contextlib.contextmanager
def numerics(precision: str | None = None, invariant: bool | None = None, row_tile: int | None = None,
             query_tile: int | None = None, sequence_tile: int | None = None, key_tile: int | None = None,
             min_tiles: int | None = None):
    """Set the numerics for the code inside (unset arguments keep the current value)."""
    changes = {name: value for name, value in dict(precision=precision, invariant=invariant, row_tile=row_tile,
                                                   query_tile=query_tile, sequence_tile=sequence_tile,
                                                   key_tile=key_tile, min_tiles=min_tiles).items()
               if value is not None}
    with _use(replace(current(), **changes)):
        yield current()


@contextlib.contextmanager
def _use(setting: Numerics):
    token = _CURRENT.set(setting)
    try:
        with _matmul_precision(setting):
            yield
    finally:
        _CURRENT.reset(token)


def _matmul_precision(setting: Numerics):
    return contextlib.nullcontext() if setting.precision is None else jax.default_matmul_precision(setting.precision)



def jit(fun=None, **jit_kwargs):
    """`jax.jit` whose cache key includes the current numerics and kernel mode (`dlmjax.kernels`;
    hidden static arguments), and whose trace runs under them."""
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    from dlmjax import kernels

    static = tuple(jit_kwargs.pop("static_argnames", ())) + ("_numerics", "_kernels")

    def traced(*args, _numerics: Numerics, _kernels: str, **kwargs):
        with _use(_numerics), kernels.use(_kernels):
            return fun(*args, **kwargs)

    compiled = jax.jit(traced, static_argnames=static, **jit_kwargs)

    def under_current(method):
        def run(*args, **kwargs):
            setting = current()
            with _matmul_precision(setting):
                return method(*args, _numerics=setting, _kernels=kernels.current(), **kwargs)
        return run

    call = functools.wraps(fun)(under_current(compiled))
    call.lower = under_current(compiled.lower)  # as jax.jit's: the program this call would run
    return call


def tile_count(rows: int, tile: int) -> int:
    """Tiles of `tile` rows that hold `rows`, and at least `Numerics.min_tiles` (`row_tiles` says why)."""
    return max(current().min_tiles, -(-rows // tile))


def row_tiles(a_mk, tile: int):
    """[M, K] -> [N, tile, K]: zero rows pad the last tile, and further tiles up to `min_tiles`.

    A tiled computation runs as a loop of at least `Numerics.min_tiles` iterations (2). XLA
    removes a loop of one iteration and fuses its body with what surrounds it, and the code it
    then emits for the tile differs from the loop body's (on CPU, which product of `a * b + c * d`
    LLVM contracts into an FMA): a batch that fits one tile rounded differently from a batch of
    several (up to 3e-7 in fp32 at XLA's default optimisation level, from RoPE). XLA also drops
    optimization barriers before fusing, so the barriers keep the tiles apart only where XLA
    honours them. `min_tiles=1` is for measuring what the loops cost (on a GPU each iteration is a
    few kernel launches); it gives up that equality."""
    m = a_mk.shape[0]
    n = tile_count(m, tile)
    return jnp.pad(a_mk, ((0, n * tile - m), (0, 0))).reshape(n, tile, a_mk.shape[-1])


def rowwise(fn, *arrays, weights=()):
    """fn(*arrays, *weights) for a function that treats each row (each index of the arrays' leading
    axes; the last axis is the row) on its own, e.g. a norm or a softmax over the last axis.
    `weights` are what fn applies to every row (parameters): pass them here, not in fn's closure
    (see `sharding.over_batch_shards`). In invariant mode the rows go through fixed tiles of
    `row_tile` rows, so that a row's result never depends on how many rows there are (XLA picks
    reduction code by shape), and on a mesh each device tiles its own rows. fn returns arrays (or
    a tuple of them) with the rows' leading axes, optionally a last axis of their own."""
    setting = current()
    if not setting.invariant:
        return fn(*arrays, *weights)
    tiled = functools.partial(_rowwise_tiled, fn, setting.row_tile, len(arrays))
    if arrays[0].ndim > 1:
        return sharding.over_batch_shards(tiled, *arrays, weights=weights)
    return tiled(*arrays, *weights)


def _rowwise_tiled(fn, tile: int, num_arrays: int, *args):
    arrays, weights = args[:num_arrays], args[num_arrays:]
    lead = arrays[0].shape[:-1]
    m = math.prod(lead)
    tiled = [row_tiles(a.reshape(m, a.shape[-1]), tile) for a in arrays]

    def one_tile(xs):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(xs), *weights))

    out = jax.lax.map(one_tile, tiled)
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:m].reshape(*lead, *y.shape[2:]), out)


def matmul(x_mk, w_kn, preferred_element_type=None):
    """x @ w over rows [M, K]. In invariant mode the rows go through one fixed [row_tile, K] dot
    per tile (`row_tiles`), so a row's result never depends on M."""
    setting = current()
    if not setting.invariant:
        return jnp.matmul(x_mk, w_kn, preferred_element_type=preferred_element_type)
    tiled = functools.partial(_matmul_tiled, tile=setting.row_tile, preferred_element_type=preferred_element_type)
    return sharding.over_batch_shards(tiled, x_mk, weights=(w_kn,))  # on a mesh, each device tiles its own rows


def _matmul_tiled(x_mk, w_kn, tile: int, preferred_element_type):
    tiles = row_tiles(x_mk, tile)

    def one_tile(x_tk):
        # The barriers keep XLA from fusing the dot with what surrounds it differently per shape,
        # where XLA honours them (see `row_tiles`).
        y = jnp.matmul(jax.lax.optimization_barrier(x_tk), w_kn, preferred_element_type=preferred_element_type)
        return jax.lax.optimization_barrier(y)

    return jax.lax.map(one_tile, tiles).reshape(-1, w_kn.shape[1])[: x_mk.shape[0]]
