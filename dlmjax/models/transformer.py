"""One decoder stack for every family (LLaDA, Dream, SDAR, Qwen3, Qwen2, Llama).

Families differ only in `ModelConfig` flags: attention topology, logit alignment, q/k/v bias,
q/k norm, GQA, tied head, RoPE theta. Weights are 2-D matrices `[in, out]` (fast on CPU and
simple to shard); layers are unrolled.

The call signature covers every decoder in dlmjax:

    model(tokens_bl, positions_bl, segments_bl=..., valid_bl=..., cache=..., write_cache=...)

- `positions` drive RoPE and the attention topology (block id = position // block_size);
- `segments` pack several candidate copies of a block in one forward: segment 0 is shared
  context, copies 1..N see the context and themselves only (MRP/PSD verification);
- `valid` marks real tokens (left padding is invalid and never attended to);
- `cache` holds the KV of earlier tokens; every query sees every valid cached key that its
  topology allows. With `write_cache=True` this chunk's KV is appended (prefill, the store
  forward of a finished block, AR steps); otherwise the cache is left as it was (denoising).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dlmjax import arithmetic
from dlmjax.config import ModelConfig
from dlmjax.models import layers
from dlmjax.models.fused import join_gate_up, join_qkv, split_gate_up, split_qkv
from dlmjax.models.moe import MoE
from dlmjax.sharding import constrain

_INIT_STD = 0.02


def _normal(rngs: nnx.Rngs, shape, dtype):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype)


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs, kernel=None):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), dtype) if kernel is None else kernel)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x):
        return linear(x, self.kernel[...], None if self.bias is None else self.bias[...])


def linear(x, kernel, bias=None):
    """x [..., in] @ kernel [in, out] (+ bias). A 2-D matmul over flattened rows: on CPU the
    backward of a batched 3-D matmul is ~4x slower."""
    y = arithmetic.matmul(x.reshape(-1, x.shape[-1]), kernel).reshape(*x.shape[:-1], kernel.shape[1])
    return y if bias is None else y + bias


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return layers.rms_norm(x, self.scale[...], self.eps)


@struct.dataclass
class KVCache:
    """Per-layer keys/values of earlier tokens, with their positions and validity."""

    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, hd]
    v: tuple[jax.Array, ...]
    positions: jax.Array  # [B, S] int32
    valid: jax.Array  # [B, S] bool: slot written and holds a real token
    length: jax.Array  # int32 scalar: slots written so far (same for every row)

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or jnp.dtype(cfg.dtype)
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        empty = cls(
            k=zeros,
            v=zeros,
            positions=jnp.zeros((batch, max_len), jnp.int32),
            valid=jnp.zeros((batch, max_len), bool),
            length=jnp.zeros((), jnp.int32),
        )
        # Inside jit an all-zero cache is a constant, and XLA would spend seconds constant-folding
        # the attention over it; the barrier keeps it a runtime value.
        return jax.lax.optimization_barrier(empty)

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def append(self, layer_kv, positions_bl, valid_bl) -> "KVCache":
        """Write one chunk (all layers' k/v) at `length` and advance it."""
        start = self.length

        def put(buf, new):
            return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=1)

        return KVCache(
            k=tuple(put(buf, k) for buf, (k, _) in zip(self.k, layer_kv)),
            v=tuple(put(buf, v) for buf, (_, v) in zip(self.v, layer_kv)),
            positions=put(self.positions, positions_bl.astype(jnp.int32)),
            valid=put(self.valid, valid_bl),
            length=start + positions_bl.shape[1],
        )

    def write_rows(self, layer_kv, start_b, positions_bl, valid_bl, write_b=None) -> "KVCache":
        """Write one chunk of L slots per row at that row's own offset `start_b` [B] (the
        row-asynchronous engine: slot = canvas column). Rows with `write_b` False keep their slots."""
        return self.put_chunk(self.chunk(layer_kv, start_b, positions_bl, valid_bl, write_b), start_b)

    def chunk(self, layer_kv, start_b, positions_bl, valid_bl, write_b=None) -> "KVCache":
        """The L slots per row from `start_b` as `write_rows` would leave them, as a cache of
        capacity L (written with `put_chunk`): the new keys/values, or for rows with `write_b`
        False the slots' current contents."""
        new = KVCache(k=tuple(k.astype(buf.dtype) for buf, (k, _) in zip(self.k, layer_kv)),
                      v=tuple(v.astype(buf.dtype) for buf, (_, v) in zip(self.v, layer_kv)),
                      positions=positions_bl.astype(jnp.int32), valid=valid_bl, length=self.length)
        if write_b is None:
            return new
        old = self.slots(start_b, positions_bl.shape[1])
        keep = lambda x_new, x_old: jnp.where(write_b.reshape((-1,) + (1,) * (x_new.ndim - 1)), x_new, x_old)
        k, v, positions, valid = jax.tree.map(keep, (new.k, new.v, new.positions, new.valid),
                                              (old.k, old.v, old.positions, old.valid))
        return new.replace(k=k, v=v, positions=positions, valid=valid)

    def slots(self, start_b, width: int) -> "KVCache":
        """The `width` slots per row from `start_b`, as they are, as a cache of capacity `width`."""
        return self.replace(k=tuple(take_rows(buf, start_b, width) for buf in self.k),
                            v=tuple(take_rows(buf, start_b, width) for buf in self.v),
                            positions=take_rows(self.positions, start_b, width),
                            valid=take_rows(self.valid, start_b, width))

    def put_chunk(self, chunk: "KVCache", start_b) -> "KVCache":
        """This cache with `chunk` (from `chunk` or `slots`) written at each row's `start_b`."""
        return self.replace(k=tuple(put_rows(buf, start_b, new) for buf, new in zip(self.k, chunk.k)),
                            v=tuple(put_rows(buf, start_b, new) for buf, new in zip(self.v, chunk.v)),
                            positions=put_rows(self.positions, start_b, chunk.positions),
                            valid=put_rows(self.valid, start_b, chunk.valid))


