"""The training loop for toy backbones and MRP heads: Optax, Orbax, data parallelism, progress, metrics.

What a run trains is a `Trainee`: a backbone (objectives block_diffusion, next_token) or an MRP
head on a frozen backbone (objective mrp; the backbone's params enter the jitted step as an
argument and get no gradient). A run directory holds `config.yaml` (the resolved config), `checkpoints/` (Orbax; every
`checkpoint_every` steps and at the end or on Ctrl-C), `metrics.jsonl`, `tb/` and, when the run
finishes, `model/` (a HF checkpoint directory with the tokenizer, loadable wherever a model path
is; for an MRP run the backbone with the head beside it, `dlmjax.heads.mrp.load_head`). Running the same command again resumes from the last checkpoint: the batch and the noise
of step s are pure functions of (seed, s), so a resumed run takes exactly the steps the
uninterrupted run would have taken.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import yaml
from flax import nnx
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dlmjax.config import ModelConfig
from dlmjax.distributed import is_main, sync
from dlmjax.evaluation.tasks import local_rows_file
from dlmjax.evaluation.toy import toy_accuracy
from dlmjax.heads.mrp import MRPConfig, abstract_head, init_head, save_head
from dlmjax.io.files import file_sha256, is_staging_name, staged_dir, write_atomic
from dlmjax.io.hf import SIDE_FILES, export_model, load_config, load_model
from dlmjax.io.tokenizer import Tokenizer, decode_stop_ids, load_tokenizer
from dlmjax.models.transformer import Transformer, abstract_model, init_model
from dlmjax.presets import resolve_model
from dlmjax.memory import check_training_memory
from dlmjax.sharding import param_sharding, placement, put_array, unsplit_weights
from dlmjax.toy.tokenizer import char_tokenizer, save_char_tokenizer, special_ids
from dlmjax.train import objectives, unfused
from dlmjax.train.config import RunConfig, RunConfigError, backbone_config, from_dict, read_yaml
from dlmjax.train.data import (
    check_toy_rows_fit, file_tasks, global_batch, global_width, make_batch, pad_batch, process_rows, sample_examples,
)
from dlmjax.train.mrp import mrp_loss
from dlmjax.train.metrics import MetricsLog
from dlmjax.validation import InputError


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # last step taken
    losses: dict[int, float]  # step -> loss, for the steps this call ran
    model_dir: Path | None  # exported HF directory when the run reached its last step


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`, after global-norm clipping.
    Weight decay applies to matrices only (not norms). Step s (from 1) applies `schedule(s)`, the
    rate it logs: the first step moves the weights, and the last one runs at the final rate."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(lambda count: schedule(count + 1), b1=0.9, b2=0.99, weight_decay=cfg.weight_decay,
                    mask=decay_mask),
    )
    return tx, schedule


# What a trained head, drafter or controller holds, whatever its frozen model computes in: bf16
# weights and Adam moments would round away updates below bf16's spacing (2^-9 near 1)
TRAINED_DTYPE = "float32"

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "qkv_bias", "o_bias", "qk_norm", "tie_word_embeddings")
# what weights were trained to compute with: an adapted model keeps them (SDAR keeps Qwen3's RoPE),
# where its attention, block size, family and special tokens may change
COMPUTE_FIELDS = ("rms_norm_eps", "rope_theta", "rotary_dim", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                  "rope_high_freq_factor", "rope_original_max_positions", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "moe_layers", "router",
                  "norm_topk_prob", "routed_scaling_factor", "router_groups", "router_topk_groups",
                  "router_expert_bias")


def initial_model(model_cfg: ModelConfig, cfg):
    """A fresh random model, or `init_from`'s weights under this run's config (e.g. an AR model
    adapted to block diffusion, as SDAR adapts Qwen3)."""
    if cfg.init_from is None:
        return init_model(model_cfg, seed=cfg.seed)
    source = load_model(resolve_model(cfg.init_from, "train.init_from"), dtype=model_cfg.dtype)  # as a restore has it
    checks = ((SHAPE_FIELDS, "other shapes"), (COMPUTE_FIELDS, "other settings its weights were trained with"))
    for fields, what in checks:
        differing = [f for f in fields if getattr(source.config, f) != getattr(model_cfg, f)]
        if differing:
            detail = ", ".join(f"{f}: {getattr(source.config, f)} vs {getattr(model_cfg, f)}" for f in differing)
            raise InputError(f"train.init_from={cfg.init_from} has {what} than this run's model ({detail}); "
                             "make the model section match it")
    graphdef, _ = nnx.split(abstract_model(model_cfg))
    return nnx.merge(graphdef, nnx.state(source))


def make_loss(run: RunConfig, model_cfg: ModelConfig):
    if run.objective == "block_diffusion":
        return partial(objectives.block_diffusion_loss, block=model_cfg.block_size, mask_id=model_cfg.mask_token_id,
                       weighting=run.train.loss_weighting)
    return objectives.next_token_loss


def make_train_step(graphdef, frozen_graphdef, loss_fn, tx, schedule):
    """jit(params, opt_state, frozen, batch, key, step): one optimiser step on `params`; `frozen`
    (params of a frozen module, or None) is an argument so it is neither differentiated nor
    compiled in as a constant."""

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, frozen, batch, key, step):
        frozen_module = None if frozen_graphdef is None else nnx.merge(frozen_graphdef, frozen)

        def compute(p):
            return loss_fn(nnx.merge(graphdef, p), frozen_module, batch, key)

        (_, metrics), grads = jax.value_and_grad(compute, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}

    return train_step


@dataclass
class Trainee:
    """What a run trains: a trainable module, maybe beside a frozen one, and how to score and export it."""

    build: Callable[[], nnx.Module]  # the initial trainable module (not called on resume)
    abstract: nnx.Module  # its structure, to restore a checkpoint into
    frozen: nnx.Module | None  # a frozen module the loss reads (the MRP backbone)
    loss: Callable  # loss(trainable, frozen, batch, key) -> (loss, metrics)
    tokenizer: Tokenizer
    block: int | None  # the data's block size (None: autoregressive rows)
    pad_id: int
    evaluate: Callable[[nnx.Module, nnx.Module | None], dict]  # (trainable, frozen) -> eval scores
    export: Callable[[nnx.Module, Path], Path]  # (trainable, run_dir) -> run_dir/model
    batch_at: Callable[[int], dict] | None = None  # step -> arrays, for trainees not trained on token rows (tspd)
    tasks: dict | None = None  # data.files' tasks by path (None: data.tasks, the toy tasks)


def data_tasks(run: RunConfig, tokenizer: Tokenizer, model: Transformer, block: int | None) -> dict | None:
    """The `FileTask`s of `data.files` for the frozen `model` (None: the run trains on the toy
    tasks); process 0 reports the lines it skips."""
    if not run.data.files:
        return None
    return file_tasks(run.data, tokenizer, block=block, report=lambda message: print(message) if is_main() else None,
                      stop_ids=decode_stop_ids(model.config, tokenizer))


def frozen_mesh(mesh: Mesh | None) -> Mesh | None:
    """Where a frozen backbone or target loads: straight onto `mesh` (sharded by its rules, no
    whole copy on one device) in a one-process run. A multi-process run loads it whole on each
    process's first device as well, since process 0 evaluates alone."""
    return mesh if mesh is not None and jax.process_count() == 1 else None


