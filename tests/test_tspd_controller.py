"""The TSPD controller: weighted BCE, calibration, training through the loop (loss falls, exact
resume), the PyTorch-format export, and the tspd / tspd+ce decoders (progress, batch invariance,
mismatch errors)."""

import json
import math
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.decoding.api import generate
from dlmjax.decoding.spec import DecoderSpecError, decoder_spec, parse_decoder
from dlmjax.heads.controller import (
    ControllerMismatchError, check_features, controller_module, export_controller, load_controller, mlp_logits,
    model_fingerprint, save_controller,
)
from dlmjax.io.safetensors import SafetensorsFile
from dlmjax.traces import TraceError, collect_traces, load_traces, save_traces
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.train.loop import train
from dlmjax.train.tspd import calibrate_threshold, class_weights, weighted_bce
from dlmjax.validation import InputError
from test_decoding import MAX_NEW, PROMPTS, peaky_model


def test_weighted_bce_on_a_hand_example():
    labels = np.array([1, 1, 1, 0], bool)
    w1, w0 = class_weights(labels)
    assert (w1, w0) == (4 / 6, 4 / 2)  # N / (2 N1), N / (2 N0)
    logits = jnp.asarray([0.0, 2.0, -1.0, 1.0])
    p = 1 / (1 + np.exp(-np.array([0.0, 2.0, -1.0, 1.0])))
    expected = np.mean([-w1 * math.log(p[0]), -w1 * math.log(p[1]), -w1 * math.log(p[2]), -w0 * math.log(1 - p[3])])
    np.testing.assert_allclose(float(weighted_bce(logits, jnp.asarray(labels), w1, w0)), expected, rtol=1e-6)


def test_calibration_picks_the_smallest_threshold_with_the_precision():
    probs = np.array([0.99, 0.95, 0.9, 0.8, 0.6, 0.3])
    labels = np.array([1, 1, 1, 0, 1, 0], bool)
    assert calibrate_threshold(probs, labels, 1.0) == (pytest.approx(0.8), True)  # p > 0.8: all right
    assert calibrate_threshold(probs, labels, 0.8) == (pytest.approx(0.3), True)  # p > 0.3: 4 of 5
    wrong_at_the_top = np.array([False, True, True, False])
    assert calibrate_threshold(np.array([0.3, 0.6, 0.97, 0.999]), wrong_at_the_top, 0.999) == (0.995, False)


@pytest.fixture(scope="module")
def sdar():
    model = peaky_model("sdar", seed=3)
    head = model.embed if model.lm_head is None else model.lm_head.kernel
    head[...] = head[...] * 0.08  # less peaked: tokens change over rounds, labels of both classes
    return model


@pytest.fixture(scope="module")
def trained(sdar, tmp_path_factory):
    root = tmp_path_factory.mktemp("tspd")
    prompts = [[(7 * i + j) % 30 + 3 for j in range(1 + i % 6)] for i in range(24)]
    traces = collect_traces(sdar, prompts, max_new_tokens=MAX_NEW, batch_size=24)
    assert 0 < traces["label"].mean() < 1
    save_traces(traces, root / "traces", {"model": model_fingerprint(sdar.config), "num_prompts": len(prompts), "block": 4})
    overrides = [f"tspd.traces={root / 'traces'}", "train.steps=60", "train.batch_size=64", "train.log_every=10",
                 "train.checkpoint_every=30", "train.eval_every=0", "tspd.target_precision=0.9"]
    run = load_run_config("configs/tspd/toy-sdar.yaml", overrides + ["backbone=null"])
    result = train(run, root / "run", progress=False)
    return root, run, result


