"""Device mesh with ('data', 'fsdp', 'expert', 'model') axes and logical-axis rules for params and activations.

Params and activations name their dimensions with logical axes ('batch', 'vocab', 'heads',
'kv_heads', 'mlp', 'embed', ...); `ShardingRules` maps each to a mesh axis or None. The
forward runs under plain `jax.jit`: params placed with `NamedSharding` give tensor parallelism
over 'model', inputs sharded on 'batch' give data parallelism over 'data', and XLA inserts the
collectives. A dimension whose size does not divide the mesh axis (e.g. 3 KV heads on 4
devices) is replicated instead, never split unevenly.

'fsdp' is data parallelism with sharded weights (ZeRO-3 style): the batch is split over
('data', 'fsdp') together, and every param's largest dimension that no logical rule already
shards (and that divides) is split over 'fsdp'; XLA all-gathers a weight where a matmul uses it
and reduce-scatters its gradient. A frozen backbone can thus be tensor-parallel ('model'),
fsdp, or both, while a small trained head stays replicated (plain data parallelism).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dlmjax.validation import InputError

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "model")


def make_mesh(model: int = 1, data: int | None = None, devices=None, expert: int = 1, fsdp: int = 1) -> Mesh:
    """A (data, fsdp, expert, model) mesh over `devices` (default: all). `data` defaults to what is left.
    'expert' holds MoE experts (expert parallelism); dense weights are replicated over it. 'fsdp'
    splits the batch like 'data' and, in addition, every param's largest free dimension."""
    devices = list(devices if devices is not None else jax.devices())
    others = model * expert * fsdp
    if data is not None and data < 1:
        raise InputError(f"data={data}: the data axis needs at least one device (leave it out to take what the "
                         "other axes leave)")
    if model < 1 or expert < 1 or fsdp < 1 or (data is None and len(devices) % others):
        raise InputError(f"fsdp={fsdp} x expert={expert} x model={model} must divide the number of devices "
                         f"({len(devices)}); choose axis sizes whose product divides it")
    data = len(devices) // others if data is None else data
    shape = f"data={data} x fsdp={fsdp} x expert={expert} x model={model}"
    if data * others > len(devices):
        raise InputError(f"mesh {shape} needs {data * others} devices; only {len(devices)} available: make the "
                         "product of the axes at most that")
    if data * others < len(devices):
        if jax.process_count() > 1:  # the mesh would leave some process without a device: it would hang
            raise InputError(f"mesh {shape} uses {data * others} of the {len(devices)} devices of "
                             f"{jax.process_count()} processes; every process must hold part of it: make the axes "
                             f"multiply to {len(devices)} (leave data out to fill the rest)")
        log.warning("mesh %s uses %d of the %d devices (leave data out to use them all)", shape, data * others,
                    len(devices))
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, fsdp, expert, model), MESH_AXES, axis_types=(auto,) * 4,
                         devices=devices[: data * others])


def parse_mesh_sizes(spec: str) -> dict[str, int]:
    """`data=2,fsdp=2,model=4` -> {axis: size} (axes from MESH_AXES, any subset, each once)."""
    sizes = {}
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        value = value.strip()
        if (not eq or name not in MESH_AXES or name in sizes or not (value.isascii() and value.isdigit())
                or int(value) < 1):
            raise InputError(f"--mesh {spec!r}: write comma-separated AXIS=N with N >= 1, each axis once, axes "
                             f"{', '.join(MESH_AXES)} (e.g. --mesh data=2,model=4)")
        sizes[name] = int(value)
    return sizes


def parse_mesh(spec: str, devices=None) -> Mesh:
    """`--mesh data=2,model=4` (axes from MESH_AXES, any subset, each once) -> `make_mesh`. An axis
    left out is 1, except 'data', which takes the devices the others leave."""
    sizes = parse_mesh_sizes(spec)
    return make_mesh(model=sizes.get("model", 1), data=sizes.get("data"), expert=sizes.get("expert", 1),
                     fsdp=sizes.get("fsdp", 1), devices=devices)


