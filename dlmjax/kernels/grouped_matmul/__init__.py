"""`grouped_matmul`: rows in tiles of one expert each, times their expert's weights, computing only
the experts that rows chose (the MoE layer's experts, `dlmjax.models.moe`). Dispatches to a Pallas
kernel (`kernel.py`, GPU through Triton and interpret mode) or the reference (`reference.py`).

Where it runs: "on" and "interpret" only (not in `kernels.AUTO` until a GPU measures it against
the layer's dense path). TPU keeps `jax.lax.ragged_dot`, which its backend computes grouped."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dlmjax import kernels
from dlmjax.kernels.grouped_matmul import kernel as _kernel
from dlmjax.kernels.grouped_matmul.reference import grouped_matmul as reference
from dlmjax.kernels.grouped_matmul.reference import tile_count, tile_expert, tile_layout, used_tiles

__all__ = ["MIN_TILE", "grouped_matmul", "reference", "runs", "tile_count", "tile_expert", "tile_layout",
           "unsupported", "used_tiles"]

TILE_N, TILE_K = 128, 64
MIN_TILE = 16  # GPU dots need >= 16 along every dimension


def _is_pow2(n: int) -> bool:
    return n >= MIN_TILE and not n & (n - 1)


def unsupported(k: int, n: int, interpret: bool) -> str | None:
    """Why the kernel cannot take rows of width `k` into `n` columns (tiles of rows are powers of
    two >= MIN_TILE by the caller's choice)."""
    if interpret:
        return None
    if jax.default_backend() == "tpu":
        return "TPU computes jax.lax.ragged_dot grouped"
    if not (_is_pow2(min(k, TILE_K)) and _is_pow2(min(n, TILE_N)) and k % min(k, TILE_K) == 0
            and n % min(n, TILE_N) == 0):
        return f"widths {k} -> {n} not multiples of a power of two >= {MIN_TILE}"
    return None


def runs(rows: int, k: int, n: int, num_experts: int, tile_m: int, dtype) -> str | None:
    """How the kernel runs for x [rows, k] and weights [num_experts, k, n] of `dtype` in tiles of
    `tile_m` rows: "kernel" (the device compiles it: probed once per shape), "interpret", or None
    for the reference (the reason logged)."""
    how = kernels.choose("grouped_matmul", unsupported(k, n, kernels.current() == "interpret"))
    if how == "kernel":
        specs = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((num_experts,), jnp.int32),
                 jax.ShapeDtypeStruct((num_experts, k, n), dtype))
        error = kernels.compile_error("grouped_matmul", _call(k, n, tile_m, how), *specs)
        if error is not None:
            kernels.fallback("grouped_matmul", error)
            return None
    return how


def grouped_matmul(x_rk, tiles_end_e, w_ekn, *, tile_m: int):
    """[I * tile_m, N] float32: each tile's rows of x [I * tile_m, K] times its expert's w [E, K, N]
    (the tiles of `tile_layout`), 0 in the unused tiles' rows. The kernel where `runs` says so, else
    the reference. Differentiable: the gradient is the reference's (a Pallas call has none of its
    own)."""
    (rows, k), (num_experts, _, n) = x_rk.shape, w_ekn.shape
    how = runs(rows, k, n, num_experts, tile_m, x_rk.dtype)
    if how is None:
        return reference(x_rk, tiles_end_e, w_ekn, tile_m=tile_m)
    return _with_reference_gradient(_call(k, n, tile_m, how), tile_m)(x_rk, tiles_end_e, w_ekn)


def _call(k: int, n: int, tile_m: int, how: str):
    return functools.partial(_kernel.grouped_matmul, tile_m=tile_m, tile_n=_tile(n, TILE_N), tile_k=_tile(k, TILE_K),
                             interpret=how == "interpret", triton=how == "kernel")


def _tile(width: int, tile: int) -> int:
    """`tile`, or the whole width where it is smaller or not a multiple (interpret mode's odd sizes)."""
    return tile if width >= tile and width % tile == 0 else width


def _with_reference_gradient(call, tile_m: int):
    def masked(x_rk, tiles_end_e, w_ekn):  # the unused tiles' rows, which the kernel leaves unwritten, at 0
        used = used_tiles(tiles_end_e, x_rk.shape[0] // tile_m)
        return jnp.where(jnp.repeat(used, tile_m)[:, None], call(x_rk, tiles_end_e, w_ekn), 0.0)

    @jax.custom_vjp
    def run(x_rk, tiles_end_e, w_ekn):
        return masked(x_rk, tiles_end_e, w_ekn)

    def forward(x_rk, tiles_end_e, w_ekn):
        return masked(x_rk, tiles_end_e, w_ekn), (x_rk, tiles_end_e, w_ekn)

    def backward(saved, grad_out):
        x_rk, tiles_end_e, w_ekn = saved
        _, pullback = jax.vjp(lambda x, w: reference(x, tiles_end_e, w, tile_m=tile_m), x_rk, w_ekn)
        grad_x, grad_w = pullback(grad_out)
        return grad_x, None, grad_w

    run.defvjp(forward, backward)
    return run
