"""A left-to-right diffusion drafter for an autoregressive target (seed 003, DFlash layout).

The drafter is a few Qwen3-style decoder layers (q/k norm, whatever the target's family) that
read the target's hidden states as extra keys and values (ALGORITHMS.md section 3):

    ctx_scD   = hidden_norm(fc(concat_i target hidden_states[id_i + 1]))    # HF indexing
    layer l:  keys/values = [k_norm(k_l(ctx)), v_l(ctx)] (RoPE at the context tokens' own positions)
              followed by the block's own keys/values (the block's positions)
    h_blD     = norm(layers(embed_target(block)))
    logits    = target lm_head(h)           # position i of the block scores the token at i

The block is [last accepted token, MASK x (K - 1)]; one forward proposes K - 1 tokens. Full
attention layers are bidirectional inside the block; sliding-window layers (`layer_types`) are
causal with their window, over the context and the block alike. The drafter has no embedding and
no lm_head: the target's are passed in at call time, so the module stores neither.

The numerics reuse dlmjax.models (Block, Attention.project_kv, layers.attention); this file only
decides what each drafter query sees. The checkpoint format lives in dlmjax.io.dflash.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from dlmjax.config import ROPE_FIELDS, ConfigError, ModelConfig
from dlmjax.models import layers
from dlmjax.models.transformer import Block, Linear, RMSNorm, Transformer
from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, POSITIVE, InputError, check_fields, is_count

FULL, SLIDING = "full_attention", "sliding_attention"


class DrafterMismatchError(InputError):
    """A drafter used with a target it was not made for."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default: `num_draft_layers` ids spaced evenly over [1, N - 3] (the middle layer
    when there is one drafter layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    # round half to even, like Python's round() in the reference
    ids = tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))
    if list(ids) != sorted(set(ids)) or min(ids) < 0:
        raise ConfigError(
            f"DFlash's default target_layer_ids for {num_draft_layers} drafter layers over a {num_target_layers}-layer "
            f"target, spread over layers [1, N-3], would be {list(ids)}, not distinct increasing layers; name "
            f"distinct ids (below {num_target_layers}) yourself: drafter.target_layer_ids in a run config, "
            "dflash_config.target_layer_ids in a drafter's config.json")
    return ids


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape and its contract with the target. `vocab_size` is the value in the
    drafter's config.json (the target's vocabulary); the drafter itself has no vocab-sized weight."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # RoPE frequency scaling, as ModelConfig's rope_* fields (a Llama 3.1 target's llama3)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    sliding_window: int | None = None
    dtype: str = "float32"
    # config.json keys without numerics (token ids, transformers bookkeeping), as (key, JSON
    # text) pairs, kept so a published config.json round-trips unchanged (dlmjax.io.dflash).
    hf_extra: tuple[tuple[str, str], ...] = ()

    limits = {**{name: AT_LEAST_1 for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                               "num_kv_heads", "head_dim", "vocab_size", "num_target_layers",
                                               "block_size", "max_position_embeddings", "sliding_window",
                                               "rope_original_max_positions")},
              "mask_token_id": AT_LEAST_0, "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "rope_factor": POSITIVE,
              "rope_low_freq_factor": POSITIVE, "rope_high_freq_factor": POSITIVE}

    def __post_init__(self):
        if isinstance(self.target_layer_ids, list):  # as config.json and YAML give it
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        check_fields(self, "drafter ", error=ConfigError)  # types and `limits`: 0.9 is not a layer, "8" no block
        if not all(is_count(i) for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids={list(self.target_layer_ids)!r} must be layer numbers (integers >= 0)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_layers}")
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ConfigError(f"layer_types {bad} are not supported; use {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need `sliding_window` (a positive int) in config.json")
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids is empty; give at least one target layer id")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            raise ConfigError(
                f"target_layer_ids {list(self.target_layer_ids)} must increase, each id once "
                f"(e.g. {sorted(set(self.target_layer_ids))}): vLLM and SGLang collect the target's hidden states in "
                "layer order, so other orders would feed `fc` its inputs permuted"
            )
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}; a drafter block needs at least 2 tokens")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's `hidden_layers=` argument: HF hidden_states indices id + 1 (increasing,
        as the ids are; `context_features` maps them back)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def layer_model_config(self) -> ModelConfig:
        """A ModelConfig that builds the drafter's Qwen3-style decoder layers."""
        return ModelConfig(
            family="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, qk_norm=True, dtype=self.dtype,
            **{name: getattr(self, name) for name in ROPE_FIELDS},
        )

    @classmethod
    def for_target(cls, target: ModelConfig, *, num_layers: int = 1, block_size: int = 8,
                   target_layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None,
                   **overrides) -> "DrafterConfig":
        """A drafter shaped like `target`'s layers (what training starts from)."""
        ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
        mask = mask_token_id if mask_token_id is not None else target.mask_token_id
        if mask is None:
            raise ConfigError(
                f"the target ({target.family}) names no mask token; pass mask_token_id (a token id < {target.vocab_size}, "
                "ideally one the target never emits)"
            )
        fields = dict(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_layers=num_layers,
            num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            vocab_size=target.vocab_size, num_target_layers=target.num_layers, target_layer_ids=tuple(ids),
            mask_token_id=int(mask), block_size=block_size, rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings, dtype=target.dtype,
            hf_extra=target_token_fields(target), **{name: getattr(target, name) for name in ROPE_FIELDS},
        )
        fields.update(overrides)
        return cls(**fields)


