"""MRP: a small head that predicts the residual between this step's logits and the next step's.

One MRP module (DeepSeek-MTP shaped, ALGORITHMS.md section 1):

    x   = eh_proj([enorm(embed(block ids after this iteration's commits)) ; hnorm(h)])
    x   = N backbone-style decoder layers (the backbone's attention topology, own KV cache)
    h_p = norm(x)

`h` is the backbone's final-normed hidden state h_A (then h_A + s * sum of earlier h_p). The
residual is added in hidden space before the backbone's frozen lm_head:

    logits_k = logits_{k-1} + s * lm_head(h_p_k),    h_k = h_{k-1} + s * h_p_k

A head holds `num_modules` modules; chain step k (0-based) uses module min(k, num_modules - 1).
Embeddings and lm_head are the backbone's, passed in at call time, so a head stores neither.

Interop: a head lives inside its backbone's checkpoint directory under the reference code's
names `mrp_modules.{m}.model.{enorm,hnorm,eh_proj,layers.{j}.*,norm}` (layers named as the
backbone's). `load_head` reads them (module and layer counts from the names, the residual scale
from config.json `mrp_residual_scale`, default 1); `save_head` writes them in PyTorch format.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax.config import ModelConfig
from dlmjax.io.hf import (
    HF_RULES, INDEX_FILE, TRANSPOSE, FusedParams, KeyRule, checkpoint_path, expected_fields, load_config, open_shards,
    tensor_shape, to_hf_tensors,
)
from dlmjax.io.files import write_atomic
from dlmjax.io.safetensors import CheckpointError, save_file
from dlmjax.models.fused import FUSED_LAYOUTS
from dlmjax.models.transformer import Block, KVCache, Linear, RMSNorm, Transformer, run_layers
from dlmjax.validation import InputError

HEAD_FILE = "mrp_head.safetensors"
SCALE_KEY = "mrp_residual_scale"


class HeadMismatchError(InputError):
    """An MRP head used with a backbone it was not made for."""


@dataclass(frozen=True)
class MRPConfig:
    """The head's shape. hidden_size and vocab_size are those of the backbone it belongs to."""

    hidden_size: int
    vocab_size: int
    num_modules: int = 1
    num_layers: int = 3  # decoder layers per module (the paper: 2-3 best)
    residual_scale: float = 1.0  # s

    def __post_init__(self):
        if self.num_modules < 1 or self.num_layers < 1:
            raise ValueError(f"MRP head needs num_modules >= 1 and num_layers >= 1, got {self.num_modules}, {self.num_layers}")
        if not math.isfinite(self.residual_scale):
            raise ValueError(f"MRP head residual_scale={self.residual_scale} must be a finite number")


class MRPModule(nnx.Module):
    def __init__(self, backbone: ModelConfig, num_layers: int, *, rngs: nnx.Rngs):
        d, dt = backbone.hidden_size, backbone.dtype
        self.config = backbone  # topology, RoPE and layer shapes are the backbone's
        self.enorm = RMSNorm(d, backbone.rms_norm_eps, dt)
        self.hnorm = RMSNorm(d, backbone.rms_norm_eps, dt)
        self.eh_proj = Linear(2 * d, d, bias=False, dtype=dt, rngs=rngs)
        self.layers = nnx.List([Block(backbone, rngs=rngs) for _ in range(num_layers)])
        self.norm = RMSNorm(d, backbone.rms_norm_eps, dt)

    def __call__(self, embeds_bld, hidden_bld, positions_bl, *, segments_bl=None, valid_bl=None,
                 cache: KVCache | None = None, visible_bll=None, chunk_parts=()):
        """(h_p [B, L, D], this chunk's per-layer (k, v)): the module's output over one chunk."""
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds_bld), self.hnorm(hidden_bld)], axis=-1))
        x, new_kv, _ = run_layers(self.layers, self.config, x, positions_bl, segments_bl=segments_bl,
                                  valid_bl=valid_bl, cache=cache, visible_bll=visible_bll, chunk_parts=chunk_parts)
        return self.norm(x), new_kv