def test_training_lowers_the_loss_and_resumes_exactly(trained, tmp_path):
    root, run, full = trained
    losses = full.losses
    assert np.mean([losses[s] for s in (50, 60)]) < losses[10]
    partial = train(run, tmp_path / "r", stop_at=30, progress=False)
    assert partial.step == 30 and partial.model_dir is None
    resumed = train(run, tmp_path / "r", progress=False)
    assert resumed.step == 60
    for step in (40, 50, 60):
        assert resumed.losses[step] == pytest.approx(losses[step], rel=1e-6)
    a = load_controller(str(full.model_dir)).params
    b = load_controller(str(resumed.model_dir)).params
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)
    # traces collected again into the run's traces directory between a stop and its resume: refused
    copy = tmp_path / "traces"
    shutil.copytree(root / "traces", copy)
    moved = load_run_config("configs/tspd/toy-sdar.yaml", [f"tspd.traces={copy}", "train.steps=60",
                                                           "train.checkpoint_every=30", "train.eval_every=0",
                                                           "backbone=null"])
    train(moved, tmp_path / "moved", stop_at=30, progress=False)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "num_prompts": meta["num_prompts"] + 1}))
    with pytest.raises(InputError, match=r"data file .*meta.json has changed since this run began"):
        train(moved, tmp_path / "moved", progress=False)
    summary = json.loads((full.model_dir / "tspd_calibration.json").read_text())
    met = summary["eval/precision@threshold"] >= summary["target_precision"]  # says whether the target was reached
    assert summary["eval/target_met"] == float(met)


def test_export_round_trip_in_pytorch_layout(trained, sdar, tmp_path):
    _, _, result = trained
    w = load_controller(str(result.model_dir))
    assert w.model == model_fingerprint(sdar.config) and w.features == tuple(json.loads(
        SafetensorsFile(w.path).metadata["features"]))
    out = export_controller(str(result.model_dir), tmp_path / "c.safetensors")
    f = SafetensorsFile(out)
    assert f.metadata["format"] == "pt"
    assert tuple(f.get("fc1.weight").shape) == (w.hidden, len(w.features))  # torch.nn.Linear: [out, in]
    assert tuple(f.get("fc2.weight").shape) == (1, w.hidden)
    again = load_controller(str(out))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, len(w.features))), jnp.float32)
    np.testing.assert_allclose(np.asarray(mlp_logits(again.jax_params(), x)), np.asarray(controller_module(w)(x)),
                               rtol=1e-6)
    # a plain numpy version of the PyTorch forward gives the same logits
    p = again.params
    xs = (np.clip(np.asarray(x), p["lo"], p["hi"]) - p["mean"]) / p["std"]
    h = xs @ p["fc1_w"].T + p["fc1_b"]
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    np.testing.assert_allclose((h @ p["fc2_w"].T + p["fc2_b"])[:, 0], np.asarray(mlp_logits(again.jax_params(), x)),
                               rtol=1e-5, atol=1e-6)


def test_a_controller_rewritten_in_place_is_read_again(trained, tmp_path):
    """load_controller caches per file version: a controller re-trained into the same path in one
    process (a notebook, a sweep) is not served from the cache."""
    _, _, result = trained
    w = load_controller(str(result.model_dir))
    out = save_controller(w.params, tmp_path / "c.safetensors", features=w.features, threshold=w.threshold,
                          model=w.model, block=w.block)
    assert load_controller(str(out)).threshold == w.threshold
    before = parse_decoder(f"tspd:controller={out}")
    save_controller(w.params, out, features=w.features, threshold=0.5 if w.threshold != 0.5 else 0.25,
                    model=w.model, block=w.block)
    assert load_controller(str(out)).threshold != w.threshold
    # the decoder's identity (its compiled programs' key) names the file's version
    after = parse_decoder(f"tspd:controller={out}")
    assert after != before and hash(after) != hash(before) and decoder_spec(after) == decoder_spec(before)
    assert after.weights().threshold != w.threshold
    with pytest.raises(DecoderSpecError, match="was rewritten after this decoder was built; build the decoder again"):
        before.weights()


