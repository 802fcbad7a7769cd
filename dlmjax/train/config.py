"""Training run configuration: a YAML file plus `section.key=value` overrides.

    objective: block_diffusion        # or next_token
    model: {family: sdar, block_size: 8, hidden_size: 128, ...}   # ModelConfig fields
    data:  {tasks: {toy-arith: 0.5, toy-constraint: 0.5}, seq_len: 64, seed: 0}
    train: {steps: 4000, batch_size: 64, lr: 3.0e-3, ...}

An MRP head (a residual head on a frozen backbone) names its backbone instead of a model section:

    objective: mrp
    backbone: toy-sdar                # a preset or a checkpoint directory (block-causal)
    mrp: {num_layers: 1, loss: kd_diff, gt_topk: 1, chain_steps: 1, ...}

Override values are parsed as YAML (`train.lr=1e-3`, `data.tasks={toy-arith: 1}`). Unknown
keys are errors that list the known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dlmjax.config import ModelConfig
from dlmjax.train.mrp import LOSSES
from dlmjax.train.objectives import WEIGHTINGS
from dlmjax.validation import InputError

OBJECTIVES = ("block_diffusion", "next_token", "mrp", "drafter", "tspd")


class RunConfigError(InputError):
    pass


@dataclass(frozen=True)
class DataConfig:
    tasks: dict = field(default_factory=lambda: {"toy-arith": 0.5, "toy-constraint": 0.5})
    seq_len: int = 64
    seed: int = 0


@dataclass(frozen=True)
class OptimConfig:
    steps: int = 4000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    loss_weighting: str = "none"  # block diffusion: "none" | "inverse_t"
    seed: int = 0
    log_every: int = 20
    checkpoint_every: int = 250
    keep_checkpoints: int = 2
    eval_every: int = 500  # 0: no evaluation during training
    eval_examples: int = 64  # per task, static decoding, seed 1234
    init_from: str | None = None  # start from a checkpoint dir or preset with the same shapes (e.g. toy-ar)


@dataclass(frozen=True)
class MRPSection:
    """The MRP head (dlmjax.heads.mrp) and its training loss (dlmjax.train.mrp)."""

    num_layers: int = 3  # decoder layers per module (the paper: 2-3 best)
    num_modules: int = 1  # chain step k uses module min(k, num_modules - 1)
    residual_scale: float = 1.0  # s in logits_k = logits_{k-1} + s * lm_head(h_p)
    init_std: float = 0.2  # normal std of every head matrix at init (the reference's setting)
    init_norm_scale: float = 1.0  # initial scale of each module's output RMSNorm (reference: 1; 0: no residual at init)
    loss: str = "kd_diff"  # kd_diff | ce | mse, or the *_sum variants (mean over all chain steps)
    gt_topk: int = 1  # masked positions revealed per block and chain step
    chain_steps: int = 1  # head iterations trained per example (n)
    temperature: float = 1.0  # KD temperature T (kd_diff losses)

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise RunConfigError(f"mrp.loss={self.loss!r}; choose one of {', '.join(LOSSES)}")
        for name in ("num_layers", "num_modules", "gt_topk", "chain_steps"):
            if getattr(self, name) < 1:
                raise RunConfigError(f"mrp.{name}={getattr(self, name)} must be >= 1")
        if self.temperature <= 0 or self.init_std < 0 or self.init_norm_scale < 0:
            raise RunConfigError(f"mrp.temperature must be > 0, mrp.init_std and mrp.init_norm_scale >= 0 "
                                 f"(got {self.temperature}, {self.init_std}, {self.init_norm_scale})")


@dataclass(frozen=True)
class DrafterSection:
    """A DFlash drafter (dlmjax.heads.drafter) on a frozen causal target, and its losses
    (dlmjax.losses; dlmjax.train.drafter)."""

    num_layers: int = 1  # drafter decoder layers
    block_size: int = 8  # K: the block is [last token, MASK x (K-1)]
    target_layer_ids: list | None = None  # None: DFlash's default, evenly over [1, N-3]
    mask_token_id: int | None = None  # None: the target's (toy tokenizer: <|mask|>)
    anchors_per_row: int = 4  # blocks trained per row and step
    labels: str = "target"  # target: the target's greedy predictions (self-distillation) | data
    ce_weight: float = 1.0
    decay_gamma: float = 0.0  # 0: position-uniform CE; else w_k = exp(-(k-1)/gamma)
    focal_alpha: float = 0.0  # first-error focal term weight alpha_f
    focal_gamma: float = 2.0
    chain_alpha: float = 0.0  # chain loss weight alpha_c
    export_dtype: str = "bfloat16"  # dtype of the exported DFlash weights
    eval_prompts: int = 16  # per task: mean accepted length of greedy speculative decoding

    def __post_init__(self):
        if self.labels not in ("target", "data"):
            raise RunConfigError(f"drafter.labels={self.labels!r}; choose target (self-distillation) or data")
        if self.block_size < 2 or self.num_layers < 1 or self.anchors_per_row < 1:
            raise RunConfigError(f"drafter.block_size must be >= 2, num_layers and anchors_per_row >= 1 (got "
                                 f"{self.block_size}, {self.num_layers}, {self.anchors_per_row})")
        if self.decay_gamma < 0 or self.focal_alpha < 0 or self.chain_alpha < 0:
            raise RunConfigError("drafter.decay_gamma, focal_alpha and chain_alpha must be >= 0 (0 turns a term off)")


@dataclass(frozen=True)
class TSPDSection:
    """The TSPD controller (dlmjax.heads.controller) trained on traces (dlmjax.train.tspd)."""

    traces: str = ""  # a `dlmjax traces` output directory
    features: list = field(default_factory=lambda: ["confidence", "entropy", "momentum", "stable", "block_pos",
                                                    "abs_pos"])
    hidden: int = 32  # width of the MLP's hidden layer
    holdout: float = 0.2  # fraction of the traces' prompts held out (eval and threshold calibration)
    target_precision: float = 0.999  # calibrated threshold: the smallest with this held-out precision

    def __post_init__(self):
        if self.hidden < 1 or not 0 < self.holdout < 1 or not 0 < self.target_precision <= 1:
            raise RunConfigError(f"tspd.hidden must be >= 1, tspd.holdout in (0, 1), tspd.target_precision in (0, 1] "
                                 f"(got {self.hidden}, {self.holdout}, {self.target_precision})")
        from dlmjax.heads.controller import check_features

        try:
            check_features(self.features)
        except ValueError as exc:
            raise RunConfigError(f"tspd.features: {exc}") from None

    def __hash__(self):
        return hash((self.traces, tuple(self.features), self.hidden, self.holdout, self.target_precision))


@dataclass(frozen=True)
class RunConfig:
    objective: str = "block_diffusion"
    model: dict = field(default_factory=dict)
    data: DataConfig = DataConfig()
    train: OptimConfig = OptimConfig()
    backbone: str | None = None  # objective mrp: the frozen backbone (preset name or checkpoint directory)
    mrp: MRPSection = MRPSection()
    drafter: DrafterSection = DrafterSection()
    tspd: TSPDSection = TSPDSection()

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise RunConfigError(f"objective={self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if self.train.loss_weighting not in WEIGHTINGS:
            raise RunConfigError(
                f"train.loss_weighting={self.train.loss_weighting!r}; choose one of {', '.join(WEIGHTINGS)}"
            )
        if self.objective == "mrp":
            self._check_mrp()
            return
        if self.objective == "drafter":
            self._check_drafter()
            return
        if self.objective == "tspd":
            self._check_tspd()
            return
        if self.tspd != TSPDSection():
            raise RunConfigError(f"the `tspd` section belongs to objective tspd, not {self.objective}")
        if self.drafter != DrafterSection():
            raise RunConfigError(f"the `drafter` section belongs to objective drafter, not {self.objective}")
        if self.backbone is not None or self.mrp != MRPSection():
            raise RunConfigError(f"`backbone` and the `mrp` section belong to objective mrp, not {self.objective}; "
                                 "set objective: mrp or remove them")
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise RunConfigError(f"unknown model keys {unknown}; ModelConfig fields are: {', '.join(sorted(known))}")
        if self.objective == "block_diffusion" and self.model.get("attention") != "block_causal":
            raise RunConfigError("objective block_diffusion needs model.attention=block_causal")
        if self.objective == "next_token" and self.model.get("attention", "causal") != "causal":
            raise RunConfigError("objective next_token needs model.attention=causal")

    def _check_mrp(self):
        if self.model:
            raise RunConfigError(
                f"objective mrp trains a head on a frozen backbone, so the model section must be empty "
                f"(got keys {sorted(self.model)}); remove it and name the backbone instead "
                "(backbone: toy-sdar or a checkpoint directory)"
            )
        if not self.backbone:
            raise RunConfigError("objective mrp needs `backbone:` (a preset such as toy-sdar or a checkpoint directory)")
        if self.train.init_from is not None:
            raise RunConfigError("train.init_from is for backbones; objective mrp starts from a random head "
                                 "(set mrp.init_std) and reads its backbone from `backbone`")

    def _check_drafter(self):
        if self.model or self.mrp != MRPSection():
            raise RunConfigError("objective drafter trains a drafter for a frozen target: remove the model and mrp "
                                 "sections and name the target (backbone: toy-ar or a checkpoint directory)")
        if not self.backbone:
            raise RunConfigError("objective drafter needs `backbone:` (the causal target: a preset such as toy-ar or "
                                 "a checkpoint directory)")
        if self.train.init_from is not None:
            raise RunConfigError("train.init_from is for backbones; objective drafter starts from a random drafter")

    def _check_tspd(self):
        if self.model or self.mrp != MRPSection() or self.drafter != DrafterSection():
            raise RunConfigError("objective tspd trains a controller on traces: remove the model, mrp and drafter "
                                 "sections (backbone: names the traces' model, to check them)")
        if not self.tspd.traces:
            raise RunConfigError("objective tspd needs tspd.traces: a directory from `dlmjax traces --out DIR`")
        if self.train.init_from is not None:
            raise RunConfigError("train.init_from is for backbones; objective tspd starts from a random controller")

    def to_dict(self) -> dict:
        """Plain data; an mrp run leaves out `model`, other runs leave out `backbone` and `mrp`."""
        order = {"mrp": ("objective", "backbone", "mrp", "data", "train"),
                 "drafter": ("objective", "backbone", "drafter", "data", "train"),
                 "tspd": ("objective", "backbone", "tspd", "data", "train")}.get(
            self.objective, ("objective", "model", "data", "train"))
        out = dataclasses.asdict(self)
        return {key: out[key] for key in order}


_SECTIONS = {"data": DataConfig, "train": OptimConfig, "mrp": MRPSection, "drafter": DrafterSection,
             "tspd": TSPDSection}
_TOP_LEVEL = ("objective", "backbone", "model", "data", "train", "mrp", "drafter", "tspd")


def _section(name: str, values: dict):
    cls = _SECTIONS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise RunConfigError(f"unknown {name} keys {unknown}; known: {', '.join(sorted(known))}")
    return cls(**{k: _coerce(name, k, cls.__dataclass_fields__[k].type, v) for k, v in values.items()})


_SCALARS = {"int": int, "float": float, "str": str}


def _coerce(section: str, key: str, type_name: str, value):
    """YAML reads `1e-4` as a string: convert scalars to the field's type, with a clear error."""
    kind = _SCALARS.get(type_name)
    if kind is None or isinstance(value, kind) and not isinstance(value, bool):
        return value
    try:
        if kind is int and float(value) != int(float(value)):
            raise ValueError
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        raise RunConfigError(f"{section}.{key}={value!r} is not a valid {type_name}") from None


def apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise RunConfigError(f"override {override!r} is not key=value (e.g. train.steps=100)")
    key, value = override.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RunConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def from_dict(raw: dict) -> RunConfig:
    unknown = sorted(set(raw) - set(_TOP_LEVEL))
    if unknown:
        raise RunConfigError(f"unknown top-level keys {unknown}; known: {', '.join(_TOP_LEVEL)}")
    backbone = raw.get("backbone")
    return RunConfig(
        objective=raw.get("objective", "block_diffusion"),
        model=dict(raw.get("model") or {}),
        data=_section("data", raw.get("data") or {}),
        train=_section("train", raw.get("train") or {}),
        backbone=None if backbone is None else str(backbone),
        mrp=_section("mrp", raw.get("mrp") or {}),
        drafter=_section("drafter", raw.get("drafter") or {}),
        tspd=_section("tspd", raw.get("tspd") or {}),
    )


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RunConfigError(f"config file {path} not found; see configs/ for examples")
        raw = yaml.safe_load(path.read_text()) or {}
    for override in overrides:
        apply_override(raw, override)
    try:
        return from_dict(raw)
    except TypeError as exc:
        raise RunConfigError(str(exc)) from exc