def pad_id_of(cfg: ModelConfig, tokenizer: Tokenizer) -> int:
    """The padding of training rows: the model's pad token, else its EOS (real checkpoints may set none)."""
    return cfg.pad_token_id if cfg.pad_token_id is not None else tokenizer.eos_id


def backbone_trainee(run: RunConfig, run_dir: Path) -> Trainee:
    """A toy backbone from `run.model`, with the toy character tokenizer saved in `run_dir/tokenizer`
    (by process 0; the others read it)."""
    if is_main():
        save_char_tokenizer(run_dir / "tokenizer")
    sync("dlmjax-train-tokenizer")
    model_cfg = backbone_config(run.model, special_ids(char_tokenizer()))
    tokenizer = load_tokenizer(run_dir / "tokenizer", model_cfg)
    loss = make_loss(run, model_cfg)

    def evaluate(model, _frozen):
        return {f"eval/{task}": toy_accuracy(model, tokenizer, task, n=run.train.eval_examples)
                for task in sorted(run.data.tasks)}

    return Trainee(
        build=lambda: initial_model(model_cfg, run.train), abstract=abstract_model(model_cfg), frozen=None,
        loss=lambda model, _frozen, batch, key: loss(model, batch, key), tokenizer=tokenizer,
        block=model_cfg.block_size if run.objective == "block_diffusion" else None,
        pad_id=model_cfg.pad_token_id, evaluate=evaluate, export=lambda model, out: export_run(model, out),
    )