def target_token_fields(target: ModelConfig) -> tuple[tuple[str, str], ...]:
    """The target's token ids and head tying, written into a new drafter's config.json as the
    published drafters carry them (servers read the head from the target either way)."""
    import json

    eos = list(target.eos_token_ids)
    fields = {"tie_word_embeddings": target.tie_word_embeddings, "bos_token_id": target.bos_token_id,
              "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    return tuple((k, json.dumps(v)) for k, v in sorted(fields.items()))


def check_compatible(cfg: DrafterConfig, target: ModelConfig) -> None:
    """Refuse a drafter made for another target, naming both values."""
    problems = []
    if target.attention != "causal":
        problems.append(
            f"the target is {target.family} with {target.attention} attention; a drafter speculates for a causal "
            "(autoregressive) target such as qwen3, qwen2 or llama"
        )
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:  # vLLM would remap the drafter's ids to the target's (no map ships)
        problems.append(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocab (vocab_size {target.vocab_size})")
    if cfg.num_target_layers != target.num_layers:
        problems.append(f"drafter num_target_layers {cfg.num_target_layers} != target num_hidden_layers {target.num_layers}")
    out_of_range = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if out_of_range:
        problems.append(
            f"drafter target_layer_ids {list(out_of_range)} are out of range for a target with {target.num_layers} layers "
            f"(valid ids 0..{target.num_layers - 1})"
        )
    if problems:
        raise DrafterMismatchError("drafter does not fit this target: " + "; ".join(problems))


class MaskEmbedding(nnx.Variable):
    """A drafter's own embedding of the mask token [D] (DFlash's optional `mask_embedding.pt`),
    used where the target's embedding row would be. Read and written, never trained."""


class Drafter(nnx.Module):
    """fc, hidden_norm, Qwen3-style layers, norm (DFlash's parameters, nothing vocab-sized), and
    optionally its own mask embedding."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        layer_cfg = cfg.layer_model_config()
        n_ctx = len(cfg.target_layer_ids) * cfg.hidden_size
        self.fc = Linear(n_ctx, cfg.hidden_size, bias=False, dtype=cfg.dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.layers = nnx.List([Block(layer_cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mask_embedding: MaskEmbedding | None = nnx.data(None)  # set by load_drafter where shipped

    def embed(self, target: Transformer, tokens_bl):
        """A block's input embeddings: the target's, with the drafter's own mask embedding at mask
        tokens where it has one (as vLLM substitutes it)."""
        x = target.embed_tokens(tokens_bl)
        if self.mask_embedding is None:
            return x
        is_mask = (tokens_bl == self.config.mask_token_id)[..., None]
        return jnp.where(is_mask, self.mask_embedding[...].astype(x.dtype), x)

    def context(self, feats_scF):
        """Concatenated target hidden states [B, S, n_ids * D] -> context [B, S, D]."""
        return self.hidden_norm(self.fc(feats_scF.astype(self.fc.kernel[...].dtype)))

    def context_kv(self, ctx_bsd, ctx_positions_bs):
        """Each layer's (k, v) of the context: that layer's k/v projection, k_norm, RoPE at the
        context tokens' own positions. Returns a tuple over layers of (k, v) [B, S, Hkv, hd]."""
        cos, sin = layers.rope_angles(ctx_positions_bs, self.config.head_dim, self.config.rope_theta, self.config)
        return tuple(block.attn.project_kv(ctx_bsd, cos, sin) for block in self.layers)

    def __call__(self, embed_blD, positions_bl, ctx_kv, ctx_visible, self_visible):
        """The drafter's forward over block embeddings.

        ctx_kv: per layer (k, v) [B, S, Hkv, hd] of the context (from `context_kv`, or a cache);
        ctx_visible, self_visible: per layer [B, L, S] and [B, L, L] bool (`visibilities`), or
        `layers.Visibility` (`block_visibilities`).
        Returns the final-normed hidden state [B, L, D]; score it with the target's lm_head.
        """
        cfg = self.config
        cos, sin = layers.rope_angles(positions_bl, cfg.head_dim, cfg.rope_theta, cfg)
        x = embed_blD.astype(self.fc.kernel[...].dtype)
        for i, block in enumerate(self.layers):
            k, v = ctx_kv[i]
            x, _ = block(x, cos, sin, self_visible[i], (k, v, ctx_visible[i]))
        return self.norm(x)


def visibilities(cfg: DrafterConfig, q_pos_bl, q_group_bl, ctx_pos_bs, ctx_limit_bl, ctx_valid_bs):
    """Per-layer (context visibility [B, L, S], block visibility [B, L, L]).

    A query sees context keys that are valid and strictly before its block's start
    (`ctx_limit_bl`, the anchor position), and the keys of its own block (`q_group_bl`: block id,
    so several training blocks can share one forward). Sliding-window layers are further causal
    with their window (q - k < window).
    """
    ctx_vis = ctx_valid_bs[:, None, :] & (ctx_pos_bs[:, None, :] < ctx_limit_bl[:, :, None])
    blk_vis = q_group_bl[:, :, None] == q_group_bl[:, None, :]
    out_ctx, out_blk = [], []
    for kind in cfg.layer_types:
        if kind == SLIDING:
            w = cfg.sliding_window
            near_ctx = (q_pos_bl[:, :, None] - ctx_pos_bs[:, None, :]) < w
            d_blk = q_pos_bl[:, :, None] - q_pos_bl[:, None, :]
            out_ctx.append(ctx_vis & near_ctx)
            out_blk.append(blk_vis & (d_blk >= 0) & (d_blk < w))
        else:
            out_ctx.append(ctx_vis)
            out_blk.append(blk_vis)
    return tuple(out_ctx), tuple(out_blk)


def block_visibilities(cfg: DrafterConfig, positions_bl, ctx_pos_bs, ctx_valid_bs):
    """`visibilities` of one block per row (the block starts at positions_bl[b, 0]) as
    `layers.Visibility`, which the flash kernels take, reading each row's context only up to its
    last visible key: the context keys at or after the block's start are invalid for the whole
    row; a full-attention layer sees the rest and its block bidirectionally, a sliding-window one
    causally within its window (the context lies before every query, so causal there is no
    restriction)."""
    b, l = positions_bl.shape
    zeros = jnp.zeros((b, l), jnp.int32)
    ctx_valid = ctx_valid_bs & (ctx_pos_bs < positions_bl[:, :1])
    out_ctx, out_blk = [], []
    for kind in cfg.layer_types:
        topo = dict(attention="causal", window=cfg.sliding_window) if kind == SLIDING else dict(attention="bidirectional")
        out_ctx.append(layers.Visibility(positions_bl, zeros, ctx_pos_bs, jnp.zeros_like(ctx_pos_bs), ctx_valid,
                                         block_size=None, **topo))
        out_blk.append(layers.Visibility(positions_bl, zeros, positions_bl, zeros, jnp.ones((b, l), bool),
                                         block_size=None, **topo))
    return tuple(out_ctx), tuple(out_blk)


def block_hidden(drafter: Drafter, target: Transformer, block_bl, positions_bl, ctx_kv, ctx_pos_bs, ctx_valid_bs):
    """The drafter's final-normed hidden states [B, L, D] for one block per row against a context
    (or its cache), which the target's lm_head turns into draft logits. Row b's block starts at
    positions_bl[b, 0]; context keys at or after it are not seen."""
    ctx_vis, blk_vis = block_visibilities(drafter.config, positions_bl, ctx_pos_bs, ctx_valid_bs)
    return drafter(drafter.embed(target, block_bl), positions_bl, ctx_kv, ctx_vis, blk_vis)


def context_features(target: Transformer, cfg: DrafterConfig, layer_hidden) -> jax.Array:
    """The target's hidden states collected at `cfg.hidden_layers` (one per id, in id order) ->
    [B, L, n_ids * D].

    HF's `hidden_states[N]` (id N - 1, the last layer) is the final-normed state, so that one
    gets the target's final norm; every other id is the raw residual stream after layer id.
    """
    n = target.config.num_layers
    feats = [target.final_norm(h) if i == n - 1 else h for i, h in zip(cfg.target_layer_ids, layer_hidden)]
    return jnp.concatenate(feats, axis=-1)


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> Drafter:
    return Drafter(cfg, rngs=nnx.Rngs(seed))


def abstract_drafter(cfg: DrafterConfig) -> Drafter:
    return nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0)))
