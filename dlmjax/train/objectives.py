"""Training losses: masked block diffusion (SDAR-style) and next-token prediction. Both read the
model's log p(token) and argmax through `losses.label_scores_from_hidden`, a chunk of positions'
logits at a time, so a batch's [B, L, V] logits are never held at once.

Block diffusion trains every block of a row in one forward, as at decoding time: a block is
denoised while the blocks before it are clean. The forward runs over `[noisy ; clean]` (length
2L, positions repeated): a noisy token sees the noisy tokens of its own block and the clean
tokens of earlier blocks; a clean token sees clean tokens of its block and earlier ones (the
block-causal model itself). Each (row, block) draws its own mask rate t ~ U(0, 1); prompt tokens
are never masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlmjax.losses import label_scores_from_hidden
from dlmjax.models import layers

WEIGHTINGS = ("none", "inverse_t")


def block_diffusion_visibility(positions_bl, valid_bl, block: int):
    """[B, 2L, 2L] visibility for the `[noisy ; clean]` layout (see module docstring)."""
    blk = positions_bl // block
    q_blk, k_blk = blk[:, :, None], blk[:, None, :]
    valid_k = valid_bl[:, None, :]
    noisy_sees_noisy = (q_blk == k_blk) & valid_k
    noisy_sees_clean = (k_blk < q_blk) & valid_k
    clean_sees_clean = (k_blk <= q_blk) & valid_k
    top = jnp.concatenate([noisy_sees_noisy, noisy_sees_clean], axis=2)
    bottom = jnp.concatenate([jnp.zeros_like(clean_sees_clean), clean_sees_clean], axis=2)
    return jnp.concatenate([top, bottom], axis=1)


def noisy_half_hidden(hidden_b2ld, block: int, shift: bool):
    """[B, L, D] hidden states that score the noisy half's tokens of a `[noisy ; clean]` forward
    (length 2L): the noisy half's own; for a shifted-logit model (Fast-dLLM v2: the logits at p
    come from the column before) the column before each position: p - 1 of its noisy block, for a
    block's first position the last of the clean block before (where generation takes that token
    from), and for position 0 its own."""
    l = hidden_b2ld.shape[1] // 2
    noisy, clean = hidden_b2ld[:, :l], hidden_b2ld[:, l:]
    if not shift:
        return noisy
    starts = (jnp.arange(1, l) % block == 0)[None, :, None]
    return jnp.concatenate([noisy[:, :1], jnp.where(starts, clean[:, :-1], noisy[:, :-1])], axis=1)


MASK_RATES = ("per_block", "per_row")


def mask_blocks(key, tokens_bl, target_bl, positions_bl, *, block: int, mask_id: int, rate: str = "per_block"):
    """(noisy tokens, masked [B, L] bool, t [B, L] the mask rate at each position).

    rate "per_block": each (row, block) draws its own t ~ U(1e-3, 1); "per_row": one t per row for
    all its blocks (the MRP reference's per-sample draw, p = (1 - 1e-3) t + 1e-3)."""
    if rate not in MASK_RATES:
        raise ValueError(f"mask rate {rate!r}; choose one of {', '.join(MASK_RATES)}")
    b, l = tokens_bl.shape
    num_blocks = -(-l // block) if rate == "per_block" else 1
    t_key, m_key = jax.random.split(key)
    t_bn = jax.random.uniform(t_key, (b, num_blocks), minval=1e-3, maxval=1.0)
    t_bl = jnp.take_along_axis(t_bn, positions_bl // block, axis=1) if rate == "per_block" else jnp.broadcast_to(t_bn, (b, l))
    masked = target_bl & (jax.random.uniform(m_key, (b, l)) < t_bl)
    return jnp.where(masked, mask_id, tokens_bl), masked, t_bl


def block_diffusion_loss(model, batch, key, *, block: int, mask_id: int, weighting: str = "none"):
    """Masked cross-entropy over masked target tokens; returns (loss, metrics).

    weighting "none": mean over masked tokens (learns fastest on the toy tasks);
    "inverse_t": the ELBO weighting sum(CE / t) / number of target tokens.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"loss weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    tokens, valid, target = batch["tokens"], batch["valid"], batch["target"]
    b, l = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    noisy, masked, t = mask_blocks(key, tokens, target, positions, block=block, mask_id=mask_id)
    out = model(
        jnp.concatenate([noisy, tokens], axis=1),
        jnp.concatenate([positions, positions], axis=1),
        visible_bll=block_diffusion_visibility(positions, valid, block),
        compute_logits=False,
    )
    scores = label_scores_from_hidden(noisy_half_hidden(out.hidden, block, model.config.shift_logits),
                                      model.lm_logits, tokens)
    m = masked.astype(jnp.float32)
    if weighting == "none":
        loss = -jnp.sum(scores.logp * m) / jnp.maximum(jnp.sum(m), 1.0)
    else:
        loss = -jnp.sum(scores.logp * m / t) / jnp.maximum(jnp.sum(target), 1)
    accuracy = jnp.sum(scores.right * m) / jnp.maximum(jnp.sum(m), 1.0)
    return loss, {"loss": loss, "token_accuracy": accuracy, "masked_tokens": jnp.sum(m)}


def next_token_loss(model, batch, key=None):
    """Causal LM loss on the target tokens (position i predicts token i + 1)."""
    del key
    tokens, valid, target = batch["tokens"], batch["valid"], batch["target"]
    hidden = model(tokens, valid_bl=valid, compute_logits=False).hidden
    if model.config.shift_logits:  # the column whose logits the model's own output puts at each position
        hidden = layers.shift_right(hidden)
    scores = label_scores_from_hidden(hidden[:, :-1], model.lm_logits, tokens[:, 1:])
    m = target[:, 1:].astype(jnp.float32)
    loss = -jnp.sum(scores.logp * m) / jnp.maximum(jnp.sum(m), 1.0)
    accuracy = jnp.sum(scores.right * m) / jnp.maximum(jnp.sum(m), 1.0)
    return loss, {"loss": loss, "token_accuracy": accuracy, "masked_tokens": jnp.sum(m)}
