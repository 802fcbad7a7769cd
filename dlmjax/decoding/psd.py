"""PSD: parallel speculative decoding with multi-depth drafts and hierarchical verification.

Training-free (ALGORITHMS.md section 2). From one forward's scores, the unmasking policy P
picks this step's commit set S1. Assuming the predictions do not change, P picks again on the
positions still masked: S2, S3, ... up to `depth`, giving draft states X1 (S1 committed),
X2 (S1 + S2), ... without any model call. One verification forward over the packed drafts
(`BlockForwards.verify`) scores every X_d. Depth d+1 is accepted if, on the forward of X_d, P
would have committed exactly S_{d+1} with the same tokens; the deepest depth reached by an
unbroken chain of acceptances is kept (per row), and its forward seeds the next round.

Hence PSD's output equals running P one step per forward (`depth=1`), token for token, while
each forward can commit several steps' worth of tokens. Greedy only: with sampling the drafts
would need the policy's future random draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dlmjax.decoding import policies
from dlmjax.decoding.engine import Plan
from dlmjax.decoding.spec import DecoderSpecError, DiffusionDecoder, register_decoder

PSD_POLICIES = ("threshold", "topk", "decay", "margin")


@register_decoder
@dataclass(frozen=True)
class PSD(DiffusionDecoder):
    """policy: threshold (conf > tau), topk (k most confident), decay (threshold rising by
    `decay` per position right of the leftmost mask), margin (top-1 minus top-2 > margin);
    every policy commits at least one token per step. depth: drafts verified per forward."""

    name: ClassVar[str] = "psd"
    policy: str = "threshold"
    tau: float = 0.9
    k: int = 1
    decay: float = 0.05
    margin: float = 0.5
    depth: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.policy not in PSD_POLICIES:
            raise DecoderSpecError(f"psd: policy={self.policy!r}; choose one of {', '.join(PSD_POLICIES)}")
        if self.depth < 1 or self.k < 1:
            raise DecoderSpecError(f"psd: depth={self.depth} and k={self.k} must be >= 1")
        if self.temperature != 0.0:
            raise DecoderSpecError("psd is greedy (temperature=0): its drafts cannot know future samples")

    def select(self, scores, masked_bk):
        if self.policy == "threshold":
            return policies.threshold_commit(scores, masked_bk, self.tau)
        if self.policy == "topk":
            return policies.static_commit(scores, masked_bk, self.k)
        if self.policy == "decay":
            return policies.decaying_threshold_commit(scores, masked_bk, self.tau, self.decay)
        return policies.margin_commit(scores, masked_bk, self.margin)

    def drafts(self, tokens_bk, masked_bk, scores):
        """[B, depth, K] draft states and [B, depth, K] commit sets, with no model call."""
        states, sets = [], []
        for _ in range(self.depth):
            chosen = self.commit_set(scores, masked_bk)
            tokens_bk = jnp.where(chosen, scores.tokens, tokens_bk)
            masked_bk = masked_bk & ~chosen
            states.append(tokens_bk)
            sets.append(chosen)
        return jnp.stack(states, axis=1), jnp.stack(sets, axis=1)

    @property
    def num_copies(self) -> int:
        return self.depth

    def accepted_depth(self, drafts_bdk, sets_bdk, scores, logits_bdkv, done_b, mask_id: int):
        """Per row, how many draft depths (>= 1) the verification forward confirms."""
        confirmed = []
        for d in range(1, self.depth):
            after = policies.score(logits_bdkv[:, d - 1], mask_id=mask_id)
            masked = (drafts_bdk[:, d - 1] == mask_id) & ~done_b[:, None]
            would_commit = self.commit_set(after, masked)
            same_set = jnp.all(would_commit == sets_bdk[:, d], axis=-1)
            same_tokens = jnp.all(~sets_bdk[:, d] | (after.tokens == scores.tokens), axis=-1)
            confirmed.append(same_set & same_tokens)
        if not confirmed:
            return jnp.ones(done_b.shape, jnp.int32)
        chain = jnp.cumprod(jnp.stack(confirmed, axis=1).astype(jnp.int32), axis=1)
        return 1 + jnp.sum(chain, axis=1)

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        """S1 is this step's commit; X1..X_depth are verified by the round's forward."""
        scores = self.scores(fwd, state, keys_b)
        drafts, sets = self.drafts(tokens_bk, masked_bk, scores)
        return Plan(tokens=drafts[:, 0], copies=drafts, aux=(sets, scores))

    def resolve(self, fwd, state, plan: Plan, logits_bdkv, hidden_bdkd):
        """Keep the deepest draft P would have produced step by step; its forward seeds the next round."""
        sets, scores = plan.aux
        depth = self.accepted_depth(plan.copies, sets, scores, logits_bdkv, state.done, fwd.mask_id)

        def at_depth(x_bd):
            return jnp.take_along_axis(x_bd, (depth - 1).reshape((-1,) + (1,) * (x_bd.ndim - 1)), axis=1)[:, 0]

        return at_depth(plan.copies), at_depth(logits_bdkv), at_depth(hidden_bdkd)
