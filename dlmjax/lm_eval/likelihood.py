"""Log-likelihoods of continuations: exact for causal models, a masked-diffusion Monte Carlo
bound for diffusion models.

Causal (`causal_logprobs`): the sum of the continuation's next-token log-probs and whether every
continuation token is the argmax (lm-eval's `is_greedy`).

Diffusion (`masked_diffusion_bound`): the lower bound on log p(continuation | context) that
LLaDA's evaluation estimates. The context is never masked. The continuation is split into
groups that are denoised independently: the whole continuation for a bidirectional model
(LLaDA, Dream); each block of a block-causal model (SDAR), whose noisy block sees only its own
tokens and the clean blocks before it (what the training layout `[noisy ; clean]`,
`dlmjax.train.objectives.block_diffusion_visibility`, sees; computed here from one KV cache of the
clean row, `_block_scoring_hidden`). A shifted-logit model (Dream, Fast-dLLM v2)
scores position p from the column before it, as its logits are (on a block-causal one, the
columns `objectives.noisy_half_hidden` picks). In a group of T continuation tokens, a
sample draws l uniformly from 1..T, masks l of the T tokens uniformly at random and scores

    (T / l) * sum over the masked tokens of log p(token | context, unmasked tokens)

whose expectation is the group's bound (the discrete form of the ELBO: equal to E_t of the
1/t-weighted loss with t ~ U(0, 1)). A sample's value is the sum over groups; the estimate is
the mean over `mc_num` samples. Masks are drawn on the host from a generator seeded by
(seed, the request's tokens), so a request's estimate depends on nothing else (not its batch,
not its position).

Greedy-ness (`greedy_continuation`, LLaDA's `is_check_greedy`): the continuation is masked after
the context and revealed one position per forward, the most confident masked position (of the
first unfinished block, for a block-causal model) taking its argmax; the continuation is greedy
if that gives it back.

A `suffix` (Dream's evaluation appends EOS) follows the continuation, clean and never masked: the
bound is then on log p(continuation | context, suffix after it).

Classifier-free guidance (`cfg` > 0, LLaDA's unsupervised guidance): each noisy row is also
forwarded with its context masked too (in the same forward), and the log-probs are taken from
the logits  u + (cfg + 1) (c - u),  c the row's and u the context-masked row's, as LLaDA's
evaluation scores them. Those logits are made for the scored window only, and never by the
`residual_argmax` kernel, which cannot combine two forwards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax import arithmetic, kernels
from dlmjax.decoding import policies
from dlmjax.decoding.engine import copy_parts
from dlmjax.losses import label_scores
from dlmjax.models import layers
from dlmjax.models.transformer import KVCache, Transformer, take_rows

LENGTH_BUCKET = 16  # sequences are right-padded to a multiple of this: few compiled shapes


def _bucket(length: int) -> int:
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


def _pad_rows(rows: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, width] right-padded, valid [B, width])."""
    tokens = np.full((len(rows), width), pad_id, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        valid[i, : len(row)] = True
    return tokens, valid


def token_logprobs(model: Transformer, hidden_bkd, tokens_bk):
    """(log p(token) [B, K], whether the token is the argmax [B, K]) at final-normed hidden states
    [B, K, D]: from the [B, K, V] logits, or where `residual_argmax` runs as a kernel without them
    (`policies.hidden_token_logprobs`)."""
    if kernels.choose("residual_argmax") is None:
        return label_scores(model.lm_logits(hidden_bkd), tokens_bk)
    logp, best = policies.hidden_token_logprobs(model, hidden_bkd, tokens_bk, mask_id=None)
    return logp, best.tokens == tokens_bk


# ---------------------------------------------------------------------------------------- causal


@partial(arithmetic.jit, static_argnames=("graphdef", "span"))
def _next_token_scores(graphdef, params, inputs_bl, targets_bl, valid_bl, first_b, *, span: int):
    """(log p(target i | inputs <= i), target i == argmax) at the `span` positions from each row's
    `first_b`: [B, span] each. Only those positions get logits: a continuation is short where its
    context is long, and [B, L, V] logits of the whole row would be the largest array here."""
    model = nnx.merge(graphdef, params)
    hidden = model(inputs_bl, valid_bl=valid_bl, compute_logits=False).hidden
    return token_logprobs(model, take_rows(hidden, first_b, span), take_rows(targets_bl, first_b, span))


def causal_logprobs(model: Transformer, pairs: list[tuple[list[int], list[int]]], *, batch_size: int = 8,
                    pad_id: int = 0, prefix_id: int | None = None) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probs, whether greedy decoding gives it) per (context ids,
    continuation ids) pair; the model reads context + continuation less its last token.

    A causal model has nothing to predict a first token from: an empty context is conditioned on
    `prefix_id` (lm-eval's rule, its HF model's `prefix_token_id`: BOS, else EOS), and is an error
    without one (it would otherwise score the continuation's first token from nothing)."""
    if model.config.attention != "causal":
        raise ValueError(f"causal_logprobs needs a causal model; this one is {model.config.attention}")
    if any(not ctx for ctx, _ in pairs):
        if prefix_id is None:
            raise ValueError("an empty context leaves the continuation's first token unconditioned; pass "
                             "prefix_id (the BOS or EOS id, as lm-eval conditions on) or a non-empty context")
        pairs = [(list(ctx) or [prefix_id], cont) for ctx, cont in pairs]
    if any(not cont for _, cont in pairs):
        raise ValueError("an empty continuation: there is nothing to score")
    graphdef, params = nnx.split(model)
    results = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        rows_run = min(batch_size, 1 << (len(chunk) - 1).bit_length())  # a few compiled shapes per length bucket
        padded = chunk + [chunk[0]] * (rows_run - len(chunk))
        rows = [ctx + cont for ctx, cont in padded]
        width = _bucket(max(map(len, rows)) - 1)
        inputs, valid = _pad_rows([r[:-1] for r in rows], width, pad_id)
        targets, _ = _pad_rows([r[1:] for r in rows], width, pad_id)
        # input j-1 predicts token j: each row's continuation is read from input len(ctx) - 1, in a
        # window of `span` inputs that ends within the row's width
        span = min(_bucket(max(len(cont) for _, cont in padded)), width)
        first = np.asarray([min(len(ctx) - 1, width - span) for ctx, _ in padded], np.int32)
        logp, greedy = jax.device_get(_next_token_scores(graphdef, params, inputs, targets, valid, first, span=span))
        for i, (ctx, cont) in enumerate(chunk):
            read = slice(len(ctx) - 1 - first[i], len(ctx) - 1 - first[i] + len(cont))
            results.append((float(np.sum(logp[i, read], dtype=np.float64)), bool(np.all(greedy[i, read]))))
    return results


# ------------------------------------------------------------------------------------- diffusion


@dataclass(frozen=True)
class MaskSamples:
    """`mc` masking patterns of one request: noisy tokens, which positions are masked, and each
    masked position's weight T/l (its group's continuation length over its mask count)."""

    tokens: np.ndarray  # [L] the clean sequence
    masked: np.ndarray  # [S, L] bool
    weight: np.ndarray  # [S, L] float32, 0 where not masked


def continuation_groups(context_len: int, total_len: int, block_size: int | None,
                        suffix_len: int = 0) -> np.ndarray:
    """[L] group id of each position: -1 for the context and the suffix (never masked), else 0 for
    a bidirectional model's whole continuation, or the position's block for a block-causal model."""
    positions = np.arange(total_len)
    groups = positions // block_size if block_size else np.zeros(total_len, np.int64)
    return np.where((positions < context_len) | (positions >= total_len - suffix_len), -1, groups)


def sample_masks(context: list[int], continuation: list[int], *, mc_num: int, seed: int,
                 block_size: int | None, suffix: list[int] = ()) -> MaskSamples:
    """LLaDA-style masking patterns: per sample and group, l ~ U{1..T}, l of the T tokens masked."""
    tokens = np.asarray(list(context) + list(continuation) + list(suffix), np.int32)
    digest = zlib.crc32(tokens.tobytes())
    rng = np.random.default_rng([seed, digest])
    groups = continuation_groups(len(context), len(tokens), block_size, len(suffix))
    masked = np.zeros((mc_num, len(tokens)), bool)
    weight = np.zeros((mc_num, len(tokens)), np.float32)
    for group in np.unique(groups[groups >= 0]):
        cols = np.flatnonzero(groups == group)
        size = len(cols)
        counts = rng.integers(1, size + 1, size=mc_num)  # l per sample
        ranks = np.argsort(np.argsort(rng.random((mc_num, size)), axis=1), axis=1)  # a random order
        chosen = ranks < counts[:, None]
        masked[:, cols] = chosen
        weight[:, cols] = np.where(chosen, size / counts[:, None], 0.0)
    return MaskSamples(tokens, masked, weight)


@partial(arithmetic.jit, static_argnames=("graphdef", "block_size"))
def _clean_state(graphdef, params, clean_cl, valid_l, *, block_size: int):
    """What every masking pattern of a block-causal model reads from the clean rows `clean_cl`
    [C, L]: (KV cache with every key seen by later blocks only, final-normed hidden [C, L, D]),
    from one forward of those rows, block-causal as their half of the layout `[noisy ; clean]`
    sees. (A bidirectional model's noisy rows are forwarded whole and read no clean state.)"""
    model = nnx.merge(graphdef, params)
    c, length = clean_cl.shape
    positions_cl = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (c, length))
    clean = model(clean_cl, positions_cl, valid_bl=jnp.broadcast_to(valid_l, (c, length)),
                  cache=KVCache.init(model.config, c, length), write_cache=True, compute_logits=False)
    return _seen_by_later_blocks(clean.cache, block_size), clean.hidden


