"""Fused projections: q/k/v held as one weight [D, (H + 2 Hkv) hd], gate/up as one [D, 2F].

One matmul instead of three (two) per layer: at batch-1 decode each projection is a small
memory-bound GEMV whose launch is a real part of the step. The output columns are ordered so that
the contiguous split of the tensor-parallel 'model' axis (dlmjax.sharding) keeps whole units on
one device:

- qkv, per KV group: for each KV head g its G = H / Hkv query heads, then k_g, then v_g
  (`[..., Hkv, G + 2, hd]` flattened); a split into whole groups keeps each group's q, k, v
  together, and query head h = g G + j is the head that GQA pairs with KV head g;
- gate_up, per column: gate_j then up_j (`[..., F, 2]` flattened); a split along F keeps each
  pair together.

`split_qkv` / `split_gate_up` act on the last axis of anything (a projection's output, a kernel
[D, out], a bias [out]) and are the one definition of the layouts: the forward splits its output
with them, checkpoint export splits the weights with them, and import joins with their inverses
(`FusedLayout`, used by dlmjax.io.hf's key rules). Checkpoints keep the Hugging Face names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import numpy as np


def split_qkv(y, num_kv_heads: int, head_dim: int):
    """[..., Hkv (G + 2) hd] -> (q [..., H hd], k [..., Hkv hd], v [..., Hkv hd])."""
    lead = y.shape[:-1]
    groups = y.reshape(*lead, num_kv_heads, -1, head_dim)
    g = groups.shape[-2] - 2
    q = groups[..., :g, :].reshape(*lead, num_kv_heads * g * head_dim)
    k = groups[..., g, :].reshape(*lead, num_kv_heads * head_dim)
    v = groups[..., g + 1, :].reshape(*lead, num_kv_heads * head_dim)
    return q, k, v


def _array_module(*arrays):
    """numpy for host arrays (checkpoint import stays on the host), jax.numpy otherwise (init)."""
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def join_qkv(q, k, v, num_kv_heads: int, head_dim: int):
    """The inverse of `split_qkv`."""
    xp, lead = _array_module(q, k, v), q.shape[:-1]
    grouped = [a.reshape(*lead, num_kv_heads, -1, head_dim) for a in (q, k, v)]
    return xp.concatenate(grouped, axis=-2).reshape(*lead, -1)


def split_gate_up(y):
    """[..., 2F] -> (gate [..., F], up [..., F])."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return pairs[..., 0], pairs[..., 1]


def join_gate_up(gate, up):
    """The inverse of `split_gate_up`."""
    return _array_module(gate, up).stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


@dataclass(frozen=True)
class FusedLayout:
    """How one param holds several checkpoint tensors along its last axis. `cfg` is anything with
    `num_kv_heads` and `head_dim` (ModelConfig, DrafterConfig)."""

    name: str
    parts: tuple[str, ...]  # the tensors, in the order `split` returns them
    split: Callable  # (fused, cfg) -> tuple of parts
    join: Callable  # (tuple of parts, cfg) -> fused

    def part(self, fused, which: str, cfg):
        return self.split(fused, cfg)[self.parts.index(which)]


QKV = FusedLayout(
    "qkv", ("q", "k", "v"),
    split=lambda y, cfg: split_qkv(y, cfg.num_kv_heads, cfg.head_dim),
    join=lambda parts, cfg: join_qkv(*parts, cfg.num_kv_heads, cfg.head_dim),
)
GATE_UP = FusedLayout(
    "gate_up", ("gate", "up"),
    split=lambda y, cfg: split_gate_up(y),
    join=lambda parts, cfg: join_gate_up(*parts),
)
FUSED_LAYOUTS = {layout.name: layout for layout in (QKV, GATE_UP)}  # a fused param's module name -> its layout
