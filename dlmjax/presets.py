"""Named models usable wherever a checkpoint directory is: `--model toy-sdar`.

`toy-sdar` and `toy-ar` are trained toy models shipped inside the package (dlmjax/toy/checkpoints;
how each was made is in its TRAINING.md).

A preset is materialised once as a real HF checkpoint directory (config.json, model.safetensors,
tokenizer.json) under `$DLMJAX_CACHE` (default ~/.cache/dlmjax) and then loaded like any other.
The random presets are untrained: they exercise the whole pipeline, not the quality of text.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from dlmjax.config import ModelConfig
from dlmjax.heads.mrp import MRPHead, has_head, load_head
from dlmjax.io.hf import export_model, load_config, load_model
from dlmjax.io.tokenizer import Tokenizer, load_tokenizer
from dlmjax.models.moe import dispatch_mismatch, set_expert_dispatch
from dlmjax.models.transformer import Transformer, init_model
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, InputError, check_fields, check_value

_TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=512, qk_norm=True)
PRESETS: dict[str, dict] = {
    "random-sdar": dict(family="sdar", attention="block_causal", block_size=4, **_TINY),
    "random-qwen3": dict(family="qwen3", attention="causal", **_TINY),
    # Fast-dLLM v2's layout (Qwen2.5 layers: q/k/v biases, no q/k norm; shifted logits; blocks of 32)
    "random-fast-dllm-v2": dict(family="fast_dllm_v2", attention="block_causal", block_size=32, shift_logits=True,
                                qkv_bias=True, **{**_TINY, "qk_norm": False}),
}
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, **_TINY)
PRESETS.update({  # tiny random MoE models of each family (dlmjax.models.moe), in their published layouts
    "random-qwen3-moe": dict(family="qwen3_moe", attention="causal", moe_layers=(0, 1), norm_topk_prob=True,
                             **_TINY_MOE),
    "random-sdar-moe": dict(family="sdar_moe", attention="block_causal", block_size=4, moe_layers=(0, 1),
                            norm_topk_prob=True, **_TINY_MOE),
    "random-llada-moe": dict(family="llada_moe", attention="bidirectional", moe_layers=(0, 1), **_TINY_MOE),
    "random-llada2-moe": dict(family="llada2_moe", attention="block_causal", block_size=32, rotary_dim=8,
                              moe_layers=(1,), shared_expert_intermediate_size=32, router="sigmoid",
                              router_groups=4, router_topk_groups=2, router_expert_bias=True, norm_topk_prob=True,
                              routed_scaling_factor=2.5, **_TINY_MOE),
})

SHIPPED_DIR = Path(__file__).parent / "toy" / "checkpoints"
SHIPPED = ("toy-sdar", "toy-ar")


def preset_names() -> tuple[str, ...]:
    return SHIPPED + tuple(PRESETS)


def cache_dir() -> Path:
    return Path(os.environ.get("DLMJAX_CACHE", Path.home() / ".cache" / "dlmjax"))


def _build(name: str, out_dir: Path) -> Path:
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ids = save_char_tokenizer(tmp)
    cfg = ModelConfig(vocab_size=ids["vocab_size"], mask_token_id=ids["mask"], eos_token_ids=(ids["eos"],),
                      pad_token_id=ids["pad"], **PRESETS[name])
    export_model(init_model(cfg, seed=0), tmp)
    try:
        tmp.rename(out_dir)  # atomic: a half-built preset is never picked up
    except OSError:  # another process built it first, or something else is in the way
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise InputError(f"the preset {name} is built in {out_dir}, which holds other files and no config.json; "
                             f"delete it (or set DLMJAX_CACHE to another directory) and it is built again") from None
    return out_dir


def resolve_model(name_or_dir: str | os.PathLike, what: str = "--model") -> Path:
    """A checkpoint directory for a path or a preset name; `what` names the input in the error."""
    path = Path(name_or_dir)
    if path.is_dir():
        return path
    if str(name_or_dir) in SHIPPED:
        shipped = SHIPPED_DIR / str(name_or_dir)
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(f"the shipped model {name_or_dir} is missing from {shipped}; reinstall dlmjax "
                                    f"or rebuild it with scripts/train_toy.sh")
        return shipped
    if str(name_or_dir) in PRESETS:
        target = cache_dir() / "presets" / str(name_or_dir)
        return target if (target / "config.json").is_file() else _build(str(name_or_dir), target)
    raise FileNotFoundError(
        f"{what} {name_or_dir!r} is neither a checkpoint directory nor a preset; presets: {', '.join(preset_names())}"
    )


def load_checkpoint(name_or_dir: str | os.PathLike, *, dtype: str | None = None,
                    head_from: str | os.PathLike | None = None, mesh=None,
                    expert_dispatch: str | None = None) -> tuple[Path, Transformer, Tokenizer, MRPHead | None]:
    """(checkpoint dir, model, tokenizer, MRP head or None) for a path or preset name. The head
    comes from `head_from` (a path or preset), else from the model's own directory if it holds one.
    `mesh`: the model's params are placed on it as they load (tensor-parallel over 'model', experts
    over 'expert'). `expert_dispatch`: how an MoE model's tokens meet experts split over 'expert'
    (dlmjax.models.moe.EXPERT_DISPATCH; default each layer's "auto")."""
    path = resolve_model(name_or_dir)
    if expert_dispatch is not None and (why := dispatch_mismatch(expert_dispatch, load_config(path), mesh,
                                                                         "--mesh expert=N")):
        raise InputError(f"--expert-dispatch {expert_dispatch} would be ignored: {why}")
    model = load_model(path, dtype=dtype, mesh=mesh)
    if expert_dispatch is not None:
        set_expert_dispatch(model, expert_dispatch)
    head_dir = resolve_model(head_from, "--mrp-head") if head_from else path
    head = load_head(head_dir, model.config) if head_from or has_head(path) else None
    return path, model, load_tokenizer(path, model.config), head


# ----------------------------------------------------------------------------------------------
# Evaluation presets: dlmjax/eval_presets/NAME.yaml, one per published checkpoint and seed table.
# `dlmjax eval --preset NAME --model DIR` runs the preset's tasks, generation lengths, chat
# template and decoders on the checkpoint downloaded to DIR, after checking that DIR is the model
# the preset describes (family, mask id, block size).

PRESETS_DIR = Path(__file__).parent / "eval_presets"  # shipped with the package


@dataclass(frozen=True)
class EvalPreset:
    """One seed table on one published checkpoint (the YAML's keys; comments there cite sources)."""

    name: str
    checkpoint: str  # the Hugging Face repository the preset is for
    family: str  # dlmjax.config.FAMILIES key
    mask_token_id: int | None  # None: autoregressive
    block_size: int | None  # the model's block (block-causal), or the block a bidirectional model's decoders name
    tasks: dict  # task -> max_new_tokens
    decoders: list  # decoder specs, as `dlmjax eval --decoder`
    seeds: str = ""  # which seed documents' tables this reproduces
    chat: bool = True  # prompts through the checkpoint's own chat template
    chat_template_vars: dict = field(default_factory=dict)  # extra chat template variables (enable_thinking)
    batch_size: int = 16
    drafter: str | None = None  # the DFlash drafter repository a `drafter` decoder needs
    path: str = ""  # the YAML file it was read from
    limits = {"block_size": AT_LEAST_1, "mask_token_id": AT_LEAST_0, "batch_size": AT_LEAST_1}

    def __post_init__(self):
        from dlmjax.config import FAMILIES
        from dlmjax.decoding.spec import CAUSAL_DECODERS, DecoderSpecError, parse_decoder, parse_options
        from dlmjax.evaluation.tasks import EVAL_TASKS as TASKS

        where = f"preset {self.path or self.name}"
        check_fields(self, f"{where}: ")
        if self.family not in FAMILIES:
            raise InputError(f"{where}: family {self.family!r}; families: {', '.join(FAMILIES)}")
        if not self.tasks or not self.decoders:
            raise InputError(f"{where}: list its tasks (task: max_new_tokens) and decoders")
        for task, length in self.tasks.items():
            if task not in TASKS:
                raise InputError(f"{where}: task {task!r}; tasks: {', '.join(TASKS)}")
            check_value(f"{where}: tasks.{task}", length, "int", AT_LEAST_1)
        family = FAMILIES[self.family]
        for spec in self.decoders:
            if not isinstance(spec, str):
                raise InputError(f"{where}: decoders are spec strings such as 'threshold:tau=0.9', not {spec!r}")
            try:
                # options typed and ranged; a TSPD decoder is not built (it would read its controller file)
                cls, options = parse_options(spec)
                if spec.split(":")[0].strip() not in ("tspd", "tspd+ce"):
                    parse_decoder(spec)
            except DecoderSpecError as err:
                raise InputError(f"{where}: decoder {spec!r}: {err}") from None
            if issubclass(cls, CAUSAL_DECODERS) != (family.attention == "causal"):
                kind = "an autoregressive" if family.attention == "causal" else f"a {family.attention} diffusion"
                raise InputError(f"{where}: decoder {spec!r} does not fit {kind} model ({self.family}); use "
                                 f"{'ar or drafter' if family.attention == 'causal' else 'a diffusion decoder'}")
            if family.attention == "bidirectional" and "block" not in options:
                raise InputError(f"{where}: decoder {spec!r} names no block; a bidirectional model decodes in the "
                                 f"block its decoder names: add block={self.block_size} (the preset's block_size)")
        if family.attention == "block_causal" and self.block_size is None:
            raise InputError(f"{where}: {self.family} decodes in blocks; set block_size (the checkpoint's)")
        if family.attention == "causal" and self.mask_token_id is not None:
            raise InputError(f"{where}: {self.family} is autoregressive; set mask_token_id: null")
        if family.attention != "causal" and self.mask_token_id is None:
            raise InputError(f"{where}: a diffusion model needs its mask_token_id")

    def check_model(self, cfg) -> None:
        """Refuse a checkpoint that is not the one this preset describes."""
        fix = (f"pass --model the directory of {self.checkpoint} (downloaded from huggingface.co/{self.checkpoint}), "
               "or choose the preset of the model you have")
        if cfg.family != self.family:
            raise InputError(f"--preset {self.name} is for {self.checkpoint} (family {self.family}); the checkpoint's "
                             f"config.json is a {cfg.family} model: {fix}")
        if cfg.mask_token_id != self.mask_token_id:
            raise InputError(f"--preset {self.name} expects mask token id {self.mask_token_id}; the checkpoint has "
                             f"{cfg.mask_token_id}: {fix}")
        if cfg.attention == "block_causal" and cfg.block_size != self.block_size:
            raise InputError(f"--preset {self.name} decodes blocks of {self.block_size}; the checkpoint's block_size is "
                             f"{cfg.block_size}: {fix}")


def eval_preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))


def load_eval_preset(name_or_path: str | os.PathLike) -> EvalPreset:
    """The evaluation preset NAME (dlmjax/eval_presets/NAME.yaml) or a YAML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PRESETS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise InputError(f"--preset {name_or_path!r} is neither a YAML file nor a preset; presets: "
                         f"{', '.join(eval_preset_names()) or '(none: dlmjax/eval_presets is missing)'}")
    from dlmjax.train.config import read_yaml

    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise InputError(f"{path}: a preset is a mapping of keys (name, checkpoint, family, ...)")
    known = {f.name for f in fields(EvalPreset)} - {"path"}
    unknown = sorted(set(raw) - known)
    missing = sorted(f.name for f in fields(EvalPreset) if f.default is MISSING and f.default_factory is MISSING
                     and f.name not in raw)
    if unknown or missing:
        raise InputError(f"{path}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else []))
            + f"; a preset's keys are {', '.join(sorted(known))}")
    return EvalPreset(**raw, path=str(path))
