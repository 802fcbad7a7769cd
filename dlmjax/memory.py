"""Per-device memory estimate of a training run, printed before it starts; runs that cannot fit are refused.

The estimate is the sum of
- the parameters as placed: each array's per-device shard (`NamedSharding.shard_shape`), so a
  backbone split over 'model' or 'fsdp', and MoE experts split over 'expert', count 1/n of their
  size; a replicated (data-parallel) head counts whole on every device; in a multi-process run
  the whole copies process 0 evaluates with too (the frozen backbone's, `train.loop.frozen_mesh`,
  and the trained params', gathered for evaluation and export);
- the optimiser state of the trained parameters, placed like them (AdamW: two moments);
- the gradients of the trained parameters and the update made from them, the update placed like
  them: a step holds both before it applies the update (XLA's temporaries of a train step whose
  parameters dominate are twice the trained parameters); under fsdp the gradients are whole until
  their reduce-scatter;
- the activations of one step for the rows a device holds (`activation_bytes`): what the backward
  of each trained layer keeps, attention scores materialised (an upper bound where a flash kernel
  runs), the fp32 logits the loss reads, and a frozen backbone's forward (no gradient: one layer's
  transient plus the outputs kept);
- the weights gathered whole over fsdp: of one layer at a time for a frozen backbone (a forward
  only), of every layer for a trained one (the forward's gathered weights are kept for its backward);
- a KV cache where one is held (`kv_cache_bytes`, decoding; training holds none).

It is an estimate (XLA fuses and rematerialises; compiler workspace is not counted), meant to
catch the run that cannot fit before it compiles, with the numbers that say why. Everything here
is a small pure function of shapes, dtypes and shardings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import numpy as np

from dlmjax.losses import LOGITS_CHUNK_BYTES
from dlmjax.validation import InputError

GiB = 1024 ** 3
MiB = 1024 ** 2


def shard_bytes(shape, dtype, sharding) -> int:
    """Bytes of one device's shard of an array of `shape` and `dtype` placed with `sharding`."""
    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
    return math.prod(int(n) for n in shard) * np.dtype(dtype).itemsize


def placed_leaves(tree, shardings) -> list[tuple]:
    """[(leaf, its sharding)] of a tree of arrays or ShapeDtypeStructs and `shardings` (a tree of
    the same structure, or one sharding for all, or None: unsharded)."""
    leaves = jax.tree.leaves(tree)
    if not isinstance(shardings, jax.sharding.Sharding) and shardings is not None:
        placements = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if len(placements) != len(leaves):
            raise ValueError(f"{len(leaves)} arrays but {len(placements)} shardings")
    else:
        placements = [shardings] * len(leaves)
    return list(zip(leaves, placements))


def tree_bytes(tree, shardings) -> int:
    """Per-device bytes of a tree of arrays or ShapeDtypeStructs, each leaf placed with the
    matching leaf of `shardings` (a tree of the same structure, or one sharding for all)."""
    return sum(shard_bytes(leaf.shape, leaf.dtype, s) for leaf, s in placed_leaves(tree, shardings))


