"""Drafters in the DFlash checkpoint format (z-lab/dflash; loaded natively by vLLM and SGLang).

A DFlash directory holds config.json and model.safetensors:

- config.json: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"` and Qwen3's fields
  (hidden_size, num_hidden_layers, heads, head_dim, intermediate_size, rms_norm_eps, rope_theta
  with rope_scaling, or rope_parameters: plain, linear or llama3 RoPE (a Llama 3.1 target's drafter
  carries its llama3 scaling), layer_types, sliding_window with use_sliding_window (without it transformers,
  and the servers after it, drop the window), dtype, ...), plus `block_size`,
  `num_target_layers` and `dflash_config: {target_layer_ids, mask_token_id}`. As SGLang reads it,
  `block_size`, `num_target_layers` and `target_layer_ids` may stand at the top level or inside
  `dflash_config` (both places must agree), and `dflash_config.mask_token` (default `<|MASK|>`)
  may replace `mask_token_id`: the id is then the target tokenizer's for that token, or the id
  adding it to the tokenizer gives (its size), so such a drafter loads with its target.
- weights: `fc.weight` [D, n_ids * D], `hidden_norm.weight`, `norm.weight` and per layer
  `layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
  self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight`. No embedding, no lm_head.
- optionally `mask_embedding.pt` (torch.save of `{"mask_token_id", "embedding"}` or of a bare
  [D] tensor): the drafter's own embedding of the mask token, used in place of the target's row,
  as vLLM does. It is read, kept with the drafter and written back.

Translation is strict both ways: an unknown key or a missing required key is an error naming it.
Keys that carry no numerics (transformers bookkeeping, token ids) are kept verbatim, so a
published config.json converts to `DrafterConfig` and back unchanged, each key where it stood.
When `target_layer_ids` is absent the ids are DFlash's default (evenly over [1, N - 3]); they and
`dflash_config.mask_token_id` are always written (vLLM reads the id nowhere else).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax.config import DTYPES, ConfigError, ModelConfig, rope_fields, rope_keys, rope_parameters
from dlmjax.heads.drafter import (
    FULL, SLIDING, Drafter, DrafterConfig, MaskEmbedding, abstract_drafter, check_compatible,
    default_target_layer_ids,
)
from dlmjax.io.files import write_atomic
from dlmjax.io.hf import (
    TRANSPOSE, FusedParams, KeyRule, expected_fields, gate_up_parts, layer_rules, naming_the_file, open_shards,
    qkv_parts, read_config, tensor_shape, to_hf_tensors,
)
from dlmjax.io.safetensors import CheckpointError, save_file
from dlmjax.io.tokenizer import Tokenizer, load_tokenizer
from dlmjax.io.torch_file import read_pt, write_pt
from dlmjax.validation import AT_LEAST_1, check_value

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_FILE = "model.safetensors"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
DRAFTER_SUBDIR = "drafter"  # where a drafter stored beside its target lives

# ----------------------------------------------------------------------------------------------
# config.json <-> DrafterConfig

_REQUIRED = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
    "num_target_layers",
)
# Keys a config gives at the top level or inside dflash_config (SGLang reads both places), and
# where dlmjax writes each when the config it came from does not say.
_EITHER_PLACE = {"block_size": "top", "num_target_layers": "top", "target_layer_ids": "dflash_config"}
_NUMERIC = set(_REQUIRED) | set(_EITHER_PLACE) | {"dflash_config",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "dtype", "torch_dtype",
    "attention_bias", "attention_dropout", "hidden_act",
}
# Kept verbatim, never read: transformers bookkeeping and the target's token ids.
_PASSTHROUGH = {
    "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "transformers_version",
    "use_cache", "tie_word_embeddings", "_name_or_path", "output_hidden_states", "return_dict",
}
_DFLASH_KEYS = {*_EITHER_PLACE, "mask_token_id", "mask_token"}
DEFAULT_MASK_TOKEN = "<|MASK|>"  # SGLang's (and z-lab's demo's) mask token where dflash_config names none


def _rope(raw: dict) -> dict:
    """DrafterConfig's RoPE fields, read as a target's (`config.rope_fields`: plain, linear or llama3;
    transformers' Qwen3 rotary embedding, which DFlash drafters use, reads the same keys)."""
    params = raw.get("rope_parameters")
    if "rope_theta" not in raw and not (isinstance(params, dict) and "rope_theta" in params):
        raise ConfigError("drafter config.json is missing `rope_theta` (or `rope_parameters.rope_theta`)")
    return rope_fields(raw)


def _rope_keys(cfg: DrafterConfig, verbatim: dict) -> dict:
    """config.json's RoPE keys of `cfg`, taken out of `verbatim`: as the file read had them where they
    still say what `cfg` says (rope_theta 1000000 stays an int), else rope_theta and rope_scaling
    (transformers 4 and 5 both read that spelling)."""
    given = {key: verbatim.pop(key) for key in ("rope_theta", "rope_scaling", "rope_parameters") if key in verbatim}
    if given and rope_fields(given) == rope_fields({"rope_parameters": rope_parameters(cfg)}):
        return given
    return rope_keys(cfg)


log = logging.getLogger(__name__)
LAST_LAYER_WARNING = (
    "the drafter written to %s reads the target's last layer (target_layer_ids holds %d, num_target_layers - 1): "
    "dlmjax, transformers and z-lab's code feed it the final-normed hidden state, vLLM the residual before the "
    "norm (other drafts, no error) and SGLang refuses it; for those servers train with ids below %d")

# Qwen3Config's default `sliding_window`; it keeps a window only where `use_sliding_window` is true
_QWEN3_DEFAULT_WINDOW = 4096
# Qwen3Config's default `max_position_embeddings`
_QWEN3_DEFAULT_POSITIONS = 32768


def _sliding_window(raw: dict) -> int | None:
    """The window as transformers' Qwen3Config reads it (and vLLM, SGLang and z-lab after it):
    `sliding_window` (default 4096) where `use_sliding_window` is true, else none."""
    return raw.get("sliding_window", _QWEN3_DEFAULT_WINDOW) if raw.get("use_sliding_window") else None


def _layer_types(raw: dict, n: int) -> tuple[str, ...]:
    if "layer_types" in raw and raw["layer_types"] is not None:
        return tuple(raw["layer_types"])
    # transformers' Qwen3Config rule when layer_types is absent
    window, first_sliding = _sliding_window(raw), raw.get("max_window_layers", n)
    return tuple(SLIDING if window is not None and i >= first_sliding else FULL for i in range(n))


def _either_place(raw: dict, dcfg: dict, key: str):
    """`key`'s value at the top level or inside dflash_config (SGLang reads both); None where
    neither gives it. Where both do, they must agree."""
    if key in raw and key in dcfg and raw[key] != dcfg[key]:
        raise ConfigError(f"{key} {raw[key]!r} and dflash_config.{key} {dcfg[key]!r} disagree; keep one of them")
    return dcfg[key] if key in dcfg else raw.get(key)


def _mask_token_id(dcfg: dict, vocab_size, tokenizer: Tokenizer | None):
    """dflash_config.mask_token_id; without it the id SGLang gives dflash_config.mask_token
    (default <|MASK|>): the target tokenizer's id of that token, else the id adding it to the
    tokenizer gives (the tokenizer's size), which must stay inside the target's vocab_size."""
    token = dcfg.get("mask_token", DEFAULT_MASK_TOKEN)
    if not isinstance(token, str) or not token:
        raise ConfigError(f"dflash_config.mask_token={token!r} must be a token's text, e.g. {DEFAULT_MASK_TOKEN!r}")
    if "mask_token_id" in dcfg:
        return dcfg["mask_token_id"]
    if tokenizer is None:
        raise ConfigError(
            f"drafter config.json has no `dflash_config.mask_token_id`, so the mask id is the target tokenizer's for "
            f"mask_token {token!r}: load the drafter with its target (`dlmjax generate TARGET --drafter DIR`, "
            "`load_drafter(DIR, target_dir=TARGET)`), or write the id into dflash_config.mask_token_id")
    found = tokenizer.token_to_id(token)
    mask_id = tokenizer.vocab_size if found is None else found
    if mask_id >= vocab_size:
        raise ConfigError(
            f"the target's tokenizer has no token {token!r}, and adding it would give id {mask_id}, outside "
            f"vocab_size {vocab_size}: set dflash_config.mask_token_id to an unused id below {vocab_size}, or "
            "dflash_config.mask_token to a token the tokenizer has")
    return mask_id


def from_dflash_config(raw: dict, tokenizer: Tokenizer | None = None) -> DrafterConfig:
    """config.json dict -> DrafterConfig (strict). Keys without numerics ride along in
    `hf_extra`, so `to_dflash_config` writes the same dict back. `tokenizer` (the target's)
    gives the mask id of a config that names only dflash_config.mask_token."""
    unknown = sorted(set(raw) - _NUMERIC - _PASSTHROUGH)
    if unknown:
        raise ConfigError(
            f"unknown drafter config keys {unknown}: dlmjax refuses keys it does not implement; "
            f"known keys: {sorted(_NUMERIC | _PASSTHROUGH)}"
        )
    dcfg = raw.get("dflash_config")
    if "dflash_config" in raw and not isinstance(dcfg, dict):
        raise ConfigError(f"config key `dflash_config` must be an object, got {dcfg!r}")
    dcfg = dcfg or {}
    missing = [k for k in _REQUIRED if k not in raw and not (k in _EITHER_PLACE and k in dcfg)]
    if missing:
        raise ConfigError(f"drafter config.json is missing required keys {missing} (DFlash format; "
                          f"{', '.join(_EITHER_PLACE)} may also stand inside dflash_config)")
    if raw["architectures"] != [ARCHITECTURE]:
        raise ConfigError(f"config key `architectures` = {raw['architectures']!r}; a DFlash drafter has [{ARCHITECTURE!r}]")
    if raw["model_type"] != "qwen3":
        raise ConfigError(f"config key `model_type` = {raw['model_type']!r}; DFlash drafter layers are qwen3")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config key `hidden_act` = {raw['hidden_act']!r}; only silu is implemented")
    if raw.get("attention_bias", False):
        raise ConfigError("config key `attention_bias` = true is not supported for drafters; set false")
    if raw.get("attention_dropout", 0.0) not in (0, 0.0):
        raise ConfigError(f"config key `attention_dropout` = {raw['attention_dropout']}; dlmjax has no dropout, set 0.0")
    unknown = sorted(set(dcfg) - _DFLASH_KEYS)
    if unknown:
        raise ConfigError(f"unknown dflash_config keys {unknown}; known: {sorted(_DFLASH_KEYS)}")
    block_size, num_target_layers, ids = (_either_place(raw, dcfg, key) for key in _EITHER_PLACE)
    if raw.get("dtype") and raw.get("torch_dtype") and raw["dtype"] != raw["torch_dtype"]:
        raise ConfigError(f"config keys `dtype` ({raw['dtype']!r}) and `torch_dtype` ({raw['torch_dtype']!r}) "
                          "disagree; keep one of them")
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPES:
        raise ConfigError(f"config key `dtype` = {dtype!r}; supported: {', '.join(DTYPES)}")
    # the defaults below count with these
    check_value("config key `num_hidden_layers`", raw["num_hidden_layers"], "int", AT_LEAST_1, error=ConfigError)
    check_value("config key `num_target_layers`", num_target_layers, "int", AT_LEAST_1, error=ConfigError)
    n = raw["num_hidden_layers"]
    layer_types, window = _layer_types(raw, n), _sliding_window(raw)
    if SLIDING in layer_types and window is None:
        raise ConfigError(
            "layer_types names sliding_attention layers but `use_sliding_window` is not true: transformers then "
            "drops the window (vLLM and SGLang refuse such a drafter); set `use_sliding_window: true` and "
            "`sliding_window`, or make those layers full_attention"
        )
    if ids is None:
        ids = default_target_layer_ids(num_target_layers, n)
    elif not isinstance(ids, list):
        raise ConfigError(f"dflash_config.target_layer_ids={ids!r} must be a list of target layer numbers")
    elif not ids:
        raise ConfigError("dflash_config.target_layer_ids is empty: list the target layers the drafter reads, or "
                          "remove the key for DFlash's default")
    cfg = DrafterConfig(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_layers=n,
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        vocab_size=raw["vocab_size"], num_target_layers=num_target_layers, target_layer_ids=tuple(ids),
        mask_token_id=_mask_token_id(dcfg, raw["vocab_size"], tokenizer), block_size=block_size,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), **_rope(raw),
        max_position_embeddings=raw.get("max_position_embeddings", _QWEN3_DEFAULT_POSITIONS), layer_types=layer_types,
        sliding_window=window if SLIDING in layer_types else None, dtype=dtype,
    )
    # Everything except the fields DrafterConfig owns is written back as it was read.
    owned = {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "dflash_config", "rms_norm_eps", "max_position_embeddings", "layer_types", "dtype",
        "torch_dtype", "architectures", "model_type", *_EITHER_PLACE,
    }
    verbatim = {k: v for k, v in raw.items() if k not in owned}
    places = {key: [place for place, where in (("top", raw), ("dflash_config", dcfg)) if key in where]
              for key in _EITHER_PLACE}
    verbatim["_places"] = {key: where for key, where in places.items() if where and where != [_EITHER_PLACE[key]]}
    if "mask_token" in dcfg:
        verbatim["_mask_token"] = dcfg["mask_token"]
    verbatim["_dtype_keys"] = [key for key in ("dtype", "torch_dtype") if key in raw] or ["dtype"]  # written back
    return cfg.replace(hf_extra=tuple((k, json.dumps(v)) for k, v in sorted(verbatim.items())))


