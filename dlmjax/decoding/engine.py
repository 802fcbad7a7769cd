"""The block-diffusion decoding engine: one `jax.jit`, one `lax.while_loop` of rounds in which
every row advances through its own blocks.

Layout. A batch of left-padded prompts shares one canvas [B, T] = prefix columns [0, C) plus
`num_blocks` generation blocks of K columns. Each row's positions count from its first real
token, so its output never depends on the other rows.
- Block-causal models (SDAR): blocks sit at multiples of K in each row's own positions, as in
  SDAR's reference. A row whose prompt length is not a multiple of K starts generating inside
  a block whose first r_b columns hold the end of its prompt (fixed, never masked). The exact KV
  cache is addressed by canvas column (slot c holds column c's keys and values).
- Bidirectional models (LLaDA, Dream): semi-autoregressive blocks start right after the prompt.
  Cache mode `none` runs the full canvas each step (exact); `prefix` and `dual` are Fast-dLLM's
  approximations: once per block a full forward refreshes the KV of the prefix (and, for
  `dual`, of the suffix too), and steps then forward only the block (dual) or the block and the
  suffix (prefix) against it.

Rows advance on their own. Each row has its own current block (`DecodeState.block` [B]); a row
that finishes a block moves to its next one at once while the others keep denoising, and one
forward serves every row, each at its own block and positions. The only exception is prefix/
dual: their refresh is a full-canvas forward, so rows there wait for each other at block ends
(`BlockForwards.sync_blocks`).

The first forward (`BlockForwards.prefill`) writes the prompt's whole blocks into the exact cache
and yields block 0's logits in the same forward. A finished block is never written by a forward
of its own: the forward that runs a row's next block's first step carries the finished block in
front of it ([clean block b ; block b+1 copies], block-causal visibility), writes its KV (and the
MRP head's) and yields block b+1's logits. A decode thus runs exactly its denoising forwards.
The forward sits in `lax.cond` branches (skip a round no row needs, carry a finished block or
not); the caches are written after them (`BlockForwards.write`), so they are updated in place:
when the branches returned the written caches, XLA copied them whole, twice a round.

A round (`decode_round`), per row:
1. the decoder's `plan` commits from the row's latest logits (the certain commits) and names the
   versions of the block ("copies") the round's forward evaluates: one for the policy decoders,
   the drafts for PSD and MRP spec;
2. a row whose block is now complete (no mask left, and the plan does not keep it open for token
   editing: `Plan.open`) finishes (EOS, or its last block) or moves to its next block; a row the
   plan stops (`Plan.stop`, LLaDA2.0's EOS early stop) finishes with masks left after its EOS;
3. one forward evaluates every row's copies (a row that moved: its new block, storing the old);
4. the decoder's `resolve` reads the forward: the accepted copy (PSD, MRP spec), the logits
   that seed the row's next round, and the decoder's next carry. Rows that forwarded copies of
   their block take the carry from `resolve`; the others (moved, finished) from `plan`.

Counters: per row NFE = the forwards it used (each yields denoising logits for it, the prefill
included) and committed tokens; per batch `forwards` = every model forward run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dlmjax import arithmetic
from dlmjax.decoding import policies
from dlmjax.models.transformer import KVCache, Transformer, put_rows, take_rows
from dlmjax.validation import InputError, positive_int


@dataclass(frozen=True)
class Geometry:
    """Static shape of a decoding run (a jit static argument)."""

    prefix: int  # C: columns before the first generation block
    block: int  # K
    num_blocks: int
    max_new_tokens: int

    @property
    def total(self) -> int:
        return self.prefix + self.block * self.num_blocks


@struct.dataclass
class Rows:
    """Per-row layout arrays."""

    positions: jax.Array  # [B, T] int32
    valid: jax.Array  # [B, T] bool: real tokens (prompt or generation), not left padding
    out_start: jax.Array  # [B] int32 column of the row's first generated token
    blocks_needed: jax.Array  # [B] int32 blocks that hold the row's max_new_tokens
    row_ids: jax.Array  # [B] int32 sampling-stream id of each row (its index in the request)


@struct.dataclass
class DecodeState:
    canvas: jax.Array  # [B, T] int32
    block: jax.Array  # [B] int32: each row's current generation block
    logits: jax.Array  # [B, K, V] float32: each row's current block's latest logits (seed of its next round)
    hidden: jax.Array  # [B, K, D] the backbone's final-normed hidden state behind `logits` (MRP's input)
    cache: KVCache | None
    head_cache: Any  # the head's own cache of finished blocks (BlockHead.empty_caches), or None
    done: jax.Array  # [B] bool
    rounds: jax.Array  # [B] int32 rounds in which the row committed (its sampling-key counter)
    nfe: jax.Array  # [B] int32 forwards that yielded denoising logits for the row
    committed: jax.Array  # [B] int32 tokens committed into masked positions
    forwards: jax.Array  # int32: model forwards run for the batch
    carry: Any = None  # the decoder's own per-row state (`init_carry`; every leaf [B, ...]), e.g. trajectories


@struct.dataclass
class DecodeOutput:
    tokens: jax.Array  # [B, max_new_tokens] int32; pad after EOS
    num_generated: jax.Array  # [B] int32 tokens up to and including EOS
    nfe: jax.Array  # [B] int32
    committed: jax.Array  # [B] int32
    forwards: jax.Array  # int32


@struct.dataclass
class Plan:
    """A decoder's round before the forward: the block after the commits it is sure of, and the
    versions of the block the forward evaluates (`resolve` reads them)."""

    tokens: jax.Array  # [B, K]
    copies: jax.Array  # [B, N, K]
    aux: Any = None  # the decoder's own (e.g. PSD's draft commit sets)
    carry: Any = None  # the decoder's per-row state after this round's plan (None: keep DecodeState.carry)
    # [B] bool: rows that keep working on their block although no mask is left in it (token
    # editing, dlmjax.decoding.llada2); None: a block is complete when its masks are gone
    open: Any = None
    # [B] bool: rows that finish now although masks are left in their block (LLaDA2.0's early
    # stop on an EOS with nothing masked before it: the masks after it are never output); a row is
    # stopped only so, since `finalize` keeps its tokens up to the first EOS; None: none
    stop: Any = None


class LayoutError(InputError):
    """Prompts and lengths that cannot be laid out for block decoding."""


def plan_layout(
    prompts, *, block: int, max_new_tokens: int, block_causal: bool, pad_id: int, mask_id: int, bucket: int = 16
):
    """Host-side layout: (Geometry, canvas [B, T] int32, Rows of numpy arrays).

    The prefix width is rounded up to a multiple of `bucket` (more left padding, which no row
    can see) so that batches of similar prompt lengths share one compiled program. Any
    max_new_tokens >= 1 works: rows decode the whole blocks that hold it, and `finalize` keeps
    the first max_new_tokens.
    """
    positive_int("max_new_tokens", max_new_tokens, error=LayoutError)
    positive_int("block", block, error=LayoutError)
    lengths = np.array([len(p) for p in prompts])
    if block_causal:
        block_start = (lengths // block) * block  # where each row's first generation block starts
        in_block = lengths - block_start  # prompt tokens inside that first block
    else:
        block_start = lengths
        in_block = np.zeros_like(lengths)
    prefix = -(-int(block_start.max()) // bucket) * bucket
    pad = prefix - block_start
    blocks_needed = -(-(in_block + max_new_tokens) // block)
    geometry = Geometry(prefix, block, int(blocks_needed.max()), max_new_tokens)
    cols = np.arange(geometry.total)[None, :]
    canvas = np.full((len(prompts), geometry.total), mask_id, np.int32)
    canvas[cols < pad[:, None]] = pad_id
    for row, (p, start) in enumerate(zip(prompts, pad)):
        canvas[row, start : start + len(p)] = p
    rows = Rows(
        positions=np.maximum(cols - pad[:, None], 0).astype(np.int32),
        valid=cols >= pad[:, None],
        out_start=(prefix + in_block).astype(np.int32),
        blocks_needed=blocks_needed.astype(np.int32),
        row_ids=np.arange(len(prompts), dtype=np.int32),
    )
    return geometry, canvas, rows


class BlockHead(Protocol):
    """What the engine asks of a head that runs beside the backbone on the block (the MRP head,
    dlmjax.heads.mrp.MRPHead): its own KV caches of finished blocks (one per module), created
    with the backbone's and written by the same forwards that write the backbone's (prefill, the
    round forward that starts a block). Its forwards over the block are its decoders' business
    (dlmjax.decoding.mrp), not the engine's."""

    def empty_caches(self, batch: int, capacity: int) -> tuple[KVCache, ...]:
        """The head's empty caches for `batch` rows of `capacity` slots."""

    def context_chunks(self, backbone: Transformer, caches, tokens_bl, hidden_bld, positions_bl, valid_bl, start_b,
                       write_b=None) -> tuple[KVCache, ...]:
        """Per cache, the chunk (`KVCache.chunk`) a finished chunk of clean tokens and the
        backbone's hidden state on them makes at each row's slot `start_b` (rows with `write_b`
        False: their slots as they are)."""