def test_features_are_clamped_to_the_range_of_the_training_traces(trained, tmp_path):
    """An MLP past its training range extrapolates: the toy controller gave P(final) ~ 1 to any
    token past position 200 (trained on positions 6-47). The stored range clamps each feature: a
    position far past it scores as the largest one trained on. A file without the range (written
    before it was stored) is read unclamped."""
    from dlmjax.heads.controller import FEATURES

    root, run, result = trained
    w = load_controller(str(result.model_dir))
    arrays, _ = load_traces(run.tspd.traces)
    x = arrays["features"][:, [FEATURES.index(f) for f in w.features]]
    lo, hi = w.params["lo"], w.params["hi"]  # the training split's range, inside the traces'
    assert (lo >= x.min(0)).all() and (hi <= x.max(0)).all() and (hi > lo).any()
    pos = w.features.index("abs_pos")
    row = np.asarray(x[:1], np.float32)
    far, edge = row.copy(), row.copy()
    far[0, pos], edge[0, pos] = 10_000.0, w.params["hi"][pos]
    params = w.jax_params()
    np.testing.assert_array_equal(np.asarray(mlp_logits(params, far)), np.asarray(mlp_logits(params, edge)))
    stored = SafetensorsFile(w.path)
    unbounded = {k: stored.get(k) for k in stored.keys() if k not in ("feature_min", "feature_max")}
    from dlmjax.io.safetensors import CheckpointError, save_file

    old = tmp_path / "old.safetensors"
    save_file(unbounded, old, metadata=stored.metadata)
    legacy = load_controller(str(old))
    assert np.isinf(legacy.params["hi"]).all()
    assert not np.array_equal(np.asarray(mlp_logits(legacy.jax_params(), far)),
                              np.asarray(mlp_logits(legacy.jax_params(), edge)))


def test_tspd_decoders_progress_and_batch_invariance(trained, sdar):
    _, _, result = trained
    for spec in (f"tspd:controller={result.model_dir}", f"tspd+ce:controller={result.model_dir},tau=0.8"):
        batch = generate(sdar, PROMPTS, decoder=spec, max_new_tokens=MAX_NEW)
        for row in batch.rows:
            assert row.nfe <= MAX_NEW + 2 and row.num_tokens >= 1  # >= 1 commit per forward
        alone = generate(sdar, [PROMPTS[5]], decoder=spec, max_new_tokens=MAX_NEW)
        assert alone.rows[0].tokens == batch.rows[5].tokens and alone.rows[0].nfe == batch.rows[5].nfe


def test_a_threshold_near_one_leaves_only_the_progress_guard(trained, sdar):
    """threshold ~1: only the progress guard commits, so tspd is static (1 per step)."""
    _, _, result = trained
    static = generate(sdar, PROMPTS[:4], decoder="static", max_new_tokens=MAX_NEW)
    guarded = generate(sdar, PROMPTS[:4], decoder=f"tspd:controller={result.model_dir},threshold=0.999999",
                       max_new_tokens=MAX_NEW)
    assert [r.tokens for r in guarded.rows] == [r.tokens for r in static.rows]


def test_mismatches_are_clear_errors(trained, sdar, tmp_path):
    root, run, result = trained
    with pytest.raises(DecoderSpecError, match="reads features"):
        parse_decoder(f"tspd:controller={result.model_dir},features=confidence+entropy")
    with pytest.raises(DecoderSpecError, match="unknown"):
        parse_decoder(f"tspd:controller={result.model_dir},features=confidence+speed")
    with pytest.raises(DecoderSpecError, match="no TSPD controller"):
        parse_decoder(f"tspd:controller={tmp_path}")
    other = peaky_model("llada", seed=3)
    with pytest.raises(ControllerMismatchError, match="another model"):
        generate(other, PROMPTS[:2], decoder=f"tspd:controller={result.model_dir},block=4", max_new_tokens=MAX_NEW)
    w = load_controller(str(result.model_dir))
    assert w.block == 4  # the traces' block, stored with the controller
    elsewhere = save_controller(w.params, tmp_path / "block8.safetensors", features=w.features, threshold=w.threshold,
                                model=w.model, block=8)
    with pytest.raises(ControllerMismatchError, match="traces decoded in blocks of 8; this decode uses block 4"):
        generate(sdar, PROMPTS[:2], decoder=f"tspd:controller={elsewhere}", max_new_tokens=MAX_NEW)
    # training on traces of another model than `backbone`
    bad = load_run_config("configs/tspd/toy-sdar.yaml", [f"tspd.traces={root / 'traces'}", "train.steps=1"])
    with pytest.raises(TraceError, match="another model"):
        train(bad, tmp_path / "bad", progress=False)
    causal = load_run_config("configs/tspd/toy-sdar.yaml", [f"tspd.traces={root / 'traces'}", "train.steps=1",
                                                             "backbone=toy-ar"])
    with pytest.raises(TraceError, match="backbone=toy-ar is a causal qwen3 model; a TSPD controller serves a "
                                         "diffusion model"):  # it crashed on the causal model's mask id (None)
        train(causal, tmp_path / "causal", progress=False)
    with pytest.raises(RunConfigError, match="tspd.traces"):
        load_run_config("configs/tspd/toy-sdar.yaml", ["tspd.traces=''"])
    with pytest.raises(RunConfigError, match="features"):
        load_run_config("configs/tspd/toy-sdar.yaml", ["tspd.features=[speed]"])
    # traces are recorded by absolute path (a resume may run from another directory); a missing
    # directory is named as not found, not as one that holds no traces
    config = str(Path("configs/tspd/toy-sdar.yaml").resolve())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert load_run_config(config, ["tspd.traces=traces"]).tspd.traces == str(root / "traces")
    with pytest.raises(TraceError, match="traces directory .*nowhere not found; collect traces into it"):
        load_traces(tmp_path / "nowhere")


