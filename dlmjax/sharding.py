"""Device mesh with ('data', 'model') axes and logical-axis rules for params and activations.

Params and activations name their dimensions with logical axes ('batch', 'vocab', 'heads',
'kv_heads', 'mlp', 'embed', ...); `ShardingRules` maps each to a mesh axis or None. The
forward runs under plain `jax.jit`: params placed with `NamedSharding` give tensor parallelism
over 'model', inputs sharded on 'batch' give data parallelism over 'data', and XLA inserts the
collectives. A dimension whose size does not divide the mesh axis (e.g. 3 KV heads on 4
devices) is replicated instead, never split unevenly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dlmjax.validation import InputError

MESH_AXES = ("data", "expert", "model")


def make_mesh(model: int = 1, data: int | None = None, devices=None, expert: int = 1) -> Mesh:
    """A (data, expert, model) mesh over `devices` (default: all). `data` defaults to what is left.
    'expert' holds MoE experts (expert parallelism); dense weights are replicated over it."""
    devices = list(devices if devices is not None else jax.devices())
    if model < 1 or expert < 1 or len(devices) % (model * expert):
        raise InputError(f"model={model} x expert={expert} must divide the number of devices ({len(devices)}); "
                         "choose axis sizes whose product divides it")
    data = data or len(devices) // (model * expert)
    if data * expert * model > len(devices):
        raise InputError(f"mesh {data} x {expert} x {model} needs {data * expert * model} devices; only "
                         f"{len(devices)} available: make data x expert x model at most that")
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, expert, model), MESH_AXES, axis_types=(auto,) * 3,
                         devices=devices[: data * expert * model])


def parse_mesh(spec: str, devices=None) -> Mesh:
    """`--mesh data=2,model=4` (axes from MESH_AXES, any subset, each once) -> `make_mesh`. An axis
    left out is 1, except 'data', which takes the devices the others leave."""
    sizes = {}
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in MESH_AXES or name in sizes or not value.strip().isdigit() or int(value) < 1:
            raise InputError(f"--mesh {spec!r}: write comma-separated AXIS=N with N >= 1, each axis once, axes "
                             f"{', '.join(MESH_AXES)} (e.g. --mesh data=2,model=4)")
        sizes[name] = int(value)
    return make_mesh(model=sizes.get("model", 1), data=sizes.get("data"), expert=sizes.get("expert", 1),
                     devices=devices)


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None for replicated)."""

    batch: str | None = "data"
    vocab: str | None = "model"
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    embed: str | None = None
    head_dim: str | None = None
    expert: str | None = "expert"  # the stacked experts of an MoE layer

    def __post_init__(self):
        for f in fields(self):
            axis = getattr(self, f.name)
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"sharding rule {f.name}={axis!r}: mesh axes are {MESH_AXES} or None")

    def spec(self, logical_axes: tuple[str | None, ...], dims=None, mesh_sizes=None) -> P:
        """PartitionSpec for `logical_axes`; a dim whose unit count (from `dims`) is not divisible
        by its mesh axis size is replicated. Two dims on one mesh axis is an error."""
        out, used = [], set()
        for i, name in enumerate(logical_axes):
            axis = None if name is None else getattr(self, name)
            if axis is not None and mesh_sizes is not None and axis not in mesh_sizes:
                axis = None  # a mesh without this axis (e.g. one built before 'expert' existed)
            if axis is not None and dims is not None and mesh_sizes is not None and dims[i] % mesh_sizes[axis]:
                axis = None
            if axis is not None and axis in used:
                raise ValueError(f"logical axes {logical_axes} map two dimensions onto mesh axis {axis!r}")
            used.add(axis)
            out.append(axis)
        return P(*out)


DEFAULT_RULES = ShardingRules()

# Param path (dotted NNX path) -> logical axes of its dimensions.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r".*attn\.q\.kernel", ("embed", "heads")),
    (r".*attn\.q\.bias", ("heads",)),
    (r".*attn\.(k|v)\.kernel", ("embed", "kv_heads")),
    (r".*attn\.(k|v)\.bias", ("kv_heads",)),
    (r".*attn\.o\.kernel", ("heads", "embed")),
    (r".*attn\.o\.bias", ("embed",)),
    (r".*(q|k)_norm\.scale", ("head_dim",)),
    (r".*mlp\.(gate|up)\.kernel", ("embed", "mlp")),
    (r".*mlp\.down\.kernel", ("mlp", "embed")),
    (r".*mlp\.shared\.(gate|up)\.kernel", ("embed", "mlp")),
    (r".*mlp\.shared\.down\.kernel", ("mlp", "embed")),
    (r".*mlp\.router", ("embed", None)),
    (r".*mlp\.expert_bias", (None,)),
    (r".*mlp\.experts_(gate_up|down)", ("expert", None, None)),
    (r".*norm\.scale", ("embed",)),
)


def param_logical_axes(path: str) -> tuple[str | None, ...]:
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, path):
            return axes
    raise KeyError(f"no sharding rule for parameter {path!r}; add one to dlmjax.sharding.PARAM_AXES")


def _units(logical_axes, shape, cfg) -> list[int]:
    """The count that must divide the mesh axis: heads for head axes, the dim size otherwise."""
    per_axis = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    return [per_axis.get(name, size) for name, size in zip(logical_axes, shape)]


def param_sharding(path: str, shape, cfg, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
    axes = param_logical_axes(path)
    mesh_sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return NamedSharding(mesh, rules.spec(axes, _units(axes, shape, cfg), mesh_sizes))


def put_array(array: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """Place a host array; with a sharding only each device's slice is copied (multi-host safe)."""
    if sharding is None:
        return jax.device_put(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a [B, ...] input: batch over 'data', the rest replicated."""
    return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1)))


def shard_batch(tree, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """Place every [B, ...] host array of `tree` with its batch split over 'data'."""
    data = dict(zip(mesh.axis_names, mesh.devices.shape)).get(rules.batch or "", 1)
    leaves = jax.tree.leaves(tree)
    if leaves and leaves[0].shape[0] % data:
        raise ValueError(f"batch of {leaves[0].shape[0]} rows does not split over {data} data-parallel devices; "
                         f"pad it to a multiple of {data}")
    return jax.tree.map(lambda a: put_array(np.asarray(a), batch_sharding(mesh, np.ndim(a), rules)), tree)


def constrain(x, logical_axes, rules: ShardingRules = DEFAULT_RULES):
    """with_sharding_constraint under an active mesh (`jax.set_mesh`); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    mesh_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return jax.lax.with_sharding_constraint(x, rules.spec(logical_axes, x.shape, mesh_sizes))