@dataclass(frozen=True)
class BlockForwards:
    """The forwards of one decoding run, every row at its own block (`block_b` [B]): the first
    forward, the round forward over candidate copies (carrying finished blocks to store), per
    cache mode; with a head (`BlockHead`), its cache of finished blocks kept beside the
    backbone's."""

    model: Transformer
    rows: Rows
    geometry: Geometry
    cache_mode: str  # "exact" (block-causal KV cache) | "none" | "prefix" | "dual"
    mask_id: int
    head: BlockHead | None = None
    # The decoder needs greedy scores only (`DiffusionDecoder.scores_from_hidden`): forwards then
    # return empty [..., 0] logits and the scores come from the hidden state (kernels.residual_argmax).
    scores_from_hidden: bool = False
    # Tokens never proposed besides the mask, and tokens ranked last (policies.score: the decoders'
    # `no_eos` and `eos_last`, LLaDA's logits_eos_inf and confidence_eos_eot_inf)
    banned_ids: tuple[int, ...] = ()
    last_ids: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()  # the tokens a row finishes after (the run's stop ids; none: no EOS ends a row)

    @property
    def eos(self):
        """`eos_ids` as an int32 array (-1, no token, where there are none)."""
        return jnp.asarray(self.eos_ids or (-1,), jnp.int32)

    @property
    def lead(self) -> int:
        # Shifted-logit models (Dream) need the token before the block to score the block's first position.
        return 1 if self.model.config.shift_logits else 0

    @property
    def sync_blocks(self) -> bool:
        """prefix/dual refresh their cache with a full-canvas forward at a block start, shared by
        all rows: rows there start their blocks together."""
        return self.cache_mode in ("prefix", "dual")

    def block_start(self, block_b):
        return self.geometry.prefix + block_b * self.geometry.block

    def block_tokens(self, canvas, block_b):
        """[B, K]: each row's tokens in its block `block_b`."""
        return take_rows(canvas, self.block_start(block_b), self.geometry.block)

    def put_block(self, canvas, block_b, tokens_bk):
        return put_rows(canvas, self.block_start(block_b), tokens_bk)

    def columns(self, first_b, width: int):
        """(positions, valid) [B, width] of each row's columns [first_b, first_b + width)."""
        return take_rows(self.rows.positions, first_b, width), take_rows(self.rows.valid, first_b, width)

    def _empty_cache(self, batch):
        return KVCache.init(self.model.config, batch, self.geometry.total)

    def _logits(self, hidden_bld):
        """The lm_head's logits of final-normed hidden states, or [..., 0] when the decoder scores
        from the hidden state (`scores_from_hidden`)."""
        if self.scores_from_hidden:
            return jnp.zeros((*hidden_bld.shape[:-1], 0), jnp.float32)
        return self.model.lm_logits(hidden_bld)

    @property
    def shifted_blocks(self) -> bool:
        """Shifted logits on a block-causal model (Fast-dLLM v2): position p of a block is scored from
        the hidden state at p - 1. The forward that starts a block (prefill, or the one storing the
        previous block) scores its position 0 from the previous column; later forwards of the block do
        not see that column and leave position 0 its own logits, so a decoder for these models commits
        position 0 in the block's first round (`fast-dllm-v2`; api refuses the others)."""
        return self.cache_mode == "exact" and self.model.config.shift_logits

    def _block_outputs(self, hidden_bnkd, lead_bnd):
        """(logits [B, N, K, V], hidden [B, N, K, D]) of block copies from their hidden states alone
        (a forward over a whole window or canvas computes no logits for the columns outside the
        block). The hidden state returned is the one that scores each position: shifted-logit
        models (Dream, Fast-dLLM v2) score position p from the column before it, `lead` [B, N, D]
        before position 0 (the column before the block's; or the block's first, whose logits then
        stay its own, as `layers.shift_right` leaves them). Scoring from hidden states
        (`scores_from_hidden`) then needs no logits for them either; they run no head, the hidden
        state's one other reader (api refuses MRP on them)."""
        if self.model.config.shift_logits:
            hidden_bnkd = jnp.concatenate([lead_bnd[:, :, None], hidden_bnkd[:, :, :-1]], axis=2)
        return self._logits(hidden_bnkd), hidden_bnkd

    def greedy_scores(self, hidden_bkd, residual=None):
        """policies.Scores of each row's block from its final-normed hidden state [B, K, D], through
        `kernels.residual_argmax` (no [B, K, V] logits on the kernel path); `residual` = (h_p
        [B, K, D], s) adds an MRP residual s lm_head(h_p) to the logits it scores."""
        return policies.hidden_scores(self.model, hidden_bkd, mask_id=self.mask_id, residual=residual)

    def token_probs(self, logits_bkv, hidden_bkd, tokens_bk, residual):
        """[B, K] probability of `tokens` (never the mask) under logits + s lm_head(h_p), `residual`
        = (h_p [B, K, D], s), the mask excluded. Where this decode keeps no logits
        (`scores_from_hidden`): from the kernel's argmax (`policies.hidden_token_logprobs`)."""
        if self.scores_from_hidden:
            logp, _ = policies.hidden_token_logprobs(self.model, hidden_bkd, tokens_bk, mask_id=self.mask_id,
                                                     residual=residual)
            return jnp.exp(logp)
        h_p, s = residual
        corrected = (logits_bkv + s * self.model.lm_logits(h_p)).at[..., self.mask_id].set(-jnp.inf)
        probs = arithmetic.rowwise(jax.nn.softmax, corrected)
        return jnp.take_along_axis(probs, tokens_bk[..., None], axis=-1)[..., 0]

    def block_scores(self, logits_bkv, hidden_bkd):
        """Greedy policies.Scores of a block (or of one packed copy) from a forward's output: its
        logits, or its hidden state when this decode keeps no logits (`scores_from_hidden`)."""
        if self.scores_from_hidden:
            return self.greedy_scores(hidden_bkd)
        return policies.score(logits_bkv, mask_id=self.mask_id, banned=self.banned_ids, last=self.last_ids)

    def prefill(self, canvas):
        """The first forward: (logits [B, K, V], hidden [B, K, D]) of block 0 for every row, with
        the cache (and the head's) holding the prompt's whole blocks (exact) or the refreshed
        canvas (prefix/dual)."""
        batch, zeros = canvas.shape[0], jnp.zeros((canvas.shape[0],), jnp.int32)
        head_cache = None if self.head is None else self.head.empty_caches(batch, self.geometry.total)
        if self.cache_mode in ("prefix", "dual"):
            return *self.refresh(canvas, zeros), head_cache
        if self.cache_mode == "none":
            logits, hidden = self.verify(canvas, self.block_tokens(canvas, zeros)[:, None], None, zeros)
            return logits[:, 0], hidden[:, 0], None, head_cache
        c, k = self.geometry.prefix, self.geometry.block
        out = self.model(canvas[:, : c + k], self.rows.positions[:, : c + k], valid_bl=self.rows.valid[:, : c + k],
                         compute_logits=False)
        cache = self._empty_cache(batch)
        if c:
            chunks = self._finished_chunks(cache, head_cache, canvas[:, :c], out.hidden[:, :c],
                                           [(kk[:, :c], vv[:, :c]) for kk, vv in out.chunk_kv], zeros, c)
            cache, head_cache = _put_chunks(cache, head_cache, chunks, zeros)
        # shifted blocks: position 0 reads the prompt's last hidden state (its own without a prompt)
        lead = out.hidden[:, max(c - 1, 0)]
        logits, hidden = self._block_outputs(out.hidden[:, None, c:], lead[:, None])
        return logits[:, 0], hidden[:, 0], cache, head_cache

    def _finished_chunks(self, cache, head_cache, tokens_bl, hidden_bld, chunk_kv, start_b, width, write_b=None):
        """(the backbone's cache chunk, the head's or None) of a clean chunk of `width` columns
        from `start_b` (rows with `write_b` False: their slots as they are); `_put_chunks` writes them."""
        positions, valid = self.columns(start_b, width)
        chunk = cache.chunk(chunk_kv, start_b, positions, valid, write_b)
        if head_cache is None:
            return chunk, None
        return chunk, self.head.context_chunks(self.model, head_cache, tokens_bl, hidden_bld, positions, valid,
                                               start_b, write_b)

    def refresh(self, canvas, block_b):
        """prefix/dual: one full-canvas forward that rewrites the whole cache; (logits, hidden) of
        each row's block `block_b`, and the cache."""
        out = self.model(canvas, self.rows.positions, valid_bl=self.rows.valid, compute_logits=False)
        cache = self._empty_cache(canvas.shape[0]).append(out.chunk_kv, self.rows.positions, self.rows.valid)
        start, k = self.block_start(block_b), self.geometry.block
        hidden = take_rows(out.hidden, start, k)[:, None]
        logits, hidden = self._block_outputs(hidden, take_rows(out.hidden, jnp.maximum(start - 1, 0), 1))
        return logits[:, 0], hidden[:, 0], cache

    def evaluate(self, canvas, copies_bnk, cache, head_cache, block_b, store_b):
        """The round forward: (logits [B, N, K, V], hidden [B, N, K, D], writes) of every row's N
        candidate copies of its block `block_b`. Rows with `store_b` have just moved to this
        block: exact mode computes the KV of their finished previous block in the same forward
        (writes: that block's cache slots, the other rows' as they are); prefix/dual refresh
        instead (their rows move together; writes: the refreshed cache). `write` applies the
        writes after this function's branches, which keeps the exact caches' updates in place (see
        the module docstring)."""
        n = copies_bnk.shape[1]

        def plain():
            return *self.verify(canvas, copies_bnk, cache, block_b), self.unchanged(cache, head_cache, block_b)

        if self.cache_mode == "none":
            return plain()
        if self.cache_mode in ("prefix", "dual"):
            def refreshed():
                logits, hidden, fresh = self.refresh(canvas, block_b)
                return jnp.repeat(logits[:, None], n, axis=1), jnp.repeat(hidden[:, None], n, axis=1), fresh

            return jax.lax.cond(jnp.any(store_b), refreshed, plain)

        def with_finished():
            return self.verify_with_finished(canvas, copies_bnk, cache, head_cache, block_b, store_b)

        return jax.lax.cond(jnp.any(store_b), with_finished, plain)

    def unchanged(self, cache, head_cache, block_b):
        """The writes of a round that stores nothing (see `evaluate`): none without a cache, the
        cache itself (prefix/dual), the slots of the block before `block_b` as they are (exact)."""
        if self.cache_mode == "none":
            return None
        if self.cache_mode in ("prefix", "dual"):
            return cache
        start, k = self.block_start(block_b) - self.geometry.block, self.geometry.block
        return cache.slots(start, k), None if head_cache is None else tuple(c.slots(start, k) for c in head_cache)

    def write(self, cache, head_cache, writes, block_b):
        """(cache, head cache) with a round's `writes` (from `evaluate` or `unchanged`) written."""
        if self.cache_mode == "none":
            return cache, head_cache
        if self.cache_mode in ("prefix", "dual"):
            return writes, head_cache
        return _put_chunks(cache, head_cache, writes, self.block_start(block_b) - self.geometry.block)

    def verify_with_finished(self, canvas, copies_bnk, cache, head_cache, block_b, store_b):
        """Exact mode: [block b-1 (clean, rows with `store_b` only) ; N copies of block b] in one
        forward. Block-causal visibility lets the copies see the clean block as they would see it
        in the cache, so their logits equal a store forward followed by `verify`. Returns (logits,
        hidden, writes): the clean block's cache chunks (`evaluate`)."""
        b, n, k = copies_bnk.shape
        start = self.block_start(block_b)
        prev_positions, prev_valid = self.columns(start - k, k)
        prev_valid = prev_valid & store_b[:, None]
        positions, valid = self.columns(start, k)
        tokens = jnp.concatenate([self.block_tokens(canvas, block_b - 1), copies_bnk.reshape(b, n * k)], axis=1)
        segments = jnp.concatenate([jnp.zeros((b, k), jnp.int32), copy_segments(b, n, k)], axis=1)
        out = self.model(tokens, jnp.concatenate([prev_positions, jnp.tile(positions, (1, n))], axis=1),
                         segments_bl=segments, valid_bl=jnp.concatenate([prev_valid, jnp.tile(valid, (1, n))], axis=1),
                         cache=cache, compute_logits=False, chunk_parts=(k,) + (copy_parts(n, k) or (n * k,)))
        writes = self._finished_chunks(cache, head_cache, tokens[:, :k], out.hidden[:, :k],
                                       [(kk[:, :k], vv[:, :k]) for kk, vv in out.chunk_kv], start - k, k, store_b)
        hidden = out.hidden[:, k:].reshape(b, n, k, -1)
        # shifted blocks: each copy's position 0 reads the stored block's last hidden state
        return *self._block_outputs(hidden, jnp.repeat(out.hidden[:, None, k - 1], n, axis=1)), writes

    def _window(self, block_b):
        """(first column [B], static width) of what a forward of the block reads: the block alone
        against the exact cache; the whole canvas without one; for prefix the block and
        everything after it (from C, the finished blocks masked out as keys); for dual the block.
        Shifted-logit models take one column more on the left to score the block's first position."""
        k, start, total = self.geometry.block, self.block_start(block_b), self.geometry.total
        if self.cache_mode == "exact":
            return start, k
        if self.cache_mode == "none":
            return jnp.zeros_like(start), total
        if self.cache_mode == "prefix":
            first = self.geometry.prefix - self.lead
            return jnp.full_like(start, first), total - first
        return start - self.lead, k + self.lead

    def _visible_cache(self, cache, start_b):
        """prefix/dual: hide the cached KV of what this forward recomputes."""
        if self.cache_mode in ("exact", "none"):
            return cache
        cols = jnp.arange(cache.capacity)[None, :]
        hidden = cols >= start_b[:, None]
        if self.cache_mode == "dual":
            hidden = hidden & (cols < start_b[:, None] + self.geometry.block)
        return cache.replace(valid=cache.valid & ~hidden)

    def verify(self, canvas, candidates_bnk, cache, block_b):
        """(logits [B, N, K, V], hidden [B, N, K, D]) of N candidate versions of each row's block
        `block_b`, in ONE forward.

        The copies (the row's window with the block replaced by each candidate) are packed side
        by side with their positions repeated; segment ids 1..N let each copy see the cached
        context and itself only. A copy's logits equal a step forward on its canvas (MRP spec,
        PSD verification).
        """
        b, n, k = candidates_bnk.shape
        start = self.block_start(block_b)
        first, width = self._window(block_b)
        positions, valid = self.columns(first, width)
        if self.cache_mode in ("prefix", "dual"):  # what lies before the block is in the cache
            valid = valid & (first[:, None] + jnp.arange(width)[None, :] >= start[:, None])
        window = take_rows(canvas, first, width)
        offset = start - first
        copies = jax.vmap(lambda cand: put_rows(window, offset, cand), in_axes=1, out_axes=1)(candidates_bnk)
        out = self.model(
            copies.reshape(b, n * width), jnp.tile(positions, (1, n)), segments_bl=copy_segments(b, n, width),
            valid_bl=jnp.tile(valid, (1, n)), cache=self._visible_cache(cache, start), chunk_parts=copy_parts(n, width),
            compute_logits=False,
        )

        def block_part(x_bld, first_b, columns: int):
            x = x_bld.reshape(b, n, width, -1).swapaxes(1, 2)  # [B, width, N, D]
            return take_rows(x, first_b, columns).swapaxes(1, 2)

        hidden = block_part(out.hidden, offset, k)
        if self.shifted_blocks:  # shifted within each copy; position 0 keeps its own (`shifted_blocks`)
            return self._block_outputs(hidden, hidden[:, :, 0])
        return self._block_outputs(hidden, block_part(out.hidden, jnp.maximum(offset - 1, 0), 1)[:, :, 0])

    def step(self, canvas, cache, block_b):
        """(logits [B, K, V], hidden [B, K, D]) of each row's block for the canvas as it is now."""
        logits, hidden = self.verify(canvas, self.block_tokens(canvas, block_b)[:, None], cache, block_b)
        return logits[:, 0], hidden[:, 0]


