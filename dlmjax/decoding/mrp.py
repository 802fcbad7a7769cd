"""MRP decoders: direct, spec (lossless) and remask (ALGORITHMS.md section 1).

All three run an MRP head (dlmjax.heads.mrp) on the backbone's final hidden state of the
current block; the head attends to its own KV cache of finished blocks, written by the same
prefill/store forwards that fill the backbone's cache. Head forwards are not counted as NFE.

- `mrp-direct`: after each backbone forward, commit the static pick (the most confident masked
  position, first index on ties) from the backbone's logits, then `mrp_steps` times: one head
  iteration on the block with that commit, and the static pick from the corrected logits.
  Lossy: a quality/speed knob (mrp_steps=0 is static decoding).
- `mrp-spec`: draft `drafts` static picks (the first from the seeded logits, then one per head
  iteration), verify all of them in ONE backbone forward over the drafts+1 packed copies
  C(0..drafts) of the block, accept per row the drafts whose copy's static pick agrees, then
  commit the backbone's own pick on the last accepted copy (bonus). The next round is seeded
  from that copy's logits and hidden state (no extra forward). Every committed token is the
  backbone's static pick on the exact state, so the output equals `static` (1 per step), at
  any batch size and whatever the head predicts; a bad head only costs speed.
- `mrp-remask`: the dynamic regime. The backbone proposes every masked position with
  confidence > tau; one head forward from the pre-commit hidden state gives residual logits C;
  a proposal is vetoed when |C[pos, token]| > delta (rule `residual`, the reference code's) or
  when its post-residual confidence softmax(logits + C)[pos, token] < tau (rule `confidence`,
  the blog's), or either (`both`). If every proposal is vetoed the one with the smallest |C|
  stays; the progress guard keeps at least one commit per step.

  What the head reads (`head_input`): the head is trained to predict a still-masked position's
  next logits from the old hidden state and the block *after* new tokens were revealed. So by
  default (`others`) C at a proposed position is read with every other proposal committed and
  that position still masked: the head's estimate of how the position's logits move once the
  rest of this step's commits land, i.e. whether they conflict with it. That is K versions of
  the block (one per position), packed into one head forward like the verification forward.
  `pre` reads the pre-commit block as it is (ALGORITHMS.md's literal wording): the head then
  sees no newly revealed token and predicts almost no change, so it rarely vetoes
  (benchmarks/results/mrp_toy measures both).

Where `kernels.residual_argmax` serves (`BlockForwards.scores_from_hidden`), mrp-direct and
mrp-spec keep no logits: each pick scores hidden states, a head step's residual added in the
kernel (`Chain`); mrp-remask reads |C| at each proposed token as one lm_head column and the
token's corrected probability from the kernel's argmax (`BlockForwards.token_probs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from dlmjax.decoding import policies
from dlmjax.decoding.engine import BlockForwards, DecodeState, Plan, copy_parts, copy_segments
from dlmjax.decoding.spec import DiffusionDecoder, register_decoder
from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, OPEN_UNIT, POSITIVE, OneOf
from dlmjax.heads.mrp import apply_residual, head_output

REMASK_RULES = ("residual", "confidence", "both")
REMASK_HEAD_INPUTS = ("others", "pre")
REMASK_HEAD_CONTEXTS = ("cache", "block")


@struct.dataclass
class Chain:
    """Where the MRP chain stands after k head iterations: what its next static pick scores and
    its next iteration reads. With logits (the XLA path): logits_k = logits_{k-1} + s lm_head(h_p)
    and hidden = h_k = h_{k-1} + s h_p, pending None. When the decode scores hidden states
    (`BlockForwards.scores_from_hidden`; logits are [B, K, 0]): hidden = h_{k-1} and pending = h_p,
    which `kernels.residual_argmax` scores as lm_head(h_{k-1}) + s lm_head(h_p) without logits."""

    logits: jax.Array  # [B, K, V], or [B, K, 0]
    hidden: jax.Array  # [B, K, D]
    pending: jax.Array | None = None  # [B, K, D]

    @classmethod
    def seed(cls, state: DecodeState) -> "Chain":
        """Step 0: the backbone forward's own logits and hidden state."""
        return cls(state.logits, state.hidden)

    def head_input(self, scale: float):
        """h_k, the next head iteration's input."""
        return self.hidden if self.pending is None else self.hidden + scale * self.pending


