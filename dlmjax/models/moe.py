"""Dropless mixture-of-experts layer: a router in float32, SiLU-gated experts, an optional shared expert.

    y = sum_k weight_tk * expert_{e_tk}(x_t)  (+ shared(x_t))

Routers (`ModelConfig.router`), each as its family's modeling code computes it:
- "softmax": softmax over all experts in float32, then top-k; `norm_topk_prob` renormalises the
  k weights to sum to 1 (Qwen3-MoE, SDAR-MoE), or not (LLaDA-MoE);
- "sigmoid": DeepSeek-V3's router (LLaDA2): sigmoid scores; a per-expert bias is added for the
  choice only; experts form `router_groups` groups, a group scored by the sum of its two best
  experts, and a token picks its experts inside its `router_topk_groups` best groups; the weights
  are the unbiased sigmoids of the chosen experts, renormalised (`norm_topk_prob`), times
  `routed_scaling_factor`.

Experts are computed grouped: the T*k (token, expert) assignments are sorted by expert and each
expert's rows go through one `jax.lax.ragged_dot` against the stacked expert weights. Nothing is
dropped and there is no capacity: a token's output depends on its own hidden state only, never on
which or how many tokens share the batch. `dense_expert_outputs` runs every expert on every token
(the reference in tests and the baseline of benchmarks/moe_cpu.py).

In the batch-invariant numerics mode (`dlmjax.numerics(invariant=True)`) tokens go through the
experts in fixed tiles of `row_tile` tokens, one compiled shape whatever the batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dlmjax import arithmetic
from dlmjax.config import ModelConfig

_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Routers (pure, float32)


def route_softmax(logits_te, top_k: int, normalize: bool):
    """(weights [T, k] float32, experts [T, k] int32): top-k of the softmax over all experts.
    Ties go to the lower expert index."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if normalize:
        weights_tk = weights_tk / weights_tk.sum(axis=-1, keepdims=True)
    return weights_tk, experts_tk.astype(jnp.int32)