def test_shipped_toy_sdar_controller_loads():
    from dlmjax.io.hf import load_config
    from dlmjax.presets import resolve_model

    w = load_controller("toy-sdar")
    w.check_model(load_config(resolve_model("toy-sdar")))
    assert 0 < w.threshold < 1 and w.features == ("confidence", "entropy", "momentum", "block_pos", "abs_pos")
    assert np.isfinite(w.params["lo"]).all() and np.isfinite(w.params["hi"]).all()  # trained with its range
    assert parse_decoder("tspd+ce:controller=toy-sdar").weights() is w


def test_learn2pd_block_filter_trains_decodes_and_kinds_do_not_mix(trained, sdar, tmp_path):
    root, _, token_run = trained
    overrides = [f"tspd.traces={root / 'traces'}", "train.steps=20", "train.batch_size=16", "train.log_every=10",
                 "train.eval_every=0", "tspd.features=[block_confidence]", "backbone=null"]
    result = train(load_run_config("configs/tspd/toy-sdar.yaml", overrides), tmp_path / "l2pd", progress=False)
    w = load_controller(str(result.model_dir))
    assert w.kind == "block" and w.params["fc1_w"].shape[1] == 4 and w.params["fc2_w"].shape[0] == 4
    assert result.losses[20] < result.losses[10] * 1.5  # it trains (finite, not diverging)
    spec = f"learn2pd:controller={result.model_dir},threshold=0.5,features=block_confidence"  # its one feature
    batch = generate(sdar, PROMPTS[:4], decoder=spec, max_new_tokens=MAX_NEW)
    assert all(1 <= r.nfe <= MAX_NEW + 2 for r in batch.rows)
    with pytest.raises(DecoderSpecError, match="block controller"):
        parse_decoder(f"tspd:controller={result.model_dir}")
    with pytest.raises(DecoderSpecError, match="token controller"):
        parse_decoder(f"learn2pd:controller={token_run.model_dir}")
    # without a controller: a block filter is named (toy-sdar's own controller is a token controller)
    with pytest.raises(DecoderSpecError, match=r"learn2pd needs controller=PATH: a block filter .*learn2pd_filter"):
        parse_decoder("learn2pd")
    filter_in_the_checkout = Path(__file__).parents[1] / "benchmarks/results/tspd_toy/learn2pd_filter.safetensors"
    assert load_controller(str(filter_in_the_checkout)).kind == "block"


