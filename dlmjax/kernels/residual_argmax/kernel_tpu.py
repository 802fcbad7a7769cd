"""`residual_argmax` in the shape Mosaic (Pallas on TPU) compiles: the statistics of `kernel.py`
(the same `update` per tile), with the vocabulary tiled by the grid instead of a loop.

The lm_head does not fit VMEM, so the grid is (tile of `tile_m` positions, tile of `tile_v`
columns) and Pallas streams one [D, tile_v] block of it per step; the column axis is sequential
("arbitrary") and carries the statistics in VMEM scratch, lane-replicated ([tile_m, 128]) as
Mosaic stores rows. The final norm is applied once per row tile, at its first column tile, into
scratch. Each column tile is one [tile_m, D] x [D, tile_v] dot (plus the residual's). A vocabulary
that is not a multiple of the tile gets a partial last tile whose columns past V are ignored.

It returns the six statistics as `kernel.residual_argmax_stats` does with one slice ([M, 1]
each), so `kernel.finish` merges them alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dlmjax.kernels.residual_argmax.kernel import allowed, initial_stats, row_inputs, update
from dlmjax.models.layers import normalize_rows

LANES = 128
DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.float32, jnp.float32, jnp.float32)  # top1 index top2 m s t


def _kernel(*refs, vocab: int, mask_id: int | None, eps: float | None, residual_scale: float | None):
    it = iter(refs)
    x_ref = next(it)
    scale_ref = next(it) if eps is not None else None
    r_ref = next(it) if residual_scale is not None else None
    w_ref = next(it)
    outs = [next(it) for _ in DTYPES]
    hidden_ref = next(it)
    stats = list(it)
    tile = pl.program_id(1)
    rows, tile_v = x_ref.shape[0], w_ref.shape[1]

    @pl.when(tile == 0)
    def _():
        x = x_ref[...]  # the model's final RMSNorm (layers.rms_norm), if asked for
        hidden_ref[...] = x if eps is None else scale_ref[...] * normalize_rows(x, eps)
        for ref, value in zip(stats, initial_stats(rows)):
            ref[...] = jnp.broadcast_to(value, ref.shape)

    w = w_ref[...]
    logits = jnp.dot(hidden_ref[...], w, preferred_element_type=jnp.float32)
    if r_ref is not None:
        logits = logits + residual_scale * jnp.dot(r_ref[...], w, preferred_element_type=jnp.float32)
    first = tile * tile_v
    cols = first + jax.lax.broadcasted_iota(jnp.int32, (1, tile_v), 1)
    new = update([ref[...][:, :1] for ref in stats], logits, (cols < vocab) & allowed(cols, mask_id), first)
    for ref, value in zip(stats, new):
        ref[...] = jnp.broadcast_to(value, ref.shape)

    @pl.when(tile == pl.num_programs(1) - 1)
    def _():
        for out, ref in zip(outs, stats):
            out[...] = ref[...]


@functools.partial(jax.jit, static_argnames=("mask_id", "eps", "residual_scale", "tile_m", "tile_v", "interpret"))
def residual_argmax_stats(x_md, w_dv, scale_d=None, h_p_md=None, *, mask_id: int | None, eps: float | None,
                          residual_scale: float | None, tile_m: int, tile_v: int, interpret: bool):
    """The six running statistics, each [M, 1]; M % tile_m == 0 with tile_m a multiple of 8 or M,
    tile_v a multiple of 128 or V."""
    m, d = x_md.shape
    vocab = w_dv.shape[1]
    inputs, specs = row_inputs(x_md, scale_d, h_p_md, tile_m=tile_m, eps=eps, residual_scale=residual_scale)
    inputs.append(w_dv)
    specs.append(pl.BlockSpec((d, tile_v), lambda i, j: (0, j)))
    stat = pl.BlockSpec((tile_m, LANES), lambda i, j: (i, 0))
    kernel = functools.partial(_kernel, vocab=vocab, mask_id=mask_id, eps=eps, residual_scale=residual_scale)
    out = pl.pallas_call(
        kernel, grid=(m // tile_m, pl.cdiv(vocab, tile_v)), in_specs=specs, out_specs=[stat] * len(DTYPES),
        out_shape=[jax.ShapeDtypeStruct((m, LANES), dtype) for dtype in DTYPES],
        scratch_shapes=[pltpu.VMEM((tile_m, d), x_md.dtype)] + [pltpu.VMEM((tile_m, LANES), t) for t in DTYPES],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret, name="residual_argmax_tpu",
    )(*inputs)
    return [a[:, :1] for a in out]
