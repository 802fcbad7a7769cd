"""Tiny random transformers models and checkpoint writers shared by the tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from flax import nnx

from dlmjax import arithmetic
from dlmjax.io.safetensors import save_file

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)


def randomize(model, seed: int = 0, scale: float = 0.2):
    """Give every parameter (biases and norm scales included) a random value, so that a
    dropped bias or a swapped norm cannot hide behind transformers' zero/one init."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model.eval()


def torch_model(kind: str, seed: int = 0, **overrides):
    """A random fp32 transformers model: kind in qwen3, qwen2, llama."""
    import torch
    from transformers import (
        LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    classes = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    kwargs = dict(TINY, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                  attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return randomize(model_cls(config_cls(**kwargs)), seed)


def additive_mask(kind: str, length: int, block_size: int = 4):
    """[1, 1, L, L] float mask (0 visible, finfo.min hidden) as transformers' eager attention adds it."""
    import torch

    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    visible = {
        "causal": k <= q,
        "bidirectional": np.ones((length, length), bool),
        "block_causal": (k // block_size) <= (q // block_size),
    }[kind]
    mask = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
    return torch.from_numpy(mask)[None, None]


def torch_logits(model, tokens: np.ndarray, mask_kind: str | None = None, block_size: int = 4) -> np.ndarray:
    import torch

    with torch.no_grad():
        kwargs = {}
        if mask_kind is not None:
            kwargs["attention_mask"] = additive_mask(mask_kind, tokens.shape[1], block_size).expand(
                tokens.shape[0], 1, -1, -1
            )
        return model(torch.from_numpy(tokens).long(), **kwargs).logits.float().numpy()


def write_checkpoint(out_dir: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def llada_tensors(llama_state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename a Llama state dict into LLaDA's `model.transformer.*` layout."""
    renames = {
        "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
        "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
        "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm",
    }
    out = {}
    for name, value in llama_state.items():
        if name == "model.embed_tokens.weight":
            out["model.transformer.wte.weight"] = value
        elif name == "model.norm.weight":
            out["model.transformer.ln_f.weight"] = value
        elif name == "lm_head.weight":
            out["model.transformer.ff_out.weight"] = value
        else:
            _, _, i, rest = name.split(".", 3)
            module, param = rest.rsplit(".", 1)
            out[f"model.transformer.blocks.{i}.{renames[module]}.{param}"] = value
    return out


def random_tokens(batch: int, length: int, vocab: int = 96, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)


@functools.partial(arithmetic.jit, static_argnums=0)  # keyed by the numerics and kernel mode, as the engine's
def _forward(graphdef, state, *args):
    return nnx.merge(graphdef, state)(*args)


def compiled_forward(module):
    """module(*args) as one compiled program per graph and argument shapes, for reference loops
    that call a model step after step: run eagerly, every step dispatches (and on a new shape
    compiles) each operation on its own, which made those loops most of the suite's time."""
    graphdef, state = nnx.split(module)
    return functools.partial(_forward, graphdef, state)