def _put_chunks(cache: KVCache, head_cache, chunks, start_b):
    """`cache` and the head's caches with their chunks (`BlockForwards._finished_chunks`) written at `start_b`."""
    chunk, head_chunks = chunks
    cache = cache.put_chunk(chunk, start_b)
    if head_cache is not None:
        head_cache = tuple(c.put_chunk(h, start_b) for c, h in zip(head_cache, head_chunks))
    return cache, head_cache


def copy_parts(copies: int, width: int) -> tuple[int, ...]:
    """Attention key parts of `copies` packed copies: in the invariant numerics mode one part per
    copy, so a copy's keys are summed exactly as in a forward of that copy alone (the other
    copies' parts add exact zeros); one part otherwise."""
    return (width,) * copies if arithmetic.current().invariant else ()


def copy_segments(batch: int, copies: int, width: int):
    """Segment ids [B, copies * width] of copies packed side by side: 1..copies, so each copy sees
    the cache (segment 0) and itself only."""
    return jnp.broadcast_to(jnp.repeat(jnp.arange(1, copies + 1, dtype=jnp.int32), width), (batch, copies * width))


def round_keys(state: DecodeState, rows: Rows, seed_key):
    """One sampling key per row, from (seed, row id, the row's own round count): batch-invariant."""
    return policies.row_keys(seed_key, rows.row_ids, state.rounds)


