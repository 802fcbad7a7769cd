"""The block-diffusion decoding engine: one `jax.jit`, two nested `lax.while_loop`s.

Layout. A batch of left-padded prompts shares one canvas [B, T] = prefix columns [0, C) plus
`num_blocks` generation blocks of K columns. Each row's positions count from its first real
token, so its output never depends on the other rows.
- Block-causal models (SDAR): blocks sit at multiples of K in each row's own positions, as in
  SDAR's reference. A row whose prompt length is not a multiple of K starts generating inside
  a block whose first r_b columns hold the end of its prompt (fixed, never masked). The whole
  prompt blocks before it are prefilled into the exact KV cache (one prefill forward); every
  finished block is written by one store forward (counted apart from denoising forwards).
- Bidirectional models (LLaDA, Dream): semi-autoregressive blocks start right after the prompt.
  Cache mode `none` runs the full canvas each step (exact); `prefix` and `dual` are Fast-dLLM's
  approximations: once per block a full forward refreshes the KV of the prefix (and, for
  `dual`, of the suffix too), and steps then forward only the block (dual) or the block and the
  suffix (prefix) against it.

Loop. Outer loop over blocks; inner loop over rounds until no active row has a masked position
in the block. A round commits from the block's current logits (`state.logits`), then runs the
next forward only if something is still masked; its result seeds the next round. Decoders that
draft and verify (MRP spec, PSD) replace the round and seed the next one from their verification
forward, so the same loop serves them. Rows that are done (EOS in a finished block, or all their
tokens generated) stop committing; rows that finished the block wait for the others, which
changes nothing in their output.

Counters: NFE = denoising forwards (per row: the forwards that row used; per batch: forwards
run), prefill and store forwards apart, committed = tokens committed into masked positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dlmjax.decoding.policies import score
from dlmjax.heads.mrp import MRPHead, apply_residual, head_output
from dlmjax.models.transformer import KVCache, Transformer


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
    block: jax.Array  # int32 scalar: current generation block
    logits: jax.Array  # [B, K, V] float32: the current block's latest logits (seed of the next round)
    hidden: jax.Array  # [B, K, D] the backbone's final-normed hidden state behind `logits` (MRP's input)
    cache: KVCache | None
    head_cache: tuple[KVCache, ...] | None  # an MRP head's own KV cache of finished blocks, per module
    done: jax.Array  # [B] bool
    rounds: jax.Array  # [B] int32 rounds each row took part in (its sampling-key counter)
    nfe: jax.Array  # [B] int32 denoising forwards each row used
    batch_nfe: jax.Array  # int32 denoising forwards run
    store_forwards: jax.Array  # int32
    committed: jax.Array  # [B] int32 tokens committed into masked positions


@struct.dataclass
class DecodeOutput:
    tokens: jax.Array  # [B, max_new_tokens] int32; pad after EOS
    num_generated: jax.Array  # [B] int32 tokens up to and including EOS
    nfe: jax.Array  # [B] int32
    batch_nfe: jax.Array  # int32
    prefill_forwards: jax.Array  # int32
    store_forwards: jax.Array  # int32
    committed: jax.Array  # [B] int32


class LayoutError(ValueError):
    """Prompts and lengths that cannot be laid out for block decoding."""


def plan_layout(
    prompts, *, block: int, max_new_tokens: int, block_causal: bool, pad_id: int, mask_id: int, bucket: int = 16
):
    """Host-side layout: (Geometry, canvas [B, T] int32, Rows of numpy arrays).

    The prefix width is rounded up to a multiple of `bucket` (more left padding, which no row
    can see) so that batches of similar prompt lengths share one compiled program.
    """
    if max_new_tokens < 1 or max_new_tokens % block:
        lower, upper = (max_new_tokens // block) * block, math.ceil(max_new_tokens / block) * block
        raise LayoutError(
            f"max_new_tokens={max_new_tokens} is not a multiple of the decoding block size {block}; "
            f"use {lower or block} or {upper}"
        )
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


@dataclass(frozen=True)
class BlockForwards:
    """The forwards of one decoding run: prefill, block-start, step and store, per cache mode;
    with an MRP head, its iterations over the block and its own cache of finished blocks."""

    model: Transformer
    rows: Rows
    geometry: Geometry
    cache_mode: str  # "exact" (block-causal KV cache) | "none" | "prefix" | "dual"
    head: MRPHead | None = None

    @property
    def lead(self) -> int:
        # Shifted-logit models (Dream) need the token before the block to score the block's first position.
        return 1 if self.model.config.shift_logits else 0

    def block_start(self, block):
        return self.geometry.prefix + block * self.geometry.block

    def _columns(self, start, size):
        positions = jax.lax.dynamic_slice_in_dim(self.rows.positions, start, size, axis=1)
        valid = jax.lax.dynamic_slice_in_dim(self.rows.valid, start, size, axis=1)
        return positions, valid

    def prefill(self, canvas):
        """(cache, head cache) after the prompt's whole blocks, and the number of prefill forwards (static)."""
        batch = canvas.shape[0]
        head_cache = None if self.head is None else self.head.empty_caches(batch, self.geometry.total)
        if self.cache_mode != "exact" or self.geometry.prefix == 0:
            cache = None if self.cache_mode == "none" else self._empty_cache(batch)
            return cache, head_cache, 0
        c = self.geometry.prefix
        cache, head_cache = self._write(canvas[:, :c], 0, c, self._empty_cache(batch), head_cache)
        return cache, head_cache, 1

    def _write(self, tokens, start, size, cache, head_cache):
        """Append a clean chunk's KV to the backbone's cache (and the head's, from the same forward)."""
        positions, valid = self._columns(start, size)
        out = self.model(tokens, positions, valid_bl=valid, cache=cache, write_cache=True, compute_logits=False)
        if head_cache is not None:
            head_cache = self.head.write_context(self.model, head_cache, tokens, out.hidden, positions, valid)
        return out.cache, head_cache

    def _empty_cache(self, batch):
        return KVCache.init(self.model.config, batch, self.geometry.total)

    def begin_block(self, canvas, cache, block):
        """(logits [B, K, V], hidden [B, K, D], cache) at the start of a block. prefix/dual
        refresh their cache here."""
        if self.cache_mode in ("prefix", "dual"):
            out = self.model(canvas, self.rows.positions, valid_bl=self.rows.valid,
                             cache=self._empty_cache(canvas.shape[0]), write_cache=True)
            start, k = self.block_start(block), self.geometry.block
            logits = jax.lax.dynamic_slice_in_dim(out.logits, start, k, axis=1)
            return logits, jax.lax.dynamic_slice_in_dim(out.hidden, start, k, axis=1), out.cache
        return *self.step(canvas, cache, block), cache

    def _window(self, block):
        """(first column, static width) of what a step forwards: the block alone against the
        exact cache; the whole canvas without one; for prefix the block and everything after it
        (from C, the finished blocks masked out as keys); for dual the block. Shifted-logit models
        take one column more on the left to score the block's first position."""
        k, start, total = self.geometry.block, self.block_start(block), self.geometry.total
        if self.cache_mode == "exact":
            return start, k
        if self.cache_mode == "none":
            return jnp.zeros((), jnp.int32), total
        if self.cache_mode == "prefix":
            first = self.geometry.prefix - self.lead
            return jnp.asarray(first, jnp.int32), total - first
        return start - self.lead, k + self.lead

    def _visible_cache(self, cache, start):
        """prefix/dual: hide the cached KV of what this forward recomputes."""
        if self.cache_mode in ("exact", "none"):
            return cache
        cols = jnp.arange(cache.capacity)
        hidden = cols >= start if self.cache_mode == "prefix" else (cols >= start) & (cols < start + self.geometry.block)
        return cache.replace(valid=cache.valid & ~hidden[None, :])

    def verify(self, canvas, candidates_bnk, cache, block):
        """(logits [B, N, K, V], hidden [B, N, K, D]) of N candidate versions of the current block,
        in ONE forward.

        The copies (the step's window with the block replaced by each candidate) are packed side
        by side with their positions repeated; segment ids 1..N let each copy see the cached
        context and itself only. A copy's logits equal a step forward on its canvas (MRP spec,
        PSD verification).
        """
        b, n, k = candidates_bnk.shape
        start = self.block_start(block)
        first, width = self._window(block)
        positions, valid = self._columns(first, width)
        if self.cache_mode in ("prefix", "dual"):  # what lies before the block is in the cache
            valid = valid & (first + jnp.arange(width) >= start)[None, :]
        window = jax.lax.dynamic_slice_in_dim(canvas, first, width, axis=1)
        offset = start - first
        copies = jax.vmap(
            lambda cand: jax.lax.dynamic_update_slice_in_dim(window, cand, offset, axis=1), in_axes=1, out_axes=1
        )(candidates_bnk)  # [B, N, width]
        out = self.model(
            copies.reshape(b, n * width), jnp.tile(positions, (1, n)), segments_bl=copy_segments(b, n, width),
            valid_bl=jnp.tile(valid, (1, n)), cache=self._visible_cache(cache, start),
        )
        def block_part(x_bld):
            return jax.lax.dynamic_slice_in_dim(x_bld.reshape(b, n, width, -1), offset, k, axis=2)

        return block_part(out.logits), block_part(out.hidden)

    def step(self, canvas, cache, block):
        """(logits [B, K, V], hidden [B, K, D]) of the current block for the canvas as it is now."""
        tokens = jax.lax.dynamic_slice_in_dim(canvas, self.block_start(block), self.geometry.block, axis=1)
        logits, hidden = self.verify(canvas, tokens[:, None, :], cache, block)
        return logits[:, 0], hidden[:, 0]

    def head_step(self, step: int, tokens_bk, hidden_bkd, logits_bkv, head_cache, block):
        """One MRP head iteration over the current block (chain step `step`, 0-based): returns
        (corrected logits, next head input h, residual logits). The head attends to its own
        cache of finished blocks and to the block itself."""
        h_p = self.head_copies(step, tokens_bk[:, None, :], hidden_bkd, head_cache, block)[:, 0]
        return apply_residual(self.head, self.model, h_p, logits_bkv, hidden_bkd)

    def head_copies(self, step: int, copies_bnk, hidden_bkd, head_cache, block):
        """h_p [B, N, K, D] of N versions of the current block in ONE head forward (chain step
        `step`): packed side by side like `verify`, each copy seeing the head's cache and itself,
        all reading the same hidden state."""
        b, n, k = copies_bnk.shape
        positions, valid = self._columns(self.block_start(block), k)
        h_p = head_output(self.head, self.model, step, copies_bnk.reshape(b, n * k), jnp.tile(hidden_bkd, (1, n, 1)),
                          jnp.tile(positions, (1, n)), segments_bl=copy_segments(b, n, k),
                          valid_bl=jnp.tile(valid, (1, n)), cache=head_cache[self.head.module_index(step)])
        return h_p.reshape(b, n, k, -1)

    def store(self, canvas, cache, head_cache, block):
        """Write a finished block's KV (exact cache only; the head's too); returns
        (cache, head cache, store forwards)."""
        if self.cache_mode != "exact":
            return cache, head_cache, 0
        k, start = self.geometry.block, self.block_start(block)
        tokens = jax.lax.dynamic_slice_in_dim(canvas, start, k, axis=1)
        return *self._write(tokens, start, k, cache, head_cache), 1


