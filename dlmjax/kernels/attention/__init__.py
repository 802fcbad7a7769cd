"""Attention over key/value parts (`layers.attention` outside the invariant numerics mode).

The chain, first that serves:
1. `jax.nn.dot_product_attention` with cuDNN's flash attention on GPU, for a plain bidirectional
   forward (one part, one segment, every key valid: LLaDA/Dream prefill without padding);
2. the Pallas flash kernel: any topology, segments (packed copies see the shared context and
   themselves), key ranges per tile of queries (`key_ranges`: a causal or block-causal prefill's
   tile reads up to its own frontier, about half the square; a decode step reads only the written
   part of the cache; a sliding-window layer only its window); memory linear in length. On GPU
   `kernel.py` (Triton; a loop over key tiles); on TPU `kernel_tpu.py` (Mosaic; key tiles on the
   grid, heads as 128-lane column blocks, so head dims that are multiples of 128);
3. the reference (`reference.py`, the XLA einsum): on CPU, in "off" mode, or for visibilities
   given as matrices (training layouts), with the reason logged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dlmjax import kernels
from dlmjax.kernels.attention import kernel as _kernel
from dlmjax.kernels.attention import kernel_tpu as _kernel_tpu
from dlmjax.kernels.attention.kernel import STAGES, WARPS
from dlmjax.kernels.attention.reference import attention as reference

__all__ = ["attention", "reference"]

# Triton choices, from benchmarks/decode_gpu.py's tiles section on an H100 (SDAR-1.7B heads, a block-causal
# prefill): queries that span several tiles (a prefill) in 64 x 64 tiles on 4 warps with 3 stages ran 0.28-0.33 ms
# at 2k tokens and 1.84 ms at 8k, where 64 x 128 tiles on 4 warps with 2 stages had run 0.44 and 2.10 ms. A decode
# chunk (one tile of queries, keys split over programs in slices of SPLIT_K) keeps the latter: not swept yet.
PREFILL_TILES = dict(tile_q=64, tile_k=64, warps=4, stages=3)
DECODE_TILES = dict(tile_q=64, tile_k=128, warps=4, stages=2)
SPLIT_K = 512  # keys per program when the queries fit one tile
TPU_TILE_Q, TPU_TILE_K = 256, 512


def _is_pow2(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


def _unsupported(q_blhd, kv_parts, interpret: bool) -> str | None:
    from dlmjax.models.layers import Visibility

    if not all(isinstance(vis, Visibility) for _, _, vis in kv_parts):
        return "visibility given as a matrix"
    head_dim = q_blhd.shape[-1]
    if not interpret and _on_tpu() and head_dim % _kernel_tpu.LANES:
        return f"head dim {head_dim} is not a multiple of {_kernel_tpu.LANES} (Mosaic's lane width)"
    if not interpret and not _on_tpu() and not _is_pow2(head_dim):
        return f"head dim {head_dim} is not a power of two >= 16"
    return None


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


KEY_RANGE_TILES = 8  # query tiles whose key ranges `key_ranges` finds at once


def key_ranges(vis, tile_q: int):
    """([B, T] int32 first key, [B, T] int32 one past the last key) that each tile of `tile_q`
    queries (T tiles; the last may hold padding) reads: the keys some query of the tile can see by
    the topology, the sliding window and validity (segments left out: a tile reads what the widest
    of its copies sees). A causal or block-causal prefill's tile then reads up to its own frontier,
    about half the square; a decode step reads only the written part of the cache; a sliding-window
    layer only its window. An empty range (no key for any query of the tile) is (S, 0).

    Reading exactly these tiles changes no bit of a query that sees a key: a tile outside its range
    holds only keys hidden from all of its queries, which add exact zeros to the online softmax."""
    b, l = vis.q_pos.shape
    s = vis.k_pos.shape[1]
    tiles = -(-l // tile_q)
    q_pos = jnp.pad(vis.q_pos, ((0, 0), (0, tiles * tile_q - l)), mode="edge").reshape(b, tiles, tile_q)

    def ranges(bounds):  # [B] latest and earliest query positions of one tile -> [B] starts, ends
        latest, earliest = (bound[:, None] for bound in bounds)
        reach = _kernel.topology(latest, vis.k_pos, vis.attention, vis.block_size)  # its latest query sees most
        if vis.window is not None:  # and its earliest reaches furthest back
            reach &= earliest - vis.k_pos < vis.window
        seen = reach & vis.k_valid
        ends = jnp.max(jnp.where(seen, jnp.arange(1, s + 1, dtype=jnp.int32), 0), axis=-1)
        starts = jnp.where(seen.any(axis=-1), jnp.argmax(seen, axis=-1), s)
        return starts.astype(jnp.int32), ends.astype(jnp.int32)

    # KEY_RANGE_TILES tiles at a time (lax.map vmaps `ranges` over them): [n, B, S] booleans, so this
    # memory grows with S, not with L x S
    bounds = (q_pos.max(axis=-1).T, q_pos.min(axis=-1).T)  # [T, B] each
    starts, ends = jax.lax.map(ranges, bounds, batch_size=min(KEY_RANGE_TILES, tiles))
    return starts.T, ends.T


def _cudnn_serves(kv_parts) -> bool:
    """One plain bidirectional part, no window: jax.nn.dot_product_attention with no mask."""
    from dlmjax.models.layers import Visibility

    if len(kv_parts) != 1 or not isinstance(vis := kv_parts[0][2], Visibility):
        return False
    return vis.plain and vis.attention == "bidirectional" and vis.window is None


def dot_product_attention(implementation: str):
    """jax.nn.dot_product_attention(q, k, v) as it serves a plain bidirectional part (no mask)."""
    return functools.partial(jax.nn.dot_product_attention, implementation=implementation)


def tiles_for(queries: int, **given: int | None) -> dict:
    """{tile_q, tile_k, warps, stages} for `queries` query positions: those `given` (not None), the
    rest PREFILL_TILES' where the queries span more than one tile, else DECODE_TILES'."""
    chosen = DECODE_TILES if queries <= DECODE_TILES["tile_q"] else PREFILL_TILES
    return {name: chosen[name] if given.get(name) is None else given[name] for name in chosen}


def attention(q_blhd, kv_parts, *, tile_q: int | None = None, tile_k: int | None = None, split_k: int = SPLIT_K,
              warps: int | None = None, stages: int | None = None):
    """Grouped-query attention of q [B, L, H, hd] over parts [(k [B, S, Hkv, hd], v, visible), ...]
    with one joint softmax; see the module docstring for which path runs. The tiles, `warps` and
    `stages` shape the GPU and interpret-mode kernel; those not given are PREFILL_TILES' where the
    queries span more than one tile, else DECODE_TILES' (benchmarks/decode_gpu.py's tiles section
    times choices of them)."""
    tile_q, tile_k, warps, stages = tiles_for(q_blhd.shape[1], tile_q=tile_q, tile_k=tile_k, warps=warps,
                                              stages=stages).values()
    how = kernels.choose("attention")
    if how == "kernel" and jax.default_backend() == "gpu" and _cudnn_serves(kv_parts):
        k, v, _ = kv_parts[0]  # cuDNN first: it takes head dims the Pallas kernel does not (96, 80, ...)
        cudnn = dot_product_attention("cudnn")
        error = kernels.compile_error("attention/cudnn", cudnn, q_blhd, k, v)
        if error is None:
            return cudnn(q_blhd, k, v)
        kernels.fallback("attention/cudnn", error)
    unsupported = None if how is None else _unsupported(q_blhd, kv_parts, how == "interpret")
    if unsupported is not None:
        kernels.fallback("attention", unsupported)
    if how is None or unsupported is not None:
        return reference(q_blhd, kv_parts)
    if how == "kernel" and _on_tpu():
        build = functools.partial(tpu_calls, tile_q=TPU_TILE_Q, tile_k=TPU_TILE_K, interpret=False)
    else:
        build = functools.partial(flash_calls, tile_q=tile_q, tile_k=tile_k, split_k=split_k,
                                  interpret=how == "interpret",
                                  triton=how == "kernel" and jax.default_backend() == "gpu", warps=warps, stages=stages)
    if how == "kernel":
        for call, args in build(q_blhd, kv_parts):
            error = kernels.compile_error("attention", call, *args)
            if error is not None:
                kernels.fallback("attention", error)
                return reference(q_blhd, kv_parts)
    return with_reference_gradient(lambda q, parts: _run(q, build(q, parts)))(q_blhd, kv_parts)


def with_reference_gradient(kernel_fn):
    """`kernel_fn(q, kv_parts)` made differentiable: its forward is the kernel's, its gradient the
    reference einsum's (a Pallas call has no VJP of its own). Training takes it where a forward
    with gradients runs the kernel (a next-token loss with per-row validity); the backward then
    holds the reference's [B, H, L, S] scores, as a training step without kernels does."""

    @jax.custom_vjp
    def run(q, kv_parts):
        return kernel_fn(q, kv_parts)

    def forward(q, kv_parts):
        return kernel_fn(q, kv_parts), (q, kv_parts)

    def backward(saved, grad_out):
        out, pullback = jax.vjp(reference, *saved)
        return pullback(grad_out.astype(out.dtype))

    run.defvjp(forward, backward)
    return run