def test_controller_files_of_the_wrong_shapes_and_thresholds_of_zero_are_refused(tmp_path):
    """Every tensor's shape is checked against the features the metadata names, on save and on load:
    a block filter with one output (one score would decide all K positions), a token controller
    with two (the second silently ignored), and fc1/fc2 of different hidden sizes (a dot_general
    error mid-decode) are refused naming the tensor. A threshold of 0 commits the whole block at
    once: refused for tspd and ce, as for threshold."""
    from dlmjax.io.safetensors import CheckpointError, save_file

    shipped = load_controller("toy-sdar")
    block_filter = load_controller(str(Path(__file__).parents[1] / "benchmarks/results/tspd_toy/learn2pd_filter.safetensors"))
    hidden = shipped.params["fc1_w"].shape[0]
    wrong = {
        "token controller with two outputs": (shipped, {"fc2_w": np.zeros((2, hidden)), "fc2_b": np.zeros(2)},
                                              r"fc2.weight is \(2, \d+\), expected \(1, \d+\)"),
        "fc2 of another hidden size": (shipped, {"fc2_w": np.zeros((1, hidden + 1))}, r"fc2.weight .* expected"),
        "block filter with one output": (block_filter, {"fc2_w": block_filter.params["fc2_w"][:1],
                                                        "fc2_b": block_filter.params["fc2_b"][:1]},
                                         r"fc2.weight is \(1, \d+\), expected \(8, \d+\)"),
    }
    for name, (w, changed, message) in wrong.items():
        params = {**w.params, **changed}
        with pytest.raises(InputError, match=message):
            save_controller(params, tmp_path / "refused.safetensors", features=w.features, threshold=w.threshold,
                            model=w.model, block=w.block)
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        shutil.copy(Path(w.path), path)  # the same file with the one tensor changed
        f = SafetensorsFile(path)
        tensors = {key: np.asarray(f.get(key)) for key in f.keys()}
        tensors.update({key.replace("fc2_w", "fc2.weight").replace("fc2_b", "fc2.bias"): np.asarray(v, np.float32)
                        for key, v in changed.items()})
        save_file(tensors, path, metadata=f.metadata)
        with pytest.raises(CheckpointError, match=f"does not hold the controller its metadata names: .*{message}"):
            load_controller(str(path))
    for spec in ("tspd:controller=toy-sdar,threshold=0", "tspd+ce:controller=toy-sdar,tau=0", "ce:tau=0"):
        with pytest.raises(DecoderSpecError, match=r"must be in \(0, 1\)"):
            parse_decoder(spec)
    with pytest.raises(InputError, match=r"or \['block_confidence'\] alone"):
        check_features(["block_confidence", "confidence"])


@pytest.mark.parametrize("threshold,changed,message", [
    ("0.0", {}, r"threshold 0.0 is not in \(0, 1\)"),  # the whole block at once
    ("nan", {}, r"threshold nan is not in \(0, 1\)"),  # nothing passes: the one-token guard alone
    ("1.5", {}, r"threshold 1.5 is not in \(0, 1\)"),
    (None, {"feature_std": 0.0}, "feature_std holds values that are not positive"),
    (None, {"feature_min": 1e9}, "feature_min exceeds feature_max"),
    (None, {"fc1.weight": np.nan}, "fc1.weight holds values that are not finite"),
])
def test_controller_files_of_unusable_values_are_refused(tmp_path, threshold, changed, message):
    """A controller's file is checked as the decoder options are: its threshold in (0, 1), its
    feature scales positive, its ranges ordered, its weights finite; on load and on save."""
    from dlmjax.io.safetensors import CheckpointError, save_file

    shipped = load_controller("toy-sdar")
    f = SafetensorsFile(Path(shipped.path))
    tensors = {key: np.array(f.get(key)) for key in f.keys()}
    for key, value in changed.items():
        tensors[key][0] = value
    path = tmp_path / "changed.safetensors"
    save_file(tensors, path, metadata={**f.metadata, **({"threshold": threshold} if threshold else {})})
    with pytest.raises(CheckpointError, match=f"not a usable TSPD controller: .*{message}"):
        load_controller(str(path))
    params = {**shipped.params}
    names = {"feature_std": "std", "feature_min": "lo", "fc1.weight": "fc1_w"}
    for key, value in changed.items():
        params[names[key]] = params[names[key]].copy()
        params[names[key]].flat[0] = value
    with pytest.raises(InputError, match=message):
        save_controller(params, tmp_path / "refused.safetensors", features=shipped.features,
                        threshold=float(threshold) if threshold else shipped.threshold, model=shipped.model)
