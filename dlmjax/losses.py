"""Drafter training losses (seed 003, ALGORITHMS.md section 3), composable by config.

Every function takes one block layout: logits [..., K, V], labels [..., K] int, mask [..., K]
bool (False at block position 0, which is the given token, and past the sequence's end), so a
leading shape [B, N] of (row, anchor) works as well as [K]. Block position k = 1..K-1 is the
k-th proposal. All softmaxes are float32.

- `uniform_ce`       mean cross-entropy over supervised positions (the baseline);
- `decay_ce`         positional weighting w_k = exp(-(k - 1) / gamma), normalised by sum w
                     over supervised positions (so it stays a mean CE);
- `first_error_focal` at the first supervised position of each block where the drafter's argmax
                     differs from the label, (1 - p)^focal_gamma * CE, mean over blocks that
                     have such an error (times alpha_f in `drafter_loss`);
- `chain_loss`       minus sum_k prod_{j<=k} p_j per block (p_j = drafter probability of label j;
                     a differentiable surrogate of the expected accepted length), mean over
                     blocks. Computed as exp(cumsum(log p)) from log_softmax: finite value and
                     gradient however close p is to 0 or 1.

`drafter_loss` = (decay_ce if gamma > 0 else uniform_ce) * ce_weight
               + alpha_f * first_error_focal + alpha_c * chain_loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_NEG = -1e4  # log-probability of an unsupervised position in the chain product: exp() is exactly 0


def label_logprobs(logits, labels):
    """log p(label) [..., K], float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def position_weights(k_size: int, gamma: float):
    """w_k = exp(-(k - 1) / gamma) for block positions k = 0..K-1 (position 0 is never supervised)."""
    k = jnp.arange(k_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


def uniform_ce(logits, labels, mask):
    m = mask.astype(jnp.float32)
    return -jnp.sum(label_logprobs(logits, labels) * m) / jnp.maximum(jnp.sum(m), 1.0)


def decay_ce(logits, labels, mask, gamma: float):
    w = position_weights(labels.shape[-1], gamma) * mask.astype(jnp.float32)
    return -jnp.sum(label_logprobs(logits, labels) * w) / jnp.maximum(jnp.sum(w), 1e-12)


def first_error_onehot(logits, labels, mask):
    """[..., K] bool: the first supervised position whose argmax is not the label (none if all right)."""
    wrong = (jnp.argmax(logits, axis=-1) != labels) & mask
    before = jnp.cumsum(wrong.astype(jnp.int32), axis=-1) - wrong.astype(jnp.int32)
    return wrong & (before == 0)


def first_error_focal(logits, labels, mask, focal_gamma: float):
    logp = label_logprobs(logits, labels)
    first = jax.lax.stop_gradient(first_error_onehot(logits, labels, mask)).astype(jnp.float32)
    focal = (1.0 - jnp.exp(logp)) ** focal_gamma * (-logp)
    blocks = jnp.sum(first, axis=-1)  # 1 for a block with an error, else 0
    return jnp.sum(focal * first) / jnp.maximum(jnp.sum(blocks), 1.0)


def chain_loss(logits, labels, mask):
    logp = jnp.where(mask, label_logprobs(logits, labels), _NEG)
    # position 0 is unsupervised but must not break the chain: it contributes log 1 = 0
    logp = logp.at[..., 0].set(0.0)
    prefix = jnp.exp(jnp.cumsum(logp, axis=-1))[..., 1:]  # prod_{j<=k} p_j for k = 1..K-1
    has_any = jnp.any(mask, axis=-1).astype(jnp.float32)
    expected_len = jnp.sum(prefix, axis=-1) * has_any
    return -jnp.sum(expected_len) / jnp.maximum(jnp.sum(has_any), 1.0)


@dataclass(frozen=True)
class LossWeights:
    ce_weight: float = 1.0
    decay_gamma: float = 0.0  # 0: position-uniform CE; else w_k = exp(-(k-1)/gamma) (about 7-10 at K=16)
    focal_alpha: float = 0.0  # alpha_f (the seed: ~0.3)
    focal_gamma: float = 2.0
    chain_alpha: float = 0.0  # alpha_c


def drafter_loss(logits, labels, mask, w: LossWeights):
    """(loss, parts dict) with every term reported (the unused ones weighted by 0)."""
    ce = decay_ce(logits, labels, mask, w.decay_gamma) if w.decay_gamma > 0 else uniform_ce(logits, labels, mask)
    focal = first_error_focal(logits, labels, mask, w.focal_gamma)
    chain = chain_loss(logits, labels, mask)
    total = w.ce_weight * ce
    if w.focal_alpha:
        total = total + w.focal_alpha * focal
    if w.chain_alpha:
        total = total + w.chain_alpha * chain
    return total, {"ce": ce, "focal": focal, "chain": chain}