def _scoring_hidden(model: Transformer, noisy_bl, clean_state, valid_l, first, *, span: int, block_size):
    """[B, span, D] the final-normed hidden states that score the `span` positions from `first`
    of the noisy rows (for a shifted-logit model, the column before each). A block-causal model
    computes only what those need (`_block_scoring_hidden`) from its `_clean_state`."""
    if block_size:
        return _block_scoring_hidden(model, noisy_bl, clean_state, valid_l, first, span=span, block_size=block_size)
    hidden = model(noisy_bl, valid_bl=jnp.broadcast_to(valid_l, noisy_bl.shape), compute_logits=False).hidden
    if model.config.shift_logits:  # Dream: p scored from p - 1 and 0 from itself, as its logits are
        hidden = layers.shift_right(hidden)
    return take_rows(hidden, jnp.full(noisy_bl.shape[:1], first, jnp.int32), span)


def _seen_by_later_blocks(cache: KVCache, block_size: int) -> KVCache:
    """The cache with every key's position one block later. A cached key's position decides only
    who sees it (its rotary angle was applied when it was written), so block-causal visibility,
    block(key) <= block(query), becomes block(key) < block(query): a noisy block sees the clean
    blocks before its own and not its own clean copy."""
    return cache.replace(positions=cache.positions + block_size)