def _eos_seen(canvas, rows: Rows, end_col_b, eos):
    cols = jnp.arange(canvas.shape[1])[None, :]
    region = (cols >= rows.out_start[:, None]) & (cols < end_col_b[:, None])
    return jnp.any(jnp.isin(canvas, eos) & region, axis=-1)


def start(fwd: BlockForwards, canvas, decoder=None) -> DecodeState:
    """The state after the first forward: every row at block 0 with its logits (and the
    decoder's initial per-row carry, if it keeps one)."""
    logits, hidden, cache, head_cache = fwd.prefill(canvas)
    zeros = jnp.zeros((canvas.shape[0],), jnp.int32)
    carry = None if decoder is None else decoder.init_carry(fwd, canvas.shape[0])
    return DecodeState(canvas=canvas, block=zeros, logits=logits, hidden=hidden, cache=cache, head_cache=head_cache,
                       done=jnp.zeros(zeros.shape, bool), rounds=zeros, nfe=zeros + 1, committed=zeros,
                       forwards=jnp.ones((), jnp.int32), carry=carry)


def decode_round(decoder, fwd: BlockForwards, st: DecodeState, *, seed_key) -> DecodeState:
    """One round for every row: plan, finish or move on, one forward, resolve (module docstring)."""
    mask_id, k = fwd.mask_id, fwd.geometry.block
    tokens = fwd.block_tokens(st.canvas, st.block)
    masked = (tokens == mask_id) & ~st.done[:, None]
    keys = round_keys(st, fwd.rows, seed_key) if decoder.temperature > 0 else None
    plan = decoder.plan(fwd, st, tokens, masked, keys)
    canvas = fwd.put_block(st.canvas, st.block, plan.tokens)

    left = jnp.any(plan.tokens == mask_id, axis=-1) & ~st.done  # rows still denoising this block
    if plan.stop is not None:  # an early stop: the row's masks are left as they are
        left = left & ~plan.stop
    if plan.open is not None:  # token editing: a block without masks may still be open
        left = left | (plan.open & ~st.done)
    complete = ~st.done & ~left
    last = st.block + 1 >= fwd.rows.blocks_needed
    finished = complete & (last | _eos_seen(canvas, fwd.rows, fwd.block_start(st.block) + k, fwd.eos))
    if plan.stop is not None:  # a stopped row finishes, whatever its block holds
        finished = finished | (plan.stop & ~st.done)
    done = st.done | finished
    ready = complete & ~finished
    moves = ready & jnp.all(ready | done) if fwd.sync_blocks else ready
    block = st.block + moves
    current = fwd.block_tokens(canvas, block)
    copies = jnp.where(moves[:, None, None], current[:, None, :], plan.copies)

    need = left | moves

    def skipped():
        return (jnp.zeros((*copies.shape, st.logits.shape[-1]), st.logits.dtype),
                jnp.zeros((*copies.shape, st.hidden.shape[-1]), st.hidden.dtype),
                fwd.unchanged(st.cache, st.head_cache, block))

    logits, hidden, writes = jax.lax.cond(
        jnp.any(need), lambda: fwd.evaluate(canvas, copies, st.cache, st.head_cache, block, moves), skipped)
    cache, head_cache = fwd.write(st.cache, st.head_cache, writes, block)
    if plan.carry is None:  # the decoder keeps its carry this round: resolve sees (and may return) the current one
        plan = plan.replace(carry=st.carry)
    resolved, seed_logits, seed_hidden, resolved_carry = decoder.resolve(fwd, st, plan, logits, hidden)
    canvas = fwd.put_block(canvas, block, jnp.where(left[:, None], resolved, current))

    def seed(new_moved, new_resolved, old):
        expand = (-1,) + (1,) * (old.ndim - 1)
        return jnp.where(moves.reshape(expand), new_moved, jnp.where(left.reshape(expand), new_resolved, old))

    return st.replace(
        canvas=canvas,
        block=block,
        logits=seed(logits[:, 0], seed_logits, st.logits),
        hidden=seed(hidden[:, 0], seed_hidden, st.hidden),
        cache=cache,
        head_cache=head_cache,
        done=done,
        rounds=st.rounds + jnp.any(masked, axis=-1),
        nfe=st.nfe + need,
        committed=st.committed + jnp.sum((plan.tokens != tokens) & (tokens == mask_id), axis=-1)  # edits: not new
        + jnp.where(left, jnp.sum(resolved != plan.tokens, axis=-1), 0),
        forwards=st.forwards + jnp.any(need),
        carry=rows_where(left, resolved_carry, plan.carry),
    )


