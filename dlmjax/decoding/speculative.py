"""Speculative decoding of a causal target with a DFlash-style diffusion drafter (seed 003).

One `jax.jit`: a prefill forward of the target writes the prompt's KV and yields the first token
and the prompt's context features; then a `lax.while_loop` runs rounds of

    block   = [last token, MASK x (K - 1)]          at positions p .. p + K - 1
    draft   = drafter(block | context cache)[1:]     (K - 1 proposals, one drafter forward)
    verify  = target([last, draft] | target cache)   (one target forward over K tokens)
    accept  greedy:  the longest prefix of the draft equal to the target's argmax, plus the
                     target's token after it (the bonus);
            sampled: each draft token with probability min(1, p/q); at the first rejection a
                     token from norm(max(0, p - q)); after a full accept a bonus from p.

Sampling keys are per row (seed, row id, round), so a sampled row does not depend on its batch.
Rows advance by their own accepted length: both caches are written at per-row offsets, in place.
The target cache gets the K verified slots with only the accepted tokens' KV valid (the rest
zeroed, for the next round to overwrite: "crop after rejection"); the drafter cache likewise
keeps the context K/V of accepted tokens, from the verification forward's hidden states. A row
stops at its first EOS (padded after it, like `generate_ar`) or at `max_new_tokens`.

Counts: `target_forwards` = verification rounds (the prefill not counted); `accepted[b, r]` =
tokens row b output in round r: accepted drafts + 1, cut at its EOS and at `max_new_tokens` as
the output is (so a row's rounds add up to its tokens after the prefill's first);
`mean_accepted_length` = their mean over the rounds a row took part in (tokens per target
forward). z-lab's DFlash benchmark counts its last round uncut, runs one round more and averages
per-sample means, so its acceptance length reads slightly higher on the same tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dlmjax import arithmetic
from dlmjax.decoding.ar import (batch_row_ids, greedy_tokens, left_pad, positions_from_valid, sampling_options,
                                special_ids)
from dlmjax.decoding.policies import categorical_rows, nucleus_filter, row_keys
from dlmjax.heads.drafter import Drafter, block_hidden, check_compatible, context_features
from dlmjax.models.transformer import KVCache, Transformer
from dlmjax.sharding import shard_batch
from dlmjax.validation import InputError, positive_int


@struct.dataclass
class SpecResult:
    tokens: jax.Array  # [B, max_new_tokens] int32, pad after a row's EOS
    num_generated: jax.Array  # [B] int32, EOS included
    target_forwards: jax.Array  # int32 scalar: verification forwards (prefill excluded)
    accepted: jax.Array  # [B, max_new_tokens] int32: tokens output per round (0 once a row is done)

    @property
    def nfe(self):
        """Target forwards that produced tokens, prefill included (the `ar` decoder's count)."""
        return self.target_forwards + 1

    def accepted_lengths(self) -> list[list[int]]:
        """Per row, the accepted length of each round it took part in."""
        acc = np.asarray(self.accepted)
        return [[int(a) for a in row if a > 0] for row in acc]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification forward, over every row's rounds."""
        acc = np.asarray(self.accepted)
        rounds = int((acc > 0).sum())
        return float(acc.sum() / rounds) if rounds else 0.0


def _probs(logits, temperature: float, top_p: float):
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        logits = nucleus_filter(logits, top_p)
    return jax.nn.softmax(logits, axis=-1)


def _pick(x_bk, idx_b):
    return jnp.take_along_axis(x_bk, idx_b[:, None], axis=1)[:, 0]


def accept_greedy(draft_bk1, target_bk):
    """(accepted draft count n [B], bonus token [B]) for greedy verification against the target's
    greedy tokens [B, K] at the K verified positions."""
    n = jnp.cumprod(draft_bk1 == target_bk[:, :-1], axis=1).sum(axis=1).astype(jnp.int32)
    return n, _pick(target_bk, n)


def accept_sampled(draft_bk1, q_bk1v, p_bkv, keys_b):
    """Speculative rejection sampling with one key per row: accept draft i with probability
    min(1, p_i(d)/q_i(d)); at the first rejection n, sample from norm(max(0, p_n - q_n)); after a
    full accept, from p_K."""
    k_accept, k_bonus = jax.vmap(jax.random.split, out_axes=1)(keys_b)
    p_d = jnp.take_along_axis(p_bkv[:, :-1], draft_bk1[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q_bk1v, draft_bk1[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, p_d.shape[1:]))(k_accept)
    n = jnp.cumprod(u * q_d < p_d, axis=1).sum(axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q_bk1v, jnp.zeros_like(p_bkv[:, :1])], axis=1)  # position K-1: plain p
    residual = jnp.maximum(p_bkv - q_pad, 0.0)
    r = jnp.take_along_axis(residual, n[:, None, None], axis=1)[:, 0]
    p_n = jnp.take_along_axis(p_bkv, n[:, None, None], axis=1)[:, 0]
    mass = r.sum(axis=-1, keepdims=True)
    r = jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p_n)  # p == q exactly: resample from p
    return n, categorical_rows(k_bonus, jnp.log(r))


