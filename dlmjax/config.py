"""Model configuration: one frozen dataclass for every family, and strict HF translation.

`from_hf_config` turns a Hugging Face `config.json` dict into a `ModelConfig` and refuses
anything it does not understand: an unknown key, or a known key with a value dlmjax does not
implement (rope scaling, sliding windows, ...). The error names the keys and the fix.
`to_hf_config` is its inverse, so an exported checkpoint carries a config its family's loader
(transformers for Qwen3/Qwen2/Llama, dlmjax for every family) reads back to the same `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, POSITIVE, InputError, OneOf, Range, check_fields, check_value

ROPE_SCALINGS = ("none", "linear", "llama3")
ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")
ROUTERS = ("softmax", "sigmoid")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(InputError):
    """A checkpoint config that dlmjax cannot represent faithfully."""


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention: str = "causal"  # causal | bidirectional | block_causal
    block_size: int | None = None  # block-causal attention and block decoding
    shift_logits: bool = False  # Dream: logits at i come from position i-1 (AR-initialised)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, SDAR)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # the checkpoint's parameter dtype
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    rotary_dim: int | None = None  # partial RoPE: rotate the first rotary_dim of head_dim (None: all)
    # RoPE frequency scaling (transformers' rope_type): none, linear (every frequency / factor) or
    # llama3 (Llama 3.1+: long wavelengths / factor, short ones kept, a smooth blend between)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_positions: int = 8192  # llama3: the context the frequencies were trained for
    # Mixture of experts (dlmjax.models.moe): the layers in `moe_layers` replace the MLP by a router over
    # `num_experts` SiLU-gated experts of width `moe_intermediate_size` (+ an always-on shared expert).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_layers: tuple[int, ...] = ()
    router: str = "softmax"  # softmax: top-k of softmax; sigmoid: DeepSeek-V3 (bias, groups, scale)
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    router_groups: int = 1  # sigmoid: experts form groups; a token picks experts of its top groups only
    router_topk_groups: int = 1
    router_expert_bias: bool = False  # sigmoid: a per-expert bias added to the scores for selection only

    limits = {**{name: AT_LEAST_1 for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                               "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                                               "block_size")},
              "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "attention": OneOf(ATTENTION_KINDS),
              "mask_token_id": AT_LEAST_0,  # bos/eos/pad: any int (older Llama configs say pad_token_id -1)
              "rotary_dim": AT_LEAST_1, "num_experts": AT_LEAST_0, "num_experts_per_tok": AT_LEAST_0,
              "moe_intermediate_size": AT_LEAST_0, "shared_expert_intermediate_size": AT_LEAST_0,
              "router": OneOf(ROUTERS), "routed_scaling_factor": POSITIVE, "router_groups": AT_LEAST_1,
              "router_topk_groups": AT_LEAST_1, "rope_scaling": OneOf(ROPE_SCALINGS), "rope_factor": POSITIVE,
              "rope_low_freq_factor": POSITIVE, "rope_high_freq_factor": POSITIVE,
              "rope_original_max_positions": AT_LEAST_1}

    def __post_init__(self):
        check_fields(self, "model.", error=ConfigError)  # every field's type and `limits`
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is unknown; families: {', '.join(FAMILIES)}")
        if self.attention == "block_causal" and not self.block_size:
            raise ConfigError("block_causal attention needs block_size (e.g. 4); set it in config.json")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.rotary_dim is not None and (self.rotary_dim > self.head_dim or self.rotary_dim % 2):
            raise ConfigError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim={self.head_dim}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"llama3 RoPE scaling needs high_freq_factor ({self.rope_high_freq_factor}) > "
                              f"low_freq_factor ({self.rope_low_freq_factor})")
        self._check_moe()

    def _check_moe(self):
        if not self.num_experts:
            if self.moe_layers:
                raise ConfigError(f"moe_layers={self.moe_layers} needs num_experts >= 1")
            return
        if not self.moe_layers:
            raise ConfigError(f"num_experts={self.num_experts} with no moe_layers would build a dense model; give "
                              f"moe_layers, the indices of the layers with experts (e.g. all: [0, ..., "
                              f"{self.num_layers - 1}])")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                              f"{self.num_experts}]: a token cannot pick more experts than there are")
        if self.moe_intermediate_size < 1:
            raise ConfigError("an MoE model needs moe_intermediate_size >= 1 (the width of one expert)")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers) or len(set(self.moe_layers)) != len(
                self.moe_layers):
            raise ConfigError(f"moe_layers={self.moe_layers} must be distinct layer indices in [0, {self.num_layers})")
        groups, size = self.router_groups, self.num_experts // self.router_groups
        if self.num_experts % groups or self.router_topk_groups > groups:
            raise ConfigError(f"router groups: num_experts={self.num_experts} must split into router_groups={groups} "
                              f"equal groups, and router_topk_groups={self.router_topk_groups} <= router_groups")
        if groups > 1 and (self.router != "sigmoid" or size < 2 or self.num_experts_per_tok > self.router_topk_groups
                           * size):
            raise ConfigError(f"group-limited routing (router_groups={groups}) needs the sigmoid router, >= 2 experts "
                              f"per group and num_experts_per_tok <= router_topk_groups x experts per group")
        if self.router == "softmax" and self.routed_scaling_factor != 1.0:
            raise ConfigError(f"routed_scaling_factor={self.routed_scaling_factor} is applied by the sigmoid "
                              "(DeepSeek-V3) router only; the softmax router's weights are not scaled (set it to 1)")
        if self.router_expert_bias and self.router != "sigmoid":
            raise ConfigError("router_expert_bias is implemented for the sigmoid (DeepSeek-V3) router only")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


# ----------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values that select this family (the first: its
    # published spelling, which export writes)
    layout: str  # weight-name layout: "hf" (Qwen/Llama names) or "llada"
    attention: str
    shift_logits: bool
    qk_norm: bool
    architecture: str  # `architectures[0]` written on export
    default_mask_token_id: int | None = None
    mask_tokens: tuple[str, ...] = ()  # token strings that name the mask token in the tokenizer


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3", ("qwen3",), "hf", "causal", False, True, "Qwen3ForCausalLM"),
        Family("qwen2", ("qwen2",), "hf", "causal", False, False, "Qwen2ForCausalLM"),
        Family("llama", ("llama",), "hf", "causal", False, False, "LlamaForCausalLM"),
        Family("sdar", ("sdar",), "hf", "block_causal", False, True, "SDARForCausalLM", 151669, ("<|MASK|>",)),
        Family("dream", ("Dream", "dream"), "hf", "bidirectional", True, False, "DreamModel", 151666, ("<|mask|>",)),
        Family("llada", ("llada", "LLaDA"), "llada", "bidirectional", False, False, "LLaDAModelLM", 126336, ("<|mdm_mask|>",)),
        Family("qwen3_moe", ("qwen3_moe",), "hf", "causal", False, True, "Qwen3MoeForCausalLM"),
        Family("sdar_moe", ("sdar_moe",), "hf", "block_causal", False, True, "SDARMoeForCausalLM", 151669,
               ("<|MASK|>",)),
        # published as model_type "llada" like dense LLaDA, selected by `architectures` (see _family_of);
        # "lladamoe" is the spelling of checkpoints fine-tuned with ZHZisZZ/dllm's LLaDA-MoE config class
        Family("llada_moe", ("lladamoe",), "llada_moe", "bidirectional", False, True, "LLaDAMoEModelLM", 156895, ("<|mdm_mask|>",)),
        Family("llada2_moe", ("llada2_moe",), "llada2", "block_causal", False, True, "LLaDA2MoeModelLM", 156895,
               ("<|mask|>",)),
        # Fast-dLLM v2 (NVlabs; Efficient-Large-Model/Fast_dLLM_v2_7B): Qwen2.5 layers, block-causal
        # attention in blocks of `bd_size`, logits shifted by one (token shift, as Dream)
        Family("fast_dllm_v2", ("Fast_dLLM_Qwen",), "hf", "block_causal", True, False, "Fast_dLLM_QwenForCausalLM",
               151665, ("|<MASK>|",)),
    )
}


def family_for_model_type(model_type: str | None) -> Family:
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ConfigError(
        f"config.json model_type={model_type!r} is not supported; supported model types: {', '.join(known)}"
    )


# ----------------------------------------------------------------------------------------------
# HF -> ModelConfig

# Keys that carry no numerics (bookkeeping of transformers and of training code).
_METADATA_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "auto_map", "_name_or_path", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "bos_token_id", "eos_token_id", "pad_token_id",
    "mask_token_id", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "max_window_layers", "sliding_window",
    "attention_dropout", "embd_pdrop", "resid_pdrop", "init_device", "init_fn", "init_std",
    "init_cutoff_factor", "fuse_cross_entropy", "use_flash_attention", "debug",
    "mrp_residual_scale",  # an MRP head's residual scale s, read by dlmjax.heads.mrp
    # SDAR-4B/8B training-infrastructure switches; none changes the forward's numerics.
    "attn_implementation", "ep_size", "micro_forward", "skip_checkpoint", "use_deepep",
    "_from_model_config",
    "is_llama_config",  # nanotron's export mark (SmolLM2's configs)
    "pretraining_tp",  # Llama-2's: it only split the same matmuls into slices (transformers 5 ignores it)
}

# Keys dlmjax understands only at one value (or a set of harmless values); anything else is refused.
def _must_equal(expected, note):
    return lambda v: (v in expected, note)


_HF_FIXED: dict[str, Any] = {
    "hidden_act": _must_equal(("silu",), "only SiLU-gated MLPs are implemented"),
    "use_sliding_window": _must_equal((False, None), "sliding-window attention is not implemented"),
    "mlp_bias": _must_equal((False,), "MLP biases are not implemented"),
    "rope_interleaved": _must_equal((False, None), "interleaved (GPT-J) RoPE is not implemented"),  # SmolLM2's: false
    "use_mrope": _must_equal((False,), "multimodal RoPE is not implemented"),
}


_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
# keys a type's configs may carry that its RoPE does not read (transformers warns and goes on)
_ROPE_UNREAD = {"linear": {"original_max_position_embeddings"}}


ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_positions")  # ModelConfig's (and DrafterConfig's) RoPE fields


def rope_fields(raw: dict) -> dict:
    """ModelConfig's RoPE fields from transformers 5's `rope_parameters` (rope_type, rope_theta
    and the type's parameters) or the older `rope_theta` + `rope_scaling` (type spelled `rope_type`
    or `type`; null for none); where a config has both, they must agree. Scalings other than
    linear and llama3 (yarn, dynamic, longrope) are refused."""
    old_keys = {key: raw[key] for key in ("rope_theta", "rope_scaling") if raw.get(key) is not None}
    if raw.get("rope_parameters") is not None and old_keys:
        new = rope_fields({**raw, "rope_theta": None, "rope_scaling": None})
        old = rope_fields({**raw, "rope_parameters": None, "rope_theta": old_keys.get("rope_theta", new["rope_theta"])})
        if "rope_scaling" not in old_keys:  # a bare rope_theta beside rope_parameters says nothing of scaling
            old = {**new, "rope_theta": old["rope_theta"]}
        if new != old:
            raise ConfigError(f"config.json's `rope_parameters` ({raw['rope_parameters']!r}) and {old_keys!r} "
                              "disagree; keep one spelling")
        return new
    params = raw.get("rope_parameters")
    if params is None:
        theta, scaling, key = raw.get("rope_theta", 10000.0), raw.get("rope_scaling"), "rope_scaling"
        inner = scaling.get("rope_theta") if isinstance(scaling, dict) else None
        if inner is not None:  # transformers 5 reads it first (rope_scaling becomes its rope_parameters)
            if raw.get("rope_theta") is not None and raw["rope_theta"] != inner:
                raise ConfigError(f"config.json's `rope_theta` ({raw['rope_theta']!r}) and `rope_scaling.rope_theta` "
                                  f"({inner!r}) disagree (transformers 4 reads the first, 5 the second); keep one")
            theta = inner
    else:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ConfigError(f"rope_parameters={params!r} has no rope_theta; expected {{'rope_type': 'default', "
                              "'rope_theta': ...}")
        theta, scaling, key = params["rope_theta"], params, "rope_parameters"
    theta = float(check_value(f"config.json `{key}.rope_theta`" if params else "config.json `rope_theta`", theta,
                              "float", POSITIVE, error=ConfigError))
    if scaling is None:
        return {"rope_theta": theta}
    if not isinstance(scaling, dict):
        raise ConfigError(f"config key `{key}` = {scaling!r} must be an object (or null)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise ConfigError(f"config key `{key}` = {scaling!r}: rope_type {kind!r} is not implemented (default, "
                          "linear and llama3 are)")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config key `{key}` = {scaling!r}: partial_rotary_factor="
                          f"{scaling['partial_rotary_factor']!r} inside `{key}` is not implemented (rotary over the "
                          "whole head only); the MoE families read a top-level partial_rotary_factor")
    allowed = _ROPE_KEYS[kind] | _ROPE_UNREAD.get(kind, set()) | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = set(scaling) - allowed
    missing = _ROPE_KEYS[kind] - set(scaling)
    if unknown or missing:
        raise ConfigError(f"config key `{key}` = {scaling!r}: rope_type {kind!r} takes {sorted(_ROPE_KEYS[kind])}; "
                          f"unknown {sorted(unknown)}, missing {sorted(missing)}")

    def number(name, kind="float", limit=POSITIVE):
        return check_value(f"config.json `{key}.{name}`", scaling[name], kind, limit, error=ConfigError)

    out = {"rope_theta": theta}
    if kind == "default":
        return out
    out.update(rope_scaling=kind, rope_factor=float(number("factor")))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(number("low_freq_factor")),
                   rope_high_freq_factor=float(number("high_freq_factor")),
                   rope_original_max_positions=number("original_max_position_embeddings", "int", AT_LEAST_1))
    return out


def _rope_theta(raw: dict) -> float:
    """rope_theta of a family without RoPE scaling (a scaled config is refused)."""
    rope = rope_fields(raw)
    if len(rope) > 1:
        raise ConfigError(f"RoPE scaling {rope['rope_scaling']!r} is not implemented for this family; only plain RoPE")
    return rope["rope_theta"]


def rope_keys(cfg) -> dict:
    """config.json's `rope_theta` and `rope_scaling` of `cfg` (a ModelConfig or a DrafterConfig):
    the spelling that transformers 4 and 5 read, and so does the remote code of the families written
    against transformers 4 (SDAR, Dream, Fast-dLLM v2), vLLM and SGLang, where transformers 5's
    `rope_parameters` alone would leave them at their default theta."""
    scaling = {key: value for key, value in rope_parameters(cfg).items() if key != "rope_theta"}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling == "none" else scaling}


def rope_parameters(cfg) -> dict:
    """transformers 5's `rope_parameters` of `cfg` (a ModelConfig or a DrafterConfig: its ROPE_FIELDS)."""
    out = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        out["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_positions)
    return out


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(check_value("config.json `eos_token_id`", v, "int", error=ConfigError) for v in values)


def _dtype(raw: dict) -> str:
    value = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if value not in DTYPES:
        raise ConfigError(f"config.json dtype {value!r} is unknown; supported: {', '.join(DTYPES)}")
    return value


def _dtype_and_special_ids(raw: dict, fam: Family) -> dict:
    """The fields every family reads the same way: parameter dtype and special-token ids."""
    return dict(
        dtype=_dtype(raw),
        mask_token_id=raw.get("mask_token_id", fam.default_mask_token_id),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )


def _check_fixed(raw: dict, fixed: dict, family: str) -> list[str]:
    problems = []
    for key, check in fixed.items():
        if key in raw:
            ok, note = check(raw[key])
            if not ok:
                problems.append(f"`{key}` = {raw[key]!r} ({note})")
    return problems


def _refuse(family: str, unknown: set[str], problems: list[str]) -> None:
    msgs = []
    if unknown:
        msgs.append(
            f"unknown config keys {sorted(unknown)} for family {family}: dlmjax refuses keys it does not "
            "implement rather than ignore them; remove them from config.json if they do not change the model"
        )
    if problems:
        msgs.append(f"unsupported values for family {family}: " + "; ".join(problems))
    if msgs:
        raise ConfigError(". ".join(msgs))


_HF_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "block_size", "layer_types",
}
_FAMILY_KEYS = {  # keys only one family of the hf layout reads
    # `conplemenrary_mask` (sic, as the published 7B config spells it; `complementary_mask` in later
    # ports) switches complementary masking in its training loss: no numerics of the forward
    "fast_dllm_v2": {"bd_size", "conplemenrary_mask", "complementary_mask"},
    # the MRP head beside an SDAR backbone in the published MRP checkpoints (SDARMRPForCausalLM,
    # heavyball/sdar-*-mrp-3lyr): its modules and layers per module; the backbone's forward is
    # unchanged, and dlmjax.heads.mrp.load_head checks them against the head's tensors
    "sdar": {"num_mrp_heads", "num_nextn_predict_layers"},
}
QWEN2_BIAS_FAMILIES = ("qwen2", "dream", "fast_dllm_v2")  # q/k/v biases always, no o bias, no `attention_bias` key


