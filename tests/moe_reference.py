"""A small PyTorch reference of LLaDA-MoE-7B-A1B and LLaDA2.x, built from transformers components, for
parity tests (the authors' modeling files are remote code that needs vLLM/flash-attn; this follows them).

Both are pre-norm stacks of attention with per-head q/k RMSNorm and (partial) rotate-half RoPE, and a
MoE block whose experts run one by one over the tokens routed to them (index_add, as the modeling
code does):
- llada_moe: q/k/v/o projections; router softmax over all experts in fp32, top-k, never
  renormalised; the shared expert (if any) sits beside the MoE block (`layers.{i}.shared_expert`);
- llada2: a fused `query_key_value` projection split by heads [q heads | k heads | v heads],
  `dense` output projection (bias `use_bias`), `query_layernorm`/`key_layernorm`; the router is
  LLaDA2's gate (`Llada2Gate`: sigmoid, expert bias, group-limited with the excluded groups at -inf,
  scaled); the first `first_k_dense_replace` layers are dense; `mlp.shared_experts` is added to the
  routed output.
state_dict() names are the families' published checkpoint names.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeRMSNorm, rotate_half

NAMES = {
    "llada_moe": dict(embed="embed_tokens", attn="self_attn", out="o_proj", q_norm="q_norm", k_norm="k_norm"),
    "llada2": dict(embed="word_embeddings", attn="attention", out="dense", q_norm="query_layernorm",
                   k_norm="key_layernorm"),
}


def mlp(c: dict, width: int) -> nn.Module:
    return Qwen3MoeMLP(Qwen3MoeConfig(hidden_size=c["hidden"], hidden_act="silu"), intermediate_size=width)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        names, d, hd = NAMES[c["family"]], c["hidden"], c["head_dim"]
        self.c, self.names = c, names
        if c["family"] == "llada2":
            self.query_key_value = nn.Linear(d, (c["heads"] + 2 * c["kv_heads"]) * hd, bias=c["qkv_bias"])
        else:
            self.q_proj = nn.Linear(d, c["heads"] * hd, bias=c["qkv_bias"])
            self.k_proj = nn.Linear(d, c["kv_heads"] * hd, bias=c["qkv_bias"])
            self.v_proj = nn.Linear(d, c["kv_heads"] * hd, bias=c["qkv_bias"])
        setattr(self, names["out"], nn.Linear(c["heads"] * hd, d, bias=c["o_bias"]))
        setattr(self, names["q_norm"], Qwen3MoeRMSNorm(hd, eps=c["eps"]))
        setattr(self, names["k_norm"], Qwen3MoeRMSNorm(hd, eps=c["eps"]))

    def forward(self, x, cos, sin, mask):
        c, b, l = self.c, x.shape[0], x.shape[1]
        h, hkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
        if c["family"] == "llada2":
            q, k, v = self.query_key_value(x).view(b, l, h + 2 * hkv, hd).split([h, hkv, hkv], dim=2)
        else:
            q = self.q_proj(x).view(b, l, h, hd)
            k, v = self.k_proj(x).view(b, l, hkv, hd), self.v_proj(x).view(b, l, hkv, hd)
        q = getattr(self, self.names["q_norm"])(q).transpose(1, 2)
        k = getattr(self, self.names["k_norm"])(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(hd) + mask
        out = torch.softmax(scores, dim=-1, dtype=torch.float32) @ v
        return getattr(self, self.names["out"])(out.transpose(1, 2).reshape(b, l, h * hd))


def rope(x, cos, sin):
    """transformers' partial rotary: rotate-half over the first cos.shape[-1] dims, the rest passes."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class Router(nn.Module):
    """LLaDA-MoE's gate: softmax in fp32 over all experts, top-k, no renormalisation."""

    def __init__(self, c: dict):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c["experts"], c["hidden"]))
        self.top_k = c["top_k"]

    def forward(self, x):
        probs = torch.softmax(x @ self.weight.T, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return None, weights, experts


class Llada2Gate(nn.Module):
    """LLaDA2's gate (modeling_llada2_moe.py), written out here rather than taken from transformers'
    DeepseekV3TopkRouter, whose older releases fill the excluded groups with 0.0 instead of -inf: with
    a negative expert bias those differ (an excluded expert's 0.0 beats a kept group's negative scores).

    Scores are sigmoids of the fp32 logits; the expert bias shifts them for the choice only. A group
    scores the sum of its two best biased scores; the `topk_group` best groups stay and every expert
    of the others is set to -inf; the top-k of what is left are picked, weighted by their unbiased
    scores, renormalised whenever k > 1 and multiplied by `routed_scaling_factor`."""

    def __init__(self, c: dict):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c["experts"], c["hidden"]))
        self.register_buffer("expert_bias", torch.zeros(c["experts"]))
        self.top_k, self.groups, self.keep, self.scale = c["top_k"], c["n_group"], c["topk_group"], c["scale"]

    def forward(self, x):
        logits = x.float() @ self.weight.float().T
        scores = torch.sigmoid(logits)
        choice = scores + self.expert_bias
        t, e = choice.shape
        by_group = choice.view(t, self.groups, e // self.groups)
        group_score = by_group.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, group_score.topk(self.keep, dim=-1).indices, True)
        choice = torch.where(kept[:, :, None], by_group, torch.full_like(by_group, -math.inf)).view(t, e)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.scale, experts