def load_backbone(name: str, *, toy_data: bool = True,
                  mesh: Mesh | None = None) -> tuple[Path, Transformer, Tokenizer]:
    """(checkpoint dir, model on `mesh`, tokenizer) of an MRP run's backbone: block-causal; the toy
    tokenizer where the run trains on the toy tasks (`toy_data`)."""
    try:
        ckpt_dir = resolve_model(name, "model")
    except FileNotFoundError as exc:
        raise RunConfigError(f"backbone: {exc}") from None
    cfg = load_config(ckpt_dir)
    if cfg.attention != "block_causal":
        raise RunConfigError(
            f"backbone {name} has {cfg.attention} attention; MRP training uses the block-diffusion layout and "
            "needs a block-causal (SDAR-style) backbone such as toy-sdar"
        )
    if cfg.shift_logits:
        raise RunConfigError(
            f"backbone {name} shifts its logits ({cfg.family}: position p is scored from p - 1); MRP heads train and "
            "decode on backbones that score each position from itself, such as toy-sdar"
        )
    tokenizer = load_tokenizer(ckpt_dir, cfg)
    if toy_data and not is_toy_tokenizer(tokenizer):
        raise RunConfigError(f"backbone {name}'s tokenizer is not the toy character tokenizer that the toy tasks "
                             "are written in; train on its own data (data.files: JSONL prompt/response rows) or "
                             "train MRP heads on a toy backbone such as toy-sdar")
    return ckpt_dir, load_model(ckpt_dir, mesh=mesh), tokenizer


def is_toy_tokenizer(tokenizer: Tokenizer) -> bool:
    return tokenizer.backend.get_vocab(with_added_tokens=True) == char_tokenizer().get_vocab(with_added_tokens=True)


EVAL_SEED = 1234  # the batches and noise of MRP eval (the toy tasks' eval sets use their own)


def mrp_trainee(run: RunConfig, run_dir: Path, mesh: Mesh | None = None) -> Trainee:
    """An MRP head (`run.mrp`) on the frozen backbone `run.backbone` (loaded onto `frozen_mesh`);
    eval logs the KL metrics of `mrp_loss` on fixed batches drawn with EVAL_SEED (one per task or
    file: new draws for the toy tasks, though their prompts repeat (toy-constraint has 39, all of them in
    the training draws; its answers and masks differ); drawn from the training rows of a file)."""
    backbone_dir, backbone, tokenizer = load_backbone(run.backbone, toy_data=not run.data.files,
                                                      mesh=frozen_mesh(mesh))
    tasks = data_tasks(run, tokenizer, backbone, backbone.config.block_size)
    pad_id = pad_id_of(backbone.config, tokenizer)
    cfg, m = backbone.config, run.mrp
    m.check_supervises(cfg.block_size)
    head_made_for = cfg.replace(dtype=TRAINED_DTYPE)  # float32 weights and Adam moments on a bf16 backbone too
    head_cfg = MRPConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_modules=m.num_modules,
                         num_layers=m.num_layers, residual_scale=m.residual_scale)
    loss = partial(mrp_loss, block=cfg.block_size, mask_id=cfg.mask_token_id, loss=m.loss, gt_topk=m.gt_topk,
                   chain_steps=m.chain_steps, temperature=m.temperature, mask_rate=m.mask_rate)
    head_graphdef, _ = nnx.split(abstract_head(head_made_for, head_cfg))
    backbone_graphdef, _ = nnx.split(backbone)

    @jax.jit
    def eval_metrics(head_params, backbone_params, batch):
        head, model = nnx.merge(head_graphdef, head_params), nnx.merge(backbone_graphdef, backbone_params)
        return loss(head, model, batch, jax.random.key(EVAL_SEED))[1]

    def evaluate(head, model):
        scores = {}
        for task in sorted(run.data.weights):
            examples = sample_examples({task: 1}, run.train.eval_examples, EVAL_SEED, 0, tasks)
            batch = make_batch(examples, tokenizer, seq_len=run.data.seq_len, block=cfg.block_size, pad_id=pad_id)
            arrays = {k: jnp.asarray(v) for k, v in vars(batch).items()}
            metrics = jax.device_get(eval_metrics(nnx.state(head), nnx.state(model), arrays))
            label = task if tasks is None else tasks[task].name
            scores.update({f"eval/{label}/{k}": metrics[k] for k in ("kl", "kl_baseline", "top1", "top1_baseline")})
        return scores

    def export(head, run_dir):
        with staged_dir(run_dir / "model") as stage:  # replaces an earlier export only when complete
            export_model(backbone, stage, files_from=backbone_dir)
            save_head(head, stage)
        return run_dir / "model"

    def build():
        head = init_head(head_made_for, num_layers=m.num_layers, num_modules=m.num_modules,
                         residual_scale=m.residual_scale, init_std=m.init_std, seed=run.train.seed)
        for module in head.mrp_modules:  # the output norm sets the residual's size (init_std does not)
            module.norm.scale[...] = module.norm.scale[...] * m.init_norm_scale
        return head

    return Trainee(
        build=build,
        abstract=abstract_head(head_made_for, head_cfg), frozen=backbone, loss=loss, tokenizer=tokenizer,
        block=cfg.block_size, pad_id=pad_id, evaluate=evaluate, export=export, tasks=tasks,
    )


