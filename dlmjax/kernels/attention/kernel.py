"""Pallas flash attention over one key/value part: online softmax over key tiles, the visibility
computed per tile from positions, segments and validity (never a [L, S] mask or score matrix in
memory), and per tile of queries only the key tiles in that tile's range read (`key_ranges`:
from the tile holding the first key any of its queries sees, kv_start_bt, to one past the last,
kv_len_bt).

One program per (row, query head, tile of `tile_q` queries, slice of `split_k` keys) loops over
the key tiles of its slice within its query tile's range (a decode step's few queries split the
keys over programs, flash-decoding style; a prefill has one slice; a slice outside the range
reads nothing). A key count that is not a multiple of the tile gets a last tile that starts at
S - tile_k and hides the keys already seen: every read is in bounds and the cache is never padded
or copied. Grouped-query heads read their shared key/value head in place.

It returns each slice's unnormalised accumulators (sum_s e_s v_s [slices, B, L, H, hd] and the max
m and sum l = sum_s e_s [slices, B, H, L], e_s = exp(score_s - m)); `combine` merges slices and
parts with one joint softmax, where a part (or slice) with every key hidden adds exact zeros (the
row-asynchronous engine's store part, see layers._attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MASK_VALUE = -1e30  # as layers.MASK_VALUE: a hidden key's score
WARPS, STAGES = 4, 2  # each Triton program's warps and software-pipelining stages (the dispatcher's defaults)


def topology(q_pos, k_pos, attention: str, block_size: int | None, window: int | None = None):
    """[Lq, Lk] bool (broadcast): causal, block_causal or bidirectional, within `window` if one
    is given, as layers.visibility."""
    if attention == "causal":
        topo = k_pos <= q_pos
    elif attention == "block_causal":
        topo = _floor_div(k_pos, block_size) <= _floor_div(q_pos, block_size)
    else:
        topo = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    return topo if window is None else topo & (q_pos - k_pos < window)


def _floor_div(a, b: int):
    """a // b for a positive b from truncating ops (Mosaic lowers `//` through sign(), which it
    cannot lower off a TPU); pad slots carry negative positions."""
    return jax.lax.div(a, b) - ((jax.lax.rem(a, b) != 0) & (a < 0)).astype(a.dtype)


def _kernel(q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref, k_pos_ref, k_seg_ref, k_valid_ref, kv_start_ref, kv_len_ref,
            acc_ref, max_ref, sum_ref, *, tile_k: int, split_k: int, attention: str, block_size: int | None,
            window: int | None):
    keys = k_ref.shape[0]
    # whole tiles from the slice's start or the query tile's first, so no tile reaches into the next slice
    slice_start = pl.program_id(3) * split_k
    first = jnp.maximum(slice_start, jax.lax.div(kv_start_ref[0], tile_k) * tile_k)
    end = jnp.minimum(slice_start + split_k, kv_len_ref[0])
    q = q_ref[...]
    tile_q, head_dim = q.shape
    q_pos, q_seg = q_pos_ref[...][:, None], q_seg_ref[...][:, None]
    scale = head_dim ** -0.5

    def body(j, carry):
        m, l, acc = carry
        seen = first + j * tile_k
        start = jnp.minimum(seen, keys - tile_k)
        k, v = k_ref[pl.ds(start, tile_k), :], v_ref[pl.ds(start, tile_k), :]
        k_pos, k_seg = k_pos_ref[pl.ds(start, tile_k)][None, :], k_seg_ref[pl.ds(start, tile_k)][None, :]
        # keys not seen yet (the last tile of the cache starts at S - tile_k)
        fresh = (start + jax.lax.broadcasted_iota(jnp.int32, (1, tile_k), 1)) >= seen
        visible = (topology(q_pos, k_pos, attention, block_size, window) & ((k_seg == 0) | (k_seg == q_seg))
                   & (k_valid_ref[pl.ds(start, tile_k)][None, :] != 0))
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible & fresh, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        a = jnp.exp(m - m_new)
        e = jnp.where(fresh, jnp.exp(s - m_new), 0.0)
        l = a * l + jnp.sum(e, axis=-1, keepdims=True)
        acc = a * acc + jnp.dot(e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((tile_q, 1), MASK_VALUE, jnp.float32), jnp.zeros((tile_q, 1), jnp.float32),
            jnp.zeros((tile_q, head_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), tile_k), body, init)
    acc_ref[...] = acc
    max_ref[...] = m[:, 0]
    sum_ref[...] = l[:, 0]


@functools.partial(jax.jit, static_argnames=("attention", "block_size", "tile_q", "tile_k", "split_k", "interpret",
                                             "triton", "warps", "stages", "window"))
def flash_part(q_blhd, k_bshd, v_bshd, q_pos_bl, q_seg_bl, k_pos_bs, k_seg_bs, k_valid_bs, kv_start_bt, kv_len_bt, *,
               attention: str, block_size: int | None, tile_q: int, tile_k: int, split_k: int, interpret: bool,
               triton: bool = False, warps: int = WARPS, stages: int = STAGES, window: int | None = None):
    """(acc [slices, B, L, H, hd] f32, m [slices, B, H, L], l [slices, B, H, L]) of one part;
    L % tile_q == 0, S >= tile_k, split_k % tile_k == 0; the key ranges [B, L / tile_q].
    `triton`: lower with Pallas' Triton backend (GPU): its blocks stay in global memory and the
    key loop loads one tile at a time (Mosaic GPU would stage whole rows in shared memory), each
    program on `warps` warps with `stages` software-pipelining stages."""
    b, l, h, d = q_blhd.shape
    s, hkv = k_bshd.shape[1], k_bshd.shape[2]
    group = h // hkv
    slices = pl.cdiv(s, split_k)
    q_spec = pl.BlockSpec((None, tile_q, None, d), lambda r, hd, i, j: (r, i, hd, 0))
    kv_spec = pl.BlockSpec((None, s, None, d), lambda r, hd, i, j: (r, 0, hd // group, 0))
    q_vec = pl.BlockSpec((None, tile_q), lambda r, hd, i, j: (r, i))
    k_vec = pl.BlockSpec((None, s), lambda r, hd, i, j: (r, 0))
    acc_spec = pl.BlockSpec((None, None, tile_q, None, d), lambda r, hd, i, j: (j, r, i, hd, 0))
    stat = pl.BlockSpec((None, None, None, tile_q), lambda r, hd, i, j: (j, r, hd, i))
    tile_scalar = pl.BlockSpec((None, 1), lambda r, hd, i, j: (r, i))
    kernel = functools.partial(_kernel, tile_k=tile_k, split_k=split_k, attention=attention, block_size=block_size,
                               window=window)
    return pl.pallas_call(
        kernel, grid=(b, h, l // tile_q, slices),
        in_specs=[q_spec, kv_spec, kv_spec, q_vec, q_vec, k_vec, k_vec, k_vec, tile_scalar, tile_scalar],
        out_specs=[acc_spec, stat, stat],
        out_shape=[jax.ShapeDtypeStruct((slices, b, l, h, d), jnp.float32),
                   jax.ShapeDtypeStruct((slices, b, h, l), jnp.float32),
                   jax.ShapeDtypeStruct((slices, b, h, l), jnp.float32)],
        interpret=interpret, name="flash_attention",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages) if triton else None,
    )(q_blhd, k_bshd, v_bshd, q_pos_bl, q_seg_bl, k_pos_bs, k_seg_bs, k_valid_bs.astype(jnp.int32),
      kv_start_bt, kv_len_bt)


def combine(parts):
    """Output [B, L, H, hd] f32 of parts' (acc, m, l) (each with a leading axis of key slices)
    under one joint softmax."""
    top = functools.reduce(jnp.maximum, [m.max(axis=0) for _, m, _ in parts])
    acc, total = 0.0, 0.0
    for a, m, l in parts:
        w = jnp.exp(m - top)  # [slices, B, H, L]; 0 exactly for a slice with every key hidden
        total = total + jnp.sum(w * l, axis=0)
        acc = acc + jnp.sum(w.transpose(0, 1, 3, 2)[..., None] * a, axis=0)
    total = total.transpose(0, 2, 1)[..., None]
    return acc / jnp.where(total == 0, 1.0, total)