def _block_scoring_hidden(model: Transformer, noisy_bl, clean_state, valid_l, first, *, span: int, block_size: int):
    """`_scoring_hidden` of a block-causal model: the training layout `[noisy ; clean]` (each noisy
    block sees its own noisy tokens and the clean blocks before it), computed without the 2L x 2L
    attention of that layout's one forward, and with the clean tokens forwarded once
    (`_clean_state`: C clean rows; the B noisy rows take them in turn, the first B / C rows the
    first, and so on).

    Each noisy row forwards only the blocks that hold the read positions, against its clean row's
    cache, every block a segment of its own so that no block sees another. Rows of one clean row
    go `_packed_copies` at a time side by side in one forward row (as PSD's verification packs
    drafts), against one copy of the cache: packing more saves copies of the cache (memory) and
    costs attention among the packed columns (FLOPs), and packing up to the cache's length keeps
    that attention within the cache's own. Where a shifted-logit model scores a block's first
    position from the column before it, that column is the clean block's last, taken from the
    clean forward."""
    cache, clean_hidden = clean_state
    c, length = clean_hidden.shape[:2]
    rows = noisy_bl.shape[0]
    # the blocks from the one holding `first` to the one holding first + span - 1, in a static
    # width that also fits where those blocks start late in the row
    width = min(length, span + 2 * block_size - 2)
    start = jnp.minimum(first - first % block_size, length - width)
    columns = start + jnp.arange(width, dtype=jnp.int32)
    packed = _packed_copies(rows // c, width, length)
    forward_rows = rows // packed
    per_forward_row = lambda x: jnp.repeat(x, forward_rows // c, axis=0)  # noqa: E731  clean row i -> its rows
    cache = cache.replace(k=tuple(map(per_forward_row, cache.k)), v=tuple(map(per_forward_row, cache.v)),
                          positions=per_forward_row(cache.positions), valid=per_forward_row(cache.valid))
    blocks_per_row = -(-length // block_size)
    segments = jnp.arange(packed, dtype=jnp.int32)[:, None] * blocks_per_row + columns // block_size + 1
    as_forward_rows = lambda x: jnp.broadcast_to(x.reshape(-1), (forward_rows, packed * width))  # noqa: E731
    chunk = model(
        jax.lax.dynamic_slice_in_dim(noisy_bl, start, width, axis=1).reshape(forward_rows, packed * width),
        as_forward_rows(jnp.tile(columns, packed)), segments_bl=as_forward_rows(segments),
        valid_bl=as_forward_rows(jnp.tile(jax.lax.dynamic_slice_in_dim(valid_l, start, width), packed)),
        cache=cache, chunk_parts=copy_parts(packed, width), compute_logits=False,
    ).hidden.reshape(rows, width, -1)
    offset = jnp.full((rows,), first - start, jnp.int32)
    own = take_rows(chunk, offset, span)
    if not model.config.shift_logits:
        return own
    # column p - 1 for each read p: of the noisy chunk, or for a block's first position of the clean
    # row (the chunk's own column before `start` is never read: `start` is a block's first position)
    before = take_rows(jnp.pad(chunk, ((0, 0), (1, 0), (0, 0))), offset, span)
    clean_before = jax.lax.dynamic_slice_in_dim(jnp.pad(clean_hidden, ((0, 0), (1, 0), (0, 0))), first, span, axis=1)
    read = (first + jnp.arange(span))[None, :, None]
    before = jnp.where(read % block_size == 0, jnp.repeat(clean_before, rows // c, axis=0), before)
    return jnp.where(read == 0, own, before)  # position 0 scores from itself


def _packed_copies(copies: int, width: int, length: int) -> int:
    """How many of a clean row's `copies` noisy chunks of `width` columns one forward row packs:
    the most that divides `copies` and fits the cache's `length` (at least 1)."""
    return max(n for n in range(1, copies + 1) if copies % n == 0 and (n == 1 or n * width <= length))


@partial(arithmetic.jit, static_argnames=("graphdef", "span", "block_size", "mask_id", "cfg"))
def _masked_scores(graphdef, params, clean_l, masked_bl, valid_l, first, context_l, clean_state, *, span, block_size,
                   mask_id, cfg=0.0):
    """log p(clean token | the noisy row) at the `span` positions from `first`: [B, span] (read
    where masked), for the B masking patterns `masked_bl` of the one sequence `clean_l` [L], whose
    `_clean_state` is given. Only those positions, the continuation's, get logits. With `cfg` > 0,
    from the guided logits (module docstring; `context_l` marks the context, and the clean state
    is that of [clean, clean with the context masked])."""
    model = nnx.merge(graphdef, params)
    noisy = jnp.where(masked_bl, mask_id, clean_l)
    labels = jax.lax.dynamic_slice_in_dim(jnp.broadcast_to(clean_l, masked_bl.shape), first, span, axis=1)
    score = partial(_scoring_hidden, model, clean_state=clean_state, valid_l=valid_l, first=first, span=span,
                    block_size=block_size)
    if not cfg:
        return token_logprobs(model, score(noisy), labels)[0]
    unconditional = jnp.where(context_l, mask_id, noisy)  # the context masked wherever it is seen
    conditional, guide = jnp.split(model.lm_logits(score(jnp.concatenate([noisy, unconditional]))).astype(jnp.float32), 2)
    return label_scores(guide + (cfg + 1) * (conditional - guide), labels).logp


def masked_logprobs(model: Transformer, clean: np.ndarray, masked: np.ndarray, *, mask_id: int,
                    pad_id: int = 0, cfg: float = 0.0, context_len: int = 0, batch_size: int | None = None) -> np.ndarray:
    """[S, L] log-probs of the clean tokens at the masked positions of each pattern (0 elsewhere)
    for one sequence `clean` [L] under its masking patterns `masked` [S, L], `batch_size`
    patterns per forward (all at once by default); with `cfg` > 0, guided against the rows with
    their first `context_len` tokens masked too. A block-causal model forwards the clean row once
    for all of them (`_clean_state`)."""
    if cfg < 0:
        raise ValueError(f"cfg={cfg} is negative; the guidance scale is 0 (none) or more, as in LLaDA's evaluation")
    if cfg and not context_len:
        raise ValueError("cfg guides the continuation against the context masked out; there is no context here "
                         "(pass context_len, or cfg=0)")
    block = model.config.block_size if model.config.attention == "block_causal" else None
    width = _bucket(len(clean))
    tokens, valid = _pad_rows([clean.tolist()], width, pad_id)
    context = np.arange(width) < context_len
    mask = np.zeros((len(masked), width), bool)
    mask[:, : len(clean)] = masked
    read = np.flatnonzero(masked.any(axis=0))  # the columns any pattern masks: the continuation's
    if read.size == 0:
        return np.zeros(masked.shape)
    span = min(_bucket(read[-1] - read[0] + 1), width)
    first = min(int(read[0]), width - span)
    graphdef, params = nnx.split(model)
    clean_rows = np.stack([tokens[0], np.where(context, mask_id, tokens[0])]) if cfg else tokens
    clean_state = _clean_state(graphdef, params, clean_rows, valid[0], block_size=block) if block else None
    batch_size = batch_size or len(mask)
    full = np.zeros(mask.shape, np.float32)
    for start in range(0, len(mask), batch_size):
        patterns = mask[start : start + batch_size]
        rows = len(patterns)
        if rows < batch_size:  # one compiled shape: pad with copies, dropped below
            patterns = np.concatenate([patterns, np.repeat(patterns[:1], batch_size - rows, axis=0)])
        scores = _masked_scores(graphdef, params, tokens[0], patterns, valid[0], np.int32(first), context, clean_state,
                                span=span, block_size=block, mask_id=mask_id, cfg=float(cfg))
        full[start : start + rows, first : first + span] = np.asarray(jax.device_get(scores))[:rows]
    return np.where(masked, full[:, : len(clean)], 0.0)


@partial(arithmetic.jit, static_argnames=("graphdef", "block_size", "mask_id", "cfg"))
def _reveal_most_confident(graphdef, params, tokens_bl, valid_bl, context_bl, *, block_size, mask_id, cfg=0.0):
    """The rows with one more masked position revealed: the most confident (of the first block
    with a masked position, for a block-causal model) takes its argmax; the mask id is never
    proposed. With `cfg`, from the guided logits."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens_bl, valid_bl=valid_bl).logits.astype(jnp.float32)
    if cfg:
        guide = model(jnp.where(context_bl, mask_id, tokens_bl), valid_bl=valid_bl).logits.astype(jnp.float32)
        logits = guide + (cfg + 1) * (logits - guide)
    scores = policies.score(logits, mask_id=mask_id)
    masked = tokens_bl == mask_id
    if block_size:  # the first block that still has a masked position
        blocks = jnp.arange(tokens_bl.shape[1]) // block_size
        first = jnp.min(jnp.where(masked, blocks, tokens_bl.shape[1]), axis=1, keepdims=True)
        masked &= blocks == first
    return jnp.where(policies.top_k_mask(scores.confidence, masked, 1), scores.tokens, tokens_bl)


def greedy_continuation(model: Transformer, context: list[int], continuation: list[int], *, mask_id: int,
                        pad_id: int = 0, cfg: float = 0.0) -> bool:
    """Whether greedy decoding from `context` gives `continuation` (module docstring): one forward
    per continuation token."""
    block = model.config.block_size if model.config.attention == "block_causal" else None
    width = _bucket(len(context) + len(continuation))
    tokens, valid = _pad_rows([list(context) + [mask_id] * len(continuation)], width, pad_id)
    context_bl = np.arange(width)[None] < len(context)
    graphdef, params = nnx.split(model)
    for _ in continuation:
        tokens = _reveal_most_confident(graphdef, params, tokens, valid, context_bl, block_size=block,
                                        mask_id=mask_id, cfg=float(cfg))
    return np.asarray(tokens)[0, len(context) : len(context) + len(continuation)].tolist() == list(continuation)


def masked_diffusion_bound(model: Transformer, context: list[int], continuation: list[int], *, mc_num: int,
                           seed: int, mask_id: int, batch_size: int = 32, pad_id: int = 0, cfg: float = 0.0,
                           suffix: list[int] = (), return_samples: bool = False):
    """The Monte Carlo estimate of the masked-diffusion bound on log p(continuation | context)
    (module docstring): the mean over `mc_num` samples, run `batch_size` samples per forward,
    guided by `cfg` where it is > 0, with `suffix` clean after the continuation. With
    `return_samples`, the per-sample values [mc_num] instead."""
    if not continuation:
        raise ValueError("the continuation is empty; there is nothing to score")
    block = model.config.block_size if model.config.attention == "block_causal" else None
    samples = sample_masks(context, continuation, mc_num=mc_num, seed=seed, block_size=block, suffix=suffix)
    logp = masked_logprobs(model, samples.tokens, samples.masked, mask_id=mask_id, pad_id=pad_id, cfg=cfg,
                           context_len=len(context), batch_size=min(batch_size, mc_num))
    values = np.sum(logp * samples.weight, axis=1, dtype=np.float64)
    return values if return_samples else float(values.mean())