def _from_hf_layout(raw: dict, fam: Family, problems: tuple[str, ...] = ()) -> ModelConfig:
    """The ModelConfig of a config.json in the Llama/Qwen layout; `problems` a caller found in the
    keys it read itself are refused in the same error as this layout's."""
    windows_start = raw.get("max_window_layers")
    layer_types = raw.get("layer_types")
    if raw.get("use_sliding_window") is True and (
            layer_types is not None and all(t == "full_attention" for t in layer_types)  # it decides where given
            or layer_types is None and isinstance(windows_start, int) and windows_start >= raw["num_hidden_layers"]):
        raw = {**raw, "use_sliding_window": False}  # transformers windows no layer here: all attend in full
    unknown = set(raw) - _HF_KEYS - _METADATA_KEYS - set(_HF_FIXED) - _FAMILY_KEYS.get(fam.name, set())
    problems = [*problems, *_check_fixed(raw, _HF_FIXED, fam.name)]
    if fam.name == "fast_dllm_v2" and "block_size" in raw:  # its block is `bd_size`; a second key would be ambiguous
        problems.append(f"`block_size` = {raw['block_size']!r} (Fast-dLLM v2 names its block `bd_size`; use that key)")
    if fam.name == "dream" and raw.get("head_dim") not in (None, raw["hidden_size"] // raw["num_attention_heads"]):
        problems.append(f"`head_dim` = {raw['head_dim']!r} (modeling_dream.py uses hidden_size / num_attention_heads "
                        f"= {raw['hidden_size'] // raw['num_attention_heads']} and reads no head_dim; remove it or set "
                        "it to that)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        problems.append(f"`layer_types` = {sorted(set(map(str, layer_types)))} (only full_attention layers are implemented)")
    if raw.get("attention_dropout", 0.0) not in (0, 0.0):
        problems.append(f"`attention_dropout` = {raw['attention_dropout']} (dlmjax has no dropout; set 0.0)")
    _refuse(fam.name, unknown, problems)
    num_heads = raw["num_attention_heads"]
    # absent keys take the defaults of transformers' config classes: Llama's KV heads = heads and
    # head_dim = hidden / heads, 2048 positions; Qwen2's and Qwen3's (and their diffusion kin's) 32 KV heads
    # (Qwen3-MoE's 4), 32768 positions, and Qwen3's (SDAR's) head_dim 128
    default_kv_heads = num_heads if fam.name == "llama" else 4 if fam.name in QWEN3_MOE_FAMILIES else 32
    default_head_dim = 128 if fam.name in ("qwen3", "sdar") else raw["hidden_size"] // num_heads
    # Qwen2 (Dream, Fast-dLLM v2) always carry q/k/v biases and no o bias; Qwen3/Llama/SDAR have `attention_bias`.
    always_qkv_bias = fam.name in QWEN2_BIAS_FAMILIES
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=fam.name,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or default_kv_heads,
        head_dim=raw.get("head_dim") or default_head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        **rope_fields(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048 if fam.name == "llama" else 32768),
        attention=fam.attention,
        # Real SDAR configs carry no block_size (it is a generation argument); 4 is SDAR's default.
        # Fast-dLLM v2 reads `bd_size` (its modeling code's default: 32).
        block_size=(raw.get("bd_size", 32) if fam.name == "fast_dllm_v2" else raw.get("block_size", 4))
        if fam.attention == "block_causal" else None,
        shift_logits=fam.shift_logits,
        qkv_bias=always_qkv_bias or attention_bias,
        o_bias=attention_bias and not always_qkv_bias,
        qk_norm=fam.qk_norm,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        **_dtype_and_special_ids(raw, fam),
    )


# LLaDA's own config (configuration_llada.py, OLMo-derived names).
_LLADA_KEYS = {
    "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "mlp_ratio", "vocab_size",
    "embedding_size", "rope_theta", "rms_norm_eps", "max_sequence_length", "weight_tying",
    "include_qkv_bias", "rope_full_precision", "flash_attention", "attention_layer_norm_with_affine",
    "precision", "alibi_bias_max",
}
_LLADA_FIXED = {
    "activation_type": _must_equal(("silu",), "only the llama block's SiLU-gated MLP is implemented"),
    "block_type": _must_equal(("llama",), "only the llama block type is implemented"),
    "layer_norm_type": _must_equal(("rms",), "only RMSNorm is implemented"),
    "alibi": _must_equal((False,), "ALiBi is not implemented"),
    "scale_logits": _must_equal((False,), "logit scaling is not implemented"),
    "clip_qkv": _must_equal((None,), "q/k/v clipping is not implemented"),
    "attention_layer_norm": _must_equal((False,), "attention layer norm is not implemented"),
    "include_bias": _must_equal((False,), "linear biases other than q/k/v are not implemented"),
    "rope": _must_equal((True,), "LLaDA without RoPE is not implemented"),
    "multi_query_attention": _must_equal((None, False), "use n_kv_heads instead"),
    "input_emb_norm": _must_equal((False, None), "input embedding norm is not implemented"),
    "residual_dropout": _must_equal((0, 0.0), "dlmjax has no dropout"),
    "embedding_dropout": _must_equal((0, 0.0), "dlmjax has no dropout"),
    "block_group_size": _must_equal((1,), "grouped blocks are not implemented"),
    "bias_for_layer_norm": _must_equal((None, False), "layer-norm biases are not implemented"),
    "layer_norm_with_affine": _must_equal((True,), "norms without a learned scale are not implemented"),
}


def _from_llada(raw: dict, fam: Family) -> ModelConfig:
    unknown = set(raw) - _LLADA_KEYS - _METADATA_KEYS - set(_LLADA_FIXED)
    _refuse(fam.name, unknown, _check_fixed(raw, _LLADA_FIXED, fam.name))
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    vocab = raw.get("embedding_size") or raw["vocab_size"]
    if vocab != raw["vocab_size"]:
        raise ConfigError(
            f"LLaDA embedding_size={vocab} differs from vocab_size={raw['vocab_size']}; "
            "dlmjax needs them equal (pad the tokenizer vocab or set embedding_size=vocab_size)"
        )
    return ModelConfig(
        family=fam.name,
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * d_model,
        num_layers=raw["n_layers"],
        num_heads=n_heads,
        num_kv_heads=raw.get("n_kv_heads") or n_heads,
        head_dim=d_model // n_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        attention=fam.attention,
        shift_logits=fam.shift_logits,
        qkv_bias=bool(raw.get("include_qkv_bias", False)),
        qk_norm=False,
        tie_word_embeddings=bool(raw.get("weight_tying", True)),  # configuration_llada.py's default
        **_dtype_and_special_ids(raw, fam),
    )


# The types and ranges of the config.json keys the translators compute with (checked before they do).
_RAW_TYPES = {
    **{key: ("int", AT_LEAST_1) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "num_key_value_heads", "max_position_embeddings", "block_size", "bd_size", "d_model", "n_heads", "n_kv_heads",
        "n_layers", "mlp_hidden_size", "mlp_ratio", "embedding_size", "max_sequence_length")},
    **{key: ("float", POSITIVE) for key in ("rms_norm_eps", "rope_theta")},
    "layer_types": ("list", None), "rope_parameters": ("dict", None),
    **{key: ("bool", None) for key in ("attention_bias", "tie_word_embeddings", "include_qkv_bias", "weight_tying")},
    "mask_token_id": ("int", AT_LEAST_0), "bos_token_id": ("int", None), "pad_token_id": ("int", None),
}


