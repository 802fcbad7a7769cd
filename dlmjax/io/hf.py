"""Hugging Face checkpoint directories in and out.

Import: config.json -> `ModelConfig` (strict, see dlmjax.config), then every tensor of every
safetensors shard is mapped by a `KeyRule` onto one model parameter. Loading fails on a tensor
no rule claims, a parameter two tensors claim, a shape mismatch, or a parameter left unset.
Each rule pairs its import transform with the inverse used on export, so the two cannot drift.
Fused params (q/k/v as `attn.qkv`, gate/up as `mlp.gate_up`: dlmjax.models.fused) keep the HF
names: one rule per part names the same param with the part's `FusedLayout`, which joins the
parts on import and splits them on export (one definition of the layout, used both ways).

Export: parameters -> safetensors shards (+ index) with metadata `format: pt`, a config.json
from `to_hf_config`, and from the source directory its tokenizer files and its remote code (the
`auto_map` of its config.json and the *.py files beside it, where the source is of the exported
model's family). Qwen3/Qwen2/Llama exports load in transformers' `from_pretrained`; the remote-code
families (LLaDA, Dream, SDAR, ...) load with `trust_remote_code=True` where their source carried
the code; every family loads back into dlmjax.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax.config import DTYPES, ConfigError, FAMILIES, ModelConfig, from_hf_config, to_hf_config
from dlmjax.io import moe_weights
from dlmjax.io.files import staged_dir, write_atomic
from dlmjax.io.safetensors import SAFETENSORS_DTYPES, CheckpointError, SafetensorsFile, save_file
from dlmjax.models.fused import GATE_UP, QKV, FusedLayout
from dlmjax.models.transformer import Transformer, abstract_model
from dlmjax.sharding import DEFAULT_RULES, ShardingRules, param_sharding, put_array, unsplit_weights
from dlmjax.validation import read_json_file

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
)
TOKENIZER_FOLDERS = ("additional_chat_templates",)  # transformers 5: named chat templates, one .jinja each
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------
# Key rules


@dataclass(frozen=True)
class Transform:
    """A tensor transform and its inverse (torch layout <-> dlmjax layout)."""

    name: str
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_torch: Callable[[np.ndarray], np.ndarray]


IDENTITY = Transform("identity", lambda a: a, lambda a: a)
TRANSPOSE = Transform("transpose", lambda a: a.T, lambda a: a.T)  # torch Linear [out, in] <-> [in, out]


@dataclass(frozen=True)
class KeyRule:
    """One HF tensor name template <-> one dlmjax param path template; `{i}` is the layer.

    With a `layout` the param is fused and the tensor is its part `part` (in dlmjax layout, after
    `transform`): the fused param has one rule per part, all naming the same param."""

    hf: str
    ours: str
    transform: Transform = IDENTITY
    layout: FusedLayout | None = None
    part: str = ""

    @staticmethod
    def _regex(template: str) -> re.Pattern:
        return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))

    def match_hf(self, name: str) -> str | None:
        m = self._regex(self.hf).fullmatch(name)
        return None if m is None else self.ours.format(**m.groupdict())

    def match_ours(self, path: str) -> str | None:
        m = self._regex(self.ours).fullmatch(path)
        return None if m is None else self.hf.format(**m.groupdict())


def part_of(layout: FusedLayout, part: str, param: str) -> tuple[str, FusedLayout, str]:
    """A rule target: the part `part` of the fused param `param` (e.g. q of `attn.qkv.kernel`)."""
    return param, layout, part


def qkv_parts(hf_name: str, param: str) -> dict[str, tuple]:
    """HF q/k/v names (`hf_name` with `{p}` for q, k, v) -> the parts of the fused `param`."""
    return {hf_name.format(p=p): part_of(QKV, p, param) for p in QKV.parts}


def gate_up_parts(hf_names: dict[str, str], param: str) -> dict[str, tuple]:
    """{gate: HF name, up: HF name} -> the parts of the fused `param`."""
    return {hf_names[p]: part_of(GATE_UP, p, param) for p in GATE_UP.parts}


def layer_rules(prefix: str, names: dict[str, str | tuple]) -> list[KeyRule]:
    """Rules for one layer's tensors: HF name (after `prefix`) -> our path under `layers.{i}.`, or
    a `part_of` a fused param. Kernels are transposed (torch Linear [out, in])."""
    out = []
    for hf_name, ours in names.items():
        param, layout, part = ours if isinstance(ours, tuple) else (ours, None, "")
        transform = TRANSPOSE if param.endswith(".kernel") else IDENTITY
        out.append(KeyRule(f"{prefix}{hf_name}", f"layers.{{i}}.{param}", transform, layout, part))
    return out


HF_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.embed_tokens.weight", "embed"),
    KeyRule("model.norm.weight", "final_norm.scale"),
    KeyRule("lm_head.weight", "lm_head.kernel", TRANSPOSE),
    *layer_rules(
        "model.layers.{i}.",
        {
            **qkv_parts("self_attn.{p}_proj.weight", "attn.qkv.kernel"),
            **qkv_parts("self_attn.{p}_proj.bias", "attn.qkv.bias"),
            "self_attn.o_proj.weight": "attn.o.kernel",
            "self_attn.o_proj.bias": "attn.o.bias",
            "self_attn.q_norm.weight": "attn.q_norm.scale",
            "self_attn.k_norm.weight": "attn.k_norm.scale",
            **gate_up_parts({"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"}, "mlp.gate_up.kernel"),
            "mlp.down_proj.weight": "mlp.down.kernel",
            "input_layernorm.weight": "attn_norm.scale",
            "post_attention_layernorm.weight": "mlp_norm.scale",
        },
    ),
)

LLADA_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.transformer.wte.weight", "embed"),
    KeyRule("model.transformer.ln_f.weight", "final_norm.scale"),
    KeyRule("model.transformer.ff_out.weight", "lm_head.kernel", TRANSPOSE),
    *layer_rules(
        "model.transformer.blocks.{i}.",
        {
            **qkv_parts("{p}_proj.weight", "attn.qkv.kernel"),
            **qkv_parts("{p}_proj.bias", "attn.qkv.bias"),
            "attn_out.weight": "attn.o.kernel",
            # LLaDA: ff_out(silu(ff_proj x) * up_proj x)
            **gate_up_parts({"gate": "ff_proj.weight", "up": "up_proj.weight"}, "mlp.gate_up.kernel"),
            "ff_out.weight": "mlp.down.kernel",
            "attn_norm.weight": "attn_norm.scale",
            "ff_norm.weight": "mlp_norm.scale",
        },
    ),
)


# MoE layers, in the canonical layout of dlmjax.io.moe_weights (stacked experts, Qwen names).
SWAP_LAST = Transform("swap last two axes", lambda a: a.swapaxes(-1, -2), lambda a: a.swapaxes(-1, -2))
MOE_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router", TRANSPOSE),
    KeyRule("model.layers.{i}.mlp.gate.expert_bias", "layers.{i}.mlp.expert_bias"),
    KeyRule("model.layers.{i}.mlp.experts.gate_up_proj", "layers.{i}.mlp.experts_gate_up", SWAP_LAST),
    KeyRule("model.layers.{i}.mlp.experts.down_proj", "layers.{i}.mlp.experts_down", SWAP_LAST),
    *layer_rules("model.layers.{i}.mlp.shared_experts.", {
        **gate_up_parts({"gate": "gate_proj.weight", "up": "up_proj.weight"}, "mlp.shared.gate_up.kernel"),
        "down_proj.weight": "mlp.shared.down.kernel",
    }),
)


def key_rules(cfg: ModelConfig) -> tuple[KeyRule, ...]:
    return LLADA_RULES if FAMILIES[cfg.family].layout == "llada" else HF_RULES + MOE_RULES


def hf_name_for(path: str, rules) -> str:
    for rule in rules:
        name = rule.match_ours(path)
        if name is not None:
            return name
    raise KeyError(f"no key rule exports parameter {path!r}")


def param_rules(path: str, rules) -> list[KeyRule]:
    """The rules that export param `path`: one, or one per part of a fused param."""
    return [rule for rule in rules if rule.match_ours(path) is not None]


def to_hf_tensors(path: str, value, rules, cfg) -> dict[str, np.ndarray]:
    """Param `path`'s value -> its HF tensors in torch layout (a fused param split into its parts)."""
    out = {}
    claimed = param_rules(path, rules)
    if not claimed:  # (to_hf_config refuses the configs whose params the family's layout lacks)
        raise CheckpointError(f"param {path} has no {cfg.family} weight name: the family's checkpoints cannot hold it")
    for rule in claimed:
        part = value if rule.layout is None else rule.layout.part(value, rule.part, cfg)
        out[rule.match_ours(path)] = np.ascontiguousarray(rule.transform.to_torch(np.asarray(part)))
    return out


