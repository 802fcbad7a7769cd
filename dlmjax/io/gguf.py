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
from pathlib import Path

import numpy as np

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
    if scaling not in (None, "none"):
        raise GGUFError(f"{path.name}: rope scaling {scaling!r} is not supported (only unscaled RoPE)")


def llama_config(reader, *, vocab_size: int, tied: bool) -> dict:
    """A transformers Llama config.json dict from the GGUF metadata."""
    hidden = int(_required(reader, "llama.embedding_length"))
    n_heads = int(_required(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // n_heads))
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0))},
        "max_position_embeddings": int(_field(reader, "llama.context_length", 4096)),
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
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
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


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Rebuild the fast tokenizer from the GGUF vocabulary (via transformers) and save it."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(f"converting a GGUF tokenizer needs transformers; {TORCH_EXTRA_HINT}") from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    (out_dir / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens_map, indent=2) + "\n")


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

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(gguf_path, out_dir)
    return out_dir