def _check_raw_types(raw: dict, required: tuple[str, ...]) -> None:
    """The value of every key in `_RAW_TYPES` that is set (or required)."""
    for key, (kind, limit) in _RAW_TYPES.items():
        if raw.get(key) is not None or key in required:
            check_value(f"config.json `{key}`", raw.get(key), kind, limit, error=ConfigError)


def from_hf_config(raw: dict, family: str | None = None) -> ModelConfig:
    """Translate a config.json dict. `family` overrides the family chosen by `model_type`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json holds {type(raw).__name__}, not an object of config keys")
    if family is not None and family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; supported: {', '.join(FAMILIES)}")
    fam = FAMILIES[family] if family else _family_of(raw)
    missing = [k for k in _required_keys(fam) if k not in raw]
    if missing:
        raise ConfigError(f"config.json for family {fam.name} lacks required keys {missing}")
    _check_raw_types(raw, _required_keys(fam))
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:  # as the config classes read it
        raw = {**raw, "num_key_value_heads": raw.get("num_attention_heads")}  # (absent: their default, below)
    raw = {k: v for k, v in raw.items() if v is not None or k not in _RAW_TYPES}  # null: unset (the default)
    if fam.name in _MOE_TRANSLATORS:
        return _MOE_TRANSLATORS[fam.name](raw, fam)
    return (_from_llada if fam.layout == "llada" else _from_hf_layout)(raw, fam)


def _required_keys(fam: Family) -> tuple[str, ...]:
    if fam.layout == "llada":  # and the keys whose LLaDA default (LayerNorm, no RoPE, ...) dlmjax does not implement
        return ("d_model", "n_heads", "n_layers", "vocab_size", "activation_type", "block_type", "layer_norm_type",
                "rope")
    if fam.name in _MOE_TRANSLATORS:
        return _MOE_REQUIRED + (("intermediate_size",) if fam.name != "llada_moe" else ())
    return ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


# ----------------------------------------------------------------------------------------------
# ModelConfig -> HF


def _token_ids(cfg: ModelConfig) -> dict:
    eos = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id
    out = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id}
    if cfg.mask_token_id is not None and FAMILIES[cfg.family].default_mask_token_id is not None:
        out["mask_token_id"] = cfg.mask_token_id
    return out


def to_hf_config(cfg: ModelConfig) -> dict:
    """The config.json of `cfg` in its family's published layout. Refused where that layout cannot
    express `cfg` (the file would load as another model): its translation back must give `cfg`."""
    out = _MOE_EXPORTERS[cfg.family](cfg) if cfg.family in _MOE_EXPORTERS else _to_dense(cfg)
    back = from_hf_config(out)
    # what the file need not carry: the dtype (the export's own), the mask token of a family whose
    # config names none (its tokenizer does) or left at the family's, the block of a model without blocks
    ignored = {"dtype"}
    if cfg.mask_token_id is None or FAMILIES[cfg.family].default_mask_token_id is None:
        ignored.add("mask_token_id")
    if cfg.attention != "block_causal":
        ignored.add("block_size")
    lost = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in ignored and getattr(back, f.name) != getattr(cfg, f.name)}
    if lost:
        fits = [name for name, f in FAMILIES.items() if name != cfg.family and f.layout == FAMILIES[cfg.family].layout
                and (f.attention, f.shift_logits) == (cfg.attention, cfg.shift_logits)]
        hint = (f"; a model with this attention exports as family {' or '.join(fits)}"
                if fits and {"attention", "shift_logits"} & set(lost) else "")
        raise ConfigError(f"family {cfg.family}'s config.json cannot express {lost} (it would load as "
                          f"{ {k: getattr(back, k) for k in lost} }){hint}")
    return out


def _to_dense(cfg: ModelConfig) -> dict:
    fam = FAMILIES[cfg.family]
    if fam.layout == "llada":
        return {
            "architectures": [fam.architecture],
            "model_type": "llada",
            "d_model": cfg.hidden_size,
            "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads,
            "n_layers": cfg.num_layers,
            "mlp_hidden_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "embedding_size": cfg.vocab_size,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_sequence_length": cfg.max_position_embeddings,
            "weight_tying": cfg.tie_word_embeddings,
            "include_qkv_bias": cfg.qkv_bias,
            "include_bias": False,
            "activation_type": "silu",
            "block_type": "llama",
            "layer_norm_type": "rms",
            "rope": True,
            # written as LLaDA-8B's config writes them: LLaDA's own code defaults all three to 0.1
            "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0,
            "torch_dtype": cfg.dtype,
            **_token_ids(cfg),
        }
    out = {
        "architectures": [fam.architecture],
        "model_type": fam.model_types[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_keys(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.dtype,
        **_token_ids(cfg),
    }
    if cfg.family == "dream":  # as published: modeling_dream.py takes hidden_size / num_attention_heads
        del out["head_dim"]
    if cfg.family in QWEN2_BIAS_FAMILIES:
        if not cfg.qkv_bias or cfg.o_bias:
            raise ConfigError(f"family {cfg.family} always has q/k/v biases and no o bias")
    else:
        if cfg.qkv_bias != cfg.o_bias:
            raise ConfigError(
                f"family {cfg.family} has one `attention_bias` flag for q/k/v/o; "
                f"qkv_bias={cfg.qkv_bias} and o_bias={cfg.o_bias} cannot be exported"
            )
        out["attention_bias"] = cfg.qkv_bias
    if cfg.attention == "block_causal":
        out["bd_size" if cfg.family == "fast_dllm_v2" else "block_size"] = cfg.block_size
    return out


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts families (the layer: dlmjax.models.moe)
#
# qwen3_moe / sdar_moe: Qwen3 layers whose MLP is a softmax top-k router over `num_experts` experts
# (transformers' Qwen3MoeForCausalLM; SDAR-30B-A3B adds SDAR's block diffusion). llada_moe:
# LLaDA-MoE-7B-A1B (model_type "llada", told from dense LLaDA by `architectures`), a bidirectional
# OLMoE-style stack whose router never renormalises. llada2_moe: LLaDA2.0/2.1, block diffusion with
# fused q/k/v, partial rotary and DeepSeek-V3's sigmoid router (bias, groups, scale).

LLADA_MOE_ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")


def _family_of(raw: dict) -> Family:
    architectures = raw.get("architectures") or []
    if raw.get("model_type") in FAMILIES["llada"].model_types and any(a in LLADA_MOE_ARCHITECTURES
                                                                       for a in architectures):
        return FAMILIES["llada_moe"]
    return family_for_model_type(raw.get("model_type"))


def _moe_int(raw: dict, key: str, default=None, low=AT_LEAST_1, *, nullable: bool = False):
    """config.json's integer `key` (`default` when absent). A `null` is refused, naming the key,
    unless `nullable` (keys whose null means "none", as `default`); `true`/`false` are not integers."""
    if key in raw and raw[key] is None:
        if not nullable:
            raise ConfigError(f"config.json `{key}` is null; set it to an integer"
                              + (f" (or remove it for the default, {default})" if default is not None else ""))
        return default
    value = raw.get(key, default)
    return value if value is None else check_value(f"config.json `{key}`", value, "int", low, error=ConfigError)


def _moe_float(raw: dict, key: str, default: float) -> float:
    """config.json's positive number `key` (`default` when absent); null and true/false are refused."""
    value = raw.get(key, default)
    return float(check_value(f"config.json `{key}`", value, "float", POSITIVE, error=ConfigError))