def copy_segments(batch: int, copies: int, width: int):
    """Segment ids [B, copies * width] of copies packed side by side: 1..copies, so each copy sees
    the cache (segment 0) and itself only."""
    return jnp.broadcast_to(jnp.repeat(jnp.arange(1, copies + 1, dtype=jnp.int32), width), (batch, copies * width))


def block_tokens(state: DecodeState, fwd: BlockForwards):
    return jax.lax.dynamic_slice_in_dim(state.canvas, fwd.block_start(state.block), fwd.geometry.block, axis=1)


def round_keys(state: DecodeState, rows: Rows, seed_key):
    """One sampling key per row, from (seed, row id, the row's own round count): batch-invariant."""
    return jax.vmap(lambda rid, n: jax.random.fold_in(jax.random.fold_in(seed_key, rid), n))(rows.row_ids, state.rounds)


def policy_round(
    decoder, fwd: BlockForwards, state: DecodeState, *, mask_id: int, seed_key, commit_set=None
) -> DecodeState:
    """Commit by the decoder's policy (or `commit_set(scores, masked)`) from the seeded logits,
    then forward if masks remain."""
    tokens = block_tokens(state, fwd)
    masked = (tokens == mask_id) & ~state.done[:, None]
    keys = round_keys(state, fwd.rows, seed_key) if decoder.temperature > 0 else None
    scores = score(state.logits, mask_id=mask_id, temperature=decoder.temperature, top_p=decoder.top_p, keys_b=keys)
    commit = (commit_set or decoder.commit_set)(scores, masked)
    return advance(fwd, state, tokens, jnp.where(commit, scores.tokens, tokens), mask_id)


