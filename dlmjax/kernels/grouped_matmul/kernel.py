"""Pallas `grouped_matmul` (GPU through Triton, and interpret mode): one program per expert and
block of `tile_n` output columns, looping over the expert's own row tiles (none for an expert no row
chose), each tile a sum of [tile_m, tile_k] x [tile_k, tile_n] dots. An expert's weight block is
read by its program alone, so a decode step reads each chosen expert's weights about once, and no
unchosen expert's. The weights and rows stay in global memory (whole-array blocks), read at the
program's offsets; each program writes only its expert's tiles of the output. The rows of unused
tiles are not written: the caller reads only the tiles the layout gives rows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

WARPS, STAGES = 4, 3


def _kernel(end_ref, x_ref, w_ref, out_ref, *, tile_m: int, tile_n: int, tile_k: int):
    expert, block = pl.program_id(0), pl.program_id(1)
    first = jnp.where(expert == 0, 0, end_ref[jnp.maximum(expert - 1, 0)])
    columns = pl.ds(block * tile_n, tile_n)
    chunks = x_ref.shape[1] // tile_k

    def tile(i, carry):
        rows = pl.ds(i * tile_m, tile_m)

        def chunk(c, acc):
            depth = pl.ds(c * tile_k, tile_k)
            return acc + jnp.dot(x_ref[rows, depth], w_ref[expert, depth, columns], preferred_element_type=jnp.float32)

        out_ref[rows, columns] = jax.lax.fori_loop(0, chunks, chunk, jnp.zeros((tile_m, tile_n), jnp.float32))
        return carry

    jax.lax.fori_loop(first, end_ref[expert], tile, 0)


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n", "tile_k", "interpret", "triton", "warps", "stages"))
def grouped_matmul(x_rk, tiles_end_e, w_ekn, *, tile_m: int, tile_n: int, tile_k: int, interpret: bool,
                   triton: bool = False, warps: int = WARPS, stages: int = STAGES):
    """`reference.grouped_matmul` with the unused tiles' rows unwritten; N % tile_n == 0 and
    K % tile_k == 0 (the dispatcher picks the tiles)."""
    rows, k = x_rk.shape
    num_experts, _, n = w_ekn.shape
    whole = lambda shape: pl.BlockSpec(shape, lambda e, j: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k)
    return pl.pallas_call(
        kernel, grid=(num_experts, n // tile_n),
        in_specs=[whole((num_experts,)), whole((rows, k)), whole((num_experts, k, n))],
        out_specs=whole((rows, n)), out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        interpret=interpret, name="grouped_matmul",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages) if triton else None,
    )(tiles_end_e, x_rk, w_ekn)