def _moe_bool(raw: dict, key: str, default: bool) -> bool:
    """config.json's true/false `key` (`default` when absent or null)."""
    value = raw.get(key)
    return default if value is None else check_value(f"config.json `{key}`", value, "bool", error=ConfigError)


def _moe_layer_list(raw: dict, key: str, num_layers: int) -> list:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"config.json `{key}` = {value!r} must be a list of integers")
    return value


QWEN3_MOE_FAMILIES = ("qwen3_moe", "sdar_moe")  # Qwen3MoeConfig's defaults: 4 KV heads, 32768 positions

# Qwen3-Coder's config.json carries these; Qwen3-MoE's modeling code (transformers, vLLM, SGLang) never
# reads them: accepted at the values that match that code, refused at any other
_QWEN3_CODER_FIXED = {
    "qkv_bias": _must_equal((False, None), "Qwen3-MoE has no q/k/v biases"),
    "shared_expert_intermediate_size": _must_equal((0, None), "Qwen3-MoE has no shared expert"),
    "use_qk_norm": _must_equal((True, None), "Qwen3-MoE always normalises q and k"),
}

_QWEN3_MOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
                   "router_aux_loss_coef"}


def _expert_layers(layers: tuple[int, ...], num_experts: int, fam: Family, keys: str) -> tuple[int, ...]:
    """The MoE layers a config.json names (none without experts); experts in no layer (every layer
    dense) are refused in its terms."""
    if num_experts and not layers:
        raise ConfigError(f"config.json makes no layer a mixture of experts ({keys}), which a {fam.name} model "
                          "is not; keep at least one MoE layer, or load the weights as the family's dense model")
    return layers if num_experts else ()


