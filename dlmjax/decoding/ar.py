"""Plain autoregressive generation for the causal families, on the KV cache.

The whole loop is one `jax.jit`: a prefill forward writes the prompt's KV, then a
`lax.while_loop` appends one token per step. Rows are left-padded prompts; a row stops at its
first EOS and is padded after it. This is the reference that speculative decoders must match.
Sampling draws each row's step from its own key (seed, row id, step), so a sampled row does not
depend on its batch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dlmjax import arithmetic, kernels
from dlmjax.decoding.policies import categorical_rows, hidden_scores, nucleus_filter, row_keys
from dlmjax.models.transformer import KVCache, Transformer
from dlmjax.sharding import shard_batch
from dlmjax.validation import AT_LEAST_0, INT32_MAX, OPEN_UNIT, InputError, Range, check_value, positive_int

ROW_ID_RANGE = Range(0, INT32_MAX)  # sampling-stream ids are int32


@struct.dataclass
class ARResult:
    tokens: jax.Array  # [B, max_new_tokens] int32, `pad_id` after a row's EOS
    num_generated: jax.Array  # [B] int32, EOS included
    nfe: jax.Array  # int32 scalar: forwards that produced tokens (the prefill produces the first)


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Left-pad token lists to one length, `width` or else the longest prompt's: (tokens [B, L]
    int32, valid [B, L] bool). Left padding is invisible to every row (its keys are masked)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token")
    width = max([len(p) for p in prompts] + [width or 0])
    tokens = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    valid = [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool)


def batch_row_ids(row_ids, batch: int) -> jax.Array:
    """[B] int32 sampling-stream ids: the given ones (one per prompt), else 0..B-1."""
    if row_ids is None:
        return jnp.arange(batch, dtype=jnp.int32)
    if len(row_ids) != batch:
        raise InputError(f"row_ids has {len(row_ids)} entries for {batch} prompts; give one per prompt")
    ids = np.asarray(row_ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise InputError(f"row_ids must be one integer per prompt (got a {ids.ndim}-d {ids.dtype} array)")
    if len(ids) and not (ROW_ID_RANGE.low <= ids.min() and ids.max() <= ROW_ID_RANGE.high):
        raise InputError(f"row_ids must lie in [0, {ROW_ID_RANGE.high}] (they are int32 sampling-stream ids); got "
                         f"{ids.min()} .. {ids.max()}")
    return jnp.asarray(ids, jnp.int32)


def special_ids(cfg, eos_ids=None, pad_id=None) -> tuple[tuple[int, ...], int]:
    """(eos ids, pad id) of a causal decode: the given ones, else the config's; pad falls back
    to the first EOS, then 0."""
    eos_ids = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    pad_id = cfg.pad_token_id if pad_id is None else pad_id
    return eos_ids, int(pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0))


def positions_from_valid(valid_bl):
    """Per-row positions counting real tokens from 0 (padding gets 0; it is never attended)."""
    return jnp.maximum(jnp.cumsum(valid_bl.astype(jnp.int32), axis=1) - 1, 0)


def greedy_tokens(model: Transformer, hidden_bkd):
    """[B, K] the argmax of the model's logits at final-normed hidden states [B, K, D]: through
    `kernels.residual_argmax` where it runs as a kernel (no [B, K, V] logits are made), else the
    logits' argmax."""
    if kernels.choose("residual_argmax") is None:
        return jnp.argmax(model.lm_logits(hidden_bkd), axis=-1).astype(jnp.int32)
    return hidden_scores(model, hidden_bkd, mask_id=None).tokens


def sampling_options(temperature, top_p) -> tuple[float, float]:
    """(temperature, top_p) as floats, within the decoder specs' limits: temperature >= 0 (0 is
    greedy), top_p in (0, 1]; anything else is refused, not decoded greedily or unfiltered."""
    return (float(check_value("temperature", temperature, "float", AT_LEAST_0)),
            float(check_value("top_p", top_p, "float", OPEN_UNIT)))


