"""Training losses for MRP heads (ALGORITHMS.md section 1): the backbone is frozen, the head learns
the change of the backbone's logits once a few more masked tokens of a block are known.

Every forward uses the block-diffusion layout of `objectives.py`: `[noisy ; clean]` (length 2L,
positions repeated) under `block_diffusion_visibility`, so every block of a row trains at once
with the blocks before it clean, as at decoding time.

States of one row, with a noise level p = (1 - 1e-3) t + 1e-3, t ~ U(0, 1), drawn once per row
(`mask_rate="per_row"`, the reference's per-sample draw and the default) or per (row, block)
(`"per_block"`, as the backbone objective draws it):

    A   = x_t: each target token masked with probability p (prompt tokens never)
    B_1 = A with `gt_topk` random masked positions of every block revealed (ground truth)
    B_k = B_{k-1} with `gt_topk` more revealed, k = 2..n (n = chain_steps)

The frozen backbone gives l_A, h_A (noisy half of the forward over [A ; x_0]), h_clean (its clean
half, the same in every forward) and the targets l_{B_k}. Head chain step k (0-based) reads tokens
[B_{k+1} ; x_0] and hidden states [h_k ; h_clean] (h_0 = h_A; the clean half is never updated):

    logits_{k+1} = logits_k + s * lm_head(h_p),   h_{k+1} = h_k + s * h_p,   logits_0 = l_A

and is trained so that logits_{k+1} ~ l_{B_{k+1}} at the positions still masked in B_{k+1}. The
chain is not detached: step k's loss also trains the steps before it.

Losses (`loss`), per supervised position i, weighted by w_i = 1/p_i and normalised by the number
of supervised positions (sum_i w_i loss_i / #supervised; the reference divides by the number of
answer tokens instead, a per-batch constant factor):

    kd_diff  KL(softmax(l_B / T) || softmax(logits / T)) * T^2
    ce       cross-entropy of logits against the ground truth x_0
    mse      mean over the vocabulary of (logits - l_B)^2

The plain names supervise the last chain step; the `_sum` variants average the per-step losses
over the n steps (uniform 1/n). (The reference code's `_sum` means "A + C against B", which is what
every loss here does; its chain averaging is ours to name. Its plain `mse` compares the head's own
logits C with l_A, the spec's "mse (teacher A)", for a head whose output replaces the logits; with
the residual here, logits = l_A + C against l_A would only pull C to 0, so mse's teacher is l_B
as every other loss's.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dlmjax.heads.mrp import apply_residual, head_output
from dlmjax.train.objectives import block_diffusion_visibility, mask_blocks

LOSSES = ("kd_diff", "ce", "mse", "kd_diff_sum", "ce_sum", "mse_sum")


def reveal(key, clean_bl, noisy_bl, masked_bl, *, block: int, count: int):
    """(tokens, masked): `count` random masked positions of every block set to the ground truth
    (every masked position of a block that has fewer). Positions are 0..L-1, so block = index // block."""
    b, l = clean_bl.shape
    pad = -l % block
    score = jnp.where(masked_bl, jax.random.uniform(key, (b, l)), jnp.inf)  # masked first, in random order
    score = jnp.pad(score, ((0, 0), (0, pad)), constant_values=jnp.inf).reshape(b, -1, block)
    rank = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1).reshape(b, -1)[:, :l]
    chosen = masked_bl & (rank < count)
    return jnp.where(chosen, clean_bl, noisy_bl), masked_bl & ~chosen


def backbone_forward(model, noisy_bl, clean_bl, positions_bl, visible_bll):
    """(logits [B, L, V], hidden [B, L, D]) on the noisy half and hidden on the clean half of the
    frozen backbone's forward over [noisy ; clean]; no gradient flows into the backbone."""
    l = noisy_bl.shape[1]
    out = model(jnp.concatenate([noisy_bl, clean_bl], axis=1), jnp.concatenate([positions_bl, positions_bl], axis=1),
                visible_bll=visible_bll, compute_logits=False)
    hidden = jax.lax.stop_gradient(out.hidden)
    return jax.lax.stop_gradient(model.lm_logits(hidden[:, :l])), hidden[:, :l], hidden[:, l:]