class MRPHead(nnx.Module):
    def __init__(self, backbone: ModelConfig, cfg: MRPConfig, *, rngs: nnx.Rngs):
        if (cfg.hidden_size, cfg.vocab_size) != (backbone.hidden_size, backbone.vocab_size):
            raise HeadMismatchError(f"MRPConfig hidden/vocab {cfg.hidden_size}/{cfg.vocab_size} != backbone's "
                                    f"{backbone.hidden_size}/{backbone.vocab_size}")
        self.config = cfg
        self.backbone_config = backbone
        self.mrp_modules = nnx.List([MRPModule(backbone, cfg.num_layers, rngs=rngs) for _ in range(cfg.num_modules)])

    def module_index(self, step: int) -> int:
        """Chain step `step` (0-based) uses module min(step, num_modules - 1)."""
        return min(step, len(self.mrp_modules) - 1)

    def module_for(self, step: int) -> MRPModule:
        return self.mrp_modules[self.module_index(step)]

    def empty_caches(self, batch: int, capacity: int) -> tuple[KVCache, ...]:
        # the head's layers are the backbone's attention with dense MLPs: no experts in their config
        cfg = self.backbone_config.replace(num_layers=self.config.num_layers, num_experts=0, moe_layers=())
        return tuple(KVCache.init(cfg, batch, capacity) for _ in self.mrp_modules)

    def context_chunks(self, backbone: Transformer, caches, tokens_bl, hidden_bld, positions_bl, valid_bl, start_b,
                       write_b=None):
        """Per module, the cache chunk (`KVCache.chunk`) a finished chunk of clean tokens and the
        backbone's hidden state on them makes at each row's slot offset `start_b` (rows with
        `write_b` False: their slots as they are): the context later blocks' head forwards attend
        to, once written with `KVCache.put_chunk`."""
        embeds = backbone.embed_tokens(tokens_bl)
        return tuple(
            cache.chunk(module(embeds, hidden_bld, positions_bl, valid_bl=valid_bl, cache=cache)[1], start_b,
                        positions_bl, valid_bl, write_b)
            for module, cache in zip(self.mrp_modules, caches)
        )


