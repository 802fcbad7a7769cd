"""PSD: parallel speculative decoding with multi-depth drafts and hierarchical verification.

Training-free (ALGORITHMS.md section 2). From one forward's scores, the unmasking policy P
picks this step's commit set S1. Assuming the predictions do not change, P picks again on the
positions still masked: S2, S3, ... up to `depth`, giving draft states X1 (S1 committed),
X2 (S1 + S2), ... without any model call. One verification forward over the packed drafts
(`BlockForwards.verify`) scores every X_d. Depth d+1 is accepted if, on the forward of X_d, P
would have committed exactly S_{d+1} with the same tokens; the deepest depth reached by an
unbroken chain of acceptances is kept (per row), and its forward seeds the next round.

Hence PSD's output equals running P one step per forward (`depth=1`), token for token, while
each forward can commit several steps' worth of tokens: bitwise in the invariant numerics mode
(`dlmjax.numerics(invariant=True)`, where a packed copy's logits are bitwise a lone forward's);
in the fast mode the two forwards' logits can differ by rounding and a near-tie can flip. Greedy
only: with sampling the drafts would need the policy's future random draws.

Policies with state (`DraftAndVerify`). The draft/verify walk runs over a policy step
`(carry, scores, masked) -> (commit set, next carry)`; the stateless policies here pass their
(empty) carry through. A stateful one (tspd, ce, tspd+ce in dlmjax.decoding.tspd, selected
with their `depth=N` option: `tspd:controller=toy-sdar,depth=4`, `ce:tau=0.7,depth=4`) drafts
by observing the seed scores again at every depth (for the trajectory: the same confidences,
so momentum 0 and one more stable step; the Kalman filter gets the same confidence once more).
Verification walks the real carry: on the forward of X_d the policy observes X_d's real logits
and must commit exactly S_{d+1} with the same tokens. The round's carry is the one the step-by-
step policy holds before observing the accepted copy's logits (they seed the next round, whose
plan observes them), so the output again equals the policy run one step per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from dlmjax.decoding import policies
from dlmjax.decoding.engine import Plan, rows_where
from dlmjax.decoding.spec import DecoderSpecError, DiffusionDecoder, register_decoder
from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, OPEN_UNIT, UNIT_BELOW_1

PSD_POLICIES = ("threshold", "topk", "decay", "margin")
POLICY_OPTIONS = {"threshold": ("tau",), "topk": ("k",), "decay": ("tau", "decay"), "margin": ("margin",)}  # they read
STATEFUL_POLICIES = ("tspd", "ce", "tspd+ce")  # PSD over them: their own `depth` option


def draft_chain(step, carry, scores: policies.Scores, tokens_bk, masked_bk, depth: int):
    """Drafts with no model call: (states X_1..X_depth [B, D, K], commit sets S_1..S_depth
    [B, D, K], the carry after S_1). Every depth observes the same `scores` again."""
    states, sets, after_first = [], [], None
    for d in range(depth):
        chosen, carry = step(carry, scores, masked_bk)
        after_first = carry if d == 0 else after_first
        tokens_bk = jnp.where(chosen, scores.tokens, tokens_bk)
        masked_bk = masked_bk & ~chosen
        states.append(tokens_bk)
        sets.append(chosen)
    return jnp.stack(states, axis=1), jnp.stack(sets, axis=1), after_first


def verify_chain(step, carry, drafts_bdk, sets_bdk, scores: policies.Scores, observe, done_b, mask_id: int):
    """Per row, (the deepest draft depth >= 1 confirmed by an unbroken chain, the carry at it).

    `carry` is the policy's carry after S_1; `observe(i)` gives the greedy scores of the
    verification forward's copy i (X_{i+1}). Depth d+1 is confirmed if the policy, observing
    X_d's real scores with the real carry of depth d, commits exactly S_{d+1} with the seed's
    tokens; the carry of depth d+1 is what that step leaves."""
    accepted = jnp.ones(done_b.shape, jnp.int32)
    unbroken = jnp.ones(done_b.shape, bool)
    kept = carry
    for d in range(1, drafts_bdk.shape[1]):
        observed = observe(d - 1)
        masked = (drafts_bdk[:, d - 1] == mask_id) & ~done_b[:, None]
        would_commit, carry = step(carry, observed, masked)
        same_set = jnp.all(would_commit == sets_bdk[:, d], axis=-1)
        same_tokens = jnp.all(~sets_bdk[:, d] | (observed.tokens == scores.tokens), axis=-1)
        unbroken = unbroken & same_set & same_tokens
        accepted = accepted + unbroken
        kept = rows_where(unbroken, carry, kept)
    return accepted, kept


def at_depth(x_bd, depth_b):
    """x_bd [B, D, ...] at each row's (1-based) depth: [B, ...]."""
    return jnp.take_along_axis(x_bd, (depth_b - 1).reshape((-1,) + (1,) * (x_bd.ndim - 1)), axis=1)[:, 0]


