"""The definition of `residual_argmax` in plain jnp: today's XLA path (final norm, lm_head as one
matmul that materialises [M, V] float32 logits, optional MRP residual, then `policies.score`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dlmjax import arithmetic


class ArgmaxScores(NamedTuple):
    """Per position (each [M]): the greedy token with the mask token excluded, its probability, the
    entropy of the distribution (mask excluded) and the top-1 minus top-2 probability."""

    tokens: jax.Array  # int32
    confidence: jax.Array  # float32
    entropy: jax.Array  # float32
    margin: jax.Array  # float32


def final_hidden(x_md, norm):
    """`norm` = (scale [D], eps) applies the model's final RMSNorm; None: x is already normed."""
    if norm is None:
        return x_md
    from dlmjax.models import layers

    scale, eps = norm
    return layers.rms_norm(x_md, scale, eps)


def logits(x_md, w_dv, *, norm=None, residual=None):
    """[M, V] float32: lm_head(norm(x)) (+ s * lm_head(h_p) for `residual` = (h_p [M, D], s))."""
    out = arithmetic.matmul(final_hidden(x_md, norm), w_dv, preferred_element_type=jnp.float32)
    if residual is not None:
        h_p, s = residual
        out = out + s * arithmetic.matmul(h_p, w_dv, preferred_element_type=jnp.float32)
    return out


def residual_argmax(x_md, w_dv, *, mask_id: int | None, norm=None, residual=None) -> ArgmaxScores:
    from dlmjax.decoding import policies

    scores = policies.score(logits(x_md, w_dv, norm=norm, residual=residual)[None], mask_id=mask_id)
    return ArgmaxScores(scores.tokens[0], scores.confidence[0], scores.entropy[0], scores.margin[0])
