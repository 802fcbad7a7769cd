"""Pure numerics of the decoder stack: RMSNorm, RoPE, attention masks, grouped-query attention.

Every function here is shape-polymorphic and free of parameters; `transformer.py` holds the
weights. Softmax and normalisation statistics are computed in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dlmjax import arithmetic, sharding
# imported with the model, not inside the first trace: Pallas registers jax config state on import,
# which would change every jit cache key and recompile what a warm-up already compiled
from dlmjax.kernels.attention import attention as kernel_attention

# A large finite negative instead of -inf: a query with no visible key (a padding row) gets a
# uniform softmax rather than NaNs, and its output is never read.
MASK_VALUE = -1e30


def rms_norm(x, scale, eps: float):
    """HF RMSNorm: statistics in float32, cast back, then scale."""
    return scale * arithmetic.rowwise(lambda rows: normalize_rows(rows, eps), x)


def normalize_rows(rows, eps: float):
    """RMSNorm without its scale: each row over its last axis, statistics in float32, cast back."""
    x32 = rows.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(rows.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling=None):
    """RoPE's inverse frequencies [head_dim / 2] (float32), scaled as transformers' rope types do
    (`scaling`: a ModelConfig, read for its `rope_scaling` and `rope_*` fields, or None: plain):
      linear  every frequency / factor (positions stretched by the factor);
      llama3  wavelengths longer than original / low_freq_factor are divided by the factor, those
              shorter than original / high_freq_factor kept, and the ones between blended:
              (1 - s) f / factor + s f with s = (original / wavelength - low) / (high - low)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    kind = "none" if scaling is None else scaling.rope_scaling
    if kind == "none":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.rope_factor
    wavelength = 2 * jnp.pi / inv_freq
    low, high = scaling.rope_low_freq_factor, scaling.rope_high_freq_factor
    original = scaling.rope_original_max_positions
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / scaling.rope_factor + smooth * inv_freq
    return jnp.where(wavelength > original / low, inv_freq / scaling.rope_factor,
                     jnp.where(wavelength < original / high, inv_freq, blended))


def rope_angles(positions_bl, head_dim: int, theta: float, scaling=None):
    """cos, sin of shape [B, L, head_dim] in float32 (HF layout: the two halves repeat)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = positions_bl.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_blhd, cos_bld, sin_bld):
    """Rotate-half RoPE (Llama/Qwen convention), computed in float32. Angles narrower than the head
    (partial rotary: `rope_angles` of rotary_dim) rotate its first dims and pass the rest through.
    In the invariant numerics mode it runs over fixed row tiles: XLA's fused code for
    `x * cos + r * sin` rounds differently with the array's size (measured in bf16)."""
    cos_b, sin_b = cos_bld[:, :, None, :], sin_bld[:, :, None, :]
    if arithmetic.current().invariant:
        cos_b, sin_b = (jnp.broadcast_to(a, x_blhd.shape[:3] + a.shape[-1:]) for a in (cos_b, sin_b))
    return arithmetic.rowwise(_rotate_half, x_blhd, cos_b, sin_b)