def _write_verified(cache: KVCache, layer_kv, start_b, positions_bk, valid_bk) -> KVCache:
    """`cache` with a round's K slots per row written at `start_b`: the accepted ones as given,
    the rest (rejected drafts, rows already done) zeroed and invalid, for the next round to
    overwrite.

    Zeroing by `valid_bk` makes the written values depend on the verification's outcome, so XLA
    orders the write after the round's forwards have read the cache and updates it in place;
    written as they come (the keys of a layer are ready before its attention reads the cache),
    every cache tensor was copied twice a round."""
    keep = valid_bk[:, :, None, None]
    accepted = [(jnp.where(keep, k, 0), jnp.where(keep, v, 0)) for k, v in layer_kv]
    return cache.write_rows(accepted, start_b, jnp.where(valid_bk, positions_bk, 0), valid_bk)


@partial(
    arithmetic.jit,
    static_argnames=("t_graph", "d_graph", "max_new_tokens", "block", "temperature", "top_p", "eos_ids", "pad_id"),
)
def _generate(t_graph, t_state, d_graph, d_state, tokens_bl, valid_bl, row_ids_b, key, *, max_new_tokens, block,
              temperature, top_p, eos_ids, pad_id):
    target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    dcfg = drafter.config
    b, lp = tokens_bl.shape
    k_blk = block
    capacity = lp + max_new_tokens + k_blk
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    sampled = temperature > 0.0
    hidden_layers = dcfg.hidden_layers
    arange_k = jnp.arange(k_blk, dtype=jnp.int32)

    # prefill: the prompt's KV, the first token, the prompt's context features
    positions = positions_from_valid(valid_bl)
    out = target(tokens_bl, positions, valid_bl=valid_bl, hidden_layers=hidden_layers, compute_logits=False)
    zeros_b = jnp.zeros((b,), jnp.int32)
    tcache = KVCache.init(target.config, b, capacity).write_rows(out.chunk_kv, zeros_b, positions, valid_bl)
    ctx = drafter.context(context_features(target, dcfg, out.layer_hidden))
    dcache = KVCache.init(dcfg.layer_model_config(), b, capacity).write_rows(
        drafter.context_kv(ctx, positions), zeros_b, positions, valid_bl)
    if sampled:  # from the prompt's last position only: its [B, L, V] logits are never made
        last_logits = target.lm_logits(out.hidden[:, -1])
        first = categorical_rows(row_keys(key, row_ids_b, 0), jnp.log(_probs(last_logits, temperature, top_p)))
    else:
        first = greedy_tokens(target, out.hidden[:, -1:])[:, 0]
    first = first.astype(jnp.int32)
    generated = jnp.full((b, max_new_tokens + 1), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos) | (max_new_tokens <= 1)

    def cond(carry):
        return ~jnp.all(carry["done"])

    def body(c):
        active = ~c["done"]
        k_draft, k_verify = jax.vmap(jax.random.split, out_axes=1)(row_keys(key, row_ids_b, c["round"] + 1))
        bpos = c["pos"][:, None] + arange_k
        blk = jnp.concatenate([c["last"][:, None], jnp.full((b, k_blk - 1), dcfg.mask_token_id, jnp.int32)], axis=1)
        d_hidden = block_hidden(drafter, target, blk, bpos, tuple(zip(c["dcache"].k, c["dcache"].v)),
                                c["dcache"].positions, c["dcache"].valid)[:, 1:]
        if sampled:
            q = _probs(target.lm_logits(d_hidden), temperature, top_p)
            draft = categorical_rows(k_draft, jnp.log(q))
        else:  # greedy: no logits where residual_argmax runs as a kernel
            draft = greedy_tokens(target, d_hidden)
        verify = jnp.concatenate([c["last"][:, None], draft], axis=1)
        out = target(verify, bpos, valid_bl=jnp.ones((b, k_blk), bool), cache=c["tcache"], hidden_layers=hidden_layers,
                     compute_logits=False)
        if sampled:
            n, bonus = accept_sampled(draft, q, _probs(target.lm_logits(out.hidden), temperature, top_p), k_verify)
        else:
            n, bonus = accept_greedy(draft, greedy_tokens(target, out.hidden))

        # the tokens this round emits: n drafts then the bonus; cut at EOS and at max_new_tokens
        emitted = jnp.where(arange_k < n[:, None], jnp.concatenate([draft, draft[:, :1]], axis=1), bonus[:, None])
        in_round = arange_k <= n[:, None]
        is_eos = jnp.isin(emitted, eos) & in_round
        after_eos = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
        keep = in_round & ~after_eos & (c["count"][:, None] + arange_k < max_new_tokens) & active[:, None]
        cols = jnp.where(keep, c["count"][:, None] + arange_k, max_new_tokens)  # the last column is a sink
        generated = c["generated"].at[jnp.arange(b)[:, None], cols].set(jnp.where(keep, emitted, pad_id))
        count = c["count"] + keep.sum(axis=1).astype(jnp.int32)
        done = c["done"] | (is_eos & keep).any(axis=1) | (count >= max_new_tokens)

        valid = in_round & active[:, None]
        tcache = _write_verified(c["tcache"], out.chunk_kv, c["offset"], bpos, valid)
        ctx = drafter.context(context_features(target, dcfg, out.layer_hidden))
        dcache = _write_verified(c["dcache"], drafter.context_kv(ctx, bpos), c["offset"], bpos, valid)
        gained = jnp.where(active, n + 1, 0)  # the caches advance past every verified token
        return dict(
            round=c["round"] + 1, generated=generated, count=count, done=done,
            last=jnp.where(active, bonus, c["last"]), pos=c["pos"] + gained, offset=c["offset"] + gained,
            tcache=tcache, dcache=dcache,
            accepted=c["accepted"].at[:, c["round"]].set(keep.sum(axis=1).astype(jnp.int32)),
        )

    init = dict(
        round=jnp.zeros((), jnp.int32), generated=generated, count=jnp.ones((b,), jnp.int32), done=done,
        last=first, pos=positions[:, -1] + 1, offset=jnp.full((b,), lp, jnp.int32), tcache=tcache, dcache=dcache,
        accepted=jnp.zeros((b, max_new_tokens), jnp.int32),
    )
    out = jax.lax.while_loop(cond, body, init)
    return SpecResult(
        tokens=out["generated"][:, :max_new_tokens], num_generated=out["count"], target_forwards=out["round"],
        accepted=out["accepted"],
    )