def route_sigmoid(logits_te, bias_e, top_k: int, *, groups: int, topk_groups: int, normalize: bool,
                  scale: float):
    """DeepSeek-V3 / LLaDA2 routing (see the module docstring); bias_e may be None."""
    scores_te = jax.nn.sigmoid(logits_te.astype(jnp.float32))
    choice_te = scores_te if bias_e is None else scores_te + bias_e.astype(jnp.float32)
    t, e = choice_te.shape
    if groups > 1:
        grouped_tgs = choice_te.reshape(t, groups, e // groups)
        group_score_tg = jax.lax.top_k(grouped_tgs, 2)[0].sum(axis=-1)
        _, best_groups = jax.lax.top_k(group_score_tg, topk_groups)
        keep_tg = jax.nn.one_hot(best_groups, groups, dtype=jnp.int32).sum(axis=1) > 0
        keep_te = jnp.repeat(keep_tg, e // groups, axis=-1)
        choice_te = jnp.where(keep_te, choice_te, -jnp.inf)
    _, experts_tk = jax.lax.top_k(choice_te, top_k)
    weights_tk = jnp.take_along_axis(scores_te, experts_tk, axis=-1)
    if normalize:
        weights_tk = weights_tk / (weights_tk.sum(axis=-1, keepdims=True) + 1e-20)
    return weights_tk * scale, experts_tk.astype(jnp.int32)


def route(cfg: ModelConfig, logits_te, bias_e=None):
    if cfg.router == "softmax":
        return route_softmax(logits_te, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return route_sigmoid(logits_te, bias_e, cfg.num_experts_per_tok, groups=cfg.router_groups,
                         topk_groups=cfg.router_topk_groups, normalize=cfg.norm_topk_prob,
                         scale=cfg.routed_scaling_factor)


# ----------------------------------------------------------------------------------------------
# Experts (pure)


def _swiglu(h_m2f):
    gate, up = jnp.split(h_m2f, 2, axis=-1)
    return jax.nn.silu(gate) * up


def grouped_expert_outputs(x_td, experts_tk, gate_up_ed2f, down_efd):
    """Each assignment's expert output [T, k, D] (unweighted): the T*k rows sorted by expert, one
    ragged_dot per projection over the experts' row groups, then put back in assignment order."""
    t, k = experts_tk.shape
    num_experts = gate_up_ed2f.shape[0]
    flat_m = experts_tk.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # sorted row -> assignment
    x_md = x_td[order_m // k]
    sizes_e = jnp.bincount(flat_m, length=num_experts).astype(jnp.int32)
    h_m2f = jax.lax.ragged_dot(x_md, gate_up_ed2f, sizes_e, preferred_element_type=jnp.float32)
    y_md = jax.lax.ragged_dot(_swiglu(h_m2f).astype(x_td.dtype), down_efd, sizes_e,
                              preferred_element_type=jnp.float32)
    y_md = jnp.zeros_like(y_md).at[order_m].set(y_md)  # back to assignment order
    return y_md.reshape(t, k, -1).astype(x_td.dtype)


def dense_expert_outputs(x_td, experts_tk, gate_up_ed2f, down_efd):
    """The reference: every expert on every token, then each assignment's own output [T, k, D]."""
    h_te2f = jnp.einsum("td,edf->tef", x_td, gate_up_ed2f, preferred_element_type=jnp.float32)
    y_ted = jnp.einsum("tef,efd->ted", _swiglu(h_te2f).astype(x_td.dtype), down_efd,
                       preferred_element_type=jnp.float32)
    return jnp.take_along_axis(y_ted, experts_tk[:, :, None], axis=1).astype(x_td.dtype)


EXPERT_IMPLEMENTATIONS = {"grouped": grouped_expert_outputs, "dense": dense_expert_outputs}


def combine(y_tkd, weights_tk):
    """sum_k weight * output, in float32, slot by slot in a fixed order."""
    out = y_tkd[:, 0].astype(jnp.float32) * weights_tk[:, :1]
    for slot in range(1, y_tkd.shape[1]):
        out = out + y_tkd[:, slot].astype(jnp.float32) * weights_tk[:, slot:slot + 1]
    return out.astype(y_tkd.dtype)


def moe_forward(x_td, router_de, bias_e, gate_up_ed2f, down_efd, cfg: ModelConfig, implementation: str = "grouped"):
    """The routed experts' contribution [T, D] for tokens x [T, D] (no shared expert)."""
    experts_fn = EXPERT_IMPLEMENTATIONS[implementation]

    def routed(rows_td):
        logits_te = arithmetic.matmul(rows_td.astype(jnp.float32), router_de.astype(jnp.float32))
        weights_tk, experts_tk = route(cfg, logits_te, bias_e)
        return combine(experts_fn(rows_td, experts_tk, gate_up_ed2f, down_efd), weights_tk)

    return arithmetic.rowwise(routed, x_td)  # invariant mode: fixed tiles of rows, one shape whatever T


# ----------------------------------------------------------------------------------------------
# Module


def _normal(rngs: nnx.Rngs, shape, dtype):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype)


class MoE(nnx.Module):
    """Router [D, E] and expert bias [E] (float32, as the families keep them), stacked experts
    gate_up [E, D, 2F] (gate columns first) and down [E, F, D], and `shared` (an MLP or None)."""

    implementation = "grouped"  # or "dense": every expert on every token (tests, benchmarks)

    def __init__(self, cfg: ModelConfig, *, shared: nnx.Module | None, rngs: nnx.Rngs):
        d, e, f, dt = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.dtype
        self.config = cfg
        self.router = nnx.Param(_normal(rngs, (d, e), jnp.float32))
        self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32)) if cfg.router_expert_bias else None
        self.experts_gate_up = nnx.Param(_normal(rngs, (e, d, 2 * f), dt))
        self.experts_down = nnx.Param(_normal(rngs, (e, f, d), dt))
        self.shared = shared

    def __call__(self, x):
        lead, d = x.shape[:-1], x.shape[-1]
        x_td = x.reshape(math.prod(lead), d)
        bias = None if self.expert_bias is None else self.expert_bias[...]
        y = moe_forward(x_td, self.router[...], bias, self.experts_gate_up[...], self.experts_down[...],
                        self.config, self.implementation).reshape(x.shape)
        return y if self.shared is None else y + self.shared(x)