def advance(fwd: BlockForwards, state: DecodeState, before_bk, after_bk, mask_id: int) -> DecodeState:
    """Write the block's new tokens and count them; run the next step forward if masks remain
    (its logits and hidden state seed the next round)."""
    canvas = jax.lax.dynamic_update_slice_in_dim(state.canvas, after_bk, fwd.block_start(state.block), axis=1)
    remaining = jnp.any(after_bk == mask_id, axis=-1) & ~state.done
    logits, hidden = jax.lax.cond(
        jnp.any(remaining), lambda: fwd.step(canvas, state.cache, state.block), lambda: (state.logits, state.hidden)
    )
    return state.replace(
        canvas=canvas,
        logits=logits,
        hidden=hidden,
        rounds=state.rounds + jnp.any((before_bk == mask_id) & ~state.done[:, None], axis=-1),
        committed=state.committed + jnp.sum(after_bk != before_bk, axis=-1),
        nfe=state.nfe + remaining,
        batch_nfe=state.batch_nfe + jnp.any(remaining),
    )


def verify_if_needed(fwd: BlockForwards, state: DecodeState, candidates_bnk, needed_b):
    """`fwd.verify` of the candidate copies when any row needs it; otherwise zeros and no forward."""
    def skipped():
        return (jnp.zeros(candidates_bnk.shape + state.logits.shape[-1:], state.logits.dtype),
                jnp.zeros(candidates_bnk.shape + state.hidden.shape[-1:], state.hidden.dtype))

    return jax.lax.cond(jnp.any(needed_b), lambda: fwd.verify(state.canvas, candidates_bnk, state.cache, state.block),
                        skipped)