def _rotate_half(x, cos, sin):
    rotary_dim = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    x32, passed = x32[..., :rotary_dim], x32[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos + rotated * sin
    return jnp.concatenate([out, passed], axis=-1).astype(x.dtype)


def visibility(
    q_pos_bq, q_seg_bq, k_pos_bk, k_seg_bk, k_valid_bk, *, attention: str, block_size: int | None,
    window: int | None = None,
):
    """Which keys each query may attend to: [B, Lq, Lk] bool.

    One rule serves every caller (prefill, block denoising against a cache, packed verification):
    - a key must be valid (a real token in a filled slot);
    - segment 0 is shared context that every query sees; otherwise query and key segments must
      match (packed candidate copies use segments 1..K+1 and never see each other);
    - the topology on positions: causal (k <= q), block_causal (block(k) <= block(q)),
      bidirectional (all); with a `window`, also q - k < window (sliding-window layers).
    """
    q_pos, k_pos = q_pos_bq[:, :, None], k_pos_bk[:, None, :]
    if attention == "causal":
        topo = k_pos <= q_pos
    elif attention == "block_causal":
        topo = (k_pos // block_size) <= (q_pos // block_size)
    elif attention == "bidirectional":
        topo = jnp.ones_like(k_pos <= q_pos)
    else:
        raise ValueError(f"attention={attention!r}; choose causal, bidirectional or block_causal")
    if window is not None:
        topo = topo & (q_pos - k_pos < window)
    k_seg = k_seg_bk[:, None, :]
    same_segment = (k_seg == 0) | (k_seg == q_seg_bq[:, :, None])
    return topo & same_segment & k_valid_bk[:, None, :]


@struct.dataclass
class Visibility:
    """`visibility`'s inputs, for kernels that evaluate it per tile instead of reading a
    [B, Lq, Lk] matrix (`matrix()` builds that; under jit only where a reference path reads it)."""

    q_pos: jax.Array  # [B, Lq]
    q_seg: jax.Array  # [B, Lq]
    k_pos: jax.Array  # [B, Lk]
    k_seg: jax.Array  # [B, Lk]
    k_valid: jax.Array  # [B, Lk] bool
    attention: str = struct.field(pytree_node=False)
    block_size: int | None = struct.field(pytree_node=False)
    plain: bool = struct.field(pytree_node=False, default=False)  # one segment, every key valid
    window: int | None = struct.field(pytree_node=False, default=None)  # sliding window: q - k < window

    def matrix(self):
        return visibility(self.q_pos, self.q_seg, self.k_pos, self.k_seg, self.k_valid, attention=self.attention,
                          block_size=self.block_size, window=self.window)

    def keys(self, start: int, end: int) -> "Visibility":
        """The visibility of keys [start, end) only."""
        return self.replace(k_pos=self.k_pos[:, start:end], k_seg=self.k_seg[:, start:end],
                            k_valid=self.k_valid[:, start:end])


def visible_matrix(visible):
    """[B, Lq, Lk] bool of a Visibility or of a matrix."""
    return visible.matrix() if isinstance(visible, Visibility) else visible


def key_slice(visible, start: int, end: int):
    """The visibility (Visibility or matrix) of keys [start, end)."""
    return visible.keys(start, end) if isinstance(visible, Visibility) else visible[..., start:end]


def attention(q_blhd, kv_parts, query_group: int | None = None):
    """Grouped-query attention over one or more key/value parts with one joint softmax; a part's
    visibility is a [B, L, S] matrix or a `Visibility`.

    In the invariant numerics mode (`_attention_invariant`) the rows go through tiles of the
    mode's `sequence_tile` rows, their queries through tiles of `query_group` queries (the width of
    a packed copy: a copy's queries then take the same places in the same computation as in a
    forward of that copy alone), else of the mode's `query_tile`, and their keys through tiles of
    `key_tile` keys. Otherwise `dlmjax.kernels.attention` dispatches: flash kernels on
    accelerators, `_attention` (the reference) elsewhere."""
    setting = arithmetic.current()
    if setting.invariant:
        parts = [(k, v, visible_matrix(vis)) for k, v, vis in kv_parts]
        if query_group is None and len(parts) > 1:  # a cache and one chunk: one sequence of keys
            parts = [_join_key_parts(parts)]
        tiled = functools.partial(_attention_invariant, query_tile=query_group or setting.query_tile,
                                  sequences=setting.sequence_tile, key_tile=setting.key_tile)
        return sharding.over_batch_shards(tiled, q_blhd, parts)  # on a mesh, each device tiles its own rows
    return kernel_attention(q_blhd, kv_parts)


def _attention_invariant(q_blhd, kv_parts, query_tile: int, sequences: int, key_tile: int):
    """Attention whose every reduction has one shape whatever the layout, and whose keys are summed
    in one order whatever holds them, so that a query's output is bitwise the same alone, beside
    other rows, as one of N packed copies, behind left padding, against a wider cache, or with its
    keys split otherwise between cache and chunk (`ar` and a drafter's verification):

    - keys: each part's keys that some query of the row sees come first, in their order, then
      the rest (`_seen_keys_first`), padded to whole tiles of `key_tile`; the parts follow each
      other. A query folds the tiles in order into a running softmax (`_fold_key_tiles`), and a
      key it does not see adds exact zeros, so hidden slots, wider caches and the other copies'
      parts leave its sums unchanged. At least `min_tiles` key tiles (`arithmetic.row_tiles`).
      A caller passes a cache and one chunk as one part: its keys are then one sequence, so
      where the cache ends and the chunk begins does not matter;
    - rows: tiles of `sequences` batch rows, and queries: tiles of `query_tile` queries (zero
      rows and queries pad the last), as loops of at least `min_tiles` iterations."""
    b, l, h, d = q_blhd.shape
    keys, values, visible = _join_key_parts([_seen_keys_first(*part, key_tile) for part in kv_parts])
    missing_tiles = max(0, arithmetic.current().min_tiles - keys.shape[1] // key_tile)
    keys, values, visible = _hidden_keys_after(keys, values, visible, missing_tiles * key_tile)
    pad, groups = -l % query_tile, arithmetic.tile_count(b, sequences)
    rows = groups * sequences

    def grouped(x, axis_1: int):  # [groups, sequences, ...]: rows up to `rows`, axis 1 up to a whole tile
        x = jnp.pad(x, ((0, rows - b), (0, axis_1)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(groups, sequences, *x.shape[1:])

    def query_tiles(x):  # [groups, sequences, L + pad, ...] -> [groups, L / tile, sequences, tile, ...]
        x = x.reshape(*x.shape[:2], -1, query_tile, *x.shape[3:])
        return jnp.swapaxes(x, 1, 2)

    def one_group(xs):
        q_tsqhd, k_sshd, v_sshd, visible_tsqs = xs

        def one_tile(tile_xs):
            q_sqhd, vis_sqs = jax.lax.optimization_barrier(tile_xs)
            return jax.lax.optimization_barrier(_fold_key_tiles(q_sqhd, k_sshd, v_sshd, vis_sqs, key_tile))

        return jax.lax.map(one_tile, (q_tsqhd, visible_tsqs))

    out = jax.lax.map(one_group, (query_tiles(grouped(q_blhd, pad)), grouped(keys, 0), grouped(values, 0),
                                  query_tiles(grouped(visible, pad))))  # [groups, L / tile, sequences, tile, H, hd]
    return jnp.swapaxes(out, 1, 2).reshape(rows, l + pad, h, d)[:b, :l]


def _seen_keys_first(k_bshd, v_bshd, visible_bls, key_tile: int):
    """One part's keys reordered per row: those some query of the row sees first, in their order,
    then the others; padded with hidden keys to whole tiles of `key_tile`."""
    seen_first = jnp.argsort(~visible_bls.any(axis=1), axis=1, stable=True)  # [B, S]
    k = jnp.take_along_axis(k_bshd, seen_first[:, :, None, None], axis=1)
    v = jnp.take_along_axis(v_bshd, seen_first[:, :, None, None], axis=1)
    visible = jnp.take_along_axis(visible_bls, seen_first[:, None, :], axis=2)
    return _hidden_keys_after(k, v, visible, -k.shape[1] % key_tile)


def _join_key_parts(parts):
    """Key parts (k [B,S,Hkv,hd], v, visible [B,L,S]) as one part: their keys one after another."""
    keys, values, visible = zip(*parts)
    return jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1), jnp.concatenate(visible, axis=2)


def _hidden_keys_after(k_bshd, v_bshd, visible_bls, count: int):
    """The part with `count` zero keys appended that no query sees."""
    k, v = (jnp.pad(x, ((0, 0), (0, count), (0, 0), (0, 0))) for x in (k_bshd, v_bshd))
    return k, v, jnp.pad(visible_bls, ((0, 0), (0, 0), (0, count)))


def _varying_axes(x) -> frozenset:
    """The mesh axes over which `x` varies inside a shard_map (empty outside one)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; later versions name it `vma`
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _fold_key_tiles(q_blhd, k_bshd, v_bshd, visible_bls, key_tile: int):
    """Attention of [B, L] queries over S keys as a loop over tiles of `key_tile` keys, each folded
    into a running max, sum of exponentials and weighted sum of values (the online softmax of
    flash attention). A tile of keys a query does not see leaves its running values bitwise as
    they were: its max stays, the rescale is exp(0) = 1, and it adds exact zeros. A query that
    sees no key gets zeros."""
    b, l, h, d = q_blhd.shape
    hkv = k_bshd.shape[2]
    q = q_blhd.reshape(b, l, hkv, h // hkv, d)
    tiles = k_bshd.shape[1] // key_tile

    def by_tile(x, axis: int):  # the key axis split into [tiles, key_tile], tiles first
        x = x.reshape(*x.shape[:axis], tiles, key_tile, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    def fold(carry, tile):
        top, total, out = carry
        k, v, visible = tile
        seen = visible[:, None, None, :, :]  # [B, 1, 1, L, key_tile]
        s = jnp.einsum("blkgd,bskd->bkgls", q, k, preferred_element_type=jnp.float32) * d**-0.5
        s = jnp.where(seen, s, MASK_VALUE)
        new_top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
        rescale = jnp.exp(top - new_top)
        e = jnp.where(seen, jnp.exp(s - new_top), 0.0)
        total = total * rescale + e.sum(axis=-1, keepdims=True)
        out = out * rescale + jnp.einsum("bkgls,bskd->bkgld", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return (new_top, total, out), None

    start = (jnp.full((b, hkv, h // hkv, l, 1), MASK_VALUE, jnp.float32), jnp.zeros((b, hkv, h // hkv, l, 1), jnp.float32),
             jnp.zeros((b, hkv, h // hkv, l, d), jnp.float32))
    # inside a shard_map the loop's carry must vary over the devices' axes as its updates do
    varying = tuple(set().union(*(_varying_axes(x) for x in (q, k_bshd, v_bshd, visible_bls))))
    if varying:
        start = jax.tree.map(lambda x: jax.lax.pcast(x, varying, to="varying"), start)
    (_, total, out), _ = jax.lax.scan(fold, start, (by_tile(k_bshd, 1), by_tile(v_bshd, 1), by_tile(visible_bls, 2)))
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)  # [B, Hkv, G, L, hd]
    return out.transpose(0, 3, 1, 2, 4).astype(q_blhd.dtype).reshape(b, l, h, d)


def _attention(q_blhd, kv_parts):
    """Grouped-query attention over one or more key/value parts with one joint softmax.

    kv_parts: [(k [B,S,Hkv,hd], v [B,S,Hkv,hd], visible [B,L,S]), ...]. Splitting the keys
    (cached prefix, this chunk) avoids concatenating the cache into a new buffer every step.
    q has H heads, k/v have Hkv heads; H % Hkv == 0.

    Each part's exponentials are summed on their own and the parts' sums added in order, so a
    part whose keys are all hidden adds exact zeros: a query's output is bitwise the same whether
    such a part is there or not (the row-asynchronous engine adds a store part to some forwards).
    """
    b, l, h, d = q_blhd.shape
    hkv = kv_parts[0][0].shape[2]
    q = q_blhd.reshape(b, l, hkv, h // hkv, d)
    scores = []
    for k, _, visible in kv_parts:
        s = jnp.einsum("blkgd,bskd->bkgls", q, k, preferred_element_type=jnp.float32) * d**-0.5
        scores.append(jnp.where(visible[:, None, None, :, :], s, MASK_VALUE))
    top = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
    out, total = 0.0, 0.0
    for s, (_, v, _) in zip(scores, kv_parts):
        e = jnp.exp(s - top)
        total = total + e.sum(axis=-1, keepdims=True)
        out = out + jnp.einsum("bkgls,bskd->bkgld", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / total  # [B, Hkv, G, L, hd]
    return out.transpose(0, 3, 1, 2, 4).astype(q_blhd.dtype).reshape(b, l, h, d)


def shift_right(x_bl, previous_b=None):
    """Dream alignment of logits (or of the hidden states they come from) [B, L, ...]: position i
    takes what was computed at i-1; position 0 keeps its own unless `previous_b` (the token's
    before this chunk) is given."""
    first = x_bl[:, :1] if previous_b is None else previous_b[:, None]
    return jnp.concatenate([first, x_bl[:, :-1]], axis=1)
