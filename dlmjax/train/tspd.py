"""Training the TSPD controller (objective tspd; ALGORITHMS.md section 4).

Data: traces from `dlmjax traces` (dlmjax.traces). The prompts are split once (seed
`data.seed`) into training prompts and `tspd.holdout` held-out ones; every step draws
`train.batch_size` token-rounds from the training prompts, a pure function of (seed, step), so a
resumed run takes exactly the batches of an uninterrupted one.

Loss: weighted binary cross-entropy
    L = mean_i[ -w1 y_i log p_i - w0 (1 - y_i) log(1 - p_i) ],
with w1 = N / (2 N1), w0 = N / (2 N0) from the training split's class counts (inverse class
frequency, mean weight 1). Optimiser: the loop's AdamW (configs/tspd: lr 1e-3, weight decay
1e-2 on the matrices).

A Learn2PD-style block filter trains the same way with `tspd.features: [block_confidence]`: one
example per (prompt, round) holds the block's K confidences (1.0 where not masked), K labels and
the masked positions the loss counts (`block_examples`).

Calibration (at export): the threshold is the smallest one on a grid whose held-out precision
P(label = 1 | p > threshold) reaches `tspd.target_precision` (commits that are right that often),
i.e. the most commits at that precision. The export is `model/tspd_controller.safetensors` in the
run directory (dlmjax.heads.controller, PyTorch layout).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.distributed import is_main
from dlmjax.io.files import staged_dir
from dlmjax.heads.controller import BLOCK_FEATURES, Controller, check_features, model_fingerprint, save_controller
from dlmjax.traces import TraceError, load_traces, refuse_causal

THRESHOLD_GRID = np.round(np.arange(0.05, 0.996, 0.005), 4)


def class_weights(labels) -> tuple[float, float]:
    """(w1, w0) = (N / 2 N1, N / 2 N0): inverse class frequency; an absent class gets weight 0."""
    labels = np.asarray(labels, bool)
    n, n1 = labels.size, int(labels.sum())
    n0 = n - n1
    return (n / (2 * n1) if n1 else 0.0), (n / (2 * n0) if n0 else 0.0)


def weighted_bce(logits, labels, w1: float, w0: float, mask=None):
    """Mean weighted BCE over a batch (over `mask`'s entries if given), from logits (stable log-sigmoids)."""
    y = labels.astype(jnp.float32)
    loss = -w1 * y * jax.nn.log_sigmoid(logits) - w0 * (1 - y) * jax.nn.log_sigmoid(-logits)
    if mask is None:
        return jnp.mean(loss)
    m = mask.astype(jnp.float32)
    return jnp.sum(loss * m) / jnp.maximum(jnp.sum(m), 1.0)


def block_examples(arrays, meta):
    """Learn2PD-style rows from token traces: per (prompt, round) the block's K confidences
    (1.0 where the position is not masked), labels and the masked positions, and each row's prompt."""
    k = meta.get("block")
    if not k:
        raise TraceError("traces without a block size (meta.json `block`) cannot train a block-confidence filter")
    conf = arrays["features"][:, meta["features"].index("confidence")]
    pos = arrays["features"][:, meta["features"].index("block_pos")].astype(int)
    keys, group = np.unique(arrays["prompt"].astype(np.int64) * 1_000_000 + arrays["round"], return_inverse=True)
    x = np.ones((len(keys), k), np.float32)
    y = np.zeros((len(keys), k), bool)
    m = np.zeros((len(keys), k), bool)
    x[group, pos], y[group, pos], m[group, pos] = conf, arrays["label"], True
    return x, y, m, (keys // 1_000_000).astype(np.int32)


def calibrate_threshold(probs, labels, target_precision: float) -> tuple[float, bool]:
    """(threshold, reached): the smallest grid threshold whose precision on (probs, labels)
    reaches target_precision; where none does, the grid's last (most precise) one and False."""
    probs, labels = np.asarray(probs), np.asarray(labels, bool)
    for t in THRESHOLD_GRID:
        chosen = probs > t
        if chosen.any() and labels[chosen].mean() >= target_precision:
            return float(t), True
    return float(THRESHOLD_GRID[-1]), False


def split_prompts(prompt_ids, holdout: float, seed: int):
    """(train mask, held-out mask) over token-rounds, split by prompt index (dlmjax.traces traces
    each prompt once, so no held-out prompt is also a training one)."""
    prompts = np.unique(prompt_ids)
    rng = np.random.default_rng(seed)
    held = set(rng.permutation(prompts)[: max(1, int(round(holdout * len(prompts))))].tolist())
    is_held = np.isin(prompt_ids, list(held))
    return ~is_held, is_held


def _step_indices(n: int, batch: int, seed: int, step: int):
    digest = hashlib.sha256(f"tspd:{seed}:{step}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).integers(0, n, size=batch)


def tspd_trainee(run, run_dir: Path):
    """The Trainee of objective tspd (dlmjax.train.loop)."""
    from dlmjax.io.hf import load_config
    from dlmjax.presets import resolve_model
    from dlmjax.train.loop import Trainee

    t = run.tspd
    features = check_features(t.features)
    expect = None
    if run.backbone:
        backbone = load_config(resolve_model(run.backbone, "backbone"))
        refuse_causal(backbone, f"backbone={run.backbone}")
        expect = model_fingerprint(backbone)
    arrays, meta = load_traces(t.traces, expect_model=expect)
    block = features == BLOCK_FEATURES
    if block:
        x_all, y_all, m_all, prompt = block_examples(arrays, meta)
    else:
        missing = [f for f in features if f not in meta["features"]]
        if missing:
            raise TraceError(f"traces {t.traces} lack features {missing}; collect them again with `dlmjax traces`")
        if "stable" in features and meta.get("rollout", "egp") == "egp" and is_main():  # said once, by process 0
            print(f"warning: tspd.features has `stable`, and {t.traces} are EGP traces, where a token is committed "
                  "the round its argmax is right: every traced token with stable >= 1 is labelled 0, so the "
                  "controller learns that a stable argmax is not final (the opposite of what it meets when it "
                  "decodes). Drop `stable`, or collect traces with `dlmjax traces --rollout static`.")
        cols = [meta["features"].index(f) for f in features]
        x_all, y_all = arrays["features"][:, cols].astype(np.float32), arrays["label"].astype(bool)
        m_all, prompt = np.ones(y_all.shape, bool), arrays["prompt"]
    train_mask, held_mask = split_prompts(prompt, t.holdout, run.data.seed)
    x_train, y_train, m_train = x_all[train_mask], y_all[train_mask], m_all[train_mask]
    x_held, m_held = x_all[held_mask], m_all[held_mask]
    y_held = y_all[held_mask][m_held]  # flat, the entries that count
    if len(x_train) == 0 or len(x_held) == 0:
        raise TraceError(f"traces {t.traces}: {len(x_train)} training and {len(x_held)} held-out examples; "
                         "collect traces from more prompts or change tspd.holdout")
    w1, w0 = class_weights(y_train[m_train])
    mean, std = x_train.mean(0), np.maximum(x_train.std(0), 1e-3)
    lo, hi = x_train.min(0), x_train.max(0)  # decoding clamps each feature to the range trained on

    def loss(controller, _frozen, batch, _key):
        logits = controller(batch["features"])
        y, m = batch["label"], batch["mask"]
        value = weighted_bce(logits, y, w1, w0, m)
        mf = m.astype(jnp.float32)
        accuracy = jnp.sum(((logits > 0) == y) * mf) / jnp.maximum(jnp.sum(mf), 1.0)
        return value, {"loss": value, "accuracy": accuracy,
                       "positive_rate": jnp.sum(y * mf) / jnp.maximum(jnp.sum(mf), 1.0)}

    def batch_at(step: int) -> dict:
        idx = _step_indices(len(x_train), run.train.batch_size, run.data.seed, step)
        return {"features": x_train[idx], "label": y_train[idx], "mask": m_train[idx]}

    @jax.jit
    def held_probs(params):
        from dlmjax.heads.controller import mlp_outputs

        out = mlp_outputs(params, jnp.asarray(x_held))
        return jax.nn.sigmoid(out if block else out[..., 0])

    def evaluate(controller, _frozen):
        p = np.asarray(held_probs(controller.params()))[m_held]
        logits = np.log(np.clip(p, 1e-7, 1)) - np.log(np.clip(1 - p, 1e-7, 1))
        bce = float(weighted_bce(jnp.asarray(logits), jnp.asarray(y_held), w1, w0))
        chosen = p > 0.5
        threshold, reached = calibrate_threshold(p, y_held, t.target_precision)
        at = p > threshold
        return {"eval/bce": bce, "eval/accuracy": float(np.mean(chosen == y_held)),
                "eval/precision@0.5": float(y_held[chosen].mean()) if chosen.any() else 0.0,
                "eval/recall@0.5": float(chosen[y_held].mean()) if y_held.any() else 0.0,
                "eval/threshold": threshold, "eval/recall@threshold": float(at[y_held].mean()) if y_held.any() else 0.0,
                "eval/precision@threshold": float(y_held[at].mean()) if at.any() else 0.0,
                "eval/target_met": float(reached)}

    def export(controller, run_dir: Path) -> Path:
        scores = evaluate(controller, None)
        if not scores["eval/target_met"]:
            print(f"warning: no threshold reaches tspd.target_precision={t.target_precision} on the held-out traces "
                  f"(at {scores['eval/threshold']}: precision {scores['eval/precision@threshold']:.3f}); the "
                  "controller commits tokens that change later: train longer, on more traces, or lower the target")
        summary = {**scores, "w1": w1, "w0": w0, "train_examples": int(m_train.sum()),
                   "heldout_examples": int(m_held.sum()), "traces": str(t.traces), "features": list(features),
                   "target_precision": t.target_precision}
        with staged_dir(run_dir / "model") as stage:  # replaces an earlier export only when complete
            save_controller(controller, stage, features=features, threshold=scores["eval/threshold"],
                            model=meta["model"], block=meta.get("block"))
            (stage / "tspd_calibration.json").write_text(json.dumps(summary, indent=2))
        return run_dir / "model"

    return Trainee(
        build=lambda: Controller(x_train.shape[1], t.hidden, outputs=y_train.shape[1] if block else 1,
                                 seed=run.train.seed, mean=mean, std=std, lo=lo, hi=hi),
        abstract=Controller(x_train.shape[1], t.hidden, outputs=y_train.shape[1] if block else 1), frozen=None, loss=loss, tokenizer=None, block=None,
        pad_id=0, evaluate=evaluate, export=export, batch_at=batch_at,
    )
