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
from dlmjax.decoding.engine import BlockForwards, DecodeState, block_tokens, policy_round, verify_if_needed
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

    def run_round(self, fwd: BlockForwards, state: DecodeState, *, mask_id: int, seed_key) -> DecodeState:
        if self.depth == 1:
            return policy_round(self, fwd, state, mask_id=mask_id, seed_key=seed_key)
        tokens = block_tokens(state, fwd)
        masked = (tokens == mask_id) & ~state.done[:, None]
        scores = policies.score(state.logits, mask_id=mask_id)
        drafts, sets = self.drafts(tokens, masked, scores)
        needs_forward = jnp.any(drafts[:, 0] == mask_id, axis=-1) & ~state.done  # masks left after S1
        logits, hidden = verify_if_needed(fwd, state, drafts, needs_forward)
        depth = self.accepted_depth(drafts, sets, scores, logits, state.done, mask_id)
        pick = (depth - 1)[:, None, None]
        new_tokens = jnp.take_along_axis(drafts, pick, axis=1)[:, 0]
        seed = jnp.take_along_axis(logits, pick[..., None], axis=1)[:, 0]
        seed_hidden = jnp.take_along_axis(hidden, pick[..., None], axis=1)[:, 0]
        canvas = jax.lax.dynamic_update_slice_in_dim(state.canvas, new_tokens, fwd.block_start(state.block), axis=1)
        return state.replace(
            canvas=canvas,
            logits=jnp.where(needs_forward[:, None, None], seed, state.logits),
            hidden=jnp.where(needs_forward[:, None, None], seed_hidden, state.hidden),
            rounds=state.rounds + jnp.any(masked, axis=-1),
            committed=state.committed + jnp.sum(new_tokens != tokens, axis=-1),
            nfe=state.nfe + needs_forward,
            batch_nfe=state.batch_nfe + jnp.any(needs_forward),
        )
