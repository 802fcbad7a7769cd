"""Llama-architecture GGUF files -> Hugging Face checkpoint directories.

`convert_gguf(gguf_path, out_dir)` reads a llama.cpp GGUF file (e.g. a quantised SmolLM2 or
TinyLlama) and writes a directory that `dlmjax.load_model` and transformers'
`LlamaForCausalLM.from_pretrained` both read:

- `config.json`: a Llama config built from the GGUF metadata (`llama.*` hyperparameters,
  `tokenizer.ggml.*` special-token ids), `dtype` float32;
- `model.safetensors`: every tensor dequantised to float32 (with the `gguf` package) under its
  HF name. llama.cpp stores q/k projections with their rows permuted for its RoPE kernel; the
  permutation is undone here. There is no `lm_head.weight` when the GGUF has no `output.weight`
  (tied embeddings);
- tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat template,
  `special_tokens_map.json`), rebuilt from the GGUF vocabulary by transformers.

Dequantisation is exact (the float32 values the quantised blocks encode), so the converted
model reproduces the GGUF model's logits up to float32 rounding. Only the llama architecture is
supported; any tensor the converter does not recognise (e.g. llama3 `rope_freqs`) is an error
rather than silently dropped. Needs the torch extra: `pip install 'dlmjax[torch]'`.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np

from dlmjax.io.files import staged_dir, write_atomic
from dlmjax.io.safetensors import CheckpointError, save_file

TORCH_EXTRA_HINT = "install the torch extra: pip install 'dlmjax[torch]'"

# GGUF tensor name -> HF tensor name; `{i}` is the layer index.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
_PATTERNS = [
    (re.compile(re.escape(g).replace(r"\{i\}", r"(?P<i>\d+)")), hf) for g, hf in GGUF_TO_HF.items()
]


class GGUFError(CheckpointError):
    """A GGUF file that this converter cannot turn into a Llama checkpoint."""


def _require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the `gguf` package; {TORCH_EXTRA_HINT}") from e
    return gguf


# ----------------------------------------------------------------------------------------------
# Metadata


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader, key: str):
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"GGUF metadata lacks {key!r}, which a llama model needs")
    return value


def _count(reader, key: str, default=None) -> int:
    """An integer hyperparameter; a per-layer array (newer llama.cpp writers) of one value is that value."""
    value = _required(reader, key) if default is None else _field(reader, key, default)
    if isinstance(value, (list, tuple, np.ndarray)):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise GGUFError(f"GGUF metadata {key!r} differs between layers ({sorted(values)}); a llama model with "
                            "per-layer sizes is not supported")
        value = values.pop()
    return int(value)


def _f32(value) -> float:
    """GGUF floats are float32; keep the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _check_llama(reader, path: Path) -> None:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{path.name}: GGUF architecture is {arch!r}; only llama GGUFs are supported "
            "(general.architecture = 'llama')"
        )
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise GGUFError(f"{path.name}: rope scaling {scaling!r} is not supported (unscaled and linear RoPE are)")


def rope_parameters(reader) -> dict:
    """transformers' rope_parameters as llama.cpp reads the GGUF: the scaling type defaults to
    linear, its factor is `rope.scaling.factor` or the older `rope.scale_linear` (0 or absent:
    none), and type none never scales."""
    theta = _f32(_field(reader, "llama.rope.freq_base", 10000.0))
    factor = _field(reader, "llama.rope.scaling.factor")
    factor = float(_field(reader, "llama.rope.scale_linear", 0.0) if factor is None else factor)
    if _field(reader, "llama.rope.scaling.type") == "none" or factor in (0.0, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "rope_theta": theta, "factor": _f32(factor)}


def llama_config(reader, *, vocab_size: int, tied: bool) -> dict:
    """A transformers Llama config.json dict from the GGUF metadata."""
    hidden = _count(reader, "llama.embedding_length")
    n_heads = _count(reader, "llama.attention.head_count")
    head_dim = _count(reader, "llama.attention.key_length", hidden // n_heads)
    rope_dim = _count(reader, "llama.rope.dimension_count", head_dim)
    if _count(reader, "llama.attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"value heads of {_count(reader, 'llama.attention.value_length')} beside key heads of "
                        f"{head_dim} are not supported (a llama model's are equal)")
    if rope_dim != head_dim:
        raise GGUFError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _count(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _count(reader, "llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _count(reader, "llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(reader),
        "max_position_embeddings": _count(reader, "llama.context_length", 4096),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", eos),
        "dtype": "float32",
    }


# ----------------------------------------------------------------------------------------------
# Tensors


def hf_name(gguf_name: str) -> str:
    for pattern, template in _PATTERNS:
        m = pattern.fullmatch(gguf_name)
        if m is not None:
            return template.format(**m.groupdict())
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Llama counterpart; this converter does not support it")


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) -> HF's rotate-half order."""
    d_out, d_in = w.shape
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).swapaxes(1, 2).reshape(w.shape)


