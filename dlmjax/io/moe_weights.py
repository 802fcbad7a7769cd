"""Weight layouts of the MoE families, to and from one canonical layout that dlmjax.io.hf's key rules map.

On disk, experts come one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`,
the layout the families publish) or fused as transformers 5 writes them
(`mlp.experts.gate_up_proj` [E, 2F, D] with the gate rows first, `mlp.experts.down_proj` [E, D, F]).
The canonical layout is the fused one; `canonical_tensors` stacks per-expert tensors into it (every
expert of a layer must be there), and renames the families' own names to the Qwen names:

- llada2_moe: `model.word_embeddings` -> `model.embed_tokens`; `attention.query_key_value` is split
  into q/k/v (rows: the query heads, then the key heads, then the value heads);
  `attention.dense` -> `self_attn.o_proj`; `attention.{query,key}_layernorm` -> `self_attn.{q,k}_norm`;
- llada_moe: the shared expert `model.layers.{i}.shared_expert.*` -> `mlp.shared_experts.*`.

`published_tensors` is the inverse: an export is written in the family's published layout.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterator

import numpy as np

from dlmjax.config import FAMILIES, ModelConfig
from dlmjax.io.safetensors import CheckpointError

PROJECTIONS = ("gate", "up", "down")
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_QKV = re.compile(r"model\.layers\.(\d+)\.attention\.query_key_value\.(weight|bias)")
_CANONICAL_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
_CANONICAL_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")

# One table per layout, used both ways: (published name, canonical name) prefixes, `{i}` standing for
# the layer index. Loading renames published -> canonical (`canonical_tensors`), exporting the reverse.
_RENAMES = {
    "llada2": (
        ("model.word_embeddings.weight", "model.embed_tokens.weight"),
        ("model.layers.{i}.attention.dense.", "model.layers.{i}.self_attn.o_proj."),
        ("model.layers.{i}.attention.query_layernorm.", "model.layers.{i}.self_attn.q_norm."),
        ("model.layers.{i}.attention.key_layernorm.", "model.layers.{i}.self_attn.k_norm."),
    ),
    "llada_moe": (("model.layers.{i}.shared_expert.", "model.layers.{i}.mlp.shared_experts."),),
}

Tensor = tuple[str, str, Callable[[], np.ndarray]]  # canonical name, file it comes from, reader


def _rename(name: str, layout: str, *, to_published: bool = False) -> str:
    """`name` under the layout's other naming: canonical (loading) or, `to_published`, published (export)."""
    for published, canonical in _RENAMES.get(layout, ()):
        source, target = (canonical, published) if to_published else (published, canonical)
        pattern = re.escape(source).replace(re.escape("{i}"), r"(\d+)")
        renamed, count = re.subn(f"^{pattern}", target.replace("{i}", r"\1"), name)
        if count:
            return renamed
    return name


def canonical_tensors(cfg: ModelConfig, shards: dict) -> Iterator[Tensor]:
    """Every tensor of the checkpoint (`shards`: name -> SafetensorsFile) under its canonical name."""
    layout = FAMILIES[cfg.family].layout
    experts: dict[int, dict] = defaultdict(dict)
    for name, shard in shards.items():
        found = _PER_EXPERT.fullmatch(name)
        if found:
            layer, expert, projection = int(found[1]), int(found[2]), found[3]
            experts[layer][expert, projection] = (name, shard)
            continue
        found = _FUSED_QKV.fullmatch(name) if layout == "llada2" else None
        if found:
            yield from _split_qkv(cfg, int(found[1]), found[2], name, shard)
            continue
        yield _rename(name, layout), shard.path.name, (lambda s=shard, n=name: s.get(n))
    for layer, parts in sorted(experts.items()):
        yield from _stack_experts(cfg, layer, parts)


def _split_qkv(cfg: ModelConfig, layer: int, kind: str, name: str, shard) -> Iterator[Tensor]:
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bounds = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}

    def part(which):
        def read():
            fused = shard.get(name)
            if fused.shape[0] != q_rows + 2 * kv_rows:
                raise CheckpointError(f"{name} has {fused.shape[0]} rows; config.json implies (num_attention_heads + "
                                      f"2 x num_key_value_heads) x head_dim = {q_rows + 2 * kv_rows}")
            return fused[slice(*bounds[which])]
        return read

    for which in "qkv":
        yield f"model.layers.{layer}.self_attn.{which}_proj.{kind}", shard.path.name, part(which)


def _stack_experts(cfg: ModelConfig, layer: int, parts: dict) -> Iterator[Tensor]:
    prefix = f"model.layers.{layer}.mlp.experts"
    if not cfg.num_experts:
        raise CheckpointError(f"{prefix}.* are expert weights but config.json describes a model without experts")
    extra = sorted(name for (expert, _), (name, _) in parts.items() if expert >= cfg.num_experts)
    if extra:
        raise CheckpointError(f"{extra[:4]} name experts beyond num_experts={cfg.num_experts} in config.json")
    missing = [f"{prefix}.{e}.{p}_proj.weight" for e in range(cfg.num_experts) for p in PROJECTIONS
               if (e, p) not in parts]
    if missing:
        raise CheckpointError(f"checkpoint is missing expert tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                              f" ({len(missing)} of layer {layer}); re-download the checkpoint")

    def read(e, p):
        name, shard = parts[e, p]
        return shard.get(name)

    def gate_up():  # [E, 2F, D], the gate rows first
        return np.stack([np.concatenate([read(e, "gate"), read(e, "up")], axis=0) for e in range(cfg.num_experts)])

    def down():  # [E, D, F]
        return np.stack([read(e, "down") for e in range(cfg.num_experts)])

    source = parts[0, "gate"][1].path.name
    yield f"{prefix}.gate_up_proj", source, gate_up
    yield f"{prefix}.down_proj", source, down


def published_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical tensors (torch layout) -> the family's published names and layout."""
    if not cfg.num_experts and cfg.family not in ("llada2_moe", "llada_moe"):
        return tensors
    layout = FAMILIES[cfg.family].layout
    out: dict[str, np.ndarray] = {}
    fused_qkv: dict[tuple[int, str], dict[str, np.ndarray]] = defaultdict(dict)
    for name, array in tensors.items():
        experts = _CANONICAL_EXPERTS.fullmatch(name)
        qkv = _CANONICAL_QKV.fullmatch(name) if layout == "llada2" else None
        if experts:
            out.update(_per_expert(int(experts[1]), experts[2], array))
        elif qkv:
            fused_qkv[int(qkv[1]), qkv[3]][qkv[2]] = array
        else:
            out[_rename(name, layout, to_published=True)] = array
    for (layer, kind), parts in sorted(fused_qkv.items()):
        out[f"model.layers.{layer}.attention.query_key_value.{kind}"] = np.concatenate([parts[w] for w in "qkv"])
    return out


def _per_expert(layer: int, which: str, array: np.ndarray) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{layer}.mlp.experts"
    if which == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": np.ascontiguousarray(array[e]) for e in range(array.shape[0])}
    width = array.shape[1] // 2
    out = {}
    for e in range(array.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(array[e, :width])
        out[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(array[e, width:])
    return out
