"""Training run configuration: a YAML file plus `section.key=value` overrides.

    objective: block_diffusion        # or next_token
    model: {family: sdar, block_size: 8, hidden_size: 128, ...}   # ModelConfig fields
    data:  {tasks: {toy-arith: 0.5, toy-constraint: 0.5}, seq_len: 64, seed: 0}
    train: {steps: 4000, batch_size: 64, lr: 3.0e-3, ...}

Override values are parsed as YAML (`train.lr=1e-3`, `data.tasks={toy-arith: 1}`). Unknown
keys are errors that list the known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dlmjax.config import ModelConfig
from dlmjax.train.objectives import WEIGHTINGS

OBJECTIVES = ("block_diffusion", "next_token")


class RunConfigError(ValueError):
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
class RunConfig:
    objective: str = "block_diffusion"
    model: dict = field(default_factory=dict)
    data: DataConfig = DataConfig()
    train: OptimConfig = OptimConfig()

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise RunConfigError(f"objective={self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if self.train.loss_weighting not in WEIGHTINGS:
            raise RunConfigError(
                f"train.loss_weighting={self.train.loss_weighting!r}; choose one of {', '.join(WEIGHTINGS)}"
            )
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise RunConfigError(f"unknown model keys {unknown}; ModelConfig fields are: {', '.join(sorted(known))}")
        if self.objective == "block_diffusion" and self.model.get("attention") != "block_causal":
            raise RunConfigError("objective block_diffusion needs model.attention=block_causal")
        if self.objective == "next_token" and self.model.get("attention", "causal") != "causal":
            raise RunConfigError("objective next_token needs model.attention=causal")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"data": DataConfig, "train": OptimConfig}


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
    unknown = sorted(set(raw) - {"objective", "model", "data", "train"})
    if unknown:
        raise RunConfigError(f"unknown top-level keys {unknown}; known: objective, model, data, train")
    return RunConfig(
        objective=raw.get("objective", "block_diffusion"),
        model=dict(raw.get("model") or {}),
        data=_section("data", raw.get("data") or {}),
        train=_section("train", raw.get("train") or {}),
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