def head_step(fwd: BlockForwards, step: int, tokens_bk, chain: Chain, head_cache, block_b) -> Chain:
    """One MRP head iteration over each row's block (chain step `step`, 0-based) after the
    commits in `tokens_bk`. The head attends to its own cache of finished blocks and to the
    block itself."""
    hidden = chain.head_input(fwd.head.config.residual_scale)
    h_p = head_copies(fwd, step, tokens_bk[:, None, :], hidden, head_cache, block_b)[:, 0]
    if fwd.scores_from_hidden:
        return Chain(chain.logits, hidden, h_p)
    logits, hidden, _ = apply_residual(fwd.head, fwd.model, h_p, chain.logits, hidden)
    return Chain(logits, hidden)


def head_copies(fwd: BlockForwards, step: int, copies_bnk, hidden_bkd, head_cache, block_b):
    """h_p [B, N, K, D] of N versions of each row's block in ONE head forward (chain step
    `step`): packed side by side like `BlockForwards.verify`, each copy seeing the head's cache
    (None: no context, the copy alone) and itself, all reading the same hidden state."""
    b, n, k = copies_bnk.shape
    positions, valid = fwd.columns(fwd.block_start(block_b), k)
    h_p = head_output(fwd.head, fwd.model, step, copies_bnk.reshape(b, n * k), jnp.tile(hidden_bkd, (1, n, 1)),
                      jnp.tile(positions, (1, n)), segments_bl=copy_segments(b, n, k),
                      valid_bl=jnp.tile(valid, (1, n)),
                      cache=None if head_cache is None else head_cache[fwd.head.module_index(step)],
                      chunk_parts=copy_parts(n, k))
    return h_p.reshape(b, n, k, -1)


def static_pick(scores: policies.Scores, masked_bk):
    """(commit [B, K], tokens [B, K]): the most confident masked position per row and its
    greedy token, exactly as `static` (k=1) commits. Rows with nothing masked commit nothing."""
    return policies.static_commit(scores, masked_bk, 1), scores.tokens


def chain_scores(fwd: BlockForwards, chain: Chain) -> policies.Scores:
    """The greedy scores of the chain's current logits (see `Chain`)."""
    if chain.pending is None:
        return fwd.block_scores(chain.logits, chain.hidden)
    return fwd.greedy_scores(chain.hidden, residual=(chain.pending, fwd.head.config.residual_scale))


@dataclass(frozen=True)
class MRPDecoder(DiffusionDecoder):
    """Shared by the MRP decoders: they need an MRP head and a block-causal backbone."""

    needs_head: ClassVar[bool] = True


@register_decoder
@dataclass(frozen=True)
class MRPDirect(MRPDecoder):
    """mrp_steps: head iterations (one extra commit each) per backbone forward."""

    name: ClassVar[str] = "mrp-direct"
    limits = {"mrp_steps": AT_LEAST_0}
    mrp_steps: int = 1

    def __post_init__(self):
        super().__post_init__()
        self.refuse_sampling("it follows the static pick")

    def plan(self, fwd: BlockForwards, state: DecodeState, tokens_bk, masked_bk, keys_b) -> Plan:
        del keys_b
        chain = Chain.seed(state)
        for step in range(self.mrp_steps + 1):
            commit, proposed = static_pick(chain_scores(fwd, chain), masked_bk & (tokens_bk == fwd.mask_id))
            tokens_bk = jnp.where(commit, proposed, tokens_bk)
            if step < self.mrp_steps:
                chain = head_step(fwd, step, tokens_bk, chain, state.head_cache, state.block)
        return Plan(tokens=tokens_bk, copies=tokens_bk[:, None])