def _eos_seen(canvas, rows: Rows, end_col, eos):
    cols = jnp.arange(canvas.shape[1])[None, :]
    region = (cols >= rows.out_start[:, None]) & (cols < end_col)
    return jnp.any(jnp.isin(canvas, eos) & region, axis=-1)


def finalize(canvas, rows: Rows, geometry: Geometry, *, mask_id: int, pad_id: int, eos):
    """Each row's max_new_tokens generated tokens, pad after its first EOS (EOS kept)."""
    idx = rows.out_start[:, None] + jnp.arange(geometry.max_new_tokens)[None, :]
    tokens = jnp.take_along_axis(canvas, idx, axis=1)
    is_eos = jnp.isin(tokens, eos)
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), geometry.max_new_tokens)
    keep = (jnp.arange(geometry.max_new_tokens)[None, :] <= first_eos[:, None]) & (tokens != mask_id)
    tokens = jnp.where(keep, tokens, pad_id)
    return tokens, jnp.sum(keep, axis=1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "head_graphdef", "decoder", "geometry", "cache_mode", "mask_id",
                                   "pad_id", "eos_ids"))
def decode(graphdef, params, canvas, rows: Rows, seed_key, head_params=None, *, decoder, geometry, cache_mode,
           mask_id, pad_id, eos_ids, head_graphdef=None):
    """Decode a laid-out batch. An MRP head (decoders mrp-*) comes as (head_graphdef, head_params)."""
    model = nnx.merge(graphdef, params)
    head = None if head_graphdef is None else nnx.merge(head_graphdef, head_params)
    fwd = BlockForwards(model, rows, geometry, cache_mode, head)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    run_round = getattr(decoder, "run_round", None) or partial(policy_round, decoder)
    cache, head_cache, prefill_forwards = fwd.prefill(canvas)
    batch = canvas.shape[0]
    zeros_b = jnp.zeros((batch,), jnp.int32)
    cfg = model.config
    state = DecodeState(
        canvas=canvas,
        block=jnp.zeros((), jnp.int32),
        logits=jnp.zeros((batch, geometry.block, cfg.vocab_size), jnp.float32),
        hidden=jnp.zeros((batch, geometry.block, cfg.hidden_size), cfg.dtype),
        cache=cache,
        head_cache=head_cache,
        done=jnp.zeros((batch,), bool),
        rounds=zeros_b, nfe=zeros_b, committed=zeros_b,
        batch_nfe=jnp.zeros((), jnp.int32),
        store_forwards=jnp.zeros((), jnp.int32),
    )

    def has_masks(st):
        return jnp.any(block_tokens(st, fwd) == mask_id, axis=-1) & ~st.done

    def run_block(st: DecodeState) -> DecodeState:
        active = has_masks(st)
        logits, hidden, cache = fwd.begin_block(st.canvas, st.cache, st.block)
        st = st.replace(logits=logits, hidden=hidden, cache=cache, nfe=st.nfe + active, batch_nfe=st.batch_nfe + 1)
        st = jax.lax.while_loop(
            lambda s: jnp.any(has_masks(s)),
            lambda s: run_round(fwd, s, mask_id=mask_id, seed_key=seed_key),
            st,
        )
        cache, head_cache, stores = fwd.store(st.canvas, st.cache, st.head_cache, st.block)
        end_col = fwd.block_start(st.block) + geometry.block
        done = st.done | (st.block + 1 >= rows.blocks_needed) | _eos_seen(st.canvas, rows, end_col, eos)
        return st.replace(cache=cache, head_cache=head_cache, done=done, block=st.block + 1, store_forwards=st.store_forwards + stores)

    state = jax.lax.while_loop(lambda s: (s.block < geometry.num_blocks) & ~jnp.all(s.done), run_block, state)
    tokens, num_generated = finalize(state.canvas, rows, geometry, mask_id=mask_id, pad_id=pad_id, eos=eos)
    return DecodeOutput(
        tokens=tokens, num_generated=num_generated, nfe=state.nfe, batch_nfe=state.batch_nfe,
        prefill_forwards=jnp.asarray(prefill_forwards, jnp.int32), store_forwards=state.store_forwards,
        committed=state.committed,
    )
