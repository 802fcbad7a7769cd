"""Training run configuration: a YAML file plus `section.key=value` overrides.

    objective: block_diffusion        # or next_token
    model: {family: sdar, block_size: 8, hidden_size: 128, ...}   # ModelConfig fields
    data:  {tasks: {toy-arith: 0.5, toy-constraint: 0.5}, seq_len: 64, seed: 0}
    data:  {files: {train.jsonl: 1}, prompt_field: question, response_field: answer, chat: true}
                                      # (objectives mrp, drafter) a real model's data in place of tasks
    train: {steps: 4000, batch_size: 64, lr: 3.0e-3, ...}

An MRP head (a residual head on a frozen backbone) names its backbone instead of a model section:

    objective: mrp
    backbone: toy-sdar                # a preset or a checkpoint directory (block-causal)
    mrp: {num_layers: 1, loss: kd_diff, gt_topk: 1, chain_steps: 1, ...}

Where it runs (not part of the run's identity: a resumed run may change it):

    mesh: {data: 2, fsdp: 2, model: 2}   # dlmjax.sharding axes; data defaults to the devices left
    mesh: {device_memory: 16GiB}         # capacity the memory estimate is checked against (CPU: none)

Override values are parsed as YAML (`train.lr=1e-3`, `data.tasks={toy-arith: 1}`). Unknown
keys are errors that list the known ones.

Validation (dlmjax.validation): a section's fields are typed by their annotations and ranged by
the class's `limits`; every mistake is a `RunConfigError` that names the file (and the line, for
YAML syntax errors), the key and what it accepts. The mapping from YAML to the dataclasses is
written by hand (one `_section` for every section): dataclass-config libraries (draccus, tyro)
would replace about forty lines but bring their own error types and override syntax, and the
per-objective rules below would stay ours anyway.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dlmjax.config import ModelConfig
from dlmjax.io.files import absolute_if_local
from dlmjax.train.mrp import LOSSES
from dlmjax.train.objectives import MASK_RATES, WEIGHTINGS
from dlmjax.validation import (
    AT_LEAST_0, AT_LEAST_1, OPEN_UNIT, POSITIVE, PROBABILITY, SEED_RANGE, STRICT_UNIT, InputError, OneOf, Range,
    annotation_kinds, check_fields, check_value,
)

OBJECTIVES = ("block_diffusion", "next_token", "mrp", "drafter", "tspd")


class RunConfigError(InputError):
    pass


TOY_TASK_WEIGHTS = {"toy-arith": 0.5, "toy-constraint": 0.5}


@dataclass(frozen=True)
class DataConfig:
    """What a run trains on: the toy tasks (`tasks`), or for a head on a real model (objectives mrp
    and drafter) JSONL files of its data (`files`: path -> weight; each line an object whose
    `prompt_field` and `response_field` hold the prompt and the answer to learn; `chat`: the
    prompt as a user turn of the model's chat template and the answer as the assistant turn after
    it, up to its end-of-turn token; a mapping gives the template's variables
    too, e.g. {enable_thinking: false} for Qwen3, as evaluation's presets do). A file that exists
    is recorded by its absolute path, so a run resumes from any working directory."""

    limits = {"seq_len": AT_LEAST_1, "seed": SEED_RANGE}
    tasks: dict | None = None  # toy task -> weight (default TOY_TASK_WEIGHTS where no files are given)
    files: dict = field(default_factory=dict)  # JSONL file -> weight, in place of tasks
    prompt_field: str = "prompt"
    response_field: str = "response"
    chat: bool | dict = False  # true, or the chat template's variables ({enable_thinking: false})
    seq_len: int = 64
    seed: int = 0

    def __post_init__(self):
        from dlmjax.toy.tasks import TASKS

        check_fields(self, "data.", error=RunConfigError)
        if self.files:
            if self.tasks is not None:
                raise RunConfigError("data.files takes the place of data.tasks: give one of them (data.tasks=null)")
            files = {path: _coerce("float", weight) for path, weight in self.files.items()}  # `1e-1`: a number
            for path, weight in files.items():
                check_value("data.files", path, "str", error=RunConfigError)
                check_value(f"data.files.{path}", weight, "float", POSITIVE, error=RunConfigError)
            local = {path: absolute_if_local(path) for path in files}
            twice = [path for path in files if list(local.values()).count(local[path]) > 1]
            if twice:
                raise RunConfigError(f"data.files names one file twice ({', '.join(twice)}); give it once, with the "
                                     "sum of the weights")
            object.__setattr__(self, "files", {local[path]: weight for path, weight in files.items()})
            return
        if (self.prompt_field, self.response_field, self.chat) != ("prompt", "response", False):
            raise RunConfigError("data.prompt_field, data.response_field and data.chat read the rows of data.files, "
                                 "which is not given: name the JSONL files (data.files={train.jsonl: 1}) or remove "
                                 "them")
        object.__setattr__(self, "tasks", dict(TOY_TASK_WEIGHTS) if self.tasks is None
                           else {name: _coerce("float", weight) for name, weight in self.tasks.items()})
        if not self.tasks:
            raise RunConfigError(f"data.tasks is empty; give task weights, e.g. {{{next(iter(TASKS))}: 1.0}}")
        for name, weight in self.tasks.items():
            check_value("data.tasks", name, "str", OneOf(tuple(TASKS)), error=RunConfigError)
            check_value(f"data.tasks.{name}", weight, "float", POSITIVE, error=RunConfigError)

    @property
    def weights(self) -> dict[str, float]:
        """The sources a run samples from, with their weights: the files, else the toy tasks."""
        return self.files or self.tasks

    def __hash__(self):
        chat = tuple(sorted(self.chat.items())) if isinstance(self.chat, dict) else self.chat
        return hash((tuple((self.tasks or {}).items()), tuple(self.files.items()), self.prompt_field,
                     self.response_field, chat, self.seq_len, self.seed))


@dataclass(frozen=True)
class OptimConfig:
    limits = {"steps": AT_LEAST_0, "batch_size": AT_LEAST_1, "lr": POSITIVE, "warmup_steps": AT_LEAST_0,
              "min_lr_ratio": PROBABILITY, "weight_decay": AT_LEAST_0, "clip_norm": POSITIVE,
              "loss_weighting": OneOf(WEIGHTINGS), "seed": SEED_RANGE, "log_every": AT_LEAST_1,
              "checkpoint_every": AT_LEAST_1, "keep_checkpoints": AT_LEAST_1, "eval_every": AT_LEAST_0,
              "eval_examples": AT_LEAST_1}
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

    def __post_init__(self):
        check_fields(self, "train.", error=RunConfigError)


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
    mask_rate: str = "per_row"  # per_row: one noise level per row (the reference) | per_block: one per (row, block)
    limits = {"num_layers": AT_LEAST_1, "num_modules": AT_LEAST_1, "gt_topk": AT_LEAST_1, "chain_steps": AT_LEAST_1,
              "residual_scale": POSITIVE, "init_std": AT_LEAST_0, "init_norm_scale": AT_LEAST_0,
              "temperature": POSITIVE, "loss": OneOf(LOSSES), "mask_rate": OneOf(MASK_RATES)}

    def __post_init__(self):
        check_fields(self, "mrp.", error=RunConfigError)
        if self.num_modules > self.chain_steps:  # chain step k trains module k
            raise RunConfigError(
                f"mrp.num_modules={self.num_modules} with mrp.chain_steps={self.chain_steps}: modules "
                f"{self.chain_steps}..{self.num_modules - 1} would never train, yet decoding would use them; set "
                "mrp.chain_steps >= mrp.num_modules"
            )
        if self.temperature != 1.0 and not self.loss.startswith("kd_diff"):
            raise RunConfigError(f"mrp.temperature={self.temperature} is the KD temperature of the kd_diff losses; "
                                 f"mrp.loss={self.loss} does not read it: drop it, or use a kd_diff loss")

    def check_supervises(self, block_size: int) -> None:
        """Refuse reveals that leave no masked position of a block of `block_size` to supervise: the
        loss reads the positions still masked after a chain step's reveals (gt_topk more each
        step), so a last step with none would train nothing (the plain losses) or add a zero term
        whose module never trains, yet decoding would use it (the *_sum losses)."""
        reveals = self.gt_topk * self.chain_steps
        if reveals >= block_size:
            raise RunConfigError(
                f"mrp.gt_topk x mrp.chain_steps = {reveals} reveals every position of the backbone's blocks of "
                f"{block_size}, so the last chain step of mrp.loss={self.loss} would supervise nothing; make it "
                f"less than {block_size}"
            )


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
    limits = {"num_layers": AT_LEAST_1, "block_size": Range(2), "mask_token_id": AT_LEAST_0,
              "anchors_per_row": AT_LEAST_1, "labels": OneOf(("target", "data")), "ce_weight": AT_LEAST_0,
              "decay_gamma": AT_LEAST_0, "focal_alpha": AT_LEAST_0, "focal_gamma": AT_LEAST_0,
              "chain_alpha": AT_LEAST_0, "export_dtype": OneOf(("bfloat16", "float32", "float16")),
              "eval_prompts": AT_LEAST_1}  # decay_gamma, focal_alpha, chain_alpha: 0 turns a term off

    def __post_init__(self):
        check_fields(self, "drafter.", error=RunConfigError)
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise RunConfigError("drafter.target_layer_ids=[] names no target layer; list the layers (e.g. [1, 2]) or "
                                 "drop the key for DFlash's default")
        for layer in self.target_layer_ids or ():
            check_value("drafter.target_layer_ids[]", layer, "int", AT_LEAST_0, error=RunConfigError)
        if self.ce_weight == self.focal_alpha == self.chain_alpha == 0:
            raise RunConfigError("drafter.ce_weight, focal_alpha and chain_alpha are all 0: the loss is 0 and nothing "
                                 "would train; give one of them a weight")
        if self.focal_gamma != DrafterSection.focal_gamma and self.focal_alpha == 0:
            raise RunConfigError(f"drafter.focal_gamma={self.focal_gamma} shapes the first-error focal term, which "
                                 "drafter.focal_alpha=0 turns off: drop it, or give focal_alpha a weight")

    def __hash__(self):
        return hash(tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(self)))


@dataclass(frozen=True)
class TSPDSection:
    """The TSPD controller (dlmjax.heads.controller) trained on traces (dlmjax.train.tspd)."""

    traces: str = ""  # a `dlmjax traces` output directory
    # `stable` is left out: on EGP traces it only ever marks wrong tokens (dlmjax/traces.py)
    features: list = field(default_factory=lambda: ["confidence", "entropy", "momentum", "block_pos", "abs_pos"])
    hidden: int = 32  # width of the MLP's hidden layer
    holdout: float = 0.2  # fraction of the traces' prompts held out (eval and threshold calibration)
    target_precision: float = 0.999  # calibrated threshold: the smallest with this held-out precision

    limits = {"hidden": AT_LEAST_1, "holdout": STRICT_UNIT, "target_precision": OPEN_UNIT}

    def __post_init__(self):
        check_fields(self, "tspd.", error=RunConfigError)
        object.__setattr__(self, "traces", absolute_if_local(self.traces))
        from dlmjax.heads.controller import check_features

        try:
            check_features(self.features)
        except ValueError as exc:
            raise RunConfigError(f"tspd.features: {exc}") from None

    def __hash__(self):
        return hash((self.traces, tuple(self.features), self.hidden, self.holdout, self.target_precision))


@dataclass(frozen=True)
class MeshSection:
    """The device mesh of a run (dlmjax.sharding): the batch splits over data x fsdp, a backbone's
    weights tensor-parallel over model, fsdp-sharded over fsdp, MoE experts over expert; trained
    heads stay replicated. `device_memory` (e.g. 16GiB): the per-device capacity the memory
    estimate is checked against where the device reports none (CPU) or to override it."""

    data: int | None = None  # None: the devices the other axes leave
    fsdp: int = 1
    expert: int = 1
    model: int = 1
    device_memory: str | float | None = None
    limits = {"data": AT_LEAST_1, "fsdp": AT_LEAST_1, "expert": AT_LEAST_1, "model": AT_LEAST_1}

    def __post_init__(self):
        check_fields(self, "mesh.", error=RunConfigError)
        if self.device_memory is not None:
            from dlmjax.memory import parse_memory

            try:
                parse_memory(self.device_memory)
            except InputError as exc:
                raise RunConfigError(f"mesh.device_memory: {exc}") from None

    def make(self, devices=None):
        from dlmjax.sharding import make_mesh

        try:
            return make_mesh(model=self.model, data=self.data, expert=self.expert, fsdp=self.fsdp, devices=devices)
        except InputError as exc:
            raise RunConfigError(f"mesh: {exc}") from None


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
    mesh: MeshSection = MeshSection()

    limits = {"objective": OneOf(OBJECTIVES)}

    def __post_init__(self):
        check_fields(self, "", error=RunConfigError)
        if self.backbone is not None:  # a checkpoint directory by its absolute path (a preset name as given)
            object.__setattr__(self, "backbone", absolute_if_local(self.backbone))
        self._refuse_what_the_objective_does_not_read()
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
        from_tokenizer = sorted(set(self.model) & set(TOKENIZER_FIELDS))
        if from_tokenizer:
            raise RunConfigError(f"model keys {from_tokenizer} come from the toy character tokenizer the run trains "
                                 "with; remove them")
        if self.objective == "block_diffusion" and self.model.get("attention") != "block_causal":
            raise RunConfigError("objective block_diffusion needs model.attention=block_causal")
        if self.objective == "next_token" and self.model.get("attention", "causal") != "causal":
            raise RunConfigError("objective next_token needs model.attention=causal")
        from dlmjax.toy.tokenizer import char_tokenizer, special_ids

        backbone_config(self.model, special_ids(char_tokenizer()))  # refused here, where the error names the file

    def _refuse_what_the_objective_does_not_read(self):
        """Settings another objective reads, set here, would be ignored without a word."""
        heads = {"mrp": MRPSection(), "drafter": DrafterSection(), "tspd": TSPDSection()}
        if self.objective in heads:  # (a backbone objective refuses them below, with its own fix)
            for section, default in heads.items():
                if section != self.objective and getattr(self, section) != default:
                    raise RunConfigError(f"the `{section}` section belongs to objective {section}, not "
                                         f"{self.objective}; remove it")
        if self.train.loss_weighting != "none" and self.objective != "block_diffusion":
            raise RunConfigError(f"train.loss_weighting weights the block-diffusion loss; objective {self.objective} "
                                 "does not read it: remove it")
        read_by = {"drafter": "drafter.eval_prompts (prompts per task)",
                   "tspd": "its held-out traces (tspd.holdout)"}
        if self.objective in read_by and self.train.eval_examples != OptimConfig.eval_examples:
            raise RunConfigError(f"train.eval_examples is not read by objective {self.objective}, which evaluates on "
                                 f"{read_by[self.objective]}: remove it")
        if self.objective == "tspd" and dataclasses.replace(self.data, seed=0) != DataConfig():
            raise RunConfigError("objective tspd trains on its traces: data.tasks, data.files and data.seq_len are "
                                 "not read (data.seed splits and draws the traces); remove them")
        if self.data.files and self.objective in ("block_diffusion", "next_token"):
            raise RunConfigError(f"data.files trains a head on a real model's data (objectives mrp and drafter); "
                                 f"objective {self.objective} trains a toy backbone on data.tasks")

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
        """Plain data; an mrp run leaves out `model`, other runs leave out `backbone` and `mrp`.
        `mesh` is where the run runs, not what it computes: left out (a resume may change it)."""
        order = {"mrp": ("objective", "backbone", "mrp", "data", "train"),
                 "drafter": ("objective", "backbone", "drafter", "data", "train"),
                 "tspd": ("objective", "backbone", "tspd", "data", "train")}.get(
            self.objective, ("objective", "model", "data", "train"))
        out = dataclasses.asdict(self)
        return {key: out[key] for key in order}


_SECTIONS = {"data": DataConfig, "train": OptimConfig, "mrp": MRPSection, "drafter": DrafterSection,
             "tspd": TSPDSection, "mesh": MeshSection}
_TOP_LEVEL = ("objective", "backbone", "model", "data", "train", "mrp", "drafter", "tspd", "mesh")
# what a backbone run's ModelConfig takes from its tokenizer (`backbone_config`)
TOKENIZER_FIELDS = ("vocab_size", "mask_token_id", "eos_token_ids", "pad_token_id")


def _mapping(name: str | None, value) -> dict:
    """A section's YAML value (`name` None: the whole file): a mapping of string keys, or nothing."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        if name is None:
            raise RunConfigError(f"the config must be a mapping of sections ({', '.join(_TOP_LEVEL)}), not {value!r}")
        raise RunConfigError(f"`{name}` must be a mapping of keys to values (got {value!r}); e.g. `{name}: {{key: value}}`")
    return value