def to_dflash_config(cfg: DrafterConfig) -> dict:
    """DrafterConfig -> config.json dict (the inverse of `from_dflash_config`)."""
    verbatim = {k: json.loads(v) for k, v in cfg.hf_extra}
    places = {key: [default] for key, default in _EITHER_PLACE.items()} | verbatim.pop("_places", {})
    mask_token = verbatim.pop("_mask_token", None)
    dtype_keys = verbatim.pop("_dtype_keys", ["dtype"])
    dflash: dict[str, Any] = {"mask_token_id": cfg.mask_token_id}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types), **{key: cfg.dtype for key in dtype_keys}, "dflash_config": dflash,
    }
    values = {"block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
              "target_layer_ids": list(cfg.target_layer_ids)}
    for key, value in values.items():
        for place in places[key]:
            (out if place == "top" else dflash)[key] = value
    out.update(_rope_keys(cfg, verbatim))
    if SLIDING in cfg.layer_types:  # transformers (and the servers after it) keep the window only with the switch
        out["sliding_window"], out["use_sliding_window"] = cfg.sliding_window, True
        for key in ("sliding_window", "use_sliding_window"):
            verbatim.pop(key, None)
    defaults = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rope_scaling": None,
                "tie_word_embeddings": False, "use_cache": True}
    for key, value in defaults.items():
        out.setdefault(key, value)
    out.update(verbatim)
    return out


