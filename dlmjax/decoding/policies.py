"""Scoring a block's logits and choosing which masked positions to commit.

`score` turns logits into a proposed token per position with its confidence (probability
under the full softmax, float32) and entropy; the mask token is never proposed. A commit
policy maps scores and the masked set to a boolean commit set; `with_progress_guard` makes
sure every row with masked positions commits at least its most confident one.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlmjax import arithmetic
from dlmjax.kernels.residual_argmax import residual_argmax  # at import: see dlmjax.models.layers


@struct.dataclass
class Scores:
    tokens: jax.Array  # [B, K] int32 proposed token per position
    confidence: jax.Array  # [B, K] float32 probability of the proposed token
    entropy: jax.Array  # [B, K] float32 entropy of the position's distribution
    margin: jax.Array  # [B, K] float32 top-1 minus top-2 probability


def nucleus_filter(logits, top_p: float):
    """Keep the smallest set of top logits whose probability mass reaches top_p (the top token
    always survives); the rest become -inf. Works on any leading shape."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    cutoff = jnp.take_along_axis(sorted_logits, jnp.sum(cum < top_p, axis=-1, keepdims=True), axis=-1)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def row_keys(seed_key, row_ids_b, step_b):
    """One sampling key per row from (seed, the row's id, its own step count) [B]: a row's draws do
    not depend on which batch, or which slot of it, the row is in."""
    step_b = jnp.broadcast_to(jnp.asarray(step_b, jnp.int32), row_ids_b.shape)
    return jax.vmap(lambda rid, n: jax.random.fold_in(jax.random.fold_in(seed_key, rid), n))(row_ids_b, step_b)


def categorical_rows(keys_b, logits_b_v):
    """One draw per row b with key b from (unnormalised log-probability) logits [B, ..., V]."""
    return jax.vmap(lambda k, z: jax.random.categorical(k, z, axis=-1))(keys_b, logits_b_v).astype(jnp.int32)


def score(logits_bkv, *, mask_id: int | None, temperature: float = 0.0, top_p: float = 1.0, keys_b=None,
          sampled_scores: bool = False, banned: tuple[int, ...] = (), last: tuple[int, ...] = ()) -> Scores:
    """Propose tokens, never `mask_id` (None: any token) nor a `banned` one. Greedy at temperature
    0; else Gumbel-max per row with `keys_b` [B] from the tempered, then nucleus-filtered, logits.
    A sampled token's confidence (and the position's entropy and margin) is taken under the
    untempered logits (LLaDA's rule), or with `sampled_scores` under the distribution it was drawn
    from (Dream's and LLaDA2's). `last`: tokens proposed but ranked last by confidence, as LLaDA's
    `confidence_eos_eot_inf` ranks EOS and EoT (`_position_scores`)."""
    logits = logits_bkv.astype(jnp.float32)
    never = ((mask_id,) if mask_id is not None else ()) + tuple(banned)
    if never:
        logits = logits.at[..., jnp.asarray(never)].set(-jnp.inf)
    if temperature == 0.0:
        return Scores(*arithmetic.rowwise(partial(_position_scores, last=tuple(last)), logits))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:], jnp.float32))(keys_b)
    sample = partial(_position_scores, temperature=temperature, top_p=top_p, sampled_scores=sampled_scores,
                     last=tuple(last))
    return Scores(*arithmetic.rowwise(sample, logits, gumbel))


def hidden_scores(model, hidden_bkd, *, mask_id: int | None, residual=None) -> Scores:
    """Greedy Scores [B, K] straight from final-normed hidden states [B, K, D], through
    `kernels.residual_argmax` (no [B, K, V] logits where it runs as a kernel); `residual` = (h_p
    [B, K, D], s) adds an MRP residual s lm_head(h_p) to the logits it scores."""
    b, k, d = hidden_bkd.shape
    if residual is not None:
        residual = (residual[0].reshape(b * k, d), residual[1])
    scores = residual_argmax(hidden_bkd.reshape(b * k, d), model.lm_head_weight(), mask_id=mask_id, residual=residual)
    return Scores(*(a.reshape(b, k) for a in scores))


