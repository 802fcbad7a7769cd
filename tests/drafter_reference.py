"""An independent PyTorch reference drafter in the DFlash layout, from transformers' Qwen3 parts.

Written from the format's description (dlmjax.io.dflash's docstring), not from dlmjax's code:
transformers' Qwen3RMSNorm, Qwen3MLP, Qwen3RotaryEmbedding and rotate_half, and an explicit
eager attention with an additive float mask. It loads a DFlash directory by its published
tensor names, and runs greedy speculative decoding against a transformers causal model without
caches (every step recomputes the whole sequence), so it shares no cache logic with dlmjax.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dlmjax.io.safetensors import SafetensorsFile


def _rope(x, cos, sin):  # x [B, H, L, hd], cos/sin [B, L, hd]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RefAttention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)

    def forward(self, x, ctx, rope_x, rope_ctx, mask):
        b, l, _ = x.shape
        s = ctx.shape[1]
        heads = lambda t, n: t.view(b, t.shape[1], n, self.hd).transpose(1, 2)
        q = _rope(self.q_norm(heads(self.q_proj(x), self.h)), *rope_x)
        k_ctx = _rope(self.k_norm(heads(self.k_proj(ctx), self.hkv)), *rope_ctx)
        k_blk = _rope(self.k_norm(heads(self.k_proj(x), self.hkv)), *rope_x)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([heads(self.v_proj(ctx), self.hkv), heads(self.v_proj(x), self.hkv)], dim=2)
        rep = self.h // self.hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) * self.hd**-0.5 + mask[:, None]
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        assert out.shape[2] == l and k.shape[2] == s + l
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))


class RefLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = RefAttention(c)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = Qwen3MLP(c)

    def forward(self, x, ctx, rope_x, rope_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_x, rope_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDrafter(nn.Module):
    def __init__(self, raw: dict):
        super().__init__()
        params = dict(raw.get("rope_parameters") or {"rope_type": "default", **(raw.get("rope_scaling") or {}),
                                                     "rope_theta": raw["rope_theta"]})
        self.c = Qwen3Config(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"], vocab_size=raw["vocab_size"],
            rms_norm_eps=raw["rms_norm_eps"], rope_parameters=params, max_position_embeddings=raw["max_position_embeddings"],
            # the window as transformers (and the servers) read it: only with `use_sliding_window`
            use_sliding_window=raw.get("use_sliding_window", False), sliding_window=raw.get("sliding_window", 4096),
            layer_types=raw.get("layer_types"),
        )
        self.ids = list(raw["dflash_config"]["target_layer_ids"])
        self.mask_id = raw["dflash_config"]["mask_token_id"]
        self.block_size = raw["block_size"]
        self.layer_types, self.window = self.c.layer_types, self.c.sliding_window
        self.fc = nn.Linear(len(self.ids) * raw["hidden_size"], raw["hidden_size"], bias=False)
        self.hidden_norm = Qwen3RMSNorm(raw["hidden_size"], eps=raw["rms_norm_eps"])
        self.layers = nn.ModuleList([RefLayer(self.c) for _ in range(raw["num_hidden_layers"])])
        self.norm = Qwen3RMSNorm(raw["hidden_size"], eps=raw["rms_norm_eps"])
        self.rotary = Qwen3RotaryEmbedding(self.c)
        self.mask_embedding = None  # [D] where the drafter ships mask_embedding.pt

    @classmethod
    def load(cls, path) -> "RefDrafter":
        path = Path(path)
        model = cls(json.loads((path / "config.json").read_text()))
        f = SafetensorsFile(path / "model.safetensors")
        state = {k: torch.from_numpy(np.asarray(f.get(k)).astype(np.float32)) for k in f.keys()}
        model.load_state_dict(state, strict=True)
        if (path / "mask_embedding.pt").is_file():  # as vLLM reads it: a dict with `embedding`, or the tensor
            shipped = torch.load(path / "mask_embedding.pt", weights_only=True)
            model.mask_embedding = (shipped["embedding"] if isinstance(shipped, dict) else shipped).reshape(-1).float()
        return model.float().eval()

    def embed(self, target, block_ids):
        """The block's embeddings: the target's, with the shipped mask embedding at mask ids (vLLM)."""
        x = target.get_input_embeddings()(block_ids)
        if self.mask_embedding is None:
            return x
        return torch.where((block_ids == self.mask_id)[..., None], self.mask_embedding.to(x.dtype), x)

    def _mask(self, kind, q_pos, k_pos, k_is_ctx):
        """[L, S+L] additive mask for one row: every context key (all are before the block);
        every block key; sliding layers causal within their window."""
        d = q_pos[:, None] - k_pos[None, :]
        visible = torch.ones_like(d, dtype=torch.bool)
        if kind == "sliding_attention":
            visible = (d >= 0) & (d < self.window)
        return torch.where(visible, 0.0, torch.finfo(torch.float32).min)

    @torch.no_grad()
    def forward(self, feats, ctx_pos, block_embed, block_pos):
        """feats [1, S, n*D] (target hidden states at the ids), block_embed [1, L, D] -> normed [1, L, D]."""
        ctx = self.hidden_norm(self.fc(feats))
        rope_ctx = self.rotary(ctx, ctx_pos)
        rope_x = self.rotary(block_embed, block_pos)
        k_pos = torch.cat([ctx_pos[0], block_pos[0]])
        x = block_embed
        for kind, layer in zip(self.layer_types, self.layers):
            mask = self._mask(kind, block_pos[0], k_pos, None)[None]
            x = layer(x, ctx, rope_x, rope_ctx, mask)
        return self.norm(x)


@torch.no_grad()
def target_pass(target, ids_1l, layer_ids):
    out = target(ids_1l, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return out.logits, feats


@torch.no_grad()
def draft_logits(drafter: RefDrafter, target, feats, block_ids):
    """Draft logits [1, K, V] for block_ids [1, K] after a context of feats [1, S, n*D]."""
    s, k = feats.shape[1], block_ids.shape[1]
    ctx_pos = torch.arange(s)[None]
    block_pos = torch.arange(s, s + k)[None]
    h = drafter(feats, ctx_pos, drafter.embed(target, block_ids), block_pos)
    return target.lm_head(h)


@torch.no_grad()
def speculative_greedy(drafter: RefDrafter, target, prompt: list[int], max_new_tokens: int, block_size: int,
                       eos_ids=()):
    """Greedy DFlash decoding, batch 1, no caches. Returns (new tokens, per-step accepted lengths:
    accepted drafts + 1 bonus, cut at the first EOS and at max_new_tokens as DFlash's
    `acceptance_lengths` are; the first token from the prefill not counted)."""
    seq = torch.tensor([prompt])
    logits, _ = target_pass(target, seq, drafter.ids)
    out = [int(logits[0, -1].argmax())]
    steps = []
    while len(out) < max_new_tokens and not (set(out) & set(eos_ids)):
        committed = torch.tensor([prompt + out[:-1]])
        _, feats = target_pass(target, committed, drafter.ids)
        block = torch.tensor([[out[-1]] + [drafter.mask_id] * (block_size - 1)])
        draft = draft_logits(drafter, target, feats, block)[0, 1:].argmax(-1)
        block[0, 1:] = draft
        logits, _ = target_pass(target, torch.cat([committed, block], dim=1), drafter.ids)
        post = logits[0, -block_size:].argmax(-1)
        n = int((block[0, 1:] == post[:-1]).long().cumprod(0).sum())
        new = block[0, 1 : n + 1].tolist() + [int(post[n])]
        new = new[: max_new_tokens - len(out)]
        stops = [i for i, t in enumerate(new) if t in set(eos_ids)]
        new = new[: stops[0] + 1] if stops else new
        steps.append(len(new))
        out.extend(new)
    eos_at = [i for i, t in enumerate(out) if t in set(eos_ids)]
    if eos_at:
        out = out[: eos_at[0] + 1]
    return out[:max_new_tokens], steps
