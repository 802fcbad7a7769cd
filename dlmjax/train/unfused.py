"""Resume a run whose checkpoints were written before q/k/v and gate/up were fused.

Such a checkpoint holds `attn.{q,k,v}.{kernel,bias}` and `mlp.{gate,up}.kernel` (also under
`mlp.shared.`), in the params and in every optimiser moment shaped like them. `restore` reads it
under its own names (replicated), joins the parts with the layouts of dlmjax.models.fused (moments
permute exactly as their params do) and places the result with the target's shardings. A
checkpoint in the current layout is restored directly.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dlmjax.models.fused import FUSED_LAYOUTS
from dlmjax.models.transformer import Attention
from dlmjax.sharding import put_array

_UNFUSED = re.compile(r"(^|.*\.)(attn\.(q|k|v)\.(kernel|bias)|mlp\.(shared\.)?(gate|up)\.kernel)(\..*|$)")


def leaf_name(path) -> str:
    """'params.layers.0.attn.qkv.kernel.value': a pytree key path as Orbax names the leaf."""
    parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    return ".".join(str(p) for p in parts if p is not None)


def _saved_names(manager: ocp.CheckpointManager, step: int) -> list[str]:
    tree = manager.item_metadata(step).tree
    return [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def is_unfused(manager: ocp.CheckpointManager, step: int) -> bool:
    """Whether the checkpoint of `step` was written with separate q/k/v and gate/up params."""
    return any(_UNFUSED.fullmatch(name) for name in _saved_names(manager, step))


def _head_shape(module) -> SimpleNamespace:
    """num_kv_heads and head_dim of the (abstract) module's attention layers (the qkv layout's `cfg`)."""
    attn = next((node for _, node in nnx.iter_graph(module) if isinstance(node, Attention)), None)
    return SimpleNamespace(num_kv_heads=getattr(attn, "num_kv_heads", 1), head_dim=getattr(attn, "head_dim", 1))


def _fused_value(name: str, saved: dict[str, np.ndarray], cfg) -> np.ndarray:
    """The value of the fused leaf `name` joined from its saved parts."""
    for fused, layout in FUSED_LAYOUTS.items():
        if f".{fused}." in name:
            parts = [saved[name.replace(f".{fused}.", f".{part}.")] for part in layout.parts]
            return layout.join(tuple(parts), cfg)
    raise KeyError(name)


def restore(manager: ocp.CheckpointManager, step: int, abstract, module):
    """The checkpoint of `step` restored into `abstract` (leaves carrying their shardings); an
    unfused one is converted. `module`: the trained module's abstract (its attention shape)."""
    if not is_unfused(manager, step):
        return manager.restore(step, args=ocp.args.StandardRestore(abstract))
    mesh = jax.tree.leaves(abstract)[0].sharding.mesh
    replicated = NamedSharding(mesh, P())
    as_saved = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated),
                            manager.item_metadata(step).tree)
    raw = manager.restore(step, args=ocp.args.StandardRestore(as_saved))
    saved = {leaf_name(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(raw)[0]}
    cfg = _head_shape(module)

    def value(path, target):
        name = leaf_name(path)
        host = saved[name] if name in saved else _fused_value(name, saved, cfg)
        return put_array(host.astype(target.dtype), target.sharding)

    return jax.tree_util.tree_map_with_path(value, abstract)
