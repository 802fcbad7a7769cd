"""Drafter training losses (seed 003, ALGORITHMS.md section 3), composable by config, and the
label scores every training loss reads (`label_scores_from_hidden`).

Every loss reads a drafter's predictions only through two numbers per block position: log p(label)
and whether its argmax is the label (`LabelScores`, each [..., K]), with mask [..., K] bool (False
at block position 0, which is the given token, and past the sequence's end), so a leading shape
[B, N] of (row, anchor) works as well as [K]. Block position k = 1..K-1 is the k-th proposal.
`label_scores` reads them from logits; `label_scores_from_hidden` from hidden states a chunk of
positions at a time, so that training never holds the [..., K, V] logits of a whole batch (80 GB
in float32 at Qwen3's vocabulary for 16 rows x 512 anchors x 16 positions). All in float32.

- `uniform_ce`       mean cross-entropy over supervised positions (the baseline);
- `decay_ce`         positional weighting w_k = exp(-(k - 1) / gamma), normalised by sum w
                     over supervised positions (so it stays a mean CE);
- `first_error_focal` at the first supervised position of each block where the drafter's argmax
                     differs from the label, (1 - p)^focal_gamma * CE, mean over blocks that
                     have such an error (times alpha_f in `drafter_loss`);
- `chain_loss`       minus sum_k prod_{j<=k} p_j per block (p_j = drafter probability of label j;
                     a differentiable surrogate of the expected accepted length), mean over
                     blocks. Computed as exp(cumsum(log p)): finite value and gradient however
                     close p is to 0 or 1.

`drafter_loss` = (decay_ce if gamma > 0 else uniform_ce) * ce_weight
               + alpha_f * first_error_focal + alpha_c * chain_loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e4  # log-probability of an unsupervised position in the chain product: exp() is exactly 0
LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits one chunk of `label_scores_from_hidden` holds


class LabelScores(NamedTuple):
    """Per block position [..., K]: log p(label) (float32) and whether the argmax is the label."""

    logp: jax.Array
    right: jax.Array


def label_scores(logits, labels) -> LabelScores:
    """From logits [..., K, V] and labels [..., K]."""
    z = logits.astype(jnp.float32)
    at_label = jnp.take_along_axis(z, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return LabelScores(at_label - jax.nn.logsumexp(z, axis=-1), jnp.argmax(z, axis=-1) == labels)


def label_scores_from_hidden(hidden, lm_logits, labels) -> LabelScores:
    """`label_scores(lm_logits(hidden), labels)` for hidden [B, ..., D], labels [B, ...], a chunk
    of each row's positions at a time: each chunk's logits (LOGITS_CHUNK_BYTES of them for the
    batch) are made, read and dropped, and made again in the backward pass (jax.checkpoint), so
    memory holds one chunk's, not all of them. Chunks cut along positions, not rows, so a batch
    sharded over rows stays sharded."""
    b, d = hidden.shape[0], hidden.shape[-1]
    h = hidden.reshape(b, -1, d)
    y = labels.reshape(b, -1)
    vocab = jax.eval_shape(lm_logits, h[:1, :1]).shape[-1]
    width = max(1, min(h.shape[1], LOGITS_CHUNK_BYTES // (4 * vocab * b)))  # positions per row per chunk
    chunks = -(-h.shape[1] // width)
    pad = chunks * width - h.shape[1]
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, width, d).swapaxes(0, 1)
    y = jnp.pad(y, ((0, 0), (0, pad))).reshape(b, chunks, width).swapaxes(0, 1)
    scores = jax.lax.map(jax.checkpoint(lambda hy: label_scores(lm_logits(hy[0]), hy[1])), (h, y))
    per_row = labels.size // b
    return LabelScores(*(x.swapaxes(0, 1).reshape(b, -1)[:, :per_row].reshape(labels.shape) for x in scores))


def position_weights(k_size: int, gamma: float):
    """w_k = exp(-(k - 1) / gamma) for block positions k = 0..K-1 (position 0 is never supervised)."""
    k = jnp.arange(k_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


def uniform_ce(scores: LabelScores, mask):
    m = mask.astype(jnp.float32)
    return -jnp.sum(scores.logp * m) / jnp.maximum(jnp.sum(m), 1.0)


def decay_ce(scores: LabelScores, mask, gamma: float):
    w = position_weights(mask.shape[-1], gamma) * mask.astype(jnp.float32)
    return -jnp.sum(scores.logp * w) / jnp.maximum(jnp.sum(w), 1e-12)


def first_error_onehot(scores: LabelScores, mask):
    """[..., K] bool: the first supervised position whose argmax is not the label (none if all right)."""
    wrong = ~scores.right & mask
    before = jnp.cumsum(wrong.astype(jnp.int32), axis=-1) - wrong.astype(jnp.int32)
    return wrong & (before == 0)


def first_error_focal(scores: LabelScores, mask, focal_gamma: float):
    logp = scores.logp
    first = jax.lax.stop_gradient(first_error_onehot(scores, mask)).astype(jnp.float32)
    # p only at the first error (where it is below 1): (1 - p)^gamma with gamma < 1 has an infinite
    # slope at p = 1, which a confidently right position elsewhere would turn into a NaN gradient
    p = jnp.where(first > 0, jnp.exp(logp), 0.0)
    focal = (1.0 - p) ** focal_gamma * (-logp)
    blocks = jnp.sum(first, axis=-1)  # 1 for a block with an error, else 0
    return jnp.sum(focal * first) / jnp.maximum(jnp.sum(blocks), 1.0)


def chain_loss(scores: LabelScores, mask):
    logp = jnp.where(mask, scores.logp, _NEG)
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


def drafter_loss(scores: LabelScores, mask, w: LossWeights):
    """(loss, parts dict) with every term reported (the unused ones weighted by 0)."""
    ce = decay_ce(scores, mask, w.decay_gamma) if w.decay_gamma > 0 else uniform_ce(scores, mask)
    focal = first_error_focal(scores, mask, w.focal_gamma)
    chain = chain_loss(scores, mask)
    total = w.ce_weight * ce
    if w.focal_alpha:
        total = total + w.focal_alpha * focal
    if w.chain_alpha:
        total = total + w.chain_alpha * chain
    return total, {"ce": ce, "focal": focal, "chain": chain}
