"""An independent PyTorch reference of an exported MRP head, from the specification.

Written from docs/ALGORITHMS.md section 1 and the interop names, not from dlmjax's
code: one module is

    x   = eh_proj([enorm(embed(tokens)) ; hnorm(h)])      (embedding half first)
    x   = N backbone-style decoder layers (transformers' Qwen3DecoderLayer, eager attention,
          an additive float mask: the backbone's block-causal topology)
    h_p = norm(x)

and a chain step k (module min(k, M - 1)) gives logits_k = logits_{k-1} + s * lm_head(h_p) and
h_k = h_{k-1} + s * h_p. It reads the checkpoint directory as PyTorch would: config.json, the
backbone's `model.embed_tokens.weight` / `lm_head.weight` and the head's
`mrp_modules.{m}.model.{enorm,hnorm,eh_proj,layers.{j}.*,norm}` tensors, through the small
safetensors reader below (the format's 8-byte header length, JSON header, raw little-endian data),
which shares nothing with dlmjax.io.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding


_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "BOOL": np.bool_}


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file (bf16 widened exactly to fp32)."""
    raw = Path(path).read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    data, out = raw[8 + size:], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        chunk = data[start:end]
        if info["dtype"] == "BF16":  # the top half of an fp32
            array = (np.frombuffer(chunk, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(chunk, _DTYPES[info["dtype"]])
        out[name] = torch.from_numpy(array.reshape(info["shape"]).copy())
    return out


def _tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(ckpt_dir.glob("*.safetensors")):
        out.update(read_safetensors(file))
    return out


def qwen3_config(raw: dict) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"], rms_norm_eps=raw["rms_norm_eps"],
        rope_parameters={"rope_type": "default",  # transformers 5 writes rope_parameters, earlier rope_theta
                         "rope_theta": (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 1e4))},
        max_position_embeddings=raw["max_position_embeddings"],
        attention_bias=raw.get("attention_bias", False), tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )
    config._attn_implementation = "eager"
    return config


class RefMRPModule(nn.Module):
    def __init__(self, c: Qwen3Config, num_layers: int):
        super().__init__()
        d = c.hidden_size
        self.enorm = Qwen3RMSNorm(d, eps=c.rms_norm_eps)
        self.hnorm = Qwen3RMSNorm(d, eps=c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(c, layer_idx=j) for j in range(num_layers)])
        self.norm = Qwen3RMSNorm(d, eps=c.rms_norm_eps)

    def forward(self, embeds, hidden, rope, mask_4d):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, attention_mask=mask_4d, position_embeddings=rope)
        return self.norm(x)


class RefMRPHead(nn.Module):
    def __init__(self, raw_config: dict, num_modules: int, num_layers: int):
        super().__init__()
        self.config = qwen3_config(raw_config)
        self.scale = float(raw_config.get("mrp_residual_scale", 1.0))
        self.mrp_modules = nn.ModuleList([RefMRPModule(self.config, num_layers) for _ in range(num_modules)])
        self.rotary = Qwen3RotaryEmbedding(self.config)
        self.embed = nn.Embedding(self.config.vocab_size, self.config.hidden_size)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    @classmethod
    def load(cls, ckpt_dir) -> "RefMRPHead":
        ckpt_dir = Path(ckpt_dir)
        raw = json.loads((ckpt_dir / "config.json").read_text())
        tensors = _tensors(ckpt_dir)
        names = [n for n in tensors if n.startswith("mrp_modules.")]
        num_modules = 1 + max(int(n.split(".")[1]) for n in names)
        num_layers = 1 + max(int(m.group(1)) for n in names if (m := re.search(r"\.model\.layers\.(\d+)\.", n)))
        head = cls(raw, num_modules, num_layers)
        state = {n.replace(".model.", ".", 1): t for n, t in tensors.items() if n.startswith("mrp_modules.")}
        state["embed.weight"] = tensors["model.embed_tokens.weight"]
        state["lm_head.weight"] = tensors["model.embed_tokens.weight" if head.config.tie_word_embeddings
                                          else "lm_head.weight"]
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        assert not missing and not unexpected, (missing, unexpected)
        return head.float().eval()

    def chain(self, states, hidden, logits, position_ids, mask_4d):
        """Logits after each chain step: step k reads tokens `states[k]` [B, L] and h_{k-1}."""
        rope = self.rotary(hidden, position_ids)
        out = []
        for k, tokens in enumerate(states):
            module = self.mrp_modules[min(k, len(self.mrp_modules) - 1)]
            h_p = module(self.embed(tokens), hidden, rope, mask_4d)
            logits = logits + self.scale * self.lm_head(h_p)
            hidden = hidden + self.scale * h_p
            out.append(logits)
        return out