def _section(name: str, values):
    cls = _SECTIONS[name]
    values = _mapping(name, values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise RunConfigError(f"unknown {name} keys {unknown}; known: {', '.join(sorted(known))}")
    return cls(**{k: _coerce(cls.__dataclass_fields__[k].type, v) for k, v in values.items()})


def backbone_config(model: dict, ids: dict) -> ModelConfig:
    """The trained backbone's config: the `model` section with the tokenizer's `ids` (pad, eos,
    mask, vocab_size); refused where its family's checkpoint layout could not hold it (the export
    would load as another model)."""
    from dlmjax.config import ConfigError, to_hf_config

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}  # YAML has lists, not tuples
    try:
        cfg = ModelConfig(vocab_size=ids["vocab_size"], mask_token_id=ids["mask"], eos_token_ids=(ids["eos"],),
                          pad_token_id=ids["pad"], **fields)
        to_hf_config(cfg)
    except ConfigError as err:
        raise RunConfigError(f"model: {err}") from None
    return cfg


def _model_section(values) -> dict:
    """The `model` section: ModelConfig fields, numbers written `1e6` read as numbers (YAML reads
    them as strings); unknown keys are left for RunConfig to name."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    return {k: _coerce(fields[k], v) if k in fields else v for k, v in _mapping("model", values).items()}


def _coerce(type_name: str, value):
    """YAML reads `1e-4` as a string: a string that reads as a number becomes one for a numeric
    field, and a whole float (`3.0`, `1e3`) an int for an int field; everything else is left to
    the section's type check."""
    kinds = annotation_kinds(type_name)
    if isinstance(value, str) and "str" not in kinds and ("float" in kinds or "int" in kinds):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float) and "int" in kinds and "float" not in kinds and value.is_integer():
        return int(value)
    return value