DATA_RECORD = "data.json"  # the sha256 of each local file a run reads (data, traces, frozen model), as it began


def frozen_model_files(run: RunConfig) -> list[str]:
    """config.json and the weight shards of an mrp or drafter run's frozen backbone or target."""
    if run.objective not in ("mrp", "drafter"):
        return []
    directory = resolve_model(run.backbone, "backbone")
    shards = sorted(str(p) for p in directory.glob("*.safetensors") if p.name not in SIDE_FILES)
    return [str(directory / "config.json"), *shards]


def check_data_files(run: RunConfig, run_dir: Path, *, resuming: bool, main: bool) -> None:
    """A resumed run continues as it would have only if what it reads is what it began with: its
    data files, a TSPD run's traces, and the frozen backbone or target that an mrp or drafter run
    trains against (a re-exported checkpoint would be another teacher). The first run records
    their sha256 (process 0), a resumed one refuses a change (every process hashes the recorded
    files). Hashing reads the frozen model's weights once more at each start: seconds per 10 GB."""
    record = run_dir / DATA_RECORD
    checking = resuming and record.is_file()
    if not (checking or main):
        return  # process 0 alone records; every process checks a resume
    model_files = frozen_model_files(run)
    if checking:  # each recorded file hashed once more (a run recorded before a source was: not that source)
        began = json.loads(record.read_text())
        changed = sorted(p for p in began if not Path(p).is_file() or file_sha256(p) != began[p])
        if changed:
            what = "backbone file" if changed[0] in model_files else "data file"
            raise InputError(f"{what} {changed[0]} has changed since this run began (sha256 recorded in {record}); "
                             "restore it, or start a new run (another --out) on the new one")
        return
    sources = [str(local_rows_file(path, "train")) for path in run.data.files]  # a directory: the file read
    if run.objective == "tspd":  # traces collected again into the same directory would mix two sources
        sources += [str(Path(run.tspd.traces) / name) for name in ("traces.npz", "meta.json")]
    digests = {path: file_sha256(path) for path in sources + model_files if Path(path).is_file()}  # (HF names: not)
    if digests:
        write_atomic(record, json.dumps(digests, indent=2))


def _checkpoint_manager(run_dir: Path, cfg) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=False)
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())  # item_metadata: dlmjax.train.unfused


RUN_ENTRIES = ("config.yaml", "checkpoints", "metrics.jsonl", "tb", "model", "tokenizer", "drafter",  # what a run writes
               DATA_RECORD)