@register_decoder
@dataclass(frozen=True)
class MRPSpec(MRPDecoder):
    """drafts: commits drafted per round (1 from the seeded logits + drafts-1 head iterations),
    all verified by one packed backbone forward over drafts+1 copies."""

    name: ClassVar[str] = "mrp-spec"
    limits = {"drafts": AT_LEAST_1}
    drafts: int = 3

    def __post_init__(self):
        super().__post_init__()
        self.refuse_sampling("it follows the static pick")

    def draft(self, fwd: BlockForwards, state: DecodeState, tokens_bk):
        """[B, drafts+1, K] copies C(0..drafts): C(0) the block as it is, C(k) after k drafted commits."""
        copies, chain = [tokens_bk], Chain.seed(state)
        for step in range(self.drafts):
            commit, proposed = static_pick(chain_scores(fwd, chain), (copies[-1] == fwd.mask_id) & ~state.done[:, None])
            copies.append(jnp.where(commit, proposed, copies[-1]))
            if step < self.drafts - 1:
                chain = head_step(fwd, step, copies[-1], chain, state.head_cache, state.block)
        return jnp.stack(copies, axis=1)

    def init_carry(self, fwd: BlockForwards, batch: int):
        """Per row, whether its seed is exact: the logits of its block as it stands (after the
        prefill, and after the forward that moved it to its block), not of a copy that predates
        a bonus commit."""
        return {"exact": jnp.ones((batch,), bool)}

    def plan(self, fwd: BlockForwards, state: DecodeState, tokens_bk, masked_bk, keys_b) -> Plan:
        """A row whose seed is exact commits draft 0 now, as `static` would (so a block whose last
        mask that is moves on in this forward), and verifies C(1..drafts) (the last slot repeats
        C(drafts): it drafts nothing, so the walk stops before it). Other rows are sure of
        nothing: their seed predates the last bonus commit, and they verify C(0..drafts)."""
        del masked_bk, keys_b
        copies = self.draft(fwd, state, tokens_bk)
        exact = state.carry["exact"]
        shifted = jnp.concatenate([copies[:, 1:], copies[:, -1:]], axis=1)
        copies = jnp.where(exact[:, None, None], shifted, copies)
        return Plan(tokens=copies[:, 0], copies=copies, carry={"exact": jnp.ones_like(exact)})  # moved rows: exact

    def resolve(self, fwd: BlockForwards, state: DecodeState, plan: Plan, logits_bnkv, hidden_bnkd):
        """The backbone's static pick on every copy, the per-row walk over the drafts, and the bonus;
        the next seed (the accepted copy's) is exact where no bonus was committed on it."""
        copies, mask_id = plan.copies, fwd.mask_id
        n = copies.shape[1]
        picks = [static_pick(fwd.block_scores(logits_bnkv[:, k], hidden_bnkd[:, k]),
                             (copies[:, k] == mask_id) & ~state.done[:, None]) for k in range(n)]
        agrees = []
        for k in range(n - 1):
            commit, proposed = picks[k]
            drafted = copies[:, k + 1] != copies[:, k]
            same = jnp.all(commit == drafted, axis=-1) & jnp.all(~commit | (proposed == copies[:, k + 1]), axis=-1)
            agrees.append(same & jnp.any(drafted, axis=-1))
        accepted = jnp.sum(jnp.cumprod(jnp.stack(agrees, axis=1).astype(jnp.int32), axis=1), axis=1)  # [B]

        def at_accepted(x_bn):
            return jnp.take_along_axis(x_bn, accepted.reshape((-1,) + (1,) * (x_bn.ndim - 1)), axis=1)[:, 0]

        bonus_commit = at_accepted(jnp.stack([c for c, _ in picks], axis=1))
        bonus_tokens = at_accepted(jnp.stack([t for _, t in picks], axis=1))
        tokens = jnp.where(bonus_commit, bonus_tokens, at_accepted(copies))
        return tokens, at_accepted(logits_bnkv), at_accepted(hidden_bnkd), {"exact": ~jnp.any(bonus_commit, axis=-1)}


