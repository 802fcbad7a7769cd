"""Pallas `residual_argmax`: per tile of `tile_m` positions, the final norm, then the lm_head one
vocabulary tile of `tile_v` columns at a time with an online max, log-sum-exp, entropy sum and
top-2, so that no [M, V] logits are ever written.

The vocabulary loop runs inside the kernel (a `fori_loop` over column tiles), which serves the
GPU (each grid program is independent) and TPU alike. A vocabulary that is not a multiple of the
tile gets a last tile that starts at V - tile_v and ignores the columns already seen: every read
is in bounds and no weight is padded or copied.

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

NEG = -1e30  # a hidden column's logit: finite, so exp(NEG - m) * (NEG - m) is 0, not NaN


def _tile_stats(logits_mt, valid_t, first_col):
    """Top-1 value/index and top-2 value of one tile's logits (invalid columns at NEG)."""
    l = jnp.where(valid_t[None, :], logits_mt, NEG)
    local = jnp.argmax(l, axis=-1)[:, None].astype(jnp.int32)
    top1 = jnp.max(l, axis=-1, keepdims=True)
    cols = jax.lax.broadcasted_iota(jnp.int32, l.shape, 1)
    top2 = jnp.max(jnp.where(cols == local, NEG, l), axis=-1, keepdims=True)
    return l, top1, local + first_col, top2


def _kernel(*refs, vocab: int, tile_v: int, mask_id: int, eps: float | None, residual_scale: float | None):
    it = iter(refs)
    x_ref = next(it)
    scale_ref = next(it) if eps is not None else None
    r_ref = next(it) if residual_scale is not None else None
    w_ref = next(it)
    top1_ref, index_ref, top2_ref, max_ref, sum_ref, usum_ref = it

    x = x_ref[...]
    if eps is not None:  # the model's RMSNorm, as layers.rms_norm computes it
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
        x = scale_ref[...] * normed
    r = r_ref[...] if r_ref is not None else None
    rows = x.shape[0]

    def body(j, carry):
        top1, index, top2, m, s, t = carry
        seen = j * tile_v
        start = jnp.minimum(seen, vocab - tile_v)
        w = w_ref[:, pl.ds(start, tile_v)]
        logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
        if r is not None:
            logits = logits + residual_scale * jnp.dot(r, w, preferred_element_type=jnp.float32)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (tile_v,), 0)
        valid = (cols >= seen) & (cols != mask_id)
        l, t1, i1, t2 = _tile_stats(logits, valid, start)
        m_new = jnp.maximum(m, t1)
        a = jnp.exp(m - m_new)
        e = jnp.where(valid[None, :], jnp.exp(l - m_new), 0.0)
        s_new = a * s + jnp.sum(e, axis=-1, keepdims=True)
        t_new = a * (t + (m - m_new) * s) + jnp.sum(jnp.where(valid[None, :], e * (l - m_new), 0.0), axis=-1,
                                                    keepdims=True)
        better = t1 > top1  # strict: an earlier column keeps a tie, as jnp.argmax does
        top2 = jnp.where(better, jnp.maximum(top1, t2), jnp.maximum(top2, t1))
        return jnp.where(better, t1, top1), jnp.where(better, i1, index), top2, m_new, s_new, t_new

    neg = jnp.full((rows, 1), NEG, jnp.float32)
    zero = jnp.zeros((rows, 1), jnp.float32)
    init = (neg, jnp.zeros((rows, 1), jnp.int32), neg, neg, zero, zero)
    out = jax.lax.fori_loop(0, pl.cdiv(vocab, tile_v), body, init)
    for ref, value in zip((top1_ref, index_ref, top2_ref, max_ref, sum_ref, usum_ref), out):
        ref[...] = value


@functools.partial(jax.jit, static_argnames=("mask_id", "eps", "residual_scale", "tile_m", "tile_v", "interpret",
                                             "triton"))
def residual_argmax_stats(x_md, w_dv, scale_d=None, h_p_md=None, *, mask_id: int, eps: float | None,
                          residual_scale: float | None, tile_m: int, tile_v: int, interpret: bool,
                          triton: bool = False):
    """The six running statistics, each [M, 1] (see the module docstring); M % tile_m == 0 and
    V >= tile_v (the dispatcher pads rows and picks the tiles). `triton`: lower with Pallas'
    Triton backend (GPU), whose blocks stay in global memory (Mosaic GPU would stage the whole
    lm_head in shared memory)."""
    m, d = x_md.shape
    vocab = w_dv.shape[1]
    rows = pl.BlockSpec((tile_m, d), lambda i: (i, 0))
    inputs, specs = [x_md], [rows]
    if eps is not None:
        inputs.append(scale_d.reshape(1, d))
        specs.append(pl.BlockSpec((1, d), lambda i: (0, 0)))
    if residual_scale is not None:
        inputs.append(h_p_md)
        specs.append(rows)
    inputs.append(w_dv)
    specs.append(pl.BlockSpec((d, vocab), lambda i: (0, 0)))
    stat = pl.BlockSpec((tile_m, 1), lambda i: (i, 0))
    f32, i32 = jax.ShapeDtypeStruct((m, 1), jnp.float32), jax.ShapeDtypeStruct((m, 1), jnp.int32)
    kernel = functools.partial(_kernel, vocab=vocab, tile_v=tile_v, mask_id=mask_id, eps=eps,
                               residual_scale=residual_scale)
    return pl.pallas_call(
        kernel, grid=(m // tile_m,), in_specs=specs, out_specs=[stat] * 6,
        out_shape=[f32, i32, f32, f32, f32, f32], interpret=interpret, name="residual_argmax",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2) if triton else None,
    )(*inputs)


def finish(top1, index, top2, m, s, t):
    """(tokens, confidence, entropy, margin), each [M], from the running statistics."""
    log_s = jnp.log(s)
    lse = m + log_s
    confidence = jnp.exp(top1 - lse)
    return (index[:, 0], confidence[:, 0], (log_s - t / s)[:, 0], (confidence - jnp.exp(top2 - lse))[:, 0])