def _from_qwen3_moe(raw: dict, fam: Family) -> ModelConfig:
    """Qwen3-MoE (and SDAR-MoE): published configs say `num_experts`, transformers 5 writes
    `num_local_experts`; either is read (both must agree)."""
    problems = _check_fixed(raw, _QWEN3_CODER_FIXED, fam.name)
    if raw.get("use_sliding_window") is True:  # transformers 4 windows layers >= max_window_layers, 5 every layer
        problems.append("`use_sliding_window` = True (sliding-window attention is not implemented, and transformers "
                        "4 and 5 disagree on which Qwen3-MoE layers it windows)")
    cfg = _from_hf_layout({k: v for k, v in raw.items() if k not in _QWEN3_MOE_KEYS | set(_QWEN3_CODER_FIXED)}, fam,
                          tuple(problems))
    experts = {key: _moe_int(raw, key, low=AT_LEAST_0, nullable=True) for key in ("num_experts", "num_local_experts")
               if raw.get(key) is not None}
    if not experts and any(key in raw for key in ("num_experts", "num_local_experts")):
        raise ConfigError("config.json `num_experts` is null; set it to the number of experts (an integer)")
    if len(set(experts.values())) > 1:
        raise ConfigError(f"config.json says num_experts={experts['num_experts']} and num_local_experts="
                          f"{experts['num_local_experts']}; keep one of them")
    num_experts = next(iter(experts.values()), 128)
    step = _moe_int(raw, "decoder_sparse_step", 1)
    dense = set(_moe_layer_list(raw, "mlp_only_layers", cfg.num_layers))
    moe_layers = _expert_layers(tuple(i for i in range(cfg.num_layers) if i not in dense and (i + 1) % step == 0),
                                num_experts, fam, "mlp_only_layers, decoder_sparse_step")
    norm = raw.get("norm_topk_prob", False)
    return cfg.replace(num_experts=num_experts, num_experts_per_tok=_moe_int(raw, "num_experts_per_tok", 8),
                       moe_intermediate_size=_moe_int(raw, "moe_intermediate_size", 768), moe_layers=moe_layers,
                       router="softmax", norm_topk_prob=check_value("config.json `norm_topk_prob`", norm, "bool",
                                                                     error=ConfigError))