def check_run_dir(run_dir: Path) -> None:
    """A run directory is new, empty, or an earlier run's (config.yaml and only what a run writes):
    anything else (a checkpoint, another tool's files) is refused rather than mixed with the run.
    A path with `[` is refused: Orbax reads it as a glob pattern when it merges a checkpoint, whose
    metadata then never lands, so the run could not resume."""
    if "[" in str(run_dir.resolve()):
        raise RunConfigError(f"--out {run_dir}: Orbax cannot write checkpoints under a path with '[' (it reads it as a "
                             "pattern); pass a directory without '['")
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunConfigError(f"--out {run_dir} is a file; pass a directory for the run")
    entries = sorted(p.name for p in run_dir.iterdir() if not is_staging_name(p.name))
    foreign = [name for name in entries if name not in RUN_ENTRIES]
    if foreign or (entries and "config.yaml" not in entries):
        held = foreign or entries
        raise RunConfigError(
            f"--out {run_dir} holds {', '.join(held[:5])}{' ...' if len(held) > 5 else ''}, which is not a dlmjax "
            "run; pass a new or empty directory (or the directory of the run to resume)")


def _has_checkpoint(run_dir: Path) -> bool:
    """Whether the run saved a checkpoint (Orbax's step directories under checkpoints/)."""
    return any(p.name.isdigit() for p in (run_dir / "checkpoints").glob("*"))


def _write_config(run_dir: Path, run: RunConfig, write: bool = True) -> None:
    """Write the resolved config (`write` False: only check it); a resumed run must use the same
    one (fields added to the config since the run began compare at their defaults). A run that
    saved no checkpoint (it stopped on a mistake before its first) has nothing to resume: a new
    config takes its place."""
    path = run_dir / "config.yaml"
    if path.exists() and _has_checkpoint(run_dir):
        differing = config_differences(from_dict(read_yaml(path)).to_dict(), run.to_dict())
        if differing:
            raise InputError(
                f"{run_dir} holds a run with a different config ({'; '.join(differing[:5])}"
                f"{' ...' if len(differing) > 5 else ''}); use a new --out directory or the same config to resume"
            )
    if write:
        write_atomic(path, yaml.safe_dump(run.to_dict(), sort_keys=False))


def config_differences(stored: dict, given: dict, prefix: str = "") -> list[str]:
    """'section.key: stored -> given' for each setting that differs between two configs (dicts)."""
    out = []
    for key in sorted(set(stored) | set(given), key=str):
        a, b = stored.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def state_shardings(trainee: Trainee, tx, mesh: Mesh):
    """(graphdef, abstract {params, opt_state} whose leaves carry their shardings on `mesh`): a
    trained backbone's weights tensor-parallel over 'model' (dlmjax.sharding's rules; replicated
    where a dimension does not divide), heads and everything else replicated; the optimiser's
    moments sharded as their params. Fresh starts are placed, and checkpoints restored, with
    these shardings, so a checkpoint restores onto any mesh shape."""
    graphdef, shapes = nnx.split(trainee.abstract)
    replicated = NamedSharding(mesh, P())

    def sharding(path, leaf):
        if isinstance(trainee.abstract, Transformer):
            keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
            name = ".".join(str(k) for k in keys if k is not None)  # (a Variable's `.value` has none)
            try:
                return param_sharding(name, leaf.shape, trainee.abstract.config, mesh)
            except KeyError:
                pass
        return replicated

    param_sh = jax.tree_util.tree_map_with_path(sharding, shapes)
    opt_shapes = jax.eval_shape(tx.init, shapes)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt_shapes, param_sh,
                                   transform_non_params=lambda _: replicated)
    attach = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)  # noqa: E731
    return graphdef, {"params": jax.tree.map(attach, shapes, param_sh),
                      "opt_state": jax.tree.map(attach, opt_shapes, opt_sh)}


