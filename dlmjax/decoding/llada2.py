"""LLaDA2's own decoding procedure (`llada2`), and LLaDA2.1's token editing as its option.

What its authors ship (the `generate()` of the LLaDA2.0 / 2.1 model cards; the same loop is
SGLang's dLLM `JointThreshold` algorithm and diffusers' block-refinement scheduler), per block
of a block-causal model, from each forward of the block:

- Mask to token (M2T), at the block's s-th step with masks: commit every masked position whose
  confidence is > `tau`, if there are at least q_s of them; otherwise the q_s most confident
  masked positions. LLaDA2.0's quota q_s spreads the block over `steps` steps (`block // steps`
  each, the first `block % steps` steps one more; `steps` is first capped at max_new_tokens, as
  generate() caps it at gen_length); block 32 and steps 32 make q_s = 1. LLaDA2.1's generate()
  (the one with editing) reads no `steps`: its q_s is always 1 (`num_to_transfer`), so with
  `editing_threshold` set `steps` is refused.
- Token to token (T2T, LLaDA2.1; on when `editing_threshold` is set): in the same step, every
  generated (not prompt), already committed position whose predicted token differs from its
  current one with confidence > `editing_threshold` takes the predicted token.
- With editing the block does not end when its last mask is filled: it goes on with forwards of
  the filled block ("post steps"), each applying T2T, until a step edits nothing or
  `max_post_steps` post steps have run (a post step that would exceed it runs no forward).
  Without editing a block ends with its last mask.
- Early stop on EOS (generate()'s `eos_early_stop=True`, the model cards' setting). Without
  editing (LLaDA2.0's generate()): a row stops right after a step that commits an EOS, if no
  generated position before its first EOS is masked; the masks after the EOS are never decoded
  (fewer forwards than finishing the block, the same tokens). Otherwise, and with editing
  (LLaDA2.1's generate() checks after each block, so edits inside the EOS block run), a row
  stops after the block that holds its EOS, once that block is complete (no mask left and, with
  editing, its post steps done), as every decoder here. The EOS looked for is any of the run's
  stop ids, from the row's first generated position (generate() searches from the prompt's
  start: an EOS inside the prompt would end its generation empty).

Engine mapping (engine.decode_round): a round's plan is one step's commit from the latest
logits; the round's forward is the next step's forward. The plan keeps, per row, its block, the
count of steps with masks (the quota index) and of post steps, and tells the engine through
`Plan.open` that a block without masks is still open. Each row's forward count equals the
reference loop's (tested: tests/test_llada2.py against a plain loop, no cache, full forward per
step). Confidence is the probability of the proposed token, the mask token excluded, as in
every decoder here; with sampling, edits read the sampled token (keys folded with the post-step
count, so post steps draw fresh noise). With sampling, a token's confidence is its probability
under the tempered, nucleus-filtered distribution it was drawn from, as LLaDA2's
`_sample_with_temperature_topk_topp` gives it (`sampled_scores`); it has no top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dlmjax.decoding import policies
from dlmjax.decoding.engine import Plan
from dlmjax.decoding.spec import DecoderSpecError, DiffusionDecoder, register_decoder
from dlmjax.validation import AT_LEAST_0, OPEN_UNIT, PROBABILITY, STEPS


def quota_commit(scores: policies.Scores, masked_bk, tau: float, quota_b):
    """LLaDA2's M2T: the masked positions above `tau` if at least quota of them, else the quota
    most confident ones. Equals (above tau) | (ranked within the quota)."""
    ranked = policies.rank_positions(scores.confidence, masked_bk) < quota_b[:, None]
    return masked_bk & ((scores.confidence > tau) | ranked)


def eos_early_stop(fwd, state, after_bk, committed_bk):
    """[B] rows whose step committed an EOS with no generated position masked before the first
    EOS of their block (earlier blocks hold none: a row stops at the end of a block with one)."""
    k = after_bk.shape[1]
    generated = fwd.block_start(state.block)[:, None] + jnp.arange(k)[None, :] >= fwd.rows.out_start[:, None]
    is_eos = jnp.isin(after_bk, fwd.eos) & generated
    first_eos = jnp.argmax(is_eos, axis=-1)  # 0 where none: then no EOS was committed either
    masked_before = jnp.any((after_bk == fwd.mask_id) & (jnp.arange(k)[None, :] < first_eos[:, None]), axis=-1)
    return jnp.any(committed_bk & is_eos, axis=-1) & ~masked_before


@register_decoder
@dataclass(frozen=True)
class LLaDA2(DiffusionDecoder):
    """LLaDA2's decoding (module docstring): tau (confidence threshold, 0.95), steps (per block;
    LLaDA2.0's quota schedule, 32), editing_threshold (LLaDA2.1's T2T editing, with a quota of 1;
    unset: off), max_post_steps (editing steps after a block's last mask is filled, 16)."""

    name: ClassVar[str] = "llada2"
    limits = {"tau": OPEN_UNIT, "steps": STEPS, "editing_threshold": PROBABILITY,
              "max_post_steps": AT_LEAST_0}
    sampled_scores: bool = True  # LLaDA2's confidence is the sampled distribution's
    tau: float = 0.95
    steps: int = 32
    editing_threshold: float | None = None
    max_post_steps: int = 16

    def __post_init__(self):
        super().__post_init__()
        if not self.editing and self.max_post_steps != 16:
            raise DecoderSpecError(f"llada2: max_post_steps={self.max_post_steps} bounds LLaDA2.1's editing steps; "
                                   "set editing_threshold too (e.g. editing_threshold=0.5), or drop max_post_steps")
        if self.editing and self.steps != 32:
            raise DecoderSpecError(f"llada2: steps={self.steps} sets LLaDA2.0's per-step quota; with editing_threshold "
                                   "(LLaDA2.1) every step commits the masked positions above tau, or else the most "
                                   "confident one, whatever the steps (as its generate() does): drop steps")

    @property
    def editing(self) -> bool:
        return self.editing_threshold is not None

    def init_carry(self, fwd, batch: int):
        zeros = jnp.zeros((batch,), jnp.int32)
        # block -1: the first round starts the row's block afresh
        return {"block": zeros - 1, "step": zeros, "post": zeros, "closed": jnp.zeros((batch,), bool)}

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        carry = state.carry
        fresh = carry["block"] != state.block  # a row that moved starts its counters over
        step = jnp.where(fresh, 0, carry["step"])
        post = jnp.where(fresh, 0, carry["post"])
        closed = ~fresh & carry["closed"]  # block done, waiting for the others (prefix/dual)
        if keys_b is not None:
            keys_b = jax.vmap(jax.random.fold_in)(keys_b, post)
        scores = self.scores(fwd, state, keys_b)

        if self.editing:  # LLaDA2.1: num_to_transfer = 1
            quota = jnp.ones_like(step)
        else:
            steps = min(self.steps, fwd.geometry.max_new_tokens)
            quota = policies.scheduled_counts(policies.step_counts(fwd.geometry.block, steps), step)
        m2t = policies.with_progress_guard(quota_commit(scores, masked_bk, self.tau, quota), scores, masked_bk)
        has_mask = jnp.any(masked_bk, axis=-1)
        edit = jnp.zeros_like(masked_bk)
        if self.editing:
            cols = fwd.block_start(state.block)[:, None] + jnp.arange(tokens_bk.shape[1])[None, :]
            editable = (cols >= fwd.rows.out_start[:, None]) & ~masked_bk & ~(state.done | closed)[:, None]
            edit = editable & (scores.confidence > self.editing_threshold) & (scores.tokens != tokens_bk)
        after = jnp.where(m2t | edit, scores.tokens, tokens_bk)

        filled = ~jnp.any(after == fwd.mask_id, axis=-1)
        carry = {"block": state.block, "step": step + has_mask, "post": post, "closed": closed | filled}
        if not self.editing:
            return Plan(tokens=after, copies=after[:, None], carry=carry, stop=eos_early_stop(fwd, state, after, m2t))
        post = post + filled  # the next step is a post step
        ended = (~has_mask & ~jnp.any(edit, axis=-1)) | (filled & (post > self.max_post_steps))
        still_open = ~closed & ~ended
        carry.update(post=post, closed=closed | (filled & ended))
        return Plan(tokens=after, copies=after[:, None], carry=carry, open=still_open)