def mesh_sizes(mesh) -> dict[str, int]:
    """{axis name: size} of a mesh (concrete or abstract)."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape))


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis, a tuple of mesh axes (split over their product), or None
    (replicated). `fsdp`: the mesh axis over which each param's largest free dimension is split
    (None: no fsdp sharding of params)."""

    batch: str | tuple[str, ...] | None = ("data", "fsdp")
    vocab: str | None = "model"
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    embed: str | None = None
    head_dim: str | None = None
    expert: str | None = "expert"  # the stacked experts of an MoE layer
    fsdp: str | None = "fsdp"

    def __post_init__(self):
        for f in fields(self):
            axis = getattr(self, f.name)
            names = axis if isinstance(axis, tuple) else (axis,)
            if axis is not None and not all(a in MESH_AXES for a in names):
                raise ValueError(f"sharding rule {f.name}={axis!r}: mesh axes are {MESH_AXES} or None")

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of the 'batch' rule, in order (() where the batch is replicated)."""
        return self.batch if isinstance(self.batch, tuple) else () if self.batch is None else (self.batch,)

    def spec(self, logical_axes: tuple[str | None, ...], dims=None, mesh_sizes=None) -> P:
        """PartitionSpec for `logical_axes`; a dim whose unit count (from `dims`) is not divisible
        by its mesh axis size is replicated. A tuple of mesh axes keeps, given `mesh_sizes`, the
        members the mesh has with size > 1, then drops trailing ones until the dim divides.
        Two dims on one mesh axis is an error."""
        out, used = [], set()
        for i, name in enumerate(logical_axes):
            axis = None if name is None else getattr(self, PAIRED_AXES.get(name, name))
            if isinstance(axis, tuple):
                axis = self._tuple_axis(axis, None if dims is None else dims[i], mesh_sizes)
            else:
                if axis is not None and mesh_sizes is not None and axis not in mesh_sizes:
                    axis = None  # a mesh without this axis (e.g. one built before 'expert' existed)
                if axis is not None and dims is not None and mesh_sizes is not None and dims[i] % mesh_sizes[axis]:
                    axis = None
            members = axis if isinstance(axis, tuple) else (axis,)
            for member in members:
                if member is not None and member in used:
                    raise ValueError(f"logical axes {logical_axes} map two dimensions onto mesh axis {member!r}")
                used.add(member)
            out.append(axis)
        return P(*out)

    @staticmethod
    def _tuple_axis(axes: tuple[str, ...], dim, mesh_sizes):
        if mesh_sizes is None:
            return axes
        kept = [a for a in axes if mesh_sizes.get(a, 1) > 1]
        while kept and dim is not None and dim % int(np.prod([mesh_sizes[a] for a in kept])):
            kept.pop()
        if not kept:
            present = [a for a in axes if a in mesh_sizes]
            return present[0] if present and (dim is None or dim % mesh_sizes[present[0]] == 0) else None
        return kept[0] if len(kept) == 1 else tuple(kept)


DEFAULT_RULES = ShardingRules()

# A fused dimension (dlmjax.models.fused) shards like the axis it names, in whole units: gate_up's
# [D, 2F] columns are (gate_j, up_j) pairs, so 'mlp_pairs' splits like 'mlp' in units of 2 columns.
PAIRED_AXES = {"mlp_pairs": "mlp"}

# Param path (dotted NNX path) -> logical axes of its dimensions. The fused qkv's columns are grouped
# per KV head (its query heads, k, v), so 'kv_heads' splits it into whole groups.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r".*attn\.qkv\.kernel", ("embed", "kv_heads")),
    (r".*attn\.qkv\.bias", ("kv_heads",)),
    (r".*attn\.o\.kernel", ("heads", "embed")),
    (r".*attn\.o\.bias", ("embed",)),
    (r".*(q|k)_norm\.scale", ("head_dim",)),
    (r".*mlp\.gate_up\.kernel", ("embed", "mlp_pairs")),
    (r".*mlp\.down\.kernel", ("mlp", "embed")),
    (r".*mlp\.shared\.gate_up\.kernel", ("embed", "mlp_pairs")),
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
    """The count that must divide the mesh axis: heads for head axes (KV groups for the fused qkv),
    column pairs for 'mlp_pairs', the dim size otherwise."""
    per_axis = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    return [size // 2 if name == "mlp_pairs" else per_axis.get(name, size) for name, size in zip(logical_axes, shape)]


def spec_uses_axis(spec, axis: str) -> bool:
    """Whether a PartitionSpec splits some dimension over mesh axis `axis` (alone or with others)."""
    return any(e == axis or (isinstance(e, tuple) and axis in e) for e in spec)


def with_fsdp(spec: P, shape, sizes: dict[str, int], axis: str | None = "fsdp") -> P:
    """`spec` with the largest dimension it leaves unsharded split over `axis` (fsdp), if that
    axis is in the mesh with size > 1 and the dimension divides by it (the first of equal ones);
    `spec` unchanged otherwise."""
    n = sizes.get(axis, 1) if axis is not None else 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if n <= 1 or spec_uses_axis(entries, axis):
        return spec
    free = [i for i, e in enumerate(entries) if e is None and shape[i] % n == 0 and shape[i] >= n]
    if not free:
        return spec
    best = max(free, key=lambda i: (shape[i], -i))
    entries[best] = axis
    return P(*entries)


def param_sharding(path: str, shape, cfg, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
    """Where the backbone param `path` lives: its logical rule (tensor parallel over 'model',
    experts over 'expert'), then its largest free dimension over 'fsdp'."""
    axes = param_logical_axes(path)
    sizes = mesh_sizes(mesh)
    spec = rules.spec(axes, _units(axes, shape, cfg), sizes)
    return NamedSharding(mesh, with_fsdp(spec, shape, sizes, rules.fsdp))


def unsplit_weights(cfg, mesh: Mesh) -> list[str]:
    """The weight groups a mesh's 'model' (tensor parallel) or 'expert' axis leaves unsplit over
    it because their units do not divide by it (`ShardingRules.spec` replicates such a dim over
    that axis; an 'fsdp' axis may still split the param):
    e.g. ['attention (2 KV heads, model=8)']. Empty where every group splits."""
    sizes = mesh_sizes(mesh)
    model, expert = sizes.get("model", 1), sizes.get("expert", 1)
    groups = []
    if model > 1:
        groups += [("attention", f"{cfg.num_kv_heads} KV heads", cfg.num_kv_heads),
                   ("attention output", f"{cfg.num_heads} heads", cfg.num_heads),
                   ("embedding and lm_head", f"vocabulary {cfg.vocab_size}", cfg.vocab_size)]
        if cfg.num_experts == 0 or len(cfg.moe_layers) < cfg.num_layers:  # a dense MLP somewhere
            groups.append(("MLP", f"intermediate size {cfg.intermediate_size}", cfg.intermediate_size))
        if cfg.num_experts and cfg.shared_expert_intermediate_size:
            groups.append(("shared expert", f"intermediate size {cfg.shared_expert_intermediate_size}",
                           cfg.shared_expert_intermediate_size))
    out = [f"{name} ({units}, model={model})" for name, units, n in groups if n % model]
    if model > 1 and cfg.num_experts:  # PARAM_AXES splits routed experts over 'expert' (and fsdp) only
        out.append(f"routed experts ({cfg.num_experts} experts: model={model} never splits them; split them over "
                   "expert=N or fsdp=N)")
    if expert > 1 and cfg.num_experts == 0:
        out.append(f"every weight (a dense model has no experts to split over expert={expert}: put those devices "
                   "on data)")
    elif expert > 1 and cfg.num_experts % expert:
        out.append(f"experts ({cfg.num_experts} experts, expert={expert})")
    return out


def put_array(array: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """Place a host array; with a sharding only each device's slice is copied (multi-host safe)."""
    if sharding is None:
        return jax.device_put(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = DEFAULT_RULES, rows: int | None = None) -> NamedSharding:
    """Sharding for a [B, ...] input: batch over 'data' (and 'fsdp'), the rest replicated. With
    `rows`, axes it does not divide are left out (as `ShardingRules.spec` does)."""
    dims = None if rows is None else (rows,) + (1,) * (ndim - 1)
    return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1), dims, mesh_sizes(mesh)))