# ----------------------------------------------------------------------------------------------
# Weights


DFLASH_RULES: tuple[KeyRule, ...] = (
    KeyRule("fc.weight", "fc.kernel", TRANSPOSE),
    KeyRule("hidden_norm.weight", "hidden_norm.scale"),
    KeyRule("norm.weight", "norm.scale"),
    *layer_rules("layers.{i}.", {
        "input_layernorm.weight": "attn_norm.scale",
        "post_attention_layernorm.weight": "mlp_norm.scale",
        **qkv_parts("self_attn.{p}_proj.weight", "attn.qkv.kernel"),
        "self_attn.o_proj.weight": "attn.o.kernel",
        "self_attn.q_norm.weight": "attn.q_norm.scale",
        "self_attn.k_norm.weight": "attn.k_norm.scale",
        **gate_up_parts({"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"}, "mlp.gate_up.kernel"),
        "mlp.down_proj.weight": "mlp.down.kernel",
    }),
)


def _flat(state) -> dict[str, nnx.Variable]:
    return {".".join(str(k) for k in path): var for path, var in nnx.to_flat_state(state)}


def _rule_for_hf(name: str) -> KeyRule | None:
    return next((r for r in DFLASH_RULES if r.match_hf(name) is not None), None)


def load_drafter(ckpt_dir: str | Path, target_config: ModelConfig | None = None, *, dtype: str | None = None,
                 target_dir: str | Path | None = None) -> Drafter:
    """Read a DFlash drafter directory (a published one as it is). With `target_config`, refuse a
    drafter made for another target (both values named). `dtype` overrides the parameter dtype.
    `target_dir`: the target's checkpoint, whose tokenizer gives the mask id of a config that
    names only `dflash_config.mask_token` (read only then)."""
    ckpt_dir = Path(ckpt_dir)
    with naming_the_file(ckpt_dir):
        raw = read_config(ckpt_dir)
        dcfg = raw.get("dflash_config")
        names_no_id = not (isinstance(dcfg, dict) and "mask_token_id" in dcfg)
        tokenizer = load_tokenizer(target_dir) if target_dir is not None and names_no_id else None
        cfg = from_dflash_config(raw, tokenizer)
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    if target_config is not None:
        check_compatible(cfg, target_config)
    graphdef, abstract_state = nnx.split(abstract_drafter(cfg))
    expected = _flat(abstract_state)
    loaded: dict[str, jax.Array] = {}
    seen: set[tuple[str, str]] = set()  # (param, part)
    fused = FusedParams(cfg)
    for name, shard in open_shards(ckpt_dir).items():
        rule = _rule_for_hf(name)
        if rule is None:
            raise CheckpointError(
                f"tensor {name!r} in {shard.path.name} is not a DFlash drafter weight "
                "(expected fc, hidden_norm, norm and layers.{i}.* in Qwen3 names; no embedding or lm_head)"
            )
        path = rule.match_hf(name)
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} has no place in a drafter with num_hidden_layers={cfg.num_layers}")
        if (path, rule.part) in seen:
            raise CheckpointError(f"duplicate tensor {name!r}")
        seen.add((path, rule.part))
        array = rule.transform.to_jax(np.asarray(shard.get(name)))
        want = tensor_shape(rule, expected[path].shape, cfg)
        if tuple(array.shape) != want:
            torch_shape = tuple(reversed(want)) if rule.transform is TRANSPOSE else want
            raise CheckpointError(
                f"shape mismatch for {name!r}: checkpoint {tuple(np.asarray(shard.get(name)).shape)}, config expects "
                f"{torch_shape}{expected_fields(rule)} (hidden_size={cfg.hidden_size}, "
                f"{len(cfg.target_layer_ids)} target_layer_ids)"
            )
        param = fused.add(rule, path, array)
        if param is not None:
            loaded[path] = jnp.asarray(param.astype(jnp.dtype(cfg.dtype)))
    missing = set(expected) - set(loaded)
    if missing:
        names = fused.missing(missing, DFLASH_RULES)
        raise CheckpointError(f"drafter checkpoint {ckpt_dir} is missing tensors {names[:8]}")
    state = nnx.from_flat_state(
        [(tuple(int(k) if k.isdigit() else k for k in p.split(".")), expected[p].replace(loaded[p])) for p in expected]
    )
    drafter = nnx.merge(graphdef, state)
    mask_embedding = read_mask_embedding(ckpt_dir, cfg)
    if mask_embedding is not None:
        drafter.mask_embedding = MaskEmbedding(jnp.asarray(mask_embedding, jnp.dtype(cfg.dtype)))
    return drafter