# The config.json fields that size each part of a fused param (named in shape errors).
PART_FIELDS = {"q": "num_attention_heads x head_dim", "k": "num_key_value_heads x head_dim",
               "v": "num_key_value_heads x head_dim", "gate": "intermediate_size", "up": "intermediate_size"}


def tensor_shape(rule: KeyRule, param_shape, cfg) -> tuple[int, ...]:
    """The shape (dlmjax layout) the rule's tensor must have: the param's, or its part's."""
    if rule.layout is None:
        return tuple(param_shape)
    fused = jax.ShapeDtypeStruct(tuple(param_shape), jnp.float32)
    return tuple(jax.eval_shape(lambda a: rule.layout.part(a, rule.part, cfg), fused).shape)


def expected_fields(rule: KeyRule) -> str:
    """' (its columns: num_key_value_heads x head_dim)' for a part of a fused param, else ''."""
    return f" (its columns: {PART_FIELDS[rule.part]})" if rule.layout is not None else ""


class FusedParams:
    """Import side of fused params: a part waits here until the param's last part arrives."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.pending: dict[str, dict[str, np.ndarray]] = defaultdict(dict)

    def add(self, rule: KeyRule, path: str, array: np.ndarray) -> np.ndarray | None:
        """The param `path` if `array` completes it (a whole param always does), else None."""
        if rule.layout is None:
            return array
        parts = self.pending[path]
        parts[rule.part] = array
        if len(parts) < len(rule.layout.parts):
            return None
        del self.pending[path]
        return rule.layout.join(tuple(parts[p] for p in rule.layout.parts), self.cfg)

    def missing(self, paths, rules) -> list[str]:
        """The HF names of the tensors still missing for `paths` (params not complete)."""
        return [rule.match_ours(p) for p in sorted(paths) for rule in param_rules(p, rules)
                if rule.part not in self.pending.get(p, {})]


# ----------------------------------------------------------------------------------------------
# Import


def _refuse_a_training_run(ckpt_dir: Path) -> None:
    """A `dlmjax train` run directory given where a checkpoint goes: name the checkpoint it wrote."""
    exported = [ckpt_dir / sub for sub in ("model", "drafter") if (ckpt_dir / sub / "config.json").is_file()]
    if (ckpt_dir / "config.yaml").is_file() and exported:
        raise CheckpointError(f"{ckpt_dir} is a dlmjax training run; what it trained is in {exported[0]}: pass that "
                              "directory")


@contextlib.contextmanager
def naming_the_file(ckpt_dir: str | Path):
    """ConfigErrors raised inside name the checkpoint's config.json by its path (a model, its
    drafter and its head each have one)."""
    try:
        yield
    except ConfigError as err:
        message, path = str(err), str(Path(ckpt_dir) / "config.json")
        named = message.replace("config.json", path, 1) if "config.json" in message else f"{path}: {message}"
        raise ConfigError(named) from None


def read_config(ckpt_dir: str | Path) -> dict:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        from dlmjax.presets import preset_names

        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist; pass a checkpoint directory or a "
                              f"preset ({', '.join(preset_names())})")
    path = ckpt_dir / "config.json"
    if not path.is_file():
        _refuse_a_training_run(ckpt_dir)
        raise CheckpointError(
            f"missing config.json in {ckpt_dir}: a Hugging Face checkpoint directory needs config.json "
            "beside its *.safetensors files (save it with `model.config.save_pretrained(dir)`)"
        )
    return read_json_file(path, error=ConfigError, fix="fix the file or re-download the checkpoint")


SIDE_FILES = ("tspd_controller.safetensors",)  # stored beside a checkpoint, not weight shards (heads.controller)


def open_shards(ckpt_dir: str | Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the shard holding it (via the index when there is one)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} is not a directory; pass a checkpoint directory or a preset name")
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        extra = sorted(p.name for p in ckpt_dir.glob("*.safetensors") if p.name not in files + list(SIDE_FILES))
        if extra:
            raise CheckpointError(f"{ckpt_dir} holds shards that {INDEX_FILE} does not list: {extra}; remove them, or "
                                  "add their tensors to the index if they belong to this checkpoint")
    else:  # every safetensors file but the side files dlmjax keeps beside a model
        files = sorted(p.name for p in ckpt_dir.glob("*.safetensors") if p.name not in SIDE_FILES)
    if not files:
        _refuse_a_training_run(ckpt_dir)
        raise CheckpointError(
            f"no *.safetensors in {ckpt_dir}; dlmjax reads safetensors only "
            "(convert a PyTorch .bin checkpoint with transformers: `model.save_pretrained(dir)`)"
        )
    where: dict[str, SafetensorsFile] = {}
    for file in files:
        if not (ckpt_dir / file).is_file():
            raise CheckpointError(f"{INDEX_FILE} lists shard {file}, which is missing from {ckpt_dir}")
        shard = SafetensorsFile(ckpt_dir / file)
        for name in shard.keys():
            if name in where:
                raise CheckpointError(f"duplicate tensor {name!r} in {where[name].path.name} and {file}")
            where[name] = shard
    if index.is_file():
        unlisted = sorted(n for n, f in weight_map.items() if n not in where or where[n].path.name != f)
        if unlisted:
            raise CheckpointError(f"{INDEX_FILE} in {ckpt_dir} places tensors in shards that do not hold them: "
                                  f"{unlisted[:8]}{' ...' if len(unlisted) > 8 else ''}; re-download or re-export the "
                                  "checkpoint")
    return where


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map."""
    weight_map = read_json_file(index, error=CheckpointError, fix="re-download or re-export the checkpoint")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no `weight_map` of tensor names to shard files; re-download or re-export "
                              "the checkpoint")
    return weight_map