def refuse_frozen_that_cannot_fit(run: RunConfig, mesh: Mesh, *, show: bool = True) -> None:
    """Before a frozen backbone or target (objectives mrp, drafter) is read and placed: refuse the
    run whose frozen params (from its config's shapes, placed by its rules) and activations alone
    exceed the device memory, with the estimate (`check_training_memory`, which `train` calls again
    with the trained state once it is built). A backbone that cannot be found is left to the
    trainee's own error."""
    if run.objective not in ("mrp", "drafter"):
        return
    try:
        cfg = load_config(resolve_model(run.backbone, "model"))
    except (FileNotFoundError, InputError):
        return
    frozen = nnx.state(abstract_model(cfg))
    check_training_memory(run, mesh, cfg=cfg, abstract={"params": {}, "opt_state": {}}, frozen=frozen,
                          frozen_shardings=placement(frozen, mesh, cfg), show=show, show_only_refused=True)


def make_trainee(run: RunConfig, run_dir: Path, mesh: Mesh | None = None) -> Trainee:
    """The run's Trainee; a frozen model (objectives mrp, drafter) loads onto `frozen_mesh(mesh)`."""
    if run.objective == "drafter":
        from dlmjax.train.drafter import drafter_trainee  # imports this module's Trainee

        return drafter_trainee(run, run_dir, mesh)
    if run.objective == "tspd":
        from dlmjax.train.tspd import tspd_trainee  # imports this module's Trainee

        return tspd_trainee(run, run_dir)
    return mrp_trainee(run, run_dir, mesh) if run.objective == "mrp" else backbone_trainee(run, run_dir)