def read_mask_embedding(ckpt_dir: Path, cfg: DrafterConfig) -> np.ndarray | None:
    """The drafter's own mask embedding [D] from `mask_embedding.pt`, or None without the file."""
    path = ckpt_dir / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    value = read_pt(path)
    if isinstance(value, dict):
        if "embedding" not in value:
            raise CheckpointError(f"{path} holds a dict with keys {sorted(value)}; a mask embedding file has "
                                  "`embedding` (and `mask_token_id`)")
        mask_token_id = value.get("mask_token_id", cfg.mask_token_id)
        if isinstance(mask_token_id, np.ndarray) and mask_token_id.shape == () and mask_token_id.dtype.kind == "i":
            mask_token_id = int(mask_token_id)  # saved as a 0-d torch tensor
        if mask_token_id != cfg.mask_token_id:
            raise CheckpointError(f"{path} is for mask_token_id {mask_token_id}, but config.json's "
                                  f"dflash_config.mask_token_id is {cfg.mask_token_id}")
        value = value["embedding"]
    if not isinstance(value, np.ndarray) or value.size != cfg.hidden_size:
        got = f"shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
        raise CheckpointError(f"{path} holds {got}; a mask embedding has hidden_size={cfg.hidden_size} values")
    return value.reshape(-1)


