"""TSPD training traces (ALGORITHMS.md section 4; labels as in Learn2PD).

Prompts come from the toy tasks (`traces_for_tasks`, the default of `dlmjax traces`) or from text
(`traces_for_prompts`; `dlmjax traces --prompts FILE`: a JSONL field or text lines, e.g. a
training split's questions, with the model's chat template if asked). For a batch of prompts:
1. reference: decode with the model's own 1-per-step static decoder (`static`, k=1); its final
   canvas y* is the reference output (every generated block, including the EOS block's tail);
2. a rollout toward y*, `rollout`:
   - "egp" (Learn2PD's Extremely Greedy Parallel decoding, the default): each round, commit every
     masked position of the row's current block whose current argmax equals y*. When none does,
     the most confident masked position is committed with its y* token (teacher forcing keeps
     the canvas on y*, so EGP ends exactly where the reference did);
   - "static": the reference run itself (one commit per round, the most confident), so a token
     stays masked for rounds after its argmax has become final and `stable` counts those rounds.
     Under EGP a token is committed the round its argmax equals y*, so every recorded token with
     `stable` >= 1 has had the same wrong argmax since the round before, and is labelled 0: a
     controller trained on EGP traces learns that a stable argmax is not final, the opposite of
     what it sees when it decodes (dlmjax/toy/checkpoints/toy-sdar/TSPD_TRAINING.md);
3. record, per masked token per round, the trajectory features of dlmjax.decoding.tspd
   (confidence, entropy, momentum, stable, block_pos, abs_pos: the ones the decoders compute)
   and the label [argmax == y*].

Both decodes are one jitted `lax.while_loop` each over the engine's rounds (same forwards, cache
and layout as `dlmjax generate`); the batch can be split over the mesh's 'data' axis.

On-disk format: a directory with
  traces.npz   features [N, F] float32 (columns: meta["features"]), label [N] bool,
               prompt [N] int32 (index into the prompt list), round [N] int32 (the row's round),
               block [N] int32, token [N] int32 (current argmax), target [N] int32 (y*)
  meta.json    {"format": "dlmjax-tspd-traces", "version": 2, "features", "model" (fingerprint),
                "model_source", "count", "positives", "num_prompts", "tasks", "block",
                "max_new_tokens" (per task), "rollout", "cache" (exact for block-causal models), "seed"}
Each prompt is traced once (`distinct`; `collect_traces` refuses a repeat of token ids), and the
toy tasks' prompts leave out their first EVAL_PROMPTS_EXCLUDED evaluation prompts (`task_prompts`).
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax import arithmetic
from dlmjax.decoding import engine, policies
from dlmjax.decoding.api import DEFAULT_BIDIRECTIONAL_BLOCK, _round_up, check_canvas_length, check_length
from dlmjax.decoding.engine import BlockForwards, Plan
from dlmjax.decoding.spec import DiffusionDecoder, Static
from dlmjax.decoding.tspd import Trajectory, block_abs_pos, feature_matrix, observe
from dlmjax.heads.controller import FEATURES, model_fingerprint
from dlmjax.io.files import check_output_dir
from dlmjax.io.tokenizer import decode_stop_ids
from dlmjax.models.transformer import take_rows
from dlmjax.validation import InputError, count_arg, seed_arg

TRACE_FORMAT = "dlmjax-tspd-traces"
TRACE_VERSION = 2  # 2: each prompt traced once (v1 could hold one twice, on both sides of a held-out split)
EVAL_PROMPTS_EXCLUDED = 1024  # toy traces leave out the first this many prompts of each task's evaluation set
FIELDS = ("features", "label", "prompt", "round", "block", "token", "target")


class TraceError(InputError):
    """Traces that do not fit what reads them."""


@dataclass(frozen=True)
class EGPTracer(DiffusionDecoder):
    """A rollout toward y* (carry["ystar"] [B, T]; `rollout` egp or static, see the module
    docstring) that records every masked token's features into fixed buffers [B, S, K, ...] (S:
    the most rounds a row can take)."""

    name: ClassVar[str] = "egp-trace"
    max_rounds: int = 1
    rollout: str = "egp"

    def init_carry(self, fwd, batch: int):
        k, s, f = fwd.geometry.block, self.max_rounds, len(FEATURES)
        return {"traj": Trajectory.init(batch, k), "ystar": jnp.zeros((batch, fwd.geometry.total), jnp.int32),
                "count": jnp.zeros((batch,), jnp.int32), "features": jnp.zeros((batch, s, k, f), jnp.float32),
                "label": jnp.zeros((batch, s, k), bool), "recorded": jnp.zeros((batch, s, k), bool),
                "token": jnp.zeros((batch, s, k), jnp.int32), "block": jnp.zeros((batch, s), jnp.int32)}

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        c = state.carry
        scores = self.scores(fwd, state, keys_b)
        feats, traj = observe(c["traj"], scores, state.block, block_abs_pos(fwd, state.block))
        target = take_rows(c["ystar"], fwd.block_start(state.block), fwd.geometry.block)
        label = masked_bk & (scores.tokens == target)
        chosen = label if self.rollout == "egp" else jnp.zeros_like(label)  # static: the guard's top-1 only
        commit = policies.with_progress_guard(chosen, scores, masked_bk)
        after = jnp.where(commit, target, tokens_bk)

        active = jnp.any(masked_bk, axis=-1)
        idx = jnp.minimum(c["count"], self.max_rounds - 1)
        rows = jnp.arange(masked_bk.shape[0])

        def put(buf, value):
            return buf.at[rows, idx].set(jnp.where(active.reshape((-1,) + (1,) * (value.ndim - 1)), value,
                                                   buf[rows, idx]))

        carry = {**c, "traj": traj, "count": c["count"] + active,
                 "features": put(c["features"], feature_matrix(feats, FEATURES)), "label": put(c["label"], label),
                 "recorded": put(c["recorded"], masked_bk), "token": put(c["token"], scores.tokens),
                 "block": put(c["block"], state.block)}
        return Plan(tokens=after, copies=after[:, None], carry=carry)


def _loop(decoder, fwd, state):
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), partial(engine.decode_round, decoder, fwd, seed_key=None),
                              state)


_STATIC = ("graphdef", "geometry", "cache_mode", "mask_id", "eos_ids", "max_rounds", "rollout")
ROLLOUTS = ("egp", "static")


@partial(arithmetic.jit, static_argnames=_STATIC)
def _reference_and_trace(graphdef, params, canvas, rows, *, geometry, cache_mode, mask_id, eos_ids, max_rounds,
                         rollout):
    """(y* canvas [B, T], the tracer's carry) for a laid-out batch, scored as `generate` scores a
    greedy decoder's rounds (from hidden states through `residual_argmax` where it runs)."""
    static = Static()
    model = nnx.merge(graphdef, params)
    fwd = BlockForwards(model, rows, geometry, cache_mode, mask_id, scores_from_hidden=static.scores_from_hidden(model),
                        eos_ids=tuple(eos_ids))
    ystar = _loop(static, fwd, engine.start(fwd, canvas, static)).canvas
    tracer = EGPTracer(max_rounds=max_rounds, rollout=rollout)
    state = engine.start(fwd, canvas, tracer)
    state = state.replace(carry={**state.carry, "ystar": ystar})
    final = _loop(tracer, fwd, state)
    return ystar, final.carry, final.canvas


def trace_batch(model, prompt_ids: list[list[int]], *, max_new_tokens: int, mesh=None, block: int | None = None,
                cache: str = "none", rollout: str = "egp", eos_ids: tuple[int, ...] | None = None) -> dict:
    """Traces of one batch of token-id prompts (flat arrays, see module docstring; `prompt` is the
    index in `prompt_ids`). With `mesh`, the batch is split over its 'data' axis. `eos_ids`: where
    a row stops (default config.json's; `io.tokenizer.decode_stop_ids` adds a chat model's turn end)."""
    cfg = model.config
    if rollout not in ROLLOUTS:
        raise TraceError(f"rollout {rollout!r}; choose one of {', '.join(ROLLOUTS)}")
    block = trace_block(cfg, block)
    for prompt in prompt_ids:  # as generate refuses them: traces of decodes no decoder runs would mislead
        check_length(model, len(prompt), max_new_tokens)
    block_causal = cfg.attention == "block_causal"
    geometry, canvas, rows = engine.plan_layout(prompt_ids, block=block, max_new_tokens=max_new_tokens,
                                                block_causal=block_causal, pad_id=cfg.pad_token_id,
                                                mask_id=cfg.mask_token_id)
    check_canvas_length(model, geometry, rows)  # whole blocks past the model's maximum length: refused, as generate
    if mesh is not None:
        from dlmjax.sharding import shard_batch

        canvas, rows = shard_batch((canvas, rows), mesh)
    graphdef, params = nnx.split(model)
    max_rounds = geometry.num_blocks * geometry.block
    ystar, carry, canvas_out = jax.device_get(_reference_and_trace(
        graphdef, params, jnp.asarray(canvas), rows, geometry=geometry,
        cache_mode=trace_cache(cfg, cache), mask_id=cfg.mask_token_id,
        eos_ids=tuple(cfg.eos_token_ids if eos_ids is None else eos_ids), max_rounds=max_rounds, rollout=rollout))
    if not np.array_equal(canvas_out, ystar):
        raise TraceError(f"the {rollout} rollout did not reproduce the reference output; this is a bug in "
                         "dlmjax.traces")
    recorded = np.asarray(carry["recorded"])
    b, s, k = recorded.shape
    ystar_blocks = np.stack([np.take_along_axis(
        ystar, (geometry.prefix + carry["block"][:, j] * k)[:, None] + np.arange(k)[None, :], axis=1)
        for j in range(s)], axis=1)
    where = np.nonzero(recorded)
    return {
        "features": np.asarray(carry["features"])[where].astype(np.float32),
        "label": np.asarray(carry["label"])[where].astype(bool),
        "prompt": where[0].astype(np.int32),
        "round": where[1].astype(np.int32),
        "block": np.asarray(carry["block"])[where[0], where[1]].astype(np.int32),
        "token": np.asarray(carry["token"])[where].astype(np.int32),
        "target": ystar_blocks[where].astype(np.int32),
    }


def concat(parts: list[dict], offsets: list[int]) -> dict:
    out = {}
    for name in FIELDS:
        arrays = [p[name] + (o if name == "prompt" else 0) for p, o in zip(parts, offsets)]
        out[name] = np.concatenate(arrays) if arrays else np.zeros((0, len(FEATURES)) if name == "features" else 0)
    return out


def trace_cache(cfg, cache: str) -> str:
    """The cache mode both decodes ran with: `cache` (--cache) on a bidirectional model; a
    block-causal model's own exact cache (another --cache is refused, as the decoders refuse it)."""
    if cfg.attention != "block_causal":
        return cache
    if cache not in ("none", "exact"):
        raise TraceError(f"--cache {cache}: a block-causal model decodes with its own exact cache; drop --cache")
    return "exact"


def refuse_causal(cfg, name: str) -> None:
    """TSPD traces and controllers are for diffusion models: a causal one (`name`) is refused."""
    if cfg.attention == "causal":
        raise TraceError(f"{name} is a causal {cfg.family} model; a TSPD controller serves a diffusion model "
                         "(sdar, llada, dream), and so do its traces")


def trace_block(cfg, block: int | None) -> int:
    """The block a trace-aware decoder decodes `cfg`'s model in (`block`: --block); refuses the
    models and blocks they refuse (dlmjax.decoding.api)."""
    refuse_causal(cfg, "the model")
    if cfg.attention != "block_causal":
        return block or DEFAULT_BIDIRECTIONAL_BLOCK
    if cfg.shift_logits:
        raise TraceError(f"{cfg.family}: the trace-aware decoders do not run on a block-causal shifted-logit model "
                         "(it decodes with fast-dllm-v2), so its traces would train nothing they can use")
    if block not in (None, cfg.block_size):
        raise TraceError(f"--block {block}: a block-causal model decodes in its own block size {cfg.block_size}; "
                         "drop --block")
    return cfg.block_size


def collect_traces(model, prompt_ids: list[list[int]], *, max_new_tokens: int, batch_size: int = 32, mesh=None,
                   block: int | None = None, cache: str = "none", rollout: str = "egp",
                   eos_ids: tuple[int, ...] | None = None) -> dict:
    """Traces of every prompt (each given once), `batch_size` prompts per batch (a multiple of the
    mesh's data axis with `mesh`; the last batch is padded with copies of its first prompt, dropped after)."""
    first = {}
    for i, ids in enumerate(prompt_ids):
        j = first.setdefault(tuple(ids), i)
        if j != i:
            raise TraceError(f"prompt {i} repeats prompt {j}: its traces would be the same again, and a held-out "
                             "split by prompt would hold copies of training prompts; pass each prompt once "
                             "(dlmjax.traces.distinct)")
    data = 1 if mesh is None else mesh.shape["data"]
    if batch_size % data:
        raise TraceError(f"batch_size={batch_size} must be a multiple of the {data} data-parallel devices (CLI: "
                         "--batch-size)")
    parts, offsets = [], []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = list(prompt_ids[start : start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (-real % data)
        part = trace_batch(model, chunk, max_new_tokens=max_new_tokens, mesh=mesh, block=block, cache=cache,
                           rollout=rollout, eos_ids=eos_ids)
        keep = part["prompt"] < real
        parts.append({n: v[keep] for n, v in part.items()})
        offsets.append(start)
    return concat(parts, offsets)


def save_traces(traces: dict, out_dir: str | Path, meta: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "traces.npz", **{n: traces[n] for n in FIELDS})
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "features": list(FEATURES),
            "count": int(len(traces["label"])), "positives": int(np.sum(traces["label"])), **meta}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def load_traces(path: str | Path, *, expect_model: dict | None = None) -> tuple[dict, dict]:
    """(arrays, meta) of a trace directory; `expect_model` (a model_fingerprint) must match."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise TraceError(f"traces directory {path} not found; collect traces into it with `dlmjax traces --out {path}`")
    if not meta_path.is_file() or not (path / "traces.npz").is_file():
        raise TraceError(f"{path} holds no traces (traces.npz + meta.json); collect them with `dlmjax traces`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
        raise TraceError(f"{path}: format {meta.get('format')} v{meta.get('version')}, expected {TRACE_FORMAT} "
                         f"v{TRACE_VERSION}; collect them again with `dlmjax traces`")
    if expect_model is not None and meta["model"] != expect_model:
        diff = {k: (meta["model"].get(k), v) for k, v in expect_model.items() if meta["model"].get(k) != v}
        source = meta.get("model_source")
        fix = (f"train on the model they are of (backbone={source}), or " if source else "") + \
            "collect traces with the model the controller is for (`dlmjax traces --model MODEL`)"
        raise TraceError(f"{path} holds traces of {source or 'another model'} ({diff}: traces vs expected); {fix}")
    try:
        with np.load(path / "traces.npz") as f:
            arrays = {n: f[n] for n in FIELDS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:  # a truncated or foreign file
        raise TraceError(f"{path / 'traces.npz'} cannot be read ({err}); collect the traces again with "
                         "`dlmjax traces`") from None
    return arrays, meta


def task_prompts(tasks: list[str], per_task: int, seed: int):
    """[(task, prompts)]: per toy task (each named once), the first `per_task` distinct prompts its
    generator draws with `seed` in `toy_draws(per_task)` draws, leaving out the task's evaluation
    prompts (`dlmjax eval --limit N` takes the first N drawn with seed 1234; the first
    EVAL_PROMPTS_EXCLUDED are left out). toy-constraint has 39 prompts, all of them evaluated."""
    from dlmjax.evaluation.tasks import TOY_SEED
    from dlmjax.toy.tasks import get_task

    out = []
    for task in distinct(tasks):
        generator = get_task(task)
        evaluated = {ex.prompt for ex in generator.generate(EVAL_PROMPTS_EXCLUDED, TOY_SEED)}
        drawn = distinct(ex.prompt for ex in generator.generate(toy_draws(per_task), seed))
        out.append((task, [p for p in drawn if p not in evaluated][:per_task]))
    return out


def toy_draws(per_task: int) -> int:
    """How many prompts `task_prompts` draws to find `per_task` distinct ones."""
    return max(4096, 16 * per_task)


def distinct(prompts) -> list:
    """The prompts in order, each once: a repeated prompt decodes to the same traces again, and a
    held-out split by prompt (dlmjax.train.tspd) would hold copies of training prompts."""
    return list(dict.fromkeys(prompts))


def prompts_from_file(path: str | Path, *, field: str = "prompt") -> list[str]:
    """Prompts from a JSONL file (.jsonl, .ndjson or gzipped: `field` of each line's object, e.g.
    GSM8K's `question`), a .json file (a list of such objects), both read as `dlmjax eval --data`
    reads them, or a text file (one prompt per line; blank lines skipped); `traces_for_prompts`
    traces a repeat once. Training traces should not come from a test split."""
    from dlmjax.evaluation.tasks import DatasetError, read_rows, usable_rows

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"--prompts {path}: no such file")
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json", ".gz"):
        try:
            rows = read_rows(path, split="train")  # a .json object's "train" list, never its "test"
        except DatasetError as err:
            raise TraceError(f"--prompts: {err}") from None
        usable, bad = usable_rows(rows, (field,))
        if bad:
            raise TraceError(f"--prompts {path}: {len(bad)} row{'s' * (len(bad) > 1)} without a text field {field!r} "
                             f"({'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}); fix them, or pass --field NAME")
        prompts = [row[field] for _, row in usable]
    elif field != "prompt":
        raise TraceError(f"--field {field} reads JSON objects, and {path} is read as text (one prompt per line); "
                         "name the file .jsonl, or drop --field")
    else:
        prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise TraceError(f"{path} holds no prompts")
    return prompts


def traces_for_prompts(model, tokenizer, prompts: list[str], *, name: str, max_new_tokens: int, chat=False,
                       limit: int | None = None, batch_size: int = 32, mesh=None, block: int | None = None,
                       cache: str = "none", rollout: str = "egp") -> tuple[dict, dict]:
    """(traces, meta) over text prompts, e.g. a real checkpoint's training questions (`chat`: True,
    or a dict of chat template variables, renders each as a user turn with the model's template),
    the first `limit` whose token ids differ (a template may trim two texts to one)."""
    if chat:
        prompts = tokenizer.user_turns(prompts, chat)
    ids = [list(i) for i in distinct(tuple(tokenizer.encode_prompt(p)) for p in prompts)]
    if len(ids) < len(prompts):
        print(f"note: {len(prompts) - len(ids)} prompt(s) encode to the token ids of an earlier one"
              f"{' (as chat turns)' if chat else ''}; each is traced once")
    ids = ids[:limit]
    traces = collect_traces(model, ids, max_new_tokens=max_new_tokens, batch_size=batch_size, mesh=mesh, block=block,
                            cache=cache, rollout=rollout, eos_ids=decode_stop_ids(model.config, tokenizer))
    meta = {"model": model_fingerprint(model.config), "num_prompts": len(ids), "tasks": [name], "chat": bool(chat),
            "block": trace_block(model.config, block), "max_new_tokens": {name: max_new_tokens},
            "rollout": rollout, "cache": trace_cache(model.config, cache)}
    return traces, meta


def traces_for_tasks(model, tokenizer, tasks: list[str], *, per_task: int, seed: int = 0, batch_size: int = 32,
                     mesh=None, max_new_tokens: dict | None = None, block: int | None = None,
                     cache: str = "none", rollout: str = "egp") -> tuple[dict, dict]:
    """(traces, meta) over toy tasks; each task decodes with its evaluation length. `block` and
    `cache` matter for bidirectional models only (block-causal ones use their block and exact cache)."""
    from dlmjax.evaluation.tasks import TOY_MAX_NEW_TOKENS

    def toy_length(task):
        return (max_new_tokens or {}).get(task, TOY_MAX_NEW_TOKENS.get(task, 32))

    parts, offsets, total, traced = [], [], 0, []
    for task, prompts in task_prompts(tasks, per_task, seed):
        if len(prompts) < per_task:
            print(f"note: {task}: {len(prompts)} distinct prompt(s) in {toy_draws(per_task)} draws outside its first "
                  f"{EVAL_PROMPTS_EXCLUDED} evaluation prompts, fewer than --per-task {per_task}"
                  + ("" if prompts else "; left out"))
        if not prompts:
            continue
        traced.append(task)
        ids = [tokenizer.encode_prompt(p) for p in prompts]
        parts.append(collect_traces(model, ids, max_new_tokens=toy_length(task), batch_size=batch_size, mesh=mesh,
                                    block=block, cache=cache, rollout=rollout,
                                    eos_ids=decode_stop_ids(model.config, tokenizer)))
        offsets.append(total)
        total += len(ids)
    if not traced:
        raise TraceError(f"no prompts to trace: {', '.join(tasks)} drew none outside the evaluation sets")
    meta = {"model": model_fingerprint(model.config), "num_prompts": total, "tasks": traced, "seed": seed,
            "block": trace_block(model.config, block), "max_new_tokens": {t: toy_length(t) for t in traced},
            "rollout": rollout, "cache": trace_cache(model.config, cache)}
    return concat(parts, offsets), meta


# -- `dlmjax traces` ------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("traces", help="collect TSPD training traces (static reference + EGP labels)")
    p.add_argument("--model", default="toy-sdar", help="preset or checkpoint directory (default: toy-sdar)")
    p.add_argument("--tasks", default=None, help="comma-separated toy tasks (default: toy-arith,toy-constraint)")
    p.add_argument("--per-task", type=count_arg, default=None,
                   help="distinct prompts per toy task, none among its first 1,024 evaluation prompts (default 256); "
                        "with --prompts: the first N distinct ones (default all)")
    p.add_argument("--prompts", default=None,
                   help="instead of toy tasks: a JSONL file (--field of each object) or a text file (one prompt per "
                        "line), e.g. a training split's questions; needs --max-new-tokens")
    p.add_argument("--field", default="prompt", help="--prompts JSONL: the text field (GSM8K: question)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="--prompts: tokens to generate per prompt")
    p.add_argument("--chat", action="store_true", help="--prompts: render each as a user turn of the chat template")
    p.add_argument("--seed", type=seed_arg, default=0, help="prompt seed (the eval sets use 1234: keep it different)")
    p.add_argument("--batch-size", type=count_arg, default=32)
    p.add_argument("--data-parallel", action="store_true", help="split each batch over all devices ('data' axis)")
    p.add_argument("--block", type=count_arg, default=None, help="bidirectional models: decoding block (default 32)")
    p.add_argument("--cache", default="none", choices=("none", "prefix", "dual"),
                   help="bidirectional models: cache mode of both decodes (default none: exact)")
    p.add_argument("--rollout", default="egp", choices=ROLLOUTS,
                   help="egp: Learn2PD's Extremely Greedy Parallel rollout (default); static: the 1-per-step "
                        "reference run itself, where a final token can stay masked (see dlmjax/traces.py)")
    p.add_argument("--out", required=True, help="output directory (traces.npz + meta.json)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from dlmjax.presets import load_checkpoint

    if args.seed == 1234 and args.prompts is None:  # (with --prompts the seed draws nothing)
        raise InputError("--seed 1234 draws the evaluation prompts; pick another seed for training traces")
    check_output_dir(args.out)
    path, model, tokenizer, _ = load_checkpoint(args.model)
    mesh = None
    if args.data_parallel:
        from dlmjax.sharding import make_mesh

        mesh = make_mesh(model=1)
    data = 1 if mesh is None else mesh.shape["data"]
    batch_size = _round_up(args.batch_size, data)  # as eval's: each device takes an equal share
    if batch_size != args.batch_size:
        print(f"--batch-size {args.batch_size} rounded up to {batch_size}, a multiple of the {data} data-parallel "
              "devices", file=sys.stderr)
    common = dict(batch_size=batch_size, mesh=mesh, block=args.block, cache=args.cache, rollout=args.rollout)
    if args.prompts is not None:
        if args.tasks is not None:
            raise InputError("--prompts and --tasks both name the prompts; give one")
        if args.max_new_tokens is None or args.max_new_tokens < 1:
            raise InputError("--prompts needs --max-new-tokens N (N >= 1): the length the controller will decode")
        prompts = prompts_from_file(args.prompts, field=args.field)
        traces, meta = traces_for_prompts(model, tokenizer, prompts, name=Path(args.prompts).stem,
                                          max_new_tokens=args.max_new_tokens, chat=args.chat, limit=args.per_task,
                                          **common)
    else:
        if args.chat or args.max_new_tokens is not None:
            raise InputError("--chat and --max-new-tokens go with --prompts; the toy tasks use their own lengths")
        tasks = [t.strip() for t in (args.tasks or "toy-arith,toy-constraint").split(",") if t.strip()]
        if not tasks:
            raise InputError(f"--tasks {args.tasks!r} names no task; give toy-arith, toy-constraint or both")
        traces, meta = traces_for_tasks(model, tokenizer, tasks, per_task=args.per_task or 256, seed=args.seed,
                                        **common)
    out = save_traces(traces, args.out, {**meta, "model_source": str(path)})
    pos = float(np.mean(traces["label"])) if len(traces["label"]) else 0.0
    print(f"{len(traces['label'])} token-rounds ({pos:.1%} positive) from {meta['num_prompts']} prompts -> {out}")
    return 0