def placed_bytes(tree) -> dict:
    """{device: bytes} actually held by placed jax.Arrays (the sum of their addressable shards):
    what `tree_bytes` predicts, measured."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _split(n: int, ways: int) -> int:
    """n per device when a dimension of n is split `ways` ways where it divides (else replicated)."""
    return n // ways if ways > 1 and n % ways == 0 else n


def trained_experts_bytes(cfg, *, tokens: int, itemsize: int) -> int:
    """What the backward of one trained MoE layer's experts keeps beyond the rows' activations, for
    `tokens` tokens (dlmjax.models.moe.tiled_rows): each of its at most ceil(M / t) + min(E, M)
    tiles (M = tokens x top-k rows, t rows per tile) holds its expert's gate/up/down weights (D x 3F)
    and their gradient."""
    from dlmjax.models.moe import expert_tile

    rows = tokens * cfg.num_experts_per_tok
    tiles = -(-rows // expert_tile(rows, cfg.num_experts)) + min(cfg.num_experts, rows)
    return 2 * tiles * cfg.hidden_size * 3 * cfg.moe_intermediate_size * itemsize


def layer_activation_bytes(cfg, *, rows: int, q_tokens: int, kv_tokens: int, model: int = 1,
                           itemsize: int | None = None, trained: bool = False, moe: bool | None = None) -> int:
    """What one transformer layer's backward keeps for `rows` rows of `q_tokens` queries attending
    over `kv_tokens` keys, with KV groups and MLP split over `model` devices: per token the residual
    input, two norm outputs and the attention output (4 d), q, k, v and the attention context,
    the MLP's gate, up and product (3 I; an MoE layer: its top-k experts' and the shared expert's),
    plus the fp32 attention scores and probabilities (2 H q_tokens kv_tokens). A `trained` MoE
    layer also keeps its tiles' expert weights and their gradients (`trained_experts_bytes`). `moe`:
    whether the layer is an MoE one (default: any layer of an MoE model; a dense layer of one has
    `intermediate_size`)."""
    itemsize = itemsize or np.dtype(cfg.dtype).itemsize
    moe = bool(cfg.num_experts) if moe is None else moe
    experts = trained_experts_bytes(cfg, tokens=rows * q_tokens, itemsize=itemsize) if trained and moe else 0
    kv_heads = _split(cfg.num_kv_heads, model)  # the fused qkv splits into whole KV groups
    heads = cfg.num_heads // cfg.num_kv_heads * kv_heads  # a group's query heads go with it
    if moe:
        mlp = cfg.num_experts_per_tok * cfg.moe_intermediate_size + (cfg.shared_expert_intermediate_size or 0)
    else:
        mlp = _split(cfg.intermediate_size, model)
    per_token = 4 * cfg.hidden_size + (2 * heads + 2 * kv_heads) * cfg.head_dim + 3 * mlp
    scores = 2 * heads * q_tokens * kv_tokens * 4
    return rows * (q_tokens * per_token * itemsize + scores) + experts


def logits_bytes(cfg, *, rows: int, tokens: int, model: int = 1, copies: int = 1) -> int:
    """`copies` fp32 [rows, tokens, vocab] arrays, vocab split over `model` (the LM head's rule)."""
    return copies * rows * tokens * _split(cfg.vocab_size, model) * 4


def kv_cache_bytes(cfg, *, rows: int, length: int, model: int = 1, layers: int | None = None,
                   itemsize: int | None = None) -> int:
    """A KV cache of `length` positions for `rows` rows: keys and values of every layer, KV heads
    split over `model` where they divide."""
    itemsize = itemsize or np.dtype(cfg.dtype).itemsize
    layers = cfg.num_layers if layers is None else layers
    return 2 * layers * rows * length * _split(cfg.num_kv_heads, model) * cfg.head_dim * itemsize


def training_activation_bytes(objective: str, cfg, *, rows: int, seq_len: int, model: int = 1,
                              head_layers: int = 0, chain_steps: int = 1, anchors: int = 0, block: int = 0,
                              target_layers: int = 0) -> int:
    """Activations of one training step on a device holding `rows` rows of `seq_len` tokens.

    block_diffusion: the backbone trains on [noisy; clean] (2 seq_len tokens) with every layer's
    backward, logits, log-softmax and their gradient (3 fp32 copies; the loss makes them a chunk at
    a time, `losses.label_scores_from_hidden`, so at most 3 chunks' worth). next_token: seq_len
    tokens. mrp: the frozen backbone runs 1 + chain_steps forwards on 2 seq_len tokens, the
    logits of each made for the noisy half only and kept as targets; the head's `head_layers`
    layers train on every chain step on both halves, and the step being differentiated holds its
    logits (3 copies: XLA does not keep them per step; at vocab 152k this estimate was 0.87-1.0x
    of XLA's buffers for the whole train step, chain 1-2). drafter: the
    frozen target runs once on seq_len tokens (`target_layers` hidden states kept as features), the
    drafter's `head_layers` layers train on `anchors` blocks of `block` queries per row attending
    over the context and the block. tspd: a small MLP on features (counted as nothing)."""
    if objective in ("block_diffusion", "next_token"):
        tokens = 2 * seq_len if objective == "block_diffusion" else seq_len
        moe_layers = len(cfg.moe_layers)  # an MoE model's other layers are dense (LLaDA2's first)
        layers = sum(count * layer_activation_bytes(cfg, rows=rows, q_tokens=tokens, kv_tokens=tokens, model=model,
                                                    trained=True, moe=moe)
                     for count, moe in ((moe_layers, True), (cfg.num_layers - moe_layers, False)) if count)
        logits = logits_bytes(cfg, rows=rows, tokens=tokens, model=model, copies=3)
        return layers + min(logits, 3 * LOGITS_CHUNK_BYTES)
    if objective == "mrp":
        tokens = 2 * seq_len
        frozen = (layer_activation_bytes(cfg, rows=rows, q_tokens=tokens, kv_tokens=tokens, model=model)
                  + (1 + chain_steps) * logits_bytes(cfg, rows=rows, tokens=seq_len, model=model)
                  + 2 * rows * tokens * cfg.hidden_size * np.dtype(cfg.dtype).itemsize)
        head = (chain_steps * head_layers * layer_activation_bytes(cfg, rows=rows, q_tokens=tokens, kv_tokens=tokens,
                                                                   model=1, itemsize=4)  # the head trains in fp32
                + logits_bytes(cfg, rows=rows, tokens=seq_len, model=model, copies=3))
        return frozen + head
    if objective == "drafter":
        queries = anchors * block
        frozen = (layer_activation_bytes(cfg, rows=rows, q_tokens=seq_len, kv_tokens=seq_len, model=model)
                  + target_layers * rows * seq_len * cfg.hidden_size * np.dtype(cfg.dtype).itemsize
                  + logits_bytes(cfg, rows=rows, tokens=seq_len, model=model))
        head = (head_layers * layer_activation_bytes(cfg, rows=rows, q_tokens=queries, kv_tokens=seq_len + block,
                                                     model=1)
                + logits_bytes(cfg, rows=rows, tokens=queries, model=model, copies=3))
        return frozen + head
    return 0


def fsdp_gather_bytes(layer_tree, shardings, fsdp: int) -> int:
    """The largest layer's weights gathered whole over 'fsdp' (what XLA materialises where the
    layer runs): its per-device bytes times the fsdp width. 0 without fsdp."""
    if fsdp <= 1:
        return 0
    return tree_bytes(layer_tree, shardings) * fsdp


def fsdp_whole_bytes(tree, shardings, fsdp: int) -> tuple[int, int]:
    """(bytes of the leaves split over 'fsdp', gathered whole over it; per-device bytes of the
    others): a trained tree's weights as the forward keeps them for the backward, and its
    gradients before their reduce-scatter."""
    from dlmjax.sharding import spec_uses_axis

    gathered = rest = 0
    for leaf, placed in placed_leaves(tree, shardings):
        size = shard_bytes(leaf.shape, leaf.dtype, placed)
        if fsdp > 1 and spec_uses_axis(getattr(placed, "spec", ()), "fsdp"):
            gathered += size * fsdp
        else:
            rest += size
    return gathered, rest


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a run, by kind."""

    frozen_params: int = 0  # the frozen backbone (or target), as placed
    whole_copies: int = 0  # multi-process: frozen and trained params whole on a device (process 0 evaluates alone)
    trained_params: int = 0  # what the run trains, as placed
    optimizer: int = 0  # the optimiser state of the trained params
    gradients: int = 0  # the gradients of the trained params and the update made from them
    activations: int = 0  # one step's activations for the device's rows
    fsdp_gather: int = 0  # weights gathered whole over fsdp (a frozen backbone's largest layer, trained weights)
    kv_cache: int = 0  # decoding only
    mesh: str = ""  # e.g. "data=2,fsdp=2,model=2"
    rows_per_device: int = 0
    seq_len: int = 0

    @property
    def total(self) -> int:
        return sum(value for _, value in self.parts())

    def parts(self) -> list[tuple[str, int]]:
        return [("frozen params", self.frozen_params), ("whole copies (eval)", self.whole_copies),
                ("trained params", self.trained_params),
                ("optimizer state", self.optimizer), ("gradients + update", self.gradients),
                ("activations", self.activations), ("fsdp gathered weights", self.fsdp_gather),
                ("KV cache", self.kv_cache)]

    def lines(self) -> list[str]:
        kinds = self.parts()
        head = f"memory per device (mesh {self.mesh}; {self.rows_per_device} rows x {self.seq_len} tokens):"
        body = [f"  {name:<22}{format_bytes(value):>12}" for name, value in kinds if value]
        return [head, *body, f"  {'total':<22}{format_bytes(self.total):>12}"]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def one_line(self) -> str:
        """The estimate on one line (for error messages)."""
        parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in self.parts() if value)
        return f"{parts}; mesh {self.mesh}, {self.rows_per_device} rows x {self.seq_len} tokens per device"


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def parse_memory(text) -> int:
    """Bytes of '16GiB', '16G', '16 GB', '512MiB' or a bare number of GiB ('16', 80.5); binary units."""
    units = {"": GiB, "g": GiB, "gb": GiB, "gib": GiB, "m": MiB, "mb": MiB, "mib": MiB, "t": 1024 * GiB,
             "tb": 1024 * GiB, "tib": 1024 * GiB}
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise InputError(f"device memory {text!r}: write a size such as 16GiB, 80GB or 512MiB (a bare number is GiB)")
    return int(value * units[unit])


def device_memory(devices) -> int | None:
    """The smallest `bytes_limit` that `memory_stats()` reports over `devices`; None where a device
    reports none (CPU)."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 (backends without memory stats raise or return None)
            stats = None
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            return None
        limits.append(int(limit))
    return min(limits) if limits else None


def check_fits(estimate: MemoryEstimate, capacity: int | None, *, fix: str) -> None:
    """Refuse (InputError with the estimate and `fix`) an estimate above `capacity` bytes; nothing
    to check without a capacity."""
    if capacity is None or estimate.total <= capacity:
        return
    raise InputError(f"this run does not fit: about {format_bytes(estimate.total)} per device against "
                     f"{format_bytes(capacity)} of device memory ({estimate.one_line()}); {fix}")


def largest_layer(tree, shardings):
    """(leaves, shardings) of the backbone layer (paths `layers.{i}.*`) that takes the most bytes per
    device, or ([], []): an MoE model's first layers may be dense and far smaller than its expert layers."""
    from dlmjax.sharding import _path_name

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    placements = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    by_layer: dict[str, tuple[list, list]] = {}
    for (path, leaf), placed in zip(leaves, placements):
        found = re.match(r"layers\.(\d+)\.", _path_name(path))
        if found:
            layer = by_layer.setdefault(found.group(1), ([], []))
            layer[0].append(leaf)
            layer[1].append(placed)
    return max(by_layer.values(), key=lambda layer: tree_bytes(*layer), default=([], []))


def training_estimate(run, cfg, mesh, *, frozen=None, frozen_shardings=None, trained, trained_shardings, opt,
                      opt_shardings, whole_copies: bool = False) -> MemoryEstimate:
    """The per-device estimate of a training run (`run`: a RunConfig) whose backbone config is `cfg`
    (None: a run without one, e.g. tspd), with its trees (arrays or ShapeDtypeStructs) and where
    they are placed. The rows a device holds are batch_size over the data-parallel axes.
    `whole_copies`: the frozen and the trained trees are also held whole on a device (a multi-process
    run's first device of each process: `train.loop.frozen_mesh`, and the trained params gathered
    for process 0's evaluation and export)."""
    from dlmjax.sharding import data_parallel_size, mesh_sizes

    sizes = mesh_sizes(mesh)
    rows = -(-run.train.batch_size // data_parallel_size(mesh))
    activations = 0
    if cfg is not None:
        head_layers = {"mrp": run.mrp.num_layers, "drafter": run.drafter.num_layers}.get(run.objective, 0)
        target_layers = len(run.drafter.target_layer_ids or ()) or (5 if run.objective == "drafter" else 0)
        activations = training_activation_bytes(
            run.objective, cfg, rows=rows, seq_len=run.data.seq_len, model=sizes.get("model", 1),
            head_layers=head_layers, chain_steps=run.mrp.chain_steps, anchors=run.drafter.anchors_per_row,
            block=run.drafter.block_size, target_layers=target_layers)
    fsdp = sizes.get("fsdp", 1)
    # A trained tree split over fsdp: the forward's gathered weights of every layer are kept for the
    # backward, and the gradients are whole until their reduce-scatter (XLA's plan of such a step on
    # 8 CPU devices: about twice the weights gathered whole; tests/test_memory.py measures it).
    trained_gathered, trained_rest = fsdp_whole_bytes(trained, trained_shardings, fsdp)
    gather = trained_gathered
    if frozen is not None and cfg is not None:  # a forward only: one layer gathered at a time
        gather += fsdp_gather_bytes(*largest_layer(frozen, frozen_shardings), fsdp)
    trained_bytes = tree_bytes(trained, trained_shardings)
    return MemoryEstimate(
        frozen_params=tree_bytes(frozen, frozen_shardings) if frozen is not None else 0,
        whole_copies=(tree_bytes(frozen, None) if frozen is not None else 0) + tree_bytes(trained, None)
        if whole_copies else 0,
        trained_params=trained_bytes, optimizer=tree_bytes(opt, opt_shardings),
        gradients=trained_bytes + trained_gathered + trained_rest, activations=activations, fsdp_gather=gather,
        rows_per_device=rows, seq_len=run.data.seq_len,
        mesh=",".join(f"{k}={v}" for k, v in sizes.items() if v > 1 or k == "data"))


def training_fix(run, mesh) -> str:
    """What to change so that a refused run fits."""
    from dlmjax.sharding import mesh_sizes

    sizes = mesh_sizes(mesh)
    example = ""
    factor = next((f for f in range(2, sizes["data"] + 1) if sizes["data"] % f == 0), None)
    if factor:  # some of the data-parallel devices split the weights instead (the same device count)
        more = ",".join(f"{k}={v}" for k, v in {**sizes, "data": sizes["data"] // factor,
                                                 "fsdp": sizes.get("fsdp", 1) * factor}.items() if v > 1 or k == "data")
        example = f", e.g. --mesh {more}"
    return (f"fix: a smaller train.batch_size (now {run.train.batch_size}) or data.seq_len (now {run.data.seq_len}), "
            f"or split the weights over more devices with more model or fsdp, or expert for an MoE model's experts "
            f"(mesh: {{model: M, fsdp: F}} in the "
            f"config or --mesh{example}), or more devices; --device-memory sets the capacity checked")


def check_training_memory(run, mesh, *, cfg, abstract, frozen=None, frozen_shardings=None, show: bool = True,
                          capacity: int | None = None, show_only_refused: bool = False) -> MemoryEstimate:
    """Print (with `show`; with `show_only_refused` too, only when it refuses) the estimate of a run
    about to start and refuse it if it cannot fit. `abstract`: {"params", "opt_state"}
    ShapeDtypeStructs carrying their shardings (the trained state as it will be placed; empty
    dicts before it is known); `frozen`, `frozen_shardings`: the frozen backbone's state (arrays or
    ShapeDtypeStructs) and placement. Capacity: `capacity`, else mesh.device_memory from the run,
    else what the devices report (`device_memory`); none on CPU, where nothing is refused."""
    def placed(tree):
        return jax.tree.map(lambda a: a.sharding, tree)

    estimate = training_estimate(run, cfg, mesh, frozen=frozen, frozen_shardings=frozen_shardings,
                                 trained=abstract["params"], trained_shardings=placed(abstract["params"]),
                                 opt=abstract["opt_state"], opt_shardings=placed(abstract["opt_state"]),
                                 whole_copies=jax.process_count() > 1)
    if capacity is None and getattr(run.mesh, "device_memory", None) is not None:
        capacity = parse_memory(run.mesh.device_memory)
    if capacity is None:
        capacity = device_memory([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    if show and (not show_only_refused or (capacity is not None and estimate.total > capacity)):
        print(str(estimate) + (f" (of {format_bytes(capacity)})" if capacity else ""), flush=True)
    check_fits(estimate, capacity, fix=training_fix(run, mesh))
    return estimate