def head_chain(head, model, states, clean_bl, positions_bl, visible_bll, logits_a, hidden_a, hidden_clean):
    """Corrected logits [B, L, V] after each chain step: step k reads [states[k] ; clean] with
    hidden [h_k ; h_clean] and adds its residual to the running logits of the noisy half (the
    clean half's residual is never read, so its [B, L, V] logits are not made)."""
    l = clean_bl.shape[1]
    positions_2l = jnp.concatenate([positions_bl, positions_bl], axis=1)
    logits, hidden, out = logits_a, hidden_a, []
    for k, state in enumerate(states):
        tokens_2l = jnp.concatenate([state, clean_bl], axis=1)
        hidden_2l = jnp.concatenate([hidden, hidden_clean], axis=1)
        h_p = head_output(head, model, k, tokens_2l, hidden_2l, positions_2l, visible_bll=visible_bll)[:, :l]
        logits, hidden, _ = apply_residual(head, model, h_p, logits, hidden)
        out.append(logits)
    return out


def kl_per_position(teacher_blv, student_blv, temperature: float = 1.0):
    """KL(softmax(teacher / T) || softmax(student / T)) * T^2 at every position, [B, L]."""
    t = jax.nn.log_softmax(teacher_blv / temperature, axis=-1)
    s = jax.nn.log_softmax(student_blv / temperature, axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1) * temperature**2


def per_position_loss(kind: str, logits, target_logits, tokens, temperature: float):
    """[B, L] loss of one chain step's corrected logits (kind without the `_sum` suffix)."""
    if kind == "kd_diff":
        return kl_per_position(target_logits, logits, temperature)
    if kind == "ce":
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    if kind == "mse":
        return jnp.mean(jnp.square(logits - target_logits), axis=-1)
    raise ValueError(f"MRP loss {kind!r}; choose one of {', '.join(LOSSES)}")


def masked_mean(values_bl, where_bl):
    w = where_bl.astype(jnp.float32)
    return jnp.sum(values_bl * w) / jnp.maximum(jnp.sum(w), 1.0)


def mrp_loss(head, model, batch, key, *, block: int, mask_id: int, loss: str = "kd_diff", gt_topk: int = 1,
             chain_steps: int = 1, temperature: float = 1.0, mask_rate: str = "per_row"):
    """(loss, metrics) of an MRP head on a frozen backbone for one batch (tokens, valid, target [B, L]).

    metrics: `loss`; `kl` = unweighted mean KL(l_B1 || l_A + C) at the first step's supervised
    positions, `kl_baseline` = the same without the residual, KL(l_B1 || l_A); `top1` and
    `top1_baseline` = how often the argmax agrees with l_B1's there; `supervised_tokens`."""
    if loss not in LOSSES:
        raise ValueError(f"MRP loss {loss!r}; choose one of {', '.join(LOSSES)}")
    tokens, valid, target = batch["tokens"], batch["valid"], batch["target"]
    b, l = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    visible = block_diffusion_visibility(positions, valid, block)
    mask_key, *reveal_keys = jax.random.split(key, chain_steps + 1)

    state, masked, p = mask_blocks(mask_key, tokens, target, positions, block=block, mask_id=mask_id, rate=mask_rate)
    logits_a, hidden_a, hidden_clean = backbone_forward(model, state, tokens, positions, visible)
    states, still_masked, targets = [], [], []
    for k in range(chain_steps):
        state, masked = reveal(reveal_keys[k], tokens, state, masked, block=block, count=gt_topk)
        states.append(state)
        still_masked.append(masked)
        targets.append(backbone_forward(model, state, tokens, positions, visible)[0])

    predicted = head_chain(head, model, states, tokens, positions, visible, logits_a, hidden_a, hidden_clean)
    kind = loss.removesuffix("_sum")
    steps = range(chain_steps) if loss.endswith("_sum") else [chain_steps - 1]
    value = sum(
        masked_mean(per_position_loss(kind, predicted[k], targets[k], tokens, temperature) / p, still_masked[k])
        for k in steps
    ) / len(steps)

    first, supervised = targets[0], still_masked[0]
    agree = lambda logits: (jnp.argmax(logits, -1) == jnp.argmax(first, -1)).astype(jnp.float32)  # noqa: E731
    metrics = {
        "loss": value,
        "kl": masked_mean(kl_per_position(first, predicted[0]), supervised),
        "kl_baseline": masked_mean(kl_per_position(first, logits_a), supervised),
        "top1": masked_mean(agree(predicted[0]), supervised),
        "top1_baseline": masked_mean(agree(logits_a), supervised),
        "supervised_tokens": jnp.sum(supervised),
    }
    return value, metrics
