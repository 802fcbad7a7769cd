"""The definition of attention over key/value parts: today's XLA einsum (`layers._attention`),
which materialises each part's [B, H, L, S] scores. Visibilities given as `layers.Visibility`
become their matrices."""

from __future__ import annotations


def attention(q_blhd, kv_parts):
    from dlmjax.models import layers

    return layers._attention(q_blhd, [(k, v, layers.visible_matrix(vis)) for k, v, vis in kv_parts])