def flash(q_blhd, kv_parts, *, tile_q: int, tile_k: int, split_k: int = SPLIT_K, interpret: bool):
    """The Pallas path: one flash kernel per part, merged by `kernel.combine`."""
    return _run(q_blhd, flash_calls(q_blhd, kv_parts, tile_q=tile_q, tile_k=tile_k, split_k=split_k,
                                    interpret=interpret))


def flash_tpu(q_blhd, kv_parts, *, tile_q: int = TPU_TILE_Q, tile_k: int = TPU_TILE_K, interpret: bool):
    """The Mosaic-shaped Pallas path (`kernel_tpu.py`), merged by `kernel.combine`."""
    return _run(q_blhd, tpu_calls(q_blhd, kv_parts, tile_q=tile_q, tile_k=tile_k, interpret=interpret))


def _run(q_blhd, calls):
    return _kernel.combine([call(*args) for call, args in calls])[:, : q_blhd.shape[1]].astype(q_blhd.dtype)


MIN_KEYS = 16  # GPU dots need >= 16 along every dimension


def flash_calls(q_blhd, kv_parts, *, tile_q: int, tile_k: int, split_k: int, interpret: bool, triton: bool = False,
                warps: int = WARPS, stages: int = STAGES):
    """[(kernel call, its arguments)] per part: queries padded to a whole number of power-of-two
    tiles (a decode chunk: one tile of 16), keys tiled by the largest power of two up to `tile_k`
    that the part holds (the last tile shifted left, so the cache is never padded). Queries that fit
    one tile split the keys into slices of `split_k` over programs; more queries keep one slice."""
    tile_q = min(tile_q, max(MIN_KEYS, 1 << (q_blhd.shape[1] - 1).bit_length()))
    q = _padded(q_blhd, tile_q)
    calls = []
    for k, v, vis in kv_parts:
        k, v, vis = _at_least(MIN_KEYS, k, v, vis)
        keys = k.shape[1]
        tile = min(tile_k, _floor_pow2(keys))
        split = max(split_k // tile, 1) * tile if q.shape[1] == tile_q else -(-keys // tile) * tile
        call = functools.partial(_kernel.flash_part, **_topology(vis), tile_q=tile_q, tile_k=tile, split_k=split,
                                 interpret=interpret, triton=triton, warps=warps, stages=stages)
        calls.append((call, _part_args(q, k, v, vis, tile_q)))
    return calls


def tpu_calls(q_blhd, kv_parts, *, tile_q: int, tile_k: int, interpret: bool):
    """[(kernel call, its arguments)] per part for `kernel_tpu`: queries in one whole tile when
    they fit (a decode chunk is never padded), else padded to tiles of `tile_q`; keys in tiles of
    `tile_k`, or one whole tile when the part holds fewer."""
    tile_q = min(tile_q, q_blhd.shape[1])
    q = _padded(q_blhd, tile_q)
    calls = []
    for k, v, vis in kv_parts:
        k, v, vis = _at_least(1, k, v, vis)
        call = functools.partial(_kernel_tpu.flash_part, **_topology(vis), tile_q=tile_q,
                                 tile_k=min(tile_k, k.shape[1]), interpret=interpret)
        calls.append((call, _part_args(q, k, v, vis, tile_q)))
    return calls


def _topology(vis) -> dict:
    """A part's static visibility options, as both kernels take them."""
    return dict(attention=vis.attention, block_size=vis.block_size, window=vis.window)


def _padded(q_blhd, tile_q: int):
    """q [B, L, H, hd] padded with zero queries to a whole number of `tile_q` tiles."""
    return jnp.pad(q_blhd, ((0, 0), (0, -q_blhd.shape[1] % tile_q), (0, 0), (0, 0)))


def _part_args(q, k, v, vis, tile_q: int) -> tuple:
    """A part's kernel arguments: the padded queries, their positions and segments padded alike,
    then the keys, values, their visibility inputs and the key range of each tile of queries."""
    pad = ((0, 0), (0, q.shape[1] - vis.q_pos.shape[1]))
    q_pos, q_seg = (jnp.pad(a, pad).astype(jnp.int32) for a in (vis.q_pos, vis.q_seg))
    return (q, k, v, q_pos, q_seg, vis.k_pos.astype(jnp.int32), vis.k_seg.astype(jnp.int32), vis.k_valid,
            *key_ranges(vis, tile_q))


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _at_least(keys: int, k, v, vis):
    """A part with fewer than `keys` keys (a decode chunk) padded with hidden keys to that many."""
    pad = keys - k.shape[1]
    if pad <= 0:
        return k, v, vis
    pad_bs = ((0, 0), (0, pad))
    k, v = (jnp.pad(a, pad_bs + ((0, 0), (0, 0))) for a in (k, v))
    return k, v, vis.replace(k_pos=jnp.pad(vis.k_pos, pad_bs), k_seg=jnp.pad(vis.k_seg, pad_bs),
                             k_valid=jnp.pad(vis.k_valid, pad_bs))