def _partial_rotary_factor(cfg: ModelConfig) -> float:
    """The `partial_rotary_factor` whose `int(head_dim * factor)` (as `_rotary_dim` and the families'
    modeling code read it) is cfg's rotary dim: rotary_dim / head_dim can fall just below it in floating
    point (58 / 100 * 100 = 57.99...), so the exact quotient is nudged up by a quarter of a dimension."""
    rotary = cfg.rotary_dim or cfg.head_dim
    factor = rotary / cfg.head_dim
    return factor if int(cfg.head_dim * factor) == rotary else min(1.0, (rotary + 0.25) / cfg.head_dim)


def _rotary_dim(raw: dict, head_dim: int) -> int | None:
    factor = raw.get("partial_rotary_factor", 1.0)
    check_value("config.json `partial_rotary_factor`", factor, "float", Range(0, 1, low_open=True), error=ConfigError)
    rotary = int(head_dim * factor)
    if raw.get("rotary_dim") is not None and raw["rotary_dim"] != rotary:
        raise ConfigError(f"config.json says rotary_dim={raw['rotary_dim']} but partial_rotary_factor={factor} x "
                          f"head_dim={head_dim} = {rotary}; make them agree")
    return None if rotary == head_dim else rotary


_LLADA_MOE_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "dense_intermediate_size",
    "expert_intermediate_size", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
    "moe_layer_freq", "qk_layernorm", "rope_theta", "partial_rotary_factor", "output_router_logits",
    "router_aux_loss_coef",
}
_LLADA_MOE_FIXED = {
    "hidden_act": _must_equal(("silu",), "only SiLU-gated MLPs are implemented"),
    "rope_scaling": _must_equal((None,), "rope scaling is not implemented"),
    "clip_qkv": _must_equal((None,), "q/k/v clipping is not implemented"),
    "attention_dropout": _must_equal((0, 0.0), "dlmjax has no dropout; set 0.0"),
    "moe_router_score_function": _must_equal(("softmax",), "modeling_lladamoe.py routes by softmax"),
    "moe_router_enable_expert_bias": _must_equal((False, None), "the LLaDA-MoE expert bias is not implemented"),
    "router_num_group": _must_equal((None, 1), "modeling_lladamoe.py has no group-limited routing"),
    "router_topk_group": _must_equal((None, 1), "modeling_lladamoe.py has no group-limited routing"),
    "routed_scaling_factor": _must_equal((None, 1, 1.0), "modeling_lladamoe.py does not scale the routing weights"),
    # modeling_lladamoe.py fixes norm_topk_prob = False whatever the config says; a config that asks
    # for renormalisation would be silently ignored by the authors' code, so it is refused here.
    "norm_topk_prob": _must_equal((None, False), "modeling_lladamoe.py never renormalises the top-k weights"),
}