def hidden_token_logprobs(model, hidden_bkd, tokens_bk, *, mask_id: int | None, residual=None):
    """(log p(tokens) [B, K], the greedy Scores) under the logits `hidden_scores` scores, without
    making them: z_t - z_a + log p_a from its argmax a and that token's probability p_a, where z
    are the two tokens' logits (`Transformer.token_logits`, plus s times the residual's)."""
    best = hidden_scores(model, hidden_bkd, mask_id=mask_id, residual=residual)

    def token_logits(tokens):
        z = model.token_logits(hidden_bkd, tokens)
        return z if residual is None else z + residual[1] * model.token_logits(residual[0], tokens)

    return token_logits(tokens_bk) - token_logits(best.tokens) + jnp.log(best.confidence), best


def _position_scores(logits_v, gumbel_v=None, *, temperature: float = 0.0, top_p: float = 1.0,
                     sampled_scores: bool = False, last: tuple[int, ...] = ()):
    """(token, confidence, entropy, margin) of each position's logits (last axis): the argmax, or
    the Gumbel-max sample of the tempered, then nucleus-filtered, logits (transformers' order, and
    the references': Dream, LLaDA2, the `ar` decoder here). Confidence, entropy and margin are
    those of the logits' distribution, or with `sampled_scores` of the distribution the token was
    drawn from (Dream's sample_tokens). `last`: the confidence is taken from that distribution with
    these tokens' logits at -inf, so a position proposing one has confidence 0 and the others leave
    their mass out (LLaDA's confidence_eos_eot_inf)."""
    if gumbel_v is None:
        tokens, scored = jnp.argmax(logits_v, axis=-1), logits_v
    else:
        tempered = logits_v / temperature
        sampled = nucleus_filter(tempered, top_p) if top_p < 1.0 else tempered
        tokens = jnp.argmax(sampled + gumbel_v, axis=-1)
        scored = sampled if sampled_scores else logits_v
    tokens = tokens.astype(jnp.int32)
    logp = jax.nn.log_softmax(scored, axis=-1)
    probs = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    if last:
        probs_for_confidence = jax.nn.softmax(scored.at[..., jnp.asarray(last)].set(-jnp.inf), axis=-1)
    else:
        probs_for_confidence = probs
    confidence = jnp.take_along_axis(probs_for_confidence, tokens[..., None], axis=-1)[..., 0]
    top2 = jax.lax.top_k(probs, 2)[0]
    return tokens, confidence, entropy, top2[..., 0] - top2[..., 1]


def top_k_mask(values_bk, eligible_bk, k: int):
    """The k largest `values` among eligible positions (first index wins ties)."""
    ranked = jnp.where(eligible_bk, values_bk, -jnp.inf)
    _, idx = jax.lax.top_k(ranked, min(k, ranked.shape[-1]))
    chosen = jnp.zeros_like(eligible_bk).at[jnp.arange(ranked.shape[0])[:, None], idx].set(True)
    return chosen & eligible_bk


def with_progress_guard(commit_bk, scores: Scores, masked_bk):
    """Every row with a masked position commits at least its most confident one."""
    top1 = top_k_mask(scores.confidence, masked_bk, 1)
    return (commit_bk & masked_bk) | (top1 & ~jnp.any(commit_bk & masked_bk, axis=-1, keepdims=True))


STATIC_ORDERS = ("confidence", "margin", "entropy")


def rank_positions(values_bk, eligible_bk):
    """[B, K] int32: each eligible position's rank by value, highest first (the lower index first
    among equals); ineligible positions rank after every eligible one."""
    values = jnp.where(eligible_bk, values_bk, -jnp.inf)
    idx = jnp.arange(values.shape[-1])
    before = (values[:, None, :] > values[:, :, None]) | (
        (values[:, None, :] == values[:, :, None]) & (idx[None, :] < idx[:, None]))
    return jnp.sum(before & eligible_bk[:, None, :], axis=-1).astype(jnp.int32)