def rows_where(rows_b, on_tree, off_tree):
    """Per row: `on_tree`'s leaves where `rows_b` [B], `off_tree`'s elsewhere (every leaf [B, ...])."""
    return jax.tree.map(lambda on, off: jnp.where(rows_b.reshape((-1,) + (1,) * (on.ndim - 1)), on, off),
                        on_tree, off_tree)


def finalize(canvas, rows: Rows, geometry: Geometry, *, mask_id: int, pad_id: int, eos):
    """Each row's max_new_tokens generated tokens, pad after its first EOS (EOS kept)."""
    idx = rows.out_start[:, None] + jnp.arange(geometry.max_new_tokens)[None, :]
    tokens = jnp.take_along_axis(canvas, idx, axis=1)
    is_eos = jnp.isin(tokens, eos)
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), geometry.max_new_tokens)
    keep = (jnp.arange(geometry.max_new_tokens)[None, :] <= first_eos[:, None]) & (tokens != mask_id)
    tokens = jnp.where(keep, tokens, pad_id)
    return tokens, jnp.sum(keep, axis=1).astype(jnp.int32)


_STATIC = ("graphdef", "head_graphdef", "decoder", "geometry", "cache_mode", "mask_id", "pad_id", "eos_ids")


def _forwards(graphdef, params, rows, head_graphdef, head_params, geometry, cache_mode, mask_id,
              decoder=None, eos_ids=()) -> BlockForwards:
    head = None if head_graphdef is None else nnx.merge(head_graphdef, head_params)
    model = nnx.merge(graphdef, params)
    from_hidden = decoder is not None and decoder.scores_from_hidden(model)
    banned = model.config.eos_token_ids if decoder is not None and decoder.no_eos else ()
    last = tuple(eos_ids) if decoder is not None and decoder.eos_last else ()
    return BlockForwards(model, rows, geometry, cache_mode, mask_id, head, from_hidden, banned_ids=banned,
                         last_ids=last, eos_ids=tuple(eos_ids))