def dequantize(gguf, tensor) -> np.ndarray:
    """A GGUF tensor as float32 in torch layout (GGUF lists dims innermost first)."""
    try:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf package "
                        f"cannot dequantise ({e}); re-quantise the file to F32, F16 or Q8_0 (llama.cpp's "
                        "llama-quantize)") from e
    expected = tuple(int(d) for d in reversed(tensor.shape))
    if w.shape != expected:
        raise GGUFError(f"GGUF tensor {tensor.name!r}: dequantised to shape {w.shape}, expected {expected}")
    return np.ascontiguousarray(w, dtype=np.float32)


def llama_tensors(gguf, reader, config: dict) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantised under its HF name, q/k rows back in HF order."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        w = dequantize(gguf, tensor)
        proj = name.split(".")[-2]
        if proj in heads:
            w = unpermute_rope(w, heads[proj])
        tensors[name] = w
    return tensors


def _check_complete(tensors: dict, config: dict, path: Path) -> None:
    expected = {GGUF_TO_HF[k] for k in ("token_embd.weight", "output_norm.weight")}
    layer_names = [hf for g, hf in GGUF_TO_HF.items() if "{i}" in g]
    for i in range(config["num_hidden_layers"]):
        expected |= {t.format(i=i) for t in layer_names}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise GGUFError(f"{path.name}: tensors do not match llama.block_count={config['num_hidden_layers']}: "
                        f"missing {missing[:5]}, unexpected {extra[:5]}")


# ----------------------------------------------------------------------------------------------
# Tokenizer


def save_tokenizer(gguf_path: Path, out_dir: Path, vocab_size: int) -> None:
    """Rebuild the fast tokenizer from the GGUF vocabulary (via transformers) and save it.

    transformers is given a directory holding the GGUF alone: from the GGUF's own folder it would
    take any tokenizer.json lying there instead of the GGUF's vocabulary. A byte-level vocabulary
    without `<|endoftext|>` gets that token invented as a default (one id past the model's
    vocabulary); such tokens are dropped, and a tokenizer that still does not match the model's
    vocabulary is refused."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"converting a GGUF tokenizer needs transformers; {TORCH_EXTRA_HINT}") from e
    with tempfile.TemporaryDirectory() as alone:
        (Path(alone) / gguf_path.name).symlink_to(gguf_path.resolve())
        tok = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tok.save_pretrained(str(out_dir), save_jinja_files=False)
    invented = _drop_tokens_past(out_dir, vocab_size, in_use=_special_strings(tok.special_tokens_map))
    if len(tok) - len(invented) != vocab_size:
        raise GGUFError(f"{gguf_path.name}: its tokenizer has {len(tok) - len(invented)} tokens but token_embd has "
                        f"{vocab_size} rows; the file's vocabulary does not match its model")
    write_atomic(out_dir / "special_tokens_map.json", json.dumps(tok.special_tokens_map, indent=2) + "\n")


def _special_strings(special_tokens_map: dict) -> set:
    values = special_tokens_map.values()
    return {t for v in values for t in (v if isinstance(v, list) else [v]) if isinstance(t, str)}


def _drop_tokens_past(out_dir: Path, vocab_size: int, in_use: set) -> list[str]:
    """Remove the added tokens with ids >= `vocab_size` from the saved tokenizer files; returns
    their contents. One that a special token (bos, eos, ...) names is refused instead."""
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
    invented = [t["content"] for t in tokenizer.get("added_tokens", []) if t["id"] >= vocab_size]
    if not invented:
        return []
    if set(invented) & in_use:
        raise GGUFError(f"the GGUF's special tokens name {sorted(set(invented) & in_use)}, which its vocabulary of "
                        f"{vocab_size} does not hold")
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < vocab_size]
    write_atomic(out_dir / "tokenizer.json", json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {i: t for i, t in config.get("added_tokens_decoder", {}).items()
                                      if int(i) < vocab_size}
    write_atomic(config_path, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return invented


# ----------------------------------------------------------------------------------------------
# Entry point


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama GGUF file into a float32 HF checkpoint directory; returns `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    gguf = _require_gguf()
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on a bad file
        raise GGUFError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    _check_llama(reader, gguf_path)
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{gguf_path.name}: no token_embd.weight tensor")
    config = llama_config(reader, vocab_size=int(embed.shape[-1]), tied="output.weight" not in names)
    tensors = llama_tensors(gguf, reader, config)
    _check_complete(tensors, config, gguf_path)

    from dlmjax.io.hf import check_export_target

    check_export_target(out_dir)
    with staged_dir(out_dir, keep_existing=True) as stage:  # a failed conversion leaves nothing that loads
        write_atomic(stage / "config.json", json.dumps(config, indent=2) + "\n")
        save_file(tensors, stage / "model.safetensors", metadata={"format": "pt"})
        save_tokenizer(gguf_path, stage, config["vocab_size"])
    return out_dir