def _from_llada_moe(raw: dict, fam: Family) -> ModelConfig:
    unknown = set(raw) - _LLADA_MOE_KEYS - _METADATA_KEYS - set(_LLADA_MOE_FIXED)
    _refuse(fam.name, unknown, _check_fixed(raw, _LLADA_MOE_FIXED, fam.name))
    d, heads, num_layers = raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    head_dim = d // heads  # the modeling code's head size
    if raw.get("head_dim") not in (None, head_dim):
        raise ConfigError(f"config.json head_dim={raw['head_dim']}: modeling_lladamoe.py uses hidden_size / "
                          f"num_attention_heads = {head_dim}; remove head_dim or set it to {head_dim}")
    freq = raw.get("moe_layer_freq")
    freq = [1] * num_layers if freq is None else freq
    if not (isinstance(freq, list) and len(freq) == num_layers and all(f in (0, 1) for f in freq)):
        raise ConfigError(f"config.json `moe_layer_freq` = {freq!r} must list one 0 (dense) or 1 (MoE) per layer "
                          f"({num_layers} layers)")
    num_experts = _moe_int(raw, "num_experts", 64)
    attention_bias = _moe_bool(raw, "attention_bias", False)  # absent booleans read as modeling_lladamoe.py's
    return ModelConfig(
        family=fam.name, vocab_size=raw["vocab_size"], hidden_size=d,
        intermediate_size=_moe_int(raw, "dense_intermediate_size", 8192), num_layers=num_layers, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), rope_theta=float(raw.get("rope_theta", 50000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096), attention=fam.attention,  # its LLaDAConfig's
        qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=_moe_bool(raw, "qk_layernorm", False),
        tie_word_embeddings=_moe_bool(raw, "tie_word_embeddings", False), rotary_dim=_rotary_dim(raw, head_dim),
        num_experts=num_experts, num_experts_per_tok=_moe_int(raw, "num_experts_per_tok", 8),
        moe_intermediate_size=_moe_int(raw, "expert_intermediate_size", 1024),
        shared_expert_intermediate_size=_moe_int(raw, "shared_expert_intermediate_size", nullable=True) or 0,
        moe_layers=_expert_layers(tuple(i for i, f in enumerate(freq) if f), num_experts, fam, "moe_layer_freq"),
        router="softmax", norm_topk_prob=False,
        **_dtype_and_special_ids(raw, fam),
    )


_LLADA2_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "use_qkv_bias", "use_bias", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "rope_theta", "num_experts", "num_shared_experts", "num_experts_per_tok", "n_group",
    "topk_group", "routed_scaling_factor", "moe_intermediate_size", "first_k_dense_replace", "partial_rotary_factor",
    "rotary_dim", "output_router_logits", "norm_topk_prob", "block_size",
    # dropouts of training: the forward at inference has none
    "embedding_dropout", "attention_dropout", "output_dropout",
}
_LLADA2_FIXED = {
    "hidden_act": _must_equal(("silu",), "only SiLU-gated MLPs are implemented"),
    "rope_scaling": _must_equal((None,), "rope scaling is not implemented"),
    "use_sliding_window": _must_equal((False, None), "sliding-window attention is not implemented"),
    "norm_head": _must_equal((False,), "a normalised lm_head is not implemented"),
    "use_qk_norm": _must_equal((True, None), "modeling_llada2_moe.py always applies query/key layernorm"),
    "score_function": _must_equal(("sigmoid", None), "LLaDA2 routes by sigmoid scores"),
    "moe_router_enable_expert_bias": _must_equal((True, None), "LLaDA2's gate always carries expert_bias"),
    "router_dtype": _must_equal(("fp32", "float32", None), "the router runs in float32"),
    "num_nextn_predict_layers": _must_equal((0, None), "multi-token-prediction layers are not implemented"),
    # in the published configs; modeling_llada2_moe.py reads none of them (its norms are RMSNorms,
    # its router a sigmoid, its q/k/v one fused `query_key_value`)
    "use_rmsnorm": _must_equal((True, None), "LLaDA2's norms are RMSNorms"),
    "norm_softmax": _must_equal((False, None), "LLaDA2 routes by sigmoid scores"),
    "using_split_qkv_in_self_attention": _must_equal((False, None), "LLaDA2 stores one fused query_key_value"),
}