def apply_override(raw: dict, override: str) -> None:
    if "=" not in override:
        raise RunConfigError(f"override {override!r} is not key=value (e.g. train.steps=100)")
    key, value = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RunConfigError(f"override {override!r}: {key!r} is not section.key (e.g. train.steps=100)")
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or a section left empty in the YAML (`train:`)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RunConfigError(f"override {key!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.load(value, Loader=_UniqueKeyLoader)  # `{toy-arith: 1, toy-arith: 2}`: refused
    except yaml.YAMLError as err:
        raise RunConfigError(f"override {override!r}: the value is not valid YAML ({yaml_problem(err)})") from None


def from_dict(raw) -> RunConfig:
    raw = _mapping(None, raw)
    unknown = sorted(set(raw) - set(_TOP_LEVEL))
    if unknown:
        raise RunConfigError(f"unknown top-level keys {unknown}; known: {', '.join(_TOP_LEVEL)}")
    backbone = raw.get("backbone")
    return RunConfig(
        objective=raw.get("objective", "block_diffusion"),
        model=_model_section(raw.get("model")),
        data=_section("data", raw.get("data")),
        train=_section("train", raw.get("train")),
        backbone=None if backbone is None else str(backbone),
        mrp=_section("mrp", raw.get("mrp")),
        drafter=_section("drafter", raw.get("drafter")),
        tspd=_section("tspd", raw.get("tspd")),
        mesh=_section("mesh", raw.get("mesh")),
    )


def yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (getattr(err, "problem", None) or str(err))


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (a second `train:` section
    would silently replace the first, and its unset keys would fall back to their defaults)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice; keep one",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    """The parsed YAML of `path`; a syntax error or a repeated key names the file and the line."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as err:
        raise RunConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise RunConfigError(f"{path}: YAML syntax error: {yaml_problem(err)}; fix the file") from None


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The run config of a YAML file plus overrides; every error names the file."""
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RunConfigError(f"config file {path} not found; see configs/ for examples")
        raw = read_yaml(path)
        if raw is None and not overrides:  # an empty file: the defaults alone describe no run anyone meant
            raise RunConfigError(f"config file {path} is empty; start from one in configs/ (e.g. configs/toy-sdar.yaml)")
        raw = {} if raw is None else raw
    from_file = copy.deepcopy(raw)
    try:
        for override in overrides:
            apply_override(_mapping(None, raw), override)
        return from_dict(raw)
    except RunConfigError as err:
        if overrides and not _refuses_the_same(from_file, err):  # the overrides' fault: name them
            where = f"{path} with the overrides {' '.join(overrides)}" if path is not None else ' '.join(overrides)
            raise RunConfigError(f"{where}: {err}") from None
        raise RunConfigError(f"{path}: {err}" if path is not None else str(err)) from None


def _refuses_the_same(raw: dict, err: RunConfigError) -> bool:
    """Whether the config without its overrides is refused with the same error."""
    try:
        from_dict(raw)
    except RunConfigError as alone:
        return str(alone) == str(err)
    return False