def check_compatible(head: MRPHead, backbone: ModelConfig) -> None:
    """Refuse a head made for another backbone shape (hidden size, vocab, layer shapes)."""
    made_for = head.backbone_config
    fields = ("hidden_size", "vocab_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "qkv_bias", "o_bias", "qk_norm", "attention", "block_size")
    differing = [f"{f}: head {getattr(made_for, f)} vs model {getattr(backbone, f)}"
                 for f in fields if getattr(made_for, f) != getattr(backbone, f)]
    if differing:
        raise HeadMismatchError(
            "this MRP head was trained for another backbone (" + "; ".join(differing) + "); "
            "use the head shipped in the model's own checkpoint directory or train one for it "
            "(dlmjax train configs/mrp/toy-sdar.yaml backbone=...)"
        )


def head_output(head: MRPHead, backbone: Transformer, step: int, tokens_bl, hidden_bld, positions_bl, *,
                segments_bl=None, valid_bl=None, cache: KVCache | None = None, visible_bll=None, chunk_parts=()):
    """h_p [B, L, D] of chain step `step`'s module (no cache write)."""
    h_p, _ = head.module_for(step)(backbone.embed_tokens(tokens_bl), hidden_bld, positions_bl,
                                   segments_bl=segments_bl, valid_bl=valid_bl, cache=cache, visible_bll=visible_bll,
                                   chunk_parts=chunk_parts)
    return h_p


def residual_logits(head: MRPHead, backbone: Transformer, h_p):
    """The residual in logit space, s * lm_head(h_p)."""
    return head.config.residual_scale * backbone.lm_logits(h_p)


def apply_residual(head: MRPHead, backbone: Transformer, h_p, logits_blv, hidden_bld):
    """(logits_k, h_k, residual logits): logits_{k-1} + s * lm_head(h_p) and h_{k-1} + s * h_p."""
    residual = residual_logits(head, backbone, h_p)
    return logits_blv + residual, hidden_bld + head.config.residual_scale * h_p, residual


def residual_step(head: MRPHead, backbone: Transformer, step: int, tokens_bl, hidden_bld, logits_blv,
                  positions_bl, *, valid_bl=None, cache: KVCache | None = None, visible_bll=None):
    """One chained head iteration: (logits_k, h_k, residual logits s * lm_head(h_p)).

    tokens: the block after this iteration's commits; hidden, logits: h_{k-1}, logits_{k-1}."""
    h_p = head_output(head, backbone, step, tokens_bl, hidden_bld, positions_bl, valid_bl=valid_bl, cache=cache,
                      visible_bll=visible_bll)
    return apply_residual(head, backbone, h_p, logits_blv, hidden_bld)


def init_head(backbone: ModelConfig, *, num_layers: int = 3, num_modules: int = 1, residual_scale: float = 1.0,
              init_std: float = 0.2, seed: int = 0) -> MRPHead:
    """A random head: matrices ~ N(0, init_std) (0.2: the reference's setting), norm scales 1.

    One key per checkpoint tensor, in the order of the head's parameters as they were before q/k/v
    and gate/up were fused (`_unfused_parts`), so that a seed gives the weights it gave then."""
    cfg = MRPConfig(backbone.hidden_size, backbone.vocab_size, num_modules, num_layers, residual_scale)
    head = MRPHead(backbone, cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(head)
    flat = nnx.to_flat_state(state)
    parts = sorted((part_path, path, i) for path, var in flat for i, part_path in enumerate(_unfused_parts(path)))
    keys = dict(zip(((path, i) for _, path, i in parts), jax.random.split(jax.random.key(seed), len(parts))))

    def draw(path, var):
        x = var[...]
        if x.ndim < 2:
            return var
        layout = FUSED_LAYOUTS.get(path[-2])
        if layout is None:
            return var.replace(_normal(keys[path, 0], x.shape, init_std, x.dtype))
        shapes = [p.shape for p in layout.split(x, backbone)]
        return var.replace(layout.join(tuple(_normal(keys[path, i], s, init_std, x.dtype)
                                             for i, s in enumerate(shapes)), backbone))

    return nnx.merge(graphdef, nnx.from_flat_state([(path, draw(path, var)) for path, var in flat]))


def _unfused_parts(path: tuple) -> tuple[tuple, ...]:
    """The param paths that `path` held before fusion (`(path,)` for an unfused param)."""
    layout = FUSED_LAYOUTS.get(path[-2]) if len(path) >= 2 else None
    if layout is None:
        return (path,)
    return tuple((*path[:-2], part, path[-1]) for part in layout.parts)


def _normal(key, shape, std: float, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def abstract_head(backbone: ModelConfig, cfg: MRPConfig) -> MRPHead:
    return nnx.eval_shape(lambda: MRPHead(backbone, cfg, rngs=nnx.Rngs(0)))


# ----------------------------------------------------------------------------------------------
# Interop: reference weight names inside the backbone's checkpoint directory

_PREFIX = re.compile(r"mrp_modules\.(\d+)\.model\.(.+)")
_MODULE_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.enorm.weight", "enorm.scale"),
    KeyRule("model.hnorm.weight", "hnorm.scale"),
    KeyRule("model.norm.weight", "norm.scale"),
    KeyRule("model.eh_proj.weight", "eh_proj.kernel", TRANSPOSE),
    *(rule for rule in HF_RULES if "{i}" in rule.hf),  # model.layers.{i}.* as in the backbone
)


def is_head_tensor(name: str) -> bool:
    return name.startswith("mrp_modules.")


def _to_ours(name: str):
    """HF name -> (our param path, its key rule) or None."""
    m = _PREFIX.fullmatch(name)
    if m is None:
        return None
    for rule in _MODULE_RULES:
        path = rule.match_hf("model." + m.group(2))
        if path is not None:
            return f"mrp_modules.{m.group(1)}.{path}", rule
    return None


def _module_rules(path: str) -> tuple[KeyRule, ...]:
    """The key rules of the module holding param `path`, both sides under `mrp_modules.{m}.`."""
    prefix = f"mrp_modules.{path.removeprefix('mrp_modules.').partition('.')[0]}."
    return tuple(KeyRule(prefix + r.hf, prefix + r.ours, r.transform, r.layout, r.part) for r in _MODULE_RULES)


def _to_hf_tensors(path: str, value, backbone: ModelConfig) -> dict[str, np.ndarray]:
    """Param `path` -> its reference-named torch-layout tensors (a fused param's parts)."""
    out = to_hf_tensors(path, value, _module_rules(path), backbone)
    if not out:
        raise KeyError(f"no MRP weight name for parameter {path!r}")
    return out


def has_head(ckpt_dir: str | Path) -> bool:
    return any(is_head_tensor(n) for n in open_shards(ckpt_dir))


def load_head(ckpt_dir: str | Path, backbone: ModelConfig | None = None, *, stored_dtype: bool = False) -> MRPHead:
    """The MRP head stored in a checkpoint directory or a preset's (checked against `backbone` if given),
    in the backbone's dtype, or with `stored_dtype` in the dtype its file holds (`dlmjax export`
    copies a float32 head trained on a bf16 backbone as it is)."""
    ckpt_dir = checkpoint_path(ckpt_dir)
    shards = {n: s for n, s in open_shards(ckpt_dir).items() if is_head_tensor(n)}
    if not shards:
        raise CheckpointError(
            f"{ckpt_dir} holds no MRP head (no mrp_modules.* tensors); train one with "
            "`dlmjax train configs/mrp/toy-sdar.yaml --out runs/mrp` or pass a directory that has one"
        )
    made_for = load_config(ckpt_dir)
    numbers = [re.match(r"mrp_modules\.(\d+)\.model\.layers\.(\d+)\.", n) for n in shards]
    num_modules = 1 + max(int(re.match(r"mrp_modules\.(\d+)", n).group(1)) for n in shards)
    num_layers = 1 + max((int(m.group(2)) for m in numbers if m), default=-1)
    raw_config = json.loads((ckpt_dir / "config.json").read_text())
    scale = raw_config.get(SCALE_KEY, 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise CheckpointError(f"{ckpt_dir}/config.json {SCALE_KEY}={scale!r} must be a finite number (the head's "
                              "residual scale s; 1.0 where absent)")
    # the published MRP checkpoints (SDARMRPForCausalLM) state the head's shape in config.json
    for key, found in (("num_mrp_heads", num_modules), ("num_nextn_predict_layers", num_layers)):
        if raw_config.get(key) is not None and raw_config[key] != found:
            raise CheckpointError(f"{ckpt_dir}/config.json says {key}={raw_config[key]} but its mrp_modules.* tensors "
                                  f"hold {found}; the checkpoint is incomplete or its config.json is not its own")
    cfg = MRPConfig(made_for.hidden_size, made_for.vocab_size, num_modules, max(num_layers, 1), scale)
    graphdef, state = nnx.split(abstract_head(made_for, cfg))
    expected = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    loaded = {}
    fused = FusedParams(made_for)
    for name, shard in shards.items():
        found = _to_ours(name)
        if found is None or found[0] not in expected:
            raise CheckpointError(f"tensor {name!r} in {shard.path.name} is not an MRP head weight of this backbone")
        path, rule = found
        array = rule.transform.to_jax(shard.get(name))
        want = tensor_shape(rule, expected[path].shape, made_for)
        if tuple(array.shape) != want:
            raise CheckpointError(f"shape mismatch for {name!r}: {tuple(array.shape)}, expected {want}"
                                  f"{expected_fields(rule)}")
        param = fused.add(rule, path, np.asarray(array))
        if param is not None:
            loaded[path] = jnp.asarray(param if stored_dtype else param.astype(made_for.dtype))
    missing = set(expected) - set(loaded)
    if missing:
        names = [name for p in sorted(missing) for name in fused.missing([p], _module_rules(p))]
        raise CheckpointError(f"MRP head in {ckpt_dir} is missing {names[:8]}")
    state = nnx.from_flat_state(
        [(tuple(int(k) if k.isdigit() else k for k in p.split(".")), expected[p].replace(loaded[p])) for p in expected]
    )
    head = nnx.merge(graphdef, state)
    if backbone is not None:
        check_compatible(head, backbone)
    return head


def head_tensors(head: MRPHead) -> dict[str, np.ndarray]:
    """Reference-named torch-layout arrays of every head parameter."""
    out = {}
    for p, var in nnx.to_flat_state(nnx.state(head, nnx.Param)):
        out.update(_to_hf_tensors(".".join(map(str, p)), np.asarray(jax.device_get(var[...])), head.backbone_config))
    return out


def save_head(head: MRPHead, ckpt_dir: str | Path) -> Path:
    """Write the head into its backbone's checkpoint directory: `mrp_head.safetensors` (PyTorch
    format, reference names), the index listing every tensor of the directory, and the head's
    residual scale in config.json, and on an SDAR backbone its shape (the keys of the reference
    code's SDARMRPConfig). An
    earlier head in mrp_head.safetensors is replaced; one inside the model's shards (the reference
    code's own layout) is refused: export the checkpoint first (`dlmjax export SRC OUT`)."""
    ckpt_dir = Path(ckpt_dir)
    config_path = ckpt_dir / "config.json"
    config = json.loads(config_path.read_text())
    made_for = load_config(ckpt_dir)
    check_compatible(head, made_for)
    shards = open_shards(ckpt_dir)
    in_shards = sorted({s.path.name for n, s in shards.items() if is_head_tensor(n) and s.path.name != HEAD_FILE})
    if in_shards:
        raise CheckpointError(f"{ckpt_dir} holds a head inside its model shards ({', '.join(in_shards)}), which "
                              f"{HEAD_FILE} would duplicate; export it to a new directory (`dlmjax export {ckpt_dir} "
                              "OUT`, which writes the head on its own) and save the head there")
    backbone_files = {n: s.path.name for n, s in shards.items() if not is_head_tensor(n)}
    (ckpt_dir / HEAD_FILE).unlink(missing_ok=True)
    tensors = head_tensors(head)
    save_file(tensors, ckpt_dir / HEAD_FILE, metadata={"format": "pt"})
    weight_map = {**backbone_files, **{n: HEAD_FILE for n in tensors}}
    total = sum((ckpt_dir / f).stat().st_size for f in set(weight_map.values()))
    write_atomic(ckpt_dir / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config[SCALE_KEY] = head.config.residual_scale
    if made_for.family == "sdar":  # the reference's SDARMRPConfig keys: another family's config refuses them
        # (LLaDA2 reads num_nextn_predict_layers as its own multi-token-prediction layers)
        config["num_mrp_heads"], config["num_nextn_predict_layers"] = head.config.num_modules, head.config.num_layers
    write_atomic(config_path, json.dumps(config, indent=2))
    return ckpt_dir