class SparseMoe(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        if c["family"] == "llada2":
            self.gate = Llada2Gate(c)
            if c["shared"]:
                self.shared_experts = mlp(c, c["shared"])
        else:
            self.gate = Router(c)
        self.experts = nn.ModuleList([mlp(c, c["moe_width"]) for _ in range(c["experts"])])
        self.c = c

    def forward(self, x):
        b, l, d = x.shape
        flat = x.reshape(-1, d)
        _, weights, experts = self.gate(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(experts == e)
            if len(tokens):
                out.index_add_(0, tokens, expert(flat[tokens]) * weights[tokens, slot, None].to(flat.dtype))
        out = out.view(b, l, d)
        return out + self.shared_experts(x) if hasattr(self, "shared_experts") else out


class Layer(nn.Module):
    def __init__(self, c: dict, index: int):
        super().__init__()
        self.input_layernorm = Qwen3MoeRMSNorm(c["hidden"], eps=c["eps"])
        self.post_attention_layernorm = Qwen3MoeRMSNorm(c["hidden"], eps=c["eps"])
        self.attn_name = NAMES[c["family"]]["attn"]
        setattr(self, self.attn_name, Attention(c))
        self.mlp = mlp(c, c["dense_width"]) if index in c["dense_layers"] else SparseMoe(c)
        if c["family"] == "llada_moe" and c["shared"] and index not in c["dense_layers"]:
            self.shared_expert = mlp(c, c["shared"])

    def forward(self, x, cos, sin, mask):
        x = x + getattr(self, self.attn_name)(self.input_layernorm(x), cos, sin, mask)
        normed = self.post_attention_layernorm(x)
        y = self.mlp(normed)
        if hasattr(self, "shared_expert"):
            y = y + self.shared_expert(normed)
        return x + y


class Reference(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        setattr(self.model, NAMES[c["family"]]["embed"], nn.Embedding(c["vocab"], c["hidden"]))
        self.model.layers = nn.ModuleList([Layer(c, i) for i in range(c["layers"])])
        self.model.norm = Qwen3MoeRMSNorm(c["hidden"], eps=c["eps"])
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, tokens, mask):
        c = self.c
        x = getattr(self.model, NAMES[c["family"]]["embed"])(tokens)
        rd = c["rotary_dim"]
        inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        freqs = torch.arange(tokens.shape[1], dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x))

    def published_state(self) -> dict:
        """The state dict under the published names (LLaDA2's router bias: `gate.expert_bias`)."""
        return {name: value.detach().float().numpy().copy() for name, value in self.state_dict().items()}