def save_drafter(drafter: Drafter, out_dir: str | Path, *, dtype: str | None = "bfloat16") -> Path:
    """Write `drafter` as a DFlash directory (config.json + model.safetensors, PyTorch names).
    `dtype` (default bfloat16, what vLLM/SGLang serve) or None to keep the parameters' dtype."""
    out_dir = Path(out_dir)
    if (out_dir / WEIGHTS_FILE).exists():
        raise CheckpointError(f"{out_dir} already holds {WEIGHTS_FILE}; save the drafter into an empty or new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    if cfg.num_target_layers - 1 in cfg.target_layer_ids:
        log.warning(LAST_LAYER_WARNING, out_dir, cfg.num_target_layers - 1, cfg.num_target_layers - 1)
    tensors: dict[str, np.ndarray] = {}
    for path, var in sorted(_flat(nnx.state(drafter, nnx.Param)).items()):
        value = jax.device_get(var[...])
        if dtype is not None:
            value = jnp.asarray(value).astype(jnp.dtype(dtype))
        tensors.update(to_hf_tensors(path, np.asarray(value), DFLASH_RULES, cfg))
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    if drafter.mask_embedding is not None:
        value = jnp.asarray(jax.device_get(drafter.mask_embedding[...]))
        value = np.asarray(value if dtype is None else value.astype(jnp.dtype(dtype)))
        write_pt(out_dir / MASK_EMBEDDING_FILE, {"mask_token_id": cfg.mask_token_id, "embedding": value})
    written = cfg if dtype is None else cfg.replace(dtype=dtype)
    config = to_dflash_config(written)
    write_atomic(out_dir / "config.json", json.dumps(config, indent=2))
    return out_dir


def find_drafter_dir(target_dir: str | Path) -> Path | None:
    """A drafter stored beside its target: `<target_dir>/drafter/` with a DFlash config.json."""
    d = Path(target_dir) / DRAFTER_SUBDIR
    return d if (d / "config.json").is_file() else None


def resolve_drafter(target_dir: str | Path | None, target_config: ModelConfig, drafter_dir: str | Path | None = None,
                    *, dtype: str | None = None) -> Drafter:
    """The drafter for a target: `drafter_dir` if given (the CLI's `--drafter DIR`), else the one
    stored beside the target (`<target_dir>/drafter/`). Refuses a drafter for another target."""
    if drafter_dir is None:
        found = None if target_dir is None else find_drafter_dir(target_dir)
        if found is None:
            where = f"{Path(target_dir) / DRAFTER_SUBDIR}" if target_dir is not None else "beside the target"
            raise CheckpointError(
                f"decoder `drafter` needs a drafter, and there is none in {where}; pass --drafter DIR "
                "(a DFlash directory: config.json with architectures [\"DFlashDraftModel\"] + model.safetensors)"
            )
        drafter_dir = found
    return load_drafter(drafter_dir, target_config, dtype=dtype, target_dir=target_dir)


__all__ = [
    "ARCHITECTURE", "DEFAULT_MASK_TOKEN", "DFLASH_RULES", "DRAFTER_SUBDIR", "MASK_EMBEDDING_FILE", "find_drafter_dir",
    "from_dflash_config", "load_drafter", "read_mask_embedding", "resolve_drafter", "save_drafter", "to_dflash_config",
]