def static_commit(scores: Scores, masked_bk, k, order: str = "confidence"):
    """The k masked positions ranked first by `order`: highest confidence, highest margin, or
    lowest entropy (first index on ties). k: an int, or a count per row [B]."""
    ranking = {"confidence": scores.confidence, "margin": scores.margin, "entropy": -scores.entropy}[order]
    if isinstance(k, int):
        return top_k_mask(ranking, masked_bk, k)
    return masked_bk & (rank_positions(ranking, masked_bk) < k[:, None])


STEP_SCHEDULES = ("even", "linear")


def step_counts(block: int, steps: int, schedule: str = "even") -> tuple[int, ...]:
    """How many positions each step commits when a block of `block` positions is denoised in
    `steps` steps, leaving out the steps that commit none (such a step forwards the same block
    again: without it the tokens are the same, one forward fewer).

    even: `block // steps` a step, the first `block % steps` steps one more (LLaDA's
      get_num_transfer_tokens; SDAR's and LLaDA2.0's schedules are the same).
    linear: Dream's: over t = linspace(1, 1e-3, steps + 1), step i commits int(m (1 - t[i+1] /
      t[i])) of the m positions still masked, and the last step all that are left; in float32 as
      its generate() computes it in torch (with as many steps as positions, the first step commits
      none and the last two)."""
    if schedule == "even":
        steps = min(steps, block)  # more steps than positions commit one a step either way
        base, extra = divmod(block, steps)
        counts = [base + (i < extra) for i in range(steps)]
    else:
        t = _torch_linspace_f32(1.0, 1e-3, steps + 1)
        counts, left = [], block
        for i in range(steps):
            n = left if i == steps - 1 else int(np.float32(left) * (np.float32(1) - t[i + 1] / t[i]))
            counts.append(n)
            left -= n
    return tuple(n for n in counts if n > 0)


def _torch_linspace_f32(start: float, end: float, num: int) -> np.ndarray:
    """torch.linspace(start, end, num) in float32, value for value (tested): the first half counts
    up from start, the second half down from end, each value rounded once from the product and sum
    (a fused multiply-add)."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(num - 1))
    idx = np.arange(num)
    up = np.float64(start32) + step * idx
    down = np.float64(end32) - step * (num - 1 - idx)
    return np.where(idx < num // 2, up, down).astype(np.float32)


def scheduled_counts(counts: tuple[int, ...], step_b):
    """[B] int32: each row's count at its step of the block (`step_counts`), the last count once
    the schedule has run out."""
    return jnp.asarray(counts, jnp.int32)[jnp.minimum(step_b, len(counts) - 1)]


def threshold_commit(scores: Scores, masked_bk, tau: float):
    return masked_bk & (scores.confidence > tau)


def entropy_commit(scores: Scores, masked_bk, gamma: float):
    """Lowest-entropy positions first, while the running sum of entropies stays <= gamma, and
    always the lowest-entropy one (SDAR's `max(1, ...)`: where even that one is over gamma, it is
    the one committed, not the most confident)."""
    ent = jnp.where(masked_bk, scores.entropy, jnp.inf)
    order = jnp.argsort(ent, axis=-1, stable=True)
    sorted_ent = jnp.take_along_axis(ent, order, axis=-1)
    keep_sorted = jnp.cumsum(jnp.where(jnp.isfinite(sorted_ent), sorted_ent, jnp.inf), axis=-1) <= gamma
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(ent.shape[0])[:, None]
    return jnp.zeros_like(masked_bk).at[rows, order].set(keep_sorted) & masked_bk


def decaying_threshold_commit(scores: Scores, masked_bk, tau: float, decay: float):
    """Threshold that rises by `decay` per position right of the block's leftmost masked
    position: far positions need more confidence (a left-to-right prior)."""
    first = jnp.argmax(masked_bk, axis=-1)[:, None]
    distance = jnp.maximum(jnp.arange(masked_bk.shape[-1])[None, :] - first, 0)
    return masked_bk & (scores.confidence > tau + decay * distance)


def margin_commit(scores: Scores, masked_bk, margin: float):
    """Commit where the top-1 probability beats the runner-up by more than `margin`."""
    return masked_bk & (scores.margin > margin)