def restore_checkpoint(run_dir: str | Path, mesh: Mesh, step: int | None = None):
    """(graphdef, params, opt_state) of a run's checkpoint (`step`; default the last) placed on
    `mesh`, whatever mesh it was saved from: Orbax reads each device's slice of the target
    shardings (`state_shardings` on `mesh`)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir} is not a training run (no config.yaml); pass the --out directory of `dlmjax train`")
    run = from_dict(read_yaml(run_dir / "config.yaml"))
    manager = _checkpoint_manager(run_dir, run.train)
    try:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise InputError(f"{run_dir} has no checkpoint{'' if step is None else f' of step {step}'}; its checkpoints: "
                             f"{sorted(manager.all_steps()) or 'none'}")
        tx, _ = make_optimizer(run.train)
        trainee = make_trainee(run, run_dir, mesh)
        graphdef, abstract = state_shardings(trainee, tx, mesh)
        restored = unfused.restore(manager, step, abstract, trainee.abstract)  # a pre-fusion run converted
    finally:
        manager.close()
    return graphdef, restored["params"], restored["opt_state"]


def _place(tree, shardings):
    """Host values (the same on every process) placed with `shardings`: each process copies only
    its devices' slices (multi-process safe, unlike device_put of a process-local array). Arrays
    already placed so (a frozen model loaded onto the mesh) stay as they are."""
    def place(x, sh):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim):
            return x
        return put_array(np.asarray(x), sh)

    return jax.tree.map(place, tree, shardings)


def _gathered(params, mesh: Mesh):
    """`params` as process-local arrays (for evaluation and export by process 0); on one process
    they are used as they are."""
    if jax.process_count() == 1:
        return params
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))  # every process calls it, in tree order
    # a leaf at a time to the host: each device holds one array whole at once, not every trained param
    host = jax.tree.map(lambda leaf: jax.device_get(replicate(leaf)), params)
    return jax.device_put(host, jax.local_devices()[0])


def train(run: RunConfig, run_dir: str | Path, *, stop_at: int | None = None, progress: bool = True,
          mesh: Mesh | None = None) -> TrainResult:
    """Train (or resume) the run in `run_dir`; `stop_at` ends early after that step (as a kill would).

    `mesh` (default: every device on 'data') may have a 'model' axis: a trained backbone is then
    tensor-parallel over it. A run resumes on any mesh shape. In a multi-process run every process
    calls this with the same arguments and its own slice of each batch (dlmjax.train.data);
    process 0 writes the run's files, logs and shows progress, Orbax writes each checkpoint once."""
    run_dir = Path(run_dir)
    main = is_main()
    check_run_dir(run_dir)
    if run_dir.is_dir():
        _write_config(run_dir, run, write=False)  # every process refuses a different config
    sync("dlmjax-train-checked")  # before process 0 writes into run_dir
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, run)
    sync("dlmjax-train-config")
    cfg = run.train
    mesh = mesh if mesh is not None else run.mesh.make()  # the config's mesh (default: all devices on data)
    refuse_frozen_that_cannot_fit(run, mesh, show=main)
    trainee = make_trainee(run, run_dir, mesh)
    if trainee.tasks is None and trainee.batch_at is None:  # token rows of the toy tasks
        check_toy_rows_fit(run.data.weights, trainee.tokenizer, seq_len=run.data.seq_len, block=trainee.block)
    rows = process_rows(mesh, cfg.batch_size)  # this process's rows of every global batch

    tx, schedule = make_optimizer(cfg)
    manager = _checkpoint_manager(run_dir, cfg)
    start = manager.latest_step() or 0
    check_data_files(run, run_dir, resuming=bool(start), main=main)
    graphdef, abstract = state_shardings(trainee, tx, mesh)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    frozen_graphdef, frozen, frozen_sh = None, None, None
    if trainee.frozen is not None:  # a frozen backbone: tensor-parallel / fsdp as its rules say
        frozen_graphdef, frozen = nnx.split(trainee.frozen)
        frozen_sh = placement(frozen, mesh, trainee.frozen.config if isinstance(trainee.frozen, Transformer) else None)
    backbone_cfg = getattr(trainee.frozen or trainee.abstract, "config", None)
    check_training_memory(run, mesh, cfg=backbone_cfg, abstract=abstract, frozen=frozen, frozen_shardings=frozen_sh,
                          show=main)
    unsplit = unsplit_weights(backbone_cfg, mesh) if isinstance(backbone_cfg, ModelConfig) else []
    if main and unsplit:  # as loading a model on a mesh says it (io.hf.load_model)
        print(f"note: the mesh's model/expert axes leave these weights unsplit over them: {'; '.join(unsplit)}",
              file=sys.stderr)
    if main and cfg.warmup_steps > cfg.steps > 0:  # step s applies schedule(s) (`make_optimizer`)
        print(f"note: train.warmup_steps={cfg.warmup_steps} > train.steps={cfg.steps}: the learning rate rises for "
              f"the whole run and peaks at {float(schedule(cfg.steps)):.3g}, not train.lr={cfg.lr:g}; set "
              "train.warmup_steps to at most train.steps for the schedule the config names", file=sys.stderr)
    if start:  # resume: restore into the abstract structure (no init, `init_from` not read again)
        restored = unfused.restore(manager, start, abstract, trainee.abstract)  # a pre-fusion run converted
        params, opt_state = restored["params"], restored["opt_state"]
    else:
        _, params = nnx.split(trainee.build())
        params = _place(params, shardings["params"])
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
    if frozen is not None:
        frozen = _place(frozen, frozen_sh)

    train_step = make_train_step(graphdef, frozen_graphdef, trainee.loss, tx, schedule)
    base_key = jax.random.key(cfg.seed)
    log = MetricsLog(run_dir, resume_step=start) if main else None
    last = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
    losses: dict[int, float] = {}
    bar = tqdm(total=cfg.steps, initial=start, desc=f"train {run_dir.name}", disable=not (progress and main),
               dynamic_ncols=True)
    tokens_seen, window_start, done, logged = 0, time.perf_counter(), start, start
    stopped_on_input = False

    def record(step, metrics):  # a log step's row: metrics.jsonl, TensorBoard, the bar
        nonlocal tokens_seen, window_start, logged
        metrics = jax.device_get(metrics)
        losses[step] = float(metrics["loss"])
        elapsed = time.perf_counter() - window_start
        rates = {"tokens_per_s": tokens_seen * jax.process_count() / elapsed}
        if log is not None:
            log.write(step, {**metrics, **rates})
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{rates['tokens_per_s']:.0f}")
        tokens_seen, window_start, logged = 0, time.perf_counter(), step

    def is_log_step(step):
        return step % cfg.log_every == 0 or step == cfg.steps

    def is_eval_step(step):
        return cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)

    def evaluate(step):
        nonlocal window_start
        eval_start = time.perf_counter()
        local_params = _gathered(params, mesh)
        if main:  # on process 0's devices, while the others go on to the next step's collectives
            scores = trainee.evaluate(nnx.merge(graphdef, local_params), trainee.frozen)
            log.write(step, scores)
            bar.write(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        window_start += time.perf_counter() - eval_start  # tokens/s measures training only

    try:
        if start and is_eval_step(start) and _agreed(main and not log.has(start, "eval/")):
            evaluate(start)  # the run was stopped during that step's evaluation
        for step in range(start + 1, last + 1):
            if trainee.batch_at is not None:
                local = {k: np.asarray(v)[rows] for k, v in trainee.batch_at(step).items()}
            else:
                examples = sample_examples(run.data.weights, cfg.batch_size, run.data.seed, step, trainee.tasks)
                batch = make_batch([examples[i] for i in rows], trainee.tokenizer, seq_len=run.data.seq_len,
                                   block=trainee.block, pad_id=trainee.pad_id)
                batch = pad_batch(batch, global_width(batch.tokens.shape[1]), trainee.pad_id)
                local = dict(vars(batch))
            arrays = global_batch(local, rows, mesh, cfg.batch_size)
            key = jax.random.fold_in(base_key, step)
            params, opt_state, metrics = train_step(params, opt_state, frozen, arrays, key, jnp.int32(step))
            done = step
            # this process's rows, times the processes (exact on one process)
            tokens_seen += len(rows) if trainee.batch_at is not None else int(batch.valid.sum())
            bar.update(1)
            if is_log_step(step):
                record(step, metrics)
            if is_eval_step(step):
                evaluate(step)
            if step % cfg.checkpoint_every == 0:
                manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    except InputError:  # a mistake in the config or the data: a run with no checkpoint yet takes the fixed config
        stopped_on_input = True
        raise
    finally:  # also on Ctrl-C: keep the last finished step, and its log row (the resumed run starts after it)
        written = log is not None and log.has(done, "loss")  # a Ctrl-C during record()'s TensorBoard flush
        if done > logged and is_log_step(done) and not written:
            record(done, metrics)
        if done > start and manager.latest_step() != done and not stopped_on_input:
            _save_on_exit(manager, done, {"params": params, "opt_state": opt_state}, failing=sys.exc_info()[1])
        manager.wait_until_finished()
        manager.close()
        bar.close()
        if log is not None:
            log.close()

    model_dir = None
    if done == cfg.steps:
        local_params = _gathered(params, mesh)
        if main:
            model_dir = trainee.export(nnx.merge(graphdef, local_params), run_dir)
        sync("dlmjax-train-export")
        model_dir = model_dir or _export_dir(run_dir, run)
    return TrainResult(run_dir=run_dir, step=done, losses=losses, model_dir=model_dir)


def _save_on_exit(manager, step: int, state: dict, *, failing: BaseException | None) -> None:
    """Checkpoint the last finished `step` as a run stops (Ctrl-C, an error). A step that failed on
    the device had been handed that state (its buffers donated), so then there is nothing to
    save: the run resumes from its last checkpoint, and the error the user sees is the one that
    stopped it, not the save's."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)):
        print(f"step {step} was not checkpointed: the step after it failed holding its state; a rerun resumes "
              f"from the last checkpoint ({manager.latest_step() or 'none'})", file=sys.stderr)
        return
    try:
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
    except Exception as err:  # noqa: BLE001 (the state of a failed run may not be readable)
        if failing is None:
            raise
        print(f"step {step} was not checkpointed ({type(err).__name__}: {err})", file=sys.stderr)


def _agreed(flag: bool) -> bool:
    """Process 0's `flag`, on every process (they must take the same collectives)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _export_dir(run_dir: Path, run: RunConfig) -> Path:
    """Where process 0 exported the run (other processes report the same path)."""
    return run_dir / ("drafter" if run.objective == "drafter" else "model")


def export_run(model, run_dir: Path) -> Path:
    """Write the trained model as `run_dir/model` (HF layout, tokenizer included), replacing an old
    export only once the new one is complete (a killed export leaves the old one whole)."""
    with staged_dir(run_dir / "model") as stage:
        export_model(model, stage, files_from=run_dir / "tokenizer")
    return run_dir / "model"