def _run_rounds(decoder, fwd: BlockForwards, state: DecodeState, seed_key, pad_id, stop_at,
                forward_limit=None):
    """Rounds until every row is done, `stop_at` rows are, or the batch's forward count reaches
    `forward_limit` (None: no limit); (state, DecodeOutput of every row)."""
    def going(s):
        going = ~jnp.all(s.done) & (jnp.sum(s.done) < stop_at)
        return going if forward_limit is None else going & (s.forwards < forward_limit)

    state = jax.lax.while_loop(going, partial(decode_round, decoder, fwd, seed_key=seed_key), state)
    tokens, num_generated = finalize(state.canvas, fwd.rows, fwd.geometry, mask_id=fwd.mask_id, pad_id=pad_id,
                                     eos=fwd.eos)
    return state, DecodeOutput(tokens=tokens, num_generated=num_generated, nfe=state.nfe, committed=state.committed,
                               forwards=state.forwards)


@partial(arithmetic.jit, static_argnames=_STATIC)
def decode(graphdef, params, canvas, rows: Rows, seed_key, head_params=None, *, decoder, geometry, cache_mode,
           mask_id, pad_id, eos_ids, head_graphdef=None):
    """Decode a laid-out batch. An MRP head (decoders mrp-*) comes as (head_graphdef, head_params)."""
    fwd = _forwards(graphdef, params, rows, head_graphdef, head_params, geometry, cache_mode, mask_id, decoder, eos_ids)
    return _run_rounds(decoder, fwd, start(fwd, canvas, decoder), seed_key, pad_id, canvas.shape[0])[1]