class DraftAndVerify:
    """plan/resolve of PSD over a policy step (module docstring). Subclasses (dataclasses over
    DiffusionDecoder) give the `depth` field and `policy_step`."""

    depth: int

    def policy_step(self, fwd, state, carry, scores: policies.Scores, masked_bk):
        """One step of the policy: (commit set [B, K] with the progress guard, next carry)."""
        raise NotImplementedError

    def _step(self, fwd, state):
        return lambda carry, scores, masked_bk: self.policy_step(fwd, state, carry, scores, masked_bk)

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        """S1 is this step's commit; X1..X_depth are verified by the round's forward."""
        scores = self.scores(fwd, state, keys_b)
        drafts, sets, carry = draft_chain(self._step(fwd, state), state.carry, scores, tokens_bk, masked_bk,
                                          self.depth)
        return Plan(tokens=drafts[:, 0], copies=drafts, aux=(sets, scores), carry=carry)

    def resolve(self, fwd, state, plan: Plan, logits_bdkv, hidden_bdkd):
        """Keep the deepest draft the policy would have produced step by step; its forward seeds
        the next round, and the carry is the step-by-step policy's before observing it."""
        sets, scores = plan.aux
        depth, carry = verify_chain(self._step(fwd, state), plan.carry, plan.copies, sets, scores,
                                    lambda d: fwd.block_scores(logits_bdkv[:, d], hidden_bdkd[:, d]), state.done,
                                    fwd.mask_id)
        return at_depth(plan.copies, depth), at_depth(logits_bdkv, depth), at_depth(hidden_bdkd, depth), carry


@register_decoder
@dataclass(frozen=True)
class PSD(DraftAndVerify, DiffusionDecoder):
    """policy: threshold (conf > tau), topk (k most confident), decay (threshold rising by
    `decay` per position right of the leftmost mask), margin (top-1 minus top-2 > margin);
    every policy commits at least one token per step. depth: drafts verified per forward.
    PSD over tspd / ce / tspd+ce: their own depth option (module docstring)."""

    name: ClassVar[str] = "psd"
    eos_options: ClassVar[bool] = True
    limits = {"tau": OPEN_UNIT, "k": AT_LEAST_1, "decay": AT_LEAST_0, "margin": UNIT_BELOW_1, "depth": AT_LEAST_1}
    policy: str = "threshold"
    tau: float = 0.9
    k: int = 1
    decay: float = 0.05
    margin: float = 0.5
    depth: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.policy in STATEFUL_POLICIES:
            raise DecoderSpecError(
                f"psd: policy={self.policy} keeps per-token state across rounds; PSD over it is the decoder's own "
                f"depth option, e.g. `{self.policy}:{'controller=toy-sdar,' if 'tspd' in self.policy else ''}depth=4`")
        if self.policy not in PSD_POLICIES:
            raise DecoderSpecError(f"psd: policy={self.policy!r}; choose one of {', '.join(PSD_POLICIES)} "
                                   f"(PSD over {', '.join(STATEFUL_POLICIES)}: their depth option)")
        self.refuse_sampling("its drafts cannot know future samples")
        unread = [f"{name}={getattr(self, name)}" for name in ("tau", "k", "decay", "margin")
                  if name not in POLICY_OPTIONS[self.policy] and getattr(self, name) != getattr(PSD, name)]
        if unread:
            readers = [p for p, options in POLICY_OPTIONS.items() if unread[0].split("=")[0] in options]
            raise DecoderSpecError(f"psd: {', '.join(unread)} is not an option of policy={self.policy} (it reads "
                                   f"{', '.join(POLICY_OPTIONS[self.policy])}); set the policy that reads it "
                                   f"({', '.join(readers)}) or drop it")

    def ranks_by_confidence(self) -> bool:
        return self.policy != "margin"

    def select(self, scores, masked_bk):
        if self.policy == "threshold":
            return policies.threshold_commit(scores, masked_bk, self.tau)
        if self.policy == "topk":
            return policies.static_commit(scores, masked_bk, self.k)
        if self.policy == "decay":
            return policies.decaying_threshold_commit(scores, masked_bk, self.tau, self.decay)
        return policies.margin_commit(scores, masked_bk, self.margin)

    def policy_step(self, fwd, state, carry, scores, masked_bk):
        """Stateless: the carry passes through."""
        return self.commit_set(scores, masked_bk), carry