def generate_with_drafter(
    target: Transformer,
    drafter: Drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    block: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    pad_id: int | None = None,
    row_ids=None,
    mesh=None,
    width: int | None = None,
) -> SpecResult:
    """Speculative decoding of token-id `prompts` (a batch, left-padded here) with `drafter`.

    `block` (default the drafter's block_size) is K: the drafter proposes K - 1 tokens per round.
    temperature 0 is greedy and gives the target's own greedy output token for token; otherwise
    rejection sampling keeps the target's (temperature, top_p) distribution exactly. `row_ids`
    (default: the index) keys each row's sampling stream. `width`: left-pad the prompts to at
    least this many tokens (`left_pad`).
    """
    cfg = target.config
    check_compatible(drafter.config, cfg)
    block = drafter.config.block_size if block is None else positive_int("block", block)  # 2.7 is no block
    if block < 2:
        raise InputError(f"block={block}: a drafter block needs at least 2 tokens (the last token + 1 proposal)")
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    temperature, top_p = sampling_options(temperature, top_p)
    eos_ids, pad_id = special_ids(cfg, eos_ids, pad_id)
    tokens, valid = left_pad(prompts, pad_id, width)
    # The last round may verify drafts past the end; they are cut, so only the output must fit
    # (as in DFlash, which shortens its last block instead).
    limit = min(cfg.max_position_embeddings, drafter.config.max_position_embeddings)
    if tokens.shape[1] + max_new_tokens > limit:
        raise InputError(
            f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_position_embeddings ({limit}) of the target or the drafter"
        )
    row_ids = batch_row_ids(row_ids, len(prompts))
    if mesh is not None:
        tokens, valid, row_ids = shard_batch((tokens, valid, row_ids), mesh)
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    return _generate(
        t_graph, t_state, d_graph, d_state, tokens, valid, row_ids, jax.random.key(seed),
        max_new_tokens=int(max_new_tokens),
        block=block, temperature=float(temperature), top_p=float(top_p), eos_ids=eos_ids, pad_id=int(pad_id),
    )


__all__ = ["SpecResult", "accept_greedy", "accept_sampled", "generate_with_drafter"]