def _from_llada2(raw: dict, fam: Family) -> ModelConfig:
    unknown = set(raw) - _LLADA2_KEYS - _METADATA_KEYS - set(_LLADA2_FIXED)
    _refuse(fam.name, unknown, _check_fixed(raw, _LLADA2_FIXED, fam.name))
    d, heads, num_layers = raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or d // heads
    num_experts = _moe_int(raw, "num_experts", 16, low=AT_LEAST_0)  # LLaDA2MoeConfig's default
    top_k = _moe_int(raw, "num_experts_per_tok", 2)
    first_dense = _moe_int(raw, "first_k_dense_replace", 0, low=AT_LEAST_0)
    # absent: the defaults of the authors' LLaDA2MoeConfig (8 groups, 4 kept); null: no grouping
    groups, kept_groups = (1 if key in raw and raw[key] is None else _moe_int(raw, key, default)
                           for key, default in (("n_group", 8), ("topk_group", 4)))
    shared = _moe_int(raw, "num_shared_experts", 0, low=AT_LEAST_0, nullable=True)
    moe_width = _moe_int(raw, "moe_intermediate_size") or 0
    return ModelConfig(
        family=fam.name, vocab_size=raw["vocab_size"], hidden_size=d, intermediate_size=raw["intermediate_size"],
        num_layers=num_layers, num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), rope_theta=_rope_theta(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 16384), attention=fam.attention,
        block_size=_moe_int(raw, "block_size", 32), qkv_bias=_moe_bool(raw, "use_qkv_bias", False),
        o_bias=_moe_bool(raw, "use_bias", True), qk_norm=True,
        tie_word_embeddings=_moe_bool(raw, "tie_word_embeddings", False), rotary_dim=_rotary_dim(
            {"partial_rotary_factor": 0.5, **raw}, head_dim),
        num_experts=num_experts, num_experts_per_tok=top_k if num_experts else 0, moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * shared,
        moe_layers=_expert_layers(tuple(range(first_dense, num_layers)), num_experts, fam, "first_k_dense_replace"),
        router="sigmoid",
        # the gate renormalises whenever it picks more than one expert (`norm_topk_prob` is not read)
        norm_topk_prob=top_k > 1, routed_scaling_factor=_moe_float(raw, "routed_scaling_factor", 2.5),
        router_groups=groups, router_topk_groups=kept_groups,
        router_expert_bias=True,
        **_dtype_and_special_ids(raw, fam),
    )


_MOE_TRANSLATORS = {"qwen3_moe": _from_qwen3_moe, "sdar_moe": _from_qwen3_moe, "llada_moe": _from_llada_moe,
                    "llada2_moe": _from_llada2}
_MOE_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _to_qwen3_moe(cfg: ModelConfig) -> dict:
    base = _to_dense(cfg.replace(family="qwen3", num_experts=0, moe_layers=()))
    fam = FAMILIES[cfg.family]
    out = {**base, "architectures": [fam.architecture], "model_type": fam.model_types[0],
           "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
           "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
           "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in cfg.moe_layers],
           **_token_ids(cfg)}
    if cfg.attention == "block_causal":
        out["block_size"] = cfg.block_size
    return out


def _to_llada_moe(cfg: ModelConfig) -> dict:
    return {
        "architectures": [FAMILIES["llada_moe"].architecture], "model_type": "llada",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias,
        "dense_intermediate_size": cfg.intermediate_size, "expert_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size or None,
        "moe_layer_freq": [int(i in cfg.moe_layers) for i in range(cfg.num_layers)], "qk_layernorm": cfg.qk_norm,
        "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False, "router_num_group": None,
        "router_topk_group": None, "routed_scaling_factor": 1, "norm_topk_prob": False, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "partial_rotary_factor": _partial_rotary_factor(cfg),
        "torch_dtype": cfg.dtype, **_token_ids(cfg),
    }


def _to_llada2(cfg: ModelConfig) -> dict:
    first_dense = min(cfg.moe_layers) if cfg.moe_layers else cfg.num_layers
    shared, width = cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size
    if width and shared % width:
        raise ConfigError(f"llada2_moe's shared expert is num_shared_experts x moe_intermediate_size wide; "
                          f"{shared} is not a multiple of {width}")
    return {
        "architectures": [FAMILIES["llada2_moe"].architecture], "model_type": "llada2_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "use_qkv_bias": cfg.qkv_bias, "use_bias": cfg.o_bias, "use_qk_norm": True, "norm_head": False,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "partial_rotary_factor": _partial_rotary_factor(cfg), "num_experts": cfg.num_experts,
        "num_shared_experts": shared // width if width else 0, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
        "routed_scaling_factor": cfg.routed_scaling_factor, "moe_intermediate_size": width,
        "first_k_dense_replace": first_dense, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "router_dtype": "fp32", "norm_topk_prob": True, "block_size": cfg.block_size, "torch_dtype": cfg.dtype,
        **_token_ids(cfg),
    }


_MOE_EXPORTERS = {"qwen3_moe": _to_qwen3_moe, "sdar_moe": _to_qwen3_moe, "llada_moe": _to_llada_moe,
                  "llada2_moe": _to_llada2}
