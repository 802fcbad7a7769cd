"""Pallas `residual_argmax`: per tile of `tile_m` positions and per slice of `split_v` vocabulary
columns (one program each, so that a few positions still fill a GPU), the final norm, then the
lm_head one tile of `tile_v` columns at a time (each a sum of [tile_m, tile_d] x [tile_d, tile_v]
dots) with an online max, log-sum-exp, entropy sum and top-2, so that no [M, V] logits are
written. `finish` merges the slices' statistics.

A slice or vocabulary that is not a multiple of the tile gets a last tile that starts earlier and
ignores the columns already seen (or past the slice): every read is in bounds and no weight is
padded or copied.

Running statistics per position (u = logit - m, the running max m):
  s = sum exp(u), t = sum exp(u) * u, top-1 value and index, top-2 value.
A new max m' rescales both by a = exp(m - m'): s' = a s, t' = a (t + (m - m') s).
Finally lse = m + log s, entropy = log s - t / s, confidence = exp(top1 - lse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# a hidden column's logit in the exp sums: finite, so exp(NEG - m) * (NEG - m) is 0, not NaN (the
# top-1/top-2 ranking uses -inf, so a hidden column never wins; a row whose every logit is below
# NEG gets a confidence of inf and NaN entropy: its token is still right, but no trained model's
# logits reach -1e30 (tests/test_kernels.py reaches them with weights of 1e36)
NEG = -1e30
WARPS, STAGES = 8, 3  # each Triton program's warps and software-pipelining stages (the dispatcher's defaults)


def _tile_stats(logits_mt, valid_1t, first_col):
    """The tile's logits for the exp sums (invalid columns at NEG), and the top-1 value/index and
    top-2 value of its valid columns (-inf where there is none: an invalid column never wins, even
    over valid logits at or below NEG)."""
    l = jnp.where(valid_1t, logits_mt, NEG)
    ranked = jnp.where(valid_1t, logits_mt, -jnp.inf)
    local = jnp.argmax(ranked, axis=-1)[:, None].astype(jnp.int32)
    top1 = jnp.max(ranked, axis=-1, keepdims=True)
    cols = jax.lax.broadcasted_iota(jnp.int32, l.shape, 1)
    top2 = jnp.max(jnp.where(cols == local, -jnp.inf, ranked), axis=-1, keepdims=True)
    return l, top1, local + first_col, top2


def allowed(cols, mask_id: int | None):
    """Which vocabulary columns compete for the argmax: all but `mask_id` (None: all)."""
    return cols >= 0 if mask_id is None else cols != mask_id


def initial_stats(rows: int):
    """(top1, index, top2, m, s, t) before any column, each [rows, 1]."""
    none, neg = jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.full((rows, 1), NEG, jnp.float32)
    zero = jnp.zeros((rows, 1), jnp.float32)
    return none, jnp.zeros((rows, 1), jnp.int32), none, neg, zero, zero


def update(stats, logits_mt, valid_1t, first_col):
    """The running statistics (see the module docstring) after one tile of logits [rows, tile]
    whose columns start at `first_col`; `valid_1t` [1, tile] marks the columns that count."""
    top1, index, top2, m, s, t = stats
    l, t1, i1, t2 = _tile_stats(logits_mt, valid_1t, first_col)
    m_new = jnp.maximum(m, t1)
    a = jnp.exp(m - m_new)
    e = jnp.where(valid_1t, jnp.exp(l - m_new), 0.0)
    s_new = a * s + jnp.sum(e, axis=-1, keepdims=True)
    # e = 0 (a -inf logit): its term is 0, not 0 * -inf
    t_new = a * (t + (m - m_new) * s) + jnp.sum(jnp.where(valid_1t & (e > 0), e * (l - m_new), 0.0), axis=-1,
                                                keepdims=True)
    better = t1 > top1  # strict: an earlier column keeps a tie, as jnp.argmax does
    top2 = jnp.where(better, jnp.maximum(top1, t2), jnp.maximum(top2, t1))
    return jnp.where(better, t1, top1), jnp.where(better, i1, index), top2, m_new, s_new, t_new


def _kernel(*refs, vocab: int, split_v: int, tile_v: int, tile_d: int, mask_id: int | None, eps: float | None,
            residual_scale: float | None):
    it = iter(refs)
    x_ref = next(it)
    scale_ref = next(it) if eps is not None else None
    r_ref = next(it) if residual_scale is not None else None
    w_ref = next(it)
    top1_ref, index_ref, top2_ref, max_ref, sum_ref, usum_ref = it
    rows, dim = x_ref.shape
    chunks = dim // tile_d

    inv_rms = None
    if eps is not None:  # the model's RMSNorm (layers.rms_norm): statistics in f32 over the whole row
        def squares(c, acc):
            x32 = x_ref[:, pl.ds(c * tile_d, tile_d)].astype(jnp.float32)
            return acc + jnp.sum(x32 * x32, axis=-1, keepdims=True)

        inv_rms = jax.lax.rsqrt(jax.lax.fori_loop(0, chunks, squares, jnp.zeros((rows, 1), jnp.float32)) / dim + eps)

    def hidden_chunk(c):
        x = x_ref[:, pl.ds(c * tile_d, tile_d)]
        if inv_rms is None:
            return x
        return scale_ref[:, pl.ds(c * tile_d, tile_d)] * (x.astype(jnp.float32) * inv_rms).astype(x.dtype)

    def tile_logits(start):
        def chunk(c, acc):
            w = w_ref[pl.ds(c * tile_d, tile_d), pl.ds(start, tile_v)]
            base, res = acc
            base = base + jnp.dot(hidden_chunk(c), w, preferred_element_type=jnp.float32)
            if r_ref is not None:
                res = res + jnp.dot(r_ref[:, pl.ds(c * tile_d, tile_d)], w, preferred_element_type=jnp.float32)
            return base, res

        zero = jnp.zeros((rows, tile_v), jnp.float32)
        base, res = jax.lax.fori_loop(0, chunks, chunk, (zero, zero))
        return base if r_ref is None else base + residual_scale * res

    first = pl.program_id(1) * split_v
    end = jnp.minimum(first + split_v, vocab)

    def body(j, carry):
        seen = first + j * tile_v
        start = jnp.minimum(seen, vocab - tile_v)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, tile_v), 1)
        return update(carry, tile_logits(start), (cols >= seen) & (cols < end) & allowed(cols, mask_id), start)

    out = jax.lax.fori_loop(0, pl.cdiv(end - first, tile_v), body, initial_stats(rows))
    for ref, value in zip((top1_ref, index_ref, top2_ref, max_ref, sum_ref, usum_ref), out):
        ref[...] = value


def row_inputs(x_md, scale_d, h_p_md, *, tile_m: int, eps: float | None, residual_scale: float | None):
    """([x, norm scale, h_p] as used, their BlockSpecs): rows in tiles of `tile_m` on the first grid
    axis, the norm scale whole; the lm_head's spec is the caller's."""
    d = x_md.shape[1]
    rows = pl.BlockSpec((tile_m, d), lambda i, j: (i, 0))
    inputs, specs = [x_md], [rows]
    if eps is not None:
        inputs.append(scale_d.reshape(1, d))
        specs.append(pl.BlockSpec((1, d), lambda i, j: (0, 0)))
    if residual_scale is not None:
        inputs.append(h_p_md)
        specs.append(rows)
    return inputs, specs


@functools.partial(jax.jit, static_argnames=("mask_id", "eps", "residual_scale", "tile_m", "tile_v", "tile_d",
                                             "split_v", "interpret", "triton", "warps", "stages"))
def residual_argmax_stats(x_md, w_dv, scale_d=None, h_p_md=None, *, mask_id: int | None, eps: float | None,
                          residual_scale: float | None, tile_m: int, tile_v: int, tile_d: int, split_v: int,
                          interpret: bool, triton: bool = False, warps: int = WARPS, stages: int = STAGES):
    """The six running statistics of each vocabulary slice, each [M, slices] (see the module
    docstring); M % tile_m == 0, V >= tile_v, D % tile_d == 0, split_v % tile_v == 0 (the dispatcher
    pads rows and picks the tiles). `triton`: lower with Pallas' Triton backend (GPU), whose blocks
    stay in global memory (Mosaic GPU would stage the whole lm_head in shared memory), each program
    on `warps` warps with `stages` software-pipelining stages."""
    m, d = x_md.shape
    vocab = w_dv.shape[1]
    slices = pl.cdiv(vocab, split_v)
    inputs, specs = row_inputs(x_md, scale_d, h_p_md, tile_m=tile_m, eps=eps, residual_scale=residual_scale)
    inputs.append(w_dv)
    specs.append(pl.BlockSpec((d, vocab), lambda i, j: (0, 0)))
    stat = pl.BlockSpec((tile_m, 1), lambda i, j: (i, j))
    f32, i32 = jax.ShapeDtypeStruct((m, slices), jnp.float32), jax.ShapeDtypeStruct((m, slices), jnp.int32)
    kernel = functools.partial(_kernel, vocab=vocab, split_v=split_v, tile_v=tile_v, tile_d=tile_d, mask_id=mask_id,
                               eps=eps, residual_scale=residual_scale)
    return pl.pallas_call(
        kernel, grid=(m // tile_m, slices), in_specs=specs, out_specs=[stat] * 6,
        out_shape=[f32, i32, f32, f32, f32, f32], interpret=interpret, name="residual_argmax",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages) if triton else None,
    )(*inputs)


def finish(top1, index, top2, m, s, t):
    """(tokens, confidence, entropy, margin), each [M], from the slices' statistics [M, slices]:
    merged as the kernel merges tiles (the first slice keeps a tie)."""
    top = jnp.max(m, axis=-1, keepdims=True)
    a = jnp.exp(m - top)
    total = jnp.sum(a * s, axis=-1)
    u_sum = jnp.sum(a * (t + (m - top) * s), axis=-1)
    best = jnp.argmax(top1, axis=-1)[:, None]
    v1 = jnp.take_along_axis(top1, best, axis=-1)[:, 0]
    others = jnp.where(jnp.arange(top1.shape[1])[None, :] == best, NEG, top1)
    v2 = jnp.maximum(jnp.max(others, axis=-1), jnp.take_along_axis(top2, best, axis=-1)[:, 0])
    log_s = jnp.log(total)
    lse = top[:, 0] + log_s
    confidence = jnp.exp(v1 - lse)
    tokens = jnp.take_along_axis(index, best, axis=-1)[:, 0]
    return tokens, confidence, log_s - u_sum / total, confidence - jnp.exp(v2 - lse)