def sample_token(model: Transformer, hidden_bd, keys_b, temperature: float, top_p: float):
    """The next token from the last final-normed hidden state [B, D]: greedy when temperature == 0
    (`greedy_tokens`); otherwise temperature + nucleus sampling of its logits, row b with key b."""
    if temperature == 0.0:
        return greedy_tokens(model, hidden_bd[:, None])[:, 0]
    logits = model.lm_logits(hidden_bd).astype(jnp.float32) / temperature
    if top_p < 1.0:
        logits = nucleus_filter(logits, top_p)
    return categorical_rows(keys_b, logits)


@partial(arithmetic.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p", "eos_ids", "pad_id"))
def _generate(graphdef, state, tokens_bl, valid_bl, row_ids_b, key, *, max_new_tokens, temperature, top_p, eos_ids,
              pad_id):
    model = nnx.merge(graphdef, state)
    b, lp = tokens_bl.shape
    positions = positions_from_valid(valid_bl)
    # the loop carries the last position's hidden state: the prompt's [B, L, V] logits are never made
    out = model(tokens_bl, positions, valid_bl=valid_bl, compute_logits=False)
    cache = KVCache.init(model.config, b, lp + max_new_tokens).append(out.chunk_kv, positions, valid_bl)
    next_pos = positions[:, -1] + 1
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

    def cond(carry):
        step, _, done, *_ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, generated, done, hidden, cache, nfe = carry
        token = sample_token(model, hidden, row_keys(key, row_ids_b, step), temperature, top_p)
        token = jnp.where(done, pad_id, token)
        generated = generated.at[:, step].set(token)
        done = done | jnp.isin(token, eos)
        more = (step + 1 < max_new_tokens) & ~jnp.all(done)

        positions = (next_pos + step)[:, None]

        def forward():
            out = model(token[:, None], positions, cache=cache, compute_logits=False)
            return out.hidden[:, -1], out.chunk_kv

        def last():  # the loop ends after this step: no forward, and what is written is never read
            return hidden, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(forward)[1])

        # The token's KV is written after the branch: XLA copies a whole cache a branch returns.
        hidden, new_kv = jax.lax.cond(more, forward, last)
        cache = cache.append(new_kv, positions, jnp.ones(positions.shape, bool))
        return step + 1, generated, done, hidden, cache, nfe + more

    init = (
        jnp.zeros((), jnp.int32),
        jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        jnp.zeros((b,), bool),
        out.hidden[:, -1],
        cache,
        jnp.ones((), jnp.int32),
    )
    _, generated, _, _, _, nfe = jax.lax.while_loop(cond, body, init)
    is_eos = jnp.isin(generated, eos)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
    # A row that is done emits pad, so the count is up to and including its EOS.
    return ARResult(tokens=generated, num_generated=first_eos.astype(jnp.int32), nfe=nfe)


def generate_ar(
    model: Transformer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    pad_id: int | None = None,
    row_ids=None,
    mesh=None,
    width: int | None = None,
) -> ARResult:
    """Generate for a batch of token-id prompts with a causal model; with `mesh`, the batch is
    split over its 'data' axis (the batch size must divide by it). `row_ids` (default: the index)
    keys each row's sampling stream (`batch_row_ids`). `width`: left-pad the prompts to at least
    this many tokens (`left_pad`), so that batches of different prompt lengths share a program."""
    cfg = model.config
    if cfg.attention != "causal":
        raise InputError(f"AR generation needs a causal model; {cfg.family} is {cfg.attention} (use a diffusion decoder)")
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    temperature, top_p = sampling_options(temperature, top_p)
    eos_ids, pad_id = special_ids(cfg, eos_ids, pad_id)
    tokens, valid = left_pad(prompts, pad_id, width)
    if tokens.shape[1] + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(
            f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings ({cfg.max_position_embeddings})"
        )
    row_ids = batch_row_ids(row_ids, len(prompts))
    if mesh is not None:
        tokens, valid, row_ids = shard_batch((tokens, valid, row_ids), mesh)
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef, state, tokens, valid, row_ids, jax.random.key(seed),
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_ids=eos_ids, pad_id=int(pad_id),
    )
