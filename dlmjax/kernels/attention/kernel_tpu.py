"""The flash kernel of `kernel.py` in the shape Mosaic (Pallas on TPU) compiles: the same
visibility, online softmax and key ranges, with keys tiled by the grid instead of a loop.

Mosaic wants the last two dimensions of every block to be multiples of (8, 128) or whole, and
VMEM holds a few MiB, not a row of a long cache. So:

- heads are column blocks of free reshapes (q [B, L, H hd], k/v [B, S, Hkv hd]): a block is one
  head's [tile, hd] (hd a multiple of 128), and a grouped-query head reads its KV head in place;
- the grid is (row, head, query tile, key tile); the key axis is sequential ("arbitrary") and
  carries m, l and the accumulator in VMEM scratch. Each query tile's key range (`key_ranges`:
  the first key and one past the last that any of its queries sees, flattened row by row) is
  prefetched into SMEM: key tiles outside it are skipped, and their index map repeats the nearest
  tile in range, so Pallas fetches nothing for them (a causal prefill's tile reads up to its own
  frontier, a decode step only the written cache, a sliding-window layer only its window);
- a key count that is not a multiple of the tile gets a partial last tile whose slots past S are
  hidden and zeroed (never padded or copied);
- m and l leave the kernel lane-replicated ([B, L, H 128]), as Mosaic stores rows of 128 lanes.

It returns what `kernel.flash_part` does (one key slice), so `kernel.combine` merges parts alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dlmjax.kernels.attention.kernel import MASK_VALUE, topology

LANES = 128


def _kernel(kv_start_ref, kv_len_ref, q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref, k_pos_ref, k_seg_ref, k_valid_ref,
            acc_ref, max_ref, sum_ref, m_scratch, l_scratch, acc_scratch, *, keys: int, attention: str,
            block_size: int | None, window: int | None):
    tile = pl.program_id(3)
    query_tile = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)  # its index in the flat ranges
    tile_k = k_ref.shape[0]
    start = tile * tile_k

    @pl.when(tile == 0)
    def _():
        m_scratch[...] = jnp.full(m_scratch.shape, MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    @pl.when((start < kv_len_ref[query_tile]) & (start + tile_k > kv_start_ref[query_tile]))
    def _():
        q, v = q_ref[...], v_ref[...]
        visible = (topology(q_pos_ref[...], k_pos_ref[...], attention, block_size, window)
                   & ((k_seg_ref[...] == 0) | (k_seg_ref[...] == q_seg_ref[...])) & (k_valid_ref[...] != 0))
        if keys % tile_k:  # a partial last tile: what lies past S is hidden, and its values zeroed
            visible &= (start + jax.lax.broadcasted_iota(jnp.int32, (1, tile_k), 1)) < keys
            v = jnp.where((start + jax.lax.broadcasted_iota(jnp.int32, (tile_k, 1), 0)) < keys, v, jnp.zeros_like(v))
        s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(visible, s * q.shape[-1] ** -0.5, MASK_VALUE)
        m = m_scratch[...]  # [tile_q, 128], lane-replicated
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        a = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[:, :1])
        l_scratch[...] = a * l_scratch[...] + jnp.sum(e, axis=-1, keepdims=True)
        acc_scratch[...] = a[:, :1] * acc_scratch[...] + jnp.dot(e.astype(v.dtype), v,
                                                                 preferred_element_type=jnp.float32)
        m_scratch[...] = m_new

    @pl.when(tile == pl.num_programs(3) - 1)
    def _():
        acc_ref[...] = acc_scratch[...]
        max_ref[...] = m_scratch[...]
        sum_ref[...] = l_scratch[...]


@functools.partial(jax.jit, static_argnames=("attention", "block_size", "tile_q", "tile_k", "interpret", "window"))
def flash_part(q_blhd, k_bshd, v_bshd, q_pos_bl, q_seg_bl, k_pos_bs, k_seg_bs, k_valid_bs, kv_start_bt, kv_len_bt, *,
               attention: str, block_size: int | None, tile_q: int, tile_k: int, interpret: bool,
               window: int | None = None):
    """(acc [1, B, L, H, hd] f32, m [1, B, H, L], l [1, B, H, L]) of one part, as kernel.flash_part.
    L % tile_q == 0; tile_q a multiple of 8 or L; tile_k a multiple of 128 or S; the key ranges
    [B, L / tile_q]."""
    b, l, h, d = q_blhd.shape
    s, hkv = k_bshd.shape[1], k_bshd.shape[2]
    group, key_tiles, query_tiles = h // hkv, pl.cdiv(s, tile_k), l // tile_q

    def in_range(j, starts, lens, r, i):
        """Key tile j, or the nearest tile of row r's query tile i's range, from its start's tile to
        its last (0 for an empty range). Starts and lengths are >= 0 (an empty range's start is S,
        past its end), so truncating division is floor."""
        t = r * query_tiles + i
        last = jnp.maximum(jax.lax.div(lens[t] + tile_k - 1, tile_k) - 1, 0)
        return jnp.minimum(jnp.maximum(j, jax.lax.div(starts[t], tile_k)), last)

    q_spec = pl.BlockSpec((None, tile_q, d), lambda r, hd, i, j, *_: (r, i, hd))
    q_vec = pl.BlockSpec((None, tile_q, 1), lambda r, hd, i, j, *_: (r, i, 0))
    kv_spec = pl.BlockSpec((None, tile_k, d), lambda r, hd, i, j, st, n: (r, in_range(j, st, n, r, i), hd // group))
    k_vec = pl.BlockSpec((None, 1, tile_k), lambda r, hd, i, j, st, n: (r, 0, in_range(j, st, n, r, i)))
    acc_spec = pl.BlockSpec((None, tile_q, d), lambda r, hd, i, j, *_: (r, i, hd))
    stat = pl.BlockSpec((None, tile_q, LANES), lambda r, hd, i, j, *_: (r, i, hd))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, h, l // tile_q, key_tiles),
        in_specs=[q_spec, kv_spec, kv_spec, q_vec, q_vec, k_vec, k_vec, k_vec],
        out_specs=[acc_spec, stat, stat],
        scratch_shapes=[pltpu.VMEM((tile_q, LANES), jnp.float32), pltpu.VMEM((tile_q, LANES), jnp.float32),
                        pltpu.VMEM((tile_q, d), jnp.float32)],
    )
    kernel = functools.partial(_kernel, keys=s, attention=attention, block_size=block_size, window=window)
    acc, m, l_sum = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, l, h * d), jnp.float32),
                   jax.ShapeDtypeStruct((b, l, h * LANES), jnp.float32),
                   jax.ShapeDtypeStruct((b, l, h * LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="flash_attention_tpu",
    )(kv_start_bt.reshape(-1).astype(jnp.int32), kv_len_bt.reshape(-1).astype(jnp.int32), q_blhd.reshape(b, l, h * d),
      k_bshd.reshape(b, s, hkv * d), v_bshd.reshape(b, s, hkv * d), q_pos_bl[..., None], q_seg_bl[..., None],
      k_pos_bs[:, None], k_seg_bs[:, None], k_valid_bs.astype(jnp.int32)[:, None])

    def per_head(stat_bl):  # [B, L, H 128] lane-replicated -> [1, B, H, L]
        return stat_bl.reshape(b, l, h, LANES)[..., 0].transpose(0, 2, 1)[None]

    return acc.reshape(1, b, l, h, d), per_head(m), per_head(l_sum)