# -- continuous batching: slots that take the next prompt when their row is done (api.Stream) --


@partial(arithmetic.jit, static_argnames=_STATIC)
def decode_until(graphdef, params, state: DecodeState, rows: Rows, seed_key, stop_at, forward_limit,
                 head_params=None, *, decoder, geometry, cache_mode, mask_id, pad_id, eos_ids, head_graphdef=None):
    """Run rounds over the slots until `stop_at` of them are done (or all), or the batch has run
    `forward_limit` forwards in all (a traced int: the caller's next look at the rows):
    (state, DecodeOutput)."""
    fwd = _forwards(graphdef, params, rows, head_graphdef, head_params, geometry, cache_mode, mask_id, decoder, eos_ids)
    return _run_rounds(decoder, fwd, state, seed_key, pad_id, stop_at, forward_limit)


@partial(arithmetic.jit, static_argnames=("graphdef", "head_graphdef", "decoder", "geometry", "cache_mode", "mask_id"))
def admit(graphdef, params, state: DecodeState | None, rows: Rows | None, canvas_r, rows_r: Rows, slots_r,
          head_params=None, *, decoder, geometry, cache_mode, mask_id, head_graphdef=None):
    """Start R new rows (their first forward, one forward for the R) and put them in `slots_r`
    [R] of the slot state; an index >= the slot count drops that entry. With no state yet, the R
    rows are the slots. Returns (state, rows)."""
    fwd = _forwards(graphdef, params, rows_r, head_graphdef, head_params, geometry, cache_mode, mask_id,
                   decoder)
    new = start(fwd, canvas_r, decoder)
    if state is None:
        return new, rows_r

    def put(old, fresh):
        return old.at[slots_r].set(fresh, mode="drop") if old.ndim else old  # KVCache.length: unused by the engine

    merged = jax.tree.map(put, state, new)
    return merged.replace(forwards=state.forwards + 1), jax.tree.map(put, rows, rows_r)