@register_decoder
@dataclass(frozen=True)
class MRPRemask(MRPDecoder):
    """tau: commit threshold; delta: residual veto bound; rule: residual | confidence | both;
    head_input: others (each proposal judged with the other proposals committed) | pre;
    head_context: cache (the head attends to its KV cache of the earlier blocks, as in training,
    where it sees the clean context) | block (the block alone, as the reference code's remask,
    which stores no head KV). The reference code's remask is
    `rule=residual,head_input=pre,head_context=block`."""

    name: ClassVar[str] = "mrp-remask"
    limits = {"tau": OPEN_UNIT, "delta": POSITIVE, "rule": OneOf(REMASK_RULES), "head_input": OneOf(REMASK_HEAD_INPUTS),
              "head_context": OneOf(REMASK_HEAD_CONTEXTS)}
    tau: float = 0.9
    delta: float = 1.0
    rule: str = "both"
    head_input: str = "others"
    head_context: str = "cache"

    def select(self, scores, masked_bk):
        return policies.threshold_commit(scores, masked_bk, self.tau)

    def vetoed(self, proposed_bk, size_bk, post_bk):
        """The proposals to keep after the veto (before the progress guard), from |C| at each
        position's proposed token (`size`) and that token's probability under the corrected
        logits (`post`)."""
        veto = jnp.zeros_like(proposed_bk)
        if self.rule in ("residual", "both"):
            veto = veto | (size_bk > self.delta)
        if self.rule in ("confidence", "both"):
            veto = veto | (post_bk < self.tau)
        kept = proposed_bk & ~veto
        all_vetoed = jnp.any(proposed_bk, axis=-1, keepdims=True) & ~jnp.any(kept, axis=-1, keepdims=True)
        smallest = policies.top_k_mask(-size_bk, proposed_bk, 1)
        return kept | (smallest & all_vetoed)

    def head_at_proposals(self, fwd: BlockForwards, state: DecodeState, before_bk, proposed_after_bk):
        """h_p [B, K, D], the head's output at every position of the block (C = s lm_head(h_p)),
        read as `head_input` and `head_context` say."""
        context = state.head_cache if self.head_context == "cache" else None
        if self.head_input == "pre":
            return head_copies(fwd, 0, before_bk[:, None], state.hidden, context, state.block)[:, 0]
        k = before_bk.shape[1]
        # Copy j: every proposal committed except position j, which keeps its pre-commit token.
        copies = jnp.where(jnp.eye(k, dtype=bool)[None], before_bk[:, None, :], proposed_after_bk[:, None, :])
        h_p = head_copies(fwd, 0, copies, state.hidden, context, state.block)  # [B, K(copy), K, D]
        return h_p[:, jnp.arange(k), jnp.arange(k)]  # copy j's output at position j

    def plan(self, fwd: BlockForwards, state: DecodeState, tokens_bk, masked_bk, keys_b) -> Plan:
        scores = self.scores(fwd, state, keys_b)
        proposed = self.select(scores, masked_bk)
        h_p = self.head_at_proposals(fwd, state, tokens_bk, jnp.where(proposed, scores.tokens, tokens_bk))
        scale = fwd.head.config.residual_scale
        size = jnp.abs(scale * fwd.model.token_logits(h_p, scores.tokens))
        post = fwd.token_probs(state.logits, state.hidden, scores.tokens, residual=(h_p, scale))
        kept = self.vetoed(proposed, size, post)
        after = jnp.where(policies.with_progress_guard(kept, scores, masked_bk), scores.tokens, tokens_bk)
        return Plan(tokens=after, copies=after[:, None])