def take_rows(x_bt, start_b, width: int):
    """x[b, start_b[b] : start_b[b] + width] for every row b (axis 1; trailing axes kept)."""
    return jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, width, axis=0))(x_bt, start_b)


def put_rows(x_bt, start_b, new_bw):
    """x with x[b, start_b[b] : start_b[b] + width] = new[b] for every row b (axis 1)."""
    return jax.vmap(lambda row, start, new: jax.lax.dynamic_update_slice_in_dim(row, new, start, axis=0))(
        x_bt, start_b, new_bw)


@struct.dataclass
class ModelOutput:
    logits: jax.Array | None  # [B, L, V] float32, aligned so position i scores token i (or i+1 for AR)
    hidden: jax.Array  # [B, L, D] final hidden state after the final norm
    cache: KVCache | None
    layer_hidden: tuple[jax.Array, ...] = ()  # residual stream at the requested `hidden_layers`
    chunk_kv: tuple = ()  # per layer (k [B, L, Hkv, hd], v) of this chunk, for callers that write it themselves


class Attention(nnx.Module):
    """Grouped-query attention. q, k and v come from one fused projection `qkv` (dlmjax.models.fused:
    per KV group its query heads, then its key and value head)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hkv, hd, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
        # drawn as separate q, k, v kernels were, so that a seed gives the weights it gave before fusion
        qkv = join_qkv(*(_normal(rngs, (d, n * hd), dt) for n in (h, hkv, hkv)), hkv, hd)
        self.qkv = Linear(d, (h + 2 * hkv) * hd, bias=cfg.qkv_bias, dtype=dt, rngs=rngs, kernel=qkv)
        self.o = Linear(h * hd, d, bias=cfg.o_bias, dtype=dt, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, hd

    def _heads(self, y_bl, heads: int):
        return y_bl.reshape(*y_bl.shape[:2], heads, self.head_dim)

    def _finish_q(self, q, cos, sin):
        q = self._heads(q, self.num_heads)
        return layers.apply_rope(q if self.q_norm is None else self.q_norm(q), cos, sin)

    def _finish_kv(self, k, v, cos, sin):
        k = self._heads(k, self.num_kv_heads)
        k = k if self.k_norm is None else self.k_norm(k)
        return layers.apply_rope(k, cos, sin), self._heads(v, self.num_kv_heads)

    def project_kv(self, x_bld, cos, sin):
        """k, v [B, L, Hkv, hd] alone (the drafter's context): the k and v columns of the fused
        weight, q not computed."""
        bias = None if self.qkv.bias is None else split_qkv(self.qkv.bias[...], self.num_kv_heads, self.head_dim)
        _, k_w, v_w = split_qkv(self.qkv.kernel[...], self.num_kv_heads, self.head_dim)
        k = linear(x_bld, k_w, None if bias is None else bias[1])
        v = linear(x_bld, v_w, None if bias is None else bias[2])
        return self._finish_kv(k, v, cos, sin)

    def __call__(self, x_bld, cos, sin, self_visible, cached=None, chunk_parts=()):
        """Attend to this chunk (`self_visible` [B, L, L]) and, if given, to
        `cached` = (k [B,S,Hkv,hd], v, visible [B, L, S]). `chunk_parts` (static sizes summing to L)
        splits the chunk's keys into parts reduced on their own (see `layers.attention`).
        Returns (out, this chunk's (k, v))."""
        b, l, _ = x_bld.shape
        q, k, v = split_qkv(self.qkv(x_bld), self.num_kv_heads, self.head_dim)
        q = self._finish_q(q, cos, sin)
        k, v = self._finish_kv(k, v, cos, sin)
        parts, start = [] if cached is None else [cached], 0
        for size in chunk_parts or (l,):
            end = start + size
            parts.append((k[:, start:end], v[:, start:end], layers.key_slice(self_visible, start, end)))
            start = end
        out = layers.attention(q, parts, query_group=_uniform_width(chunk_parts, l))
        return self.o(out.reshape(b, l, -1)), (k, v)


def _uniform_width(chunk_parts, length: int) -> int | None:
    """The width of the chunk's key parts when they are all equal (packed copies), else None."""
    return chunk_parts[0] if chunk_parts and len(set(chunk_parts)) == 1 and length % chunk_parts[0] == 0 else None


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


class MLP(nnx.Module):
    """SwiGLU; gate and up from one fused projection `gate_up` (dlmjax.models.fused: columns paired)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None):
        d, f, dt = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.dtype
        gate_up = join_gate_up(_normal(rngs, (d, f), dt), _normal(rngs, (d, f), dt))  # as gate, up were drawn
        self.gate_up = Linear(d, 2 * f, bias=False, dtype=dt, rngs=rngs, kernel=gate_up)
        self.down = Linear(f, d, bias=False, dtype=dt, rngs=rngs)

    def __call__(self, x):
        return self.down(arithmetic.rowwise(_swiglu, *split_gate_up(self.gate_up(x))))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = moe_layer(cfg, rngs) if moe else MLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin, self_visible, cached=None, chunk_parts=()):
        attn_out, kv = self.attn(self.attn_norm(x), cos, sin, self_visible, cached, chunk_parts)
        x = x + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", None, None)), kv


def moe_layer(cfg: ModelConfig, rngs: nnx.Rngs) -> MoE:
    shared = cfg.shared_expert_intermediate_size
    return MoE(cfg, shared=MLP(cfg, rngs=rngs, intermediate_size=shared) if shared else None, rngs=rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.dtype))
        self.layers = nnx.List([Block(cfg, rngs=rngs, moe=i in cfg.moe_layers) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype, rngs=rngs)
        )

    def embed_tokens(self, tokens_bl):
        # clipped: a pad id outside the vocabulary (a config's pad_token_id >= vocab_size) sits in slots
        # no query sees, but jnp.take's default fills it with NaN, and 0 x NaN in attention is NaN
        return jnp.take(self.embed[...], tokens_bl, axis=0, mode="clip")

    def lm_head_weight(self):
        """The lm_head as [D, V] (the embedding's transpose when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head.kernel[...]

    def lm_logits(self, hidden_bld):
        """Final-normed hidden -> float32 logits (no alignment shift)."""
        w_dv = self.lm_head_weight()
        rows = hidden_bld.reshape(-1, hidden_bld.shape[-1])
        logits = arithmetic.matmul(rows, w_dv, preferred_element_type=jnp.float32)
        return logits.reshape(*hidden_bld.shape[:-1], w_dv.shape[1])

    def token_logits(self, hidden_bkd, tokens_bk):
        """Final-normed hidden [..., D] -> float32 logits [...] of the given tokens only: what
        `lm_logits` holds at `tokens`, without the other columns."""
        w_kd = jnp.moveaxis(jnp.take(self.lm_head_weight(), tokens_bk, axis=1, mode="clip"), 0, -1)
        # row by row (fixed tiles in the invariant mode: mrp-remask's veto reads these against delta)
        return arithmetic.rowwise(lambda h, w: jnp.sum(h.astype(jnp.float32) * w.astype(jnp.float32), axis=-1),
                                  hidden_bkd, w_kd)

    def __call__(
        self,
        tokens_bl,
        positions_bl=None,
        *,
        segments_bl=None,
        valid_bl=None,
        cache: KVCache | None = None,
        write_cache: bool = False,
        attention: str | None = None,
        visible_bll=None,
        compute_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),
        chunk_parts: tuple[int, ...] = (),
    ) -> ModelOutput:
        """Forward one chunk. `attention` overrides the config's topology (parity tests);
        `visible_bll` [B, L, L] replaces the chunk's visibility outright (training layouts such as
        the block-diffusion noisy+clean concatenation; not combined with a cache).

        `hidden_layers` (increasing, in 0..num_layers) follows transformers' `hidden_states`
        indexing: 0 is the embedding output, i the residual stream after layer i; at num_layers it
        is the stream before the final norm, which transformers' last entry has applied
        (`ModelOutput.hidden` is that one). `chunk_parts`: static sizes that split the chunk's keys
        into separately reduced attention parts (numerics only; see `layers.attention`).
        """
        cfg = self.config
        if hidden_layers and (list(hidden_layers) != sorted(set(hidden_layers)) or hidden_layers[0] < 0
                              or hidden_layers[-1] > cfg.num_layers):
            raise ValueError(f"hidden_layers={hidden_layers}: give increasing indices in 0..{cfg.num_layers} (one "
                             "array comes back per index, in that order)")
        b, l = tokens_bl.shape
        if chunk_parts and sum(chunk_parts) != l:
            raise ValueError(f"chunk_parts={chunk_parts} must add up to the chunk's {l} tokens (keys left out of "
                             "every part would be attended by no query)")
        if positions_bl is None:
            if cache is not None:
                raise ValueError("pass positions_bl explicitly when forwarding against a cache")
            positions_bl = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        x = constrain(self.embed_tokens(tokens_bl), ("batch", None, None))
        x, new_kv, collected = run_layers(
            self.layers, cfg, x, positions_bl, segments_bl=segments_bl, valid_bl=valid_bl, cache=cache,
            attention=attention, visible_bll=visible_bll, hidden_layers=hidden_layers, chunk_parts=chunk_parts,
        )
        hidden = self.final_norm(x)
        logits = None
        if compute_logits:
            logits = self.lm_logits(hidden)
            if cfg.shift_logits:
                logits = layers.shift_right(logits)
        if cache is not None and write_cache:
            cache = cache.append(new_kv, positions_bl, _valid(valid_bl, positions_bl))
        return ModelOutput(logits=logits, hidden=hidden, cache=cache, layer_hidden=tuple(collected),
                           chunk_kv=tuple(new_kv))


def _valid(valid_bl, positions_bl):
    return jnp.ones(positions_bl.shape, bool) if valid_bl is None else valid_bl


def run_layers(
    blocks, cfg: ModelConfig, x, positions_bl, *, segments_bl=None, valid_bl=None, cache: KVCache | None = None,
    attention: str | None = None, visible_bll=None, hidden_layers: tuple[int, ...] = (), chunk_parts=(),
):
    """Run decoder `blocks` over the embedded chunk `x` [B, L, D] (the backbone, or an MRP head's
    layers with the same topology). Returns (x, per-layer (k, v) of this chunk, collected hidden
    states at `hidden_layers`: 0 is the input, i the residual stream after block i)."""
    b, l = positions_bl.shape
    plain = segments_bl is None and valid_bl is None and cache is None  # one segment, every key valid
    segments_bl = jnp.zeros((b, l), jnp.int32) if segments_bl is None else segments_bl
    valid_bl = _valid(valid_bl, positions_bl)
    topology = dict(attention=attention or cfg.attention, block_size=cfg.block_size)
    if visible_bll is not None:
        if cache is not None:
            raise ValueError("visible_bll replaces the chunk's visibility and cannot be combined with a cache")
        self_visible = visible_bll
    else:  # the rule's inputs; attention kernels evaluate it per tile (layers.Visibility)
        self_visible = layers.Visibility(positions_bl, segments_bl, positions_bl, segments_bl, valid_bl, **topology,
                                         plain=plain)
    if cache is not None:
        cache_visible = layers.Visibility(
            positions_bl, segments_bl, cache.positions, jnp.zeros_like(cache.positions), cache.valid, **topology
        )
    cos, sin = layers.rope_angles(positions_bl, cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg)
    collected = [x] if 0 in hidden_layers else []
    new_kv = []
    for i, block in enumerate(blocks):
        cached = None if cache is None else (cache.k[i], cache.v[i], cache_visible)
        x, kv = block(x, cos, sin, self_visible, cached, chunk_parts)
        new_kv.append(kv)
        if i + 1 in hidden_layers:
            collected.append(x)
    return x, new_kv, tuple(collected)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model (std 0.02 normal, unit norms)."""
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model's structure with ShapeDtypeStruct leaves: no memory, no random numbers."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