def checkpoint_path(name_or_dir: str | Path) -> Path:
    """The directory of a checkpoint named by its path or by a preset (`toy-sdar`, `random-sdar`, ...:
    dlmjax.presets), so that the Python API takes what the CLI's --model takes."""
    from dlmjax.presets import preset_names, resolve_model

    path = Path(name_or_dir)
    return resolve_model(path) if not path.is_dir() and str(name_or_dir) in preset_names() else path


def load_config(ckpt_dir: str | Path, *, family: str | None = None, dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory or preset name."""
    ckpt_dir = checkpoint_path(ckpt_dir)
    raw = read_config(ckpt_dir)
    if isinstance(raw, dict) and raw.get("architectures") == ["DFlashDraftModel"]:
        raise CheckpointError(f"{ckpt_dir} holds a DFlash drafter, not a model: pass it as --drafter DIR (model_args "
                              "drafter=DIR) beside its target model")
    with naming_the_file(ckpt_dir):
        cfg = from_hf_config(raw, family=family)
    if dtype is None and isinstance(raw, dict) and raw.get("dtype", raw.get("torch_dtype")) is None:
        dtype = stored_dtype(ckpt_dir)  # config.json names none (LLaDA-8B's): what the weights are stored in
    return cfg.replace(dtype=dtype) if dtype else cfg


def stored_dtype(ckpt_dir: Path) -> str | None:
    """The floating dtype that holds most of a checkpoint's weight bytes (transformers' dtype "auto"
    falls back to the weights' dtype where config.json names none); None without weights to read."""
    if not any(p.name not in SIDE_FILES for p in ckpt_dir.glob("*.safetensors")):
        return None
    counts: dict[str, int] = defaultdict(int)
    for name, shard in open_shards(ckpt_dir).items():
        counts[shard.stored_dtype(name)] += shard.nbytes(name)
    names = {code: SAFETENSORS_DTYPES[code].name for code in counts if code in SAFETENSORS_DTYPES}
    floating = {names[code]: n for code, n in counts.items() if names.get(code) in DTYPES}  # F64: no model dtype
    return max(floating, key=floating.get) if floating else None


def _flat_params(model_or_state) -> dict[str, nnx.Variable]:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return {".".join(str(k) for k in path): var for path, var in nnx.to_flat_state(state)}


def load_model(
    ckpt_dir: str | Path,
    *,
    family: str | None = None,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules = DEFAULT_RULES,
) -> Transformer:
    """Load a HF checkpoint directory, or a preset by name (`toy-sdar`), into a `Transformer`
    (params sharded on `mesh` if given).

    `dtype` (float32/bfloat16/float16) overrides the checkpoint's parameter dtype.
    """
    ckpt_dir = checkpoint_path(ckpt_dir)
    cfg = load_config(ckpt_dir, family=family, dtype=dtype)
    unsplit = unsplit_weights(cfg, mesh) if mesh is not None else []
    if unsplit and jax.process_index() == 0:  # each device holds these whole (said once, by process 0)
        log.warning("%s: the mesh's model/expert axes leave these weights unsplit over them, as their sizes do not "
                    "divide by those axes: %s; choose axis sizes that divide them to split them", ckpt_dir,
                    "; ".join(unsplit))
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    expected = _flat_params(abstract_state)
    key_map = key_rules(cfg)
    loaded: dict[str, jax.Array] = {}
    source: dict[tuple[str, str], str] = {}  # (param, part) -> the tensor that gave it
    fused = FusedParams(cfg)
    tied_reads: dict[str, tuple[str, Callable]] = {}  # embed / lm_head.kernel -> (name, read) of a tied model
    for name, file, read in moe_weights.canonical_tensors(cfg, open_shards(ckpt_dir)):
        if name.startswith("mrp_modules."):
            continue  # an MRP head stored beside the backbone: dlmjax.heads.mrp.load_head reads it
        if name.endswith(".rotary_emb.inv_freq"):
            continue  # a buffer derived from the config, saved by transformers < 4.31; transformers ignores it too
        rule = next((r for r in key_map if r.match_hf(name) is not None), None)
        if rule is None:
            raise CheckpointError(f"tensor {name!r} in {file} matches no {cfg.family} weight name")
        path = rule.match_hf(name)
        if path in ("embed", "lm_head.kernel") and cfg.tie_word_embeddings:
            tied_reads[path] = (name, read)
            if path == "lm_head.kernel":
                continue  # a tied head saved explicitly: the embedding is the head, if they are equal
        if path not in expected:
            layer = re.search(r"layers\.(\d+)\.", path)
            if layer is not None and int(layer[1]) >= cfg.num_layers:
                raise CheckpointError(f"tensor {name!r} in {file} is for layer {layer[1]}, but config.json says "
                                      f"num_hidden_layers={cfg.num_layers}; check config.json")
            raise CheckpointError(
                f"tensor {name!r} in {file} has no place in a {cfg.family} model with this config "
                f"(qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}, qk_norm={cfg.qk_norm}, "
                f"tie_word_embeddings={cfg.tie_word_embeddings}); check config.json"
            )
        if (path, rule.part) in source:
            raise CheckpointError(f"duplicate: tensors {source[path, rule.part]!r} and {name!r} both map to {path}"
                                  f"{f' ({rule.part})' if rule.part else ''}")
        array = rule.transform.to_jax(read())
        want = expected[path].shape
        if tuple(array.shape) != tensor_shape(rule, want, cfg):
            raise CheckpointError(
                f"shape mismatch for {name!r} in {file}: checkpoint {tuple(array.shape)} after {rule.transform.name}, "
                f"config expects {tensor_shape(rule, want, cfg)}{expected_fields(rule)}; check config.json"
            )
        source[path, rule.part] = name
        param = fused.add(rule, path, np.asarray(array).astype(expected[path].dtype))  # MoE routers: fp32
        if param is not None:
            sharding = param_sharding(path, want, cfg, mesh, rules) if mesh is not None else None
            loaded[path] = put_array(param, sharding)
    refuse_untied_saved_head(tied_reads, ckpt_dir)
    missing = set(expected) - set(loaded)
    if missing:
        names = fused.missing(missing, key_map)
        tied = ("; a head tied to the embedding needs tie_word_embeddings: true in config.json"
                if "lm_head.kernel" in missing and not cfg.tie_word_embeddings else "")
        raise CheckpointError(f"checkpoint {ckpt_dir} is missing tensors {names[:8]}{' ...' if len(names) > 8 else ''}"
                              f"{tied}")
    state = nnx.from_flat_state(
        [(tuple(int(k) if k.isdigit() else k for k in p.split(".")), expected[p].replace(loaded[p])) for p in expected]
    )
    return nnx.merge(graphdef, state)


def refuse_untied_saved_head(tied_reads: dict[str, tuple[str, Callable]], ckpt_dir) -> None:
    """A config that ties the head to the embedding, with a saved head that differs from it (a
    fine-tune that trained its head and kept the base model's config): refused, since transformers 5
    uses the saved head there and transformers 4 and vLLM the embedding."""
    if "lm_head.kernel" not in tied_reads or "embed" not in tied_reads:
        return
    (head_name, read_head), (embed_name, read_embed) = tied_reads["lm_head.kernel"], tied_reads["embed"]
    if not np.array_equal(read_head(), read_embed()):
        raise ConfigError(
            f"{ckpt_dir}/config.json ties the output head to the embedding (tie_word_embeddings / weight_tying "
            f"true), but the checkpoint's {head_name!r} differs from {embed_name!r}: set it to false to use the "
            "saved head (as transformers 5 does), or delete the head tensor to tie them")


# ----------------------------------------------------------------------------------------------
# Export


def export_model(
    model: Transformer,
    out_dir: str | Path,
    *,
    files_from: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write `model` as a HF checkpoint directory in PyTorch format; returns `out_dir`.

    `files_from` (the directory the model was loaded from) gives the export its tokenizer files and,
    where it holds a model of the same family, its remote code (`auto_map` and *.py files).
    `tokenizer_from` is its former name (deprecated).

    `out_dir` may hold other files (a tokenizer) but no checkpoint. The export is staged beside it
    and swapped in when complete (dlmjax.io.files): a killed export leaves `out_dir` as it was."""
    if tokenizer_from is not None:
        warnings.warn("export_model(tokenizer_from=) is now files_from=", DeprecationWarning, stacklevel=2)
        files_from = files_from if files_from is not None else tokenizer_from
    out_dir = Path(out_dir)
    check_export_target(out_dir)
    if files_from is not None:
        files_from = checkpoint_path(files_from)  # a preset name, as load_model takes
        if not files_from.is_dir():  # a typo would give an export without its tokenizer
            raise CheckpointError(f"files_from={str(files_from)!r} is not a directory: pass the directory the "
                                  "model was loaded from (its tokenizer and remote code), or leave it out")
    with staged_dir(out_dir, keep_existing=True) as stage:
        _write_checkpoint(model, stage, files_from, max_shard_bytes)
    return out_dir


def check_export_target(out_dir: Path) -> None:
    """Refuse an output directory that already holds a checkpoint, or part of one (weights, a
    config.json, a shard index, a drafter: the export keeps what it does not write, and a stale
    index or drafter would be read with the new weights), or a file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} is a file; export into an empty or new directory")
    held = sorted(p.name for pattern in ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
                  for p in out_dir.glob(pattern))
    held += [name for name in ("config.json", "drafter") if (out_dir / name).exists()]
    if held:
        raise CheckpointError(f"{out_dir} already holds a checkpoint ({', '.join(held[:4])}); export into an empty "
                              "or new directory")


def _write_checkpoint(model: Transformer, out_dir: Path, files_from, max_shard_bytes: int) -> None:
    cfg = model.config
    hf_config = to_hf_config(cfg)  # first: it refuses a config the family's checkpoints cannot hold
    _write_shards(_checkpoint_tensors(model), out_dir, max_shard_bytes)
    code = remote_code(Path(files_from), cfg.family) if files_from is not None else None
    if code is not None:  # the source's spelling of model_type ("Dream"), which its code declares
        hf_config["model_type"], hf_config["auto_map"], files = code
        for src in files:
            shutil.copy2(src, out_dir / src.name)
    write_atomic(out_dir / "config.json", json.dumps(hf_config, indent=2))
    if files_from is not None:
        for file in TOKENIZER_FILES:
            src = Path(files_from) / file
            if src.is_file():
                shutil.copy2(src, out_dir / file)
        for folder in TOKENIZER_FOLDERS:
            if (Path(files_from) / folder).is_dir():
                shutil.copytree(Path(files_from) / folder, out_dir / folder, dirs_exist_ok=True)


def _checkpoint_tensors(model: Transformer) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors (published names, torch layout), made one parameter at a time."""
    cfg = model.config
    key_map = key_rules(cfg)
    for path, var in sorted(_flat_params(model).items()):
        value = np.asarray(jax.device_get(var[...]))
        if path.endswith(".router") and cfg.router != "sigmoid":
            value = value.astype(cfg.dtype)  # kept in float32, used in the activations' dtype (moe.router_logits)
        yield from moe_weights.published_tensors(cfg, to_hf_tensors(path, value, key_map, cfg)).items()


def _write_shards(tensors: Iterable[tuple[str, np.ndarray]], out_dir: Path, max_shard_bytes: int) -> None:
    """Write `tensors` in order into safetensors files of at most `max_shard_bytes` (a larger tensor
    has a file of its own), each written as soon as it is full, so host memory holds one shard,
    not the model: one file is model.safetensors; more are model-0000i-of-0000n.safetensors with
    the index transformers reads."""
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def write_shard():
        part = out_dir / f".shard-{len(written) + 1:05d}"  # named once their number is known
        save_file(shard, part, metadata={"format": "pt"})
        written.append((part, list(shard)))

    for name, array in tensors:
        if shard and size + array.nbytes > max_shard_bytes:
            write_shard()
            shard, size = {}, 0
        shard[name] = array
        size += array.nbytes
        total += array.nbytes
    write_shard()
    if len(written) == 1:
        written[0][0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, (part, names) in enumerate(written, 1):
        file = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        part.rename(out_dir / file)
        weight_map.update({name: file for name in names})
    write_atomic(out_dir / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2))


def remote_code(src_dir: Path, family: str) -> tuple[str, dict, list[Path]] | None:
    """(model_type, auto_map, *.py files) of the checkpoint in `src_dir` where it is a `family`
    model that carries remote code (LLaDA's, Dream's, SDAR's modeling files), else None."""
    if not (src_dir / "config.json").is_file():
        return None
    source = read_config(src_dir)
    if not isinstance(source, dict) or not source.get("auto_map"):
        return None
    try:
        if from_hf_config(source).family != family:
            return None
    except ConfigError:
        return None
    return source["model_type"], source["auto_map"], sorted(src_dir.glob("*.py"))


__all__ = [
    "CheckpointError", "ConfigError", "KeyRule", "Transform", "export_model", "key_rules",
    "load_config", "load_model", "open_shards", "read_config",
]