def data_parallel_size(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> int:
    """How many ways the batch splits: the product of the mesh axes of the 'batch' rule."""
    sizes = mesh_sizes(mesh)
    return int(np.prod([sizes.get(a, 1) for a in rules.batch_axes]))


def shard_batch(tree, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """Place every [B, ...] host array of `tree` with its batch split over 'data'."""
    data = mesh_sizes(mesh).get(rules.batch_axes[0], 1) if rules.batch_axes else 1
    leaves = jax.tree.leaves(tree)
    if leaves and leaves[0].shape[0] % data:
        raise ValueError(f"batch of {leaves[0].shape[0]} rows does not split over {data} data-parallel devices; "
                         f"pad it to a multiple of {data}")
    # over 'fsdp' as well where the rows divide by data x fsdp (training checks that they do)
    return jax.tree.map(lambda a: put_array(np.asarray(a), batch_sharding(mesh, np.ndim(a), rules, np.shape(a)[0])),
                        tree)


def mesh_of(x):
    """The (abstract) mesh `x` is computed on: the active one (`jax.set_mesh`), else the one its
    sharding names (a jit argument placed with a NamedSharding carries it); None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def split_batch_axes(mesh) -> tuple[str, ...]:
    """The axes of `mesh` in the 'batch' rule with size > 1, leaving out axes already split by hand
    (inside a shard_map). () without a mesh."""
    if mesh is None:
        return ()
    manual = jax.sharding.AxisType.Manual
    sizes = {a: n for a, n, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types) if kind != manual and n > 1}
    return tuple(a for a in DEFAULT_RULES.batch_axes if a in sizes)


def over_batch_shards(fn, *arrays, weights=()):
    """fn(*arrays, *weights) with each device running fn on its own rows: the arrays' (pytrees')
    leading axis (the batch) split over every batch axis of the mesh (`split_batch_axes`) under
    shard_map, `weights` (pytrees) whole on those axes, the other mesh axes left to the compiler.
    Rows that do not divide over those axes are padded with copies of the last row, cut off after;
    so no batch axis is left to the compiler, which would split fn's reductions by the batch's size.
    fn treats each row on its own and returns arrays (or a tuple of them) with that leading axis.
    Arrays that need gradients go in `weights`, not in fn's closure: the gradient of a closed-over
    array is made on the mesh outside the shard_map, which jax refuses. Without a mesh (the active
    one or the first array's, `mesh_of`) it is fn(*arrays, *weights)."""
    first = jax.tree.leaves(arrays)[0]
    mesh = mesh_of(first)
    axes = split_batch_axes(mesh) if first.ndim else ()
    if not axes or first.shape[0] == 0:
        return fn(*arrays, *weights)
    batch, shards = first.shape[0], math.prod(mesh_sizes(mesh)[a] for a in axes)
    if batch % shards:
        padded = jax.tree.map(lambda a: jnp.pad(a, [(0, -batch % shards)] + [(0, 0)] * (a.ndim - 1), mode="edge"),
                              arrays)
        return jax.tree.map(lambda y: y[:batch], over_batch_shards(fn, *padded, weights=weights))
    spec = P(axes[0] if len(axes) == 1 else axes)

    def per_device(*args):
        # The weights marked as varying over the batch axes before fn runs: their gradients are
        # then summed over the devices once, here, not inside fn's loops and branches (a sum in a
        # branch that some devices do not take never completes).
        rows, whole = args[:len(arrays)], args[len(arrays):]
        return fn(*rows, *jax.tree.map(lambda w: jax.lax.pcast(w, axes, to="varying"), whole))

    return jax.shard_map(per_device, mesh=mesh, out_specs=spec, axis_names=set(axes),
                         in_specs=(spec,) * len(arrays) + (P(),) * len(weights))(*arrays, *weights)


def on_mesh(mesh):
    """`jax.set_mesh(mesh)`, or no context for None: what runs inside is traced on the mesh, so
    `over_batch_shards` splits even intermediates whose type names no mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def to_host(tree):
    """`jax.device_get` that also takes arrays spread over several processes (a multi-host mesh):
    every process gets each array's whole value."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(fetch, tree)


def constrain(x, logical_axes, rules: ShardingRules = DEFAULT_RULES):
    """with_sharding_constraint under an active mesh (`jax.set_mesh`); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, rules.spec(logical_axes, x.shape, mesh_sizes(mesh)))


def _path_name(path) -> str:
    """'layers.0.attn.qkv.kernel' for a pytree key path of an nnx.State (the Variable's `.value` left out)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
    return ".".join(parts)


def placement(state, mesh: Mesh, cfg=None, rules: ShardingRules = DEFAULT_RULES):
    """A tree shaped like `state` (an nnx.State of arrays or ShapeDtypeStructs) of NamedShardings.
    With the backbone's `cfg`: each param that has a rule in PARAM_AXES is placed by it
    (`param_sharding`: tensor parallel, experts, fsdp), anything else replicated. Without `cfg`
    (a trained head, drafter or controller): everything replicated (data parallel)."""
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        name = _path_name(path)
        if cfg is None or not any(re.fullmatch(pattern, name) for pattern, _ in PARAM_AXES):
            return replicated
        return param_sharding(name, leaf.shape, cfg, mesh, rules)

    return jax.tree_util.tree_map_with_path(place, state)
