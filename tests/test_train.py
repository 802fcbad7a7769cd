"""Training infrastructure: data, the block-diffusion layout, configs, exact resume, metrics."""

import json
import re
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlmjax
from dlmjax.config import ModelConfig
from dlmjax.io.hf import load_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.models.transformer import init_model
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.train.data import DataError, encode_row, make_batch, sample_examples
from dlmjax.train.loop import make_optimizer, train
from dlmjax.train.objectives import block_diffusion_loss, block_diffusion_visibility, mask_blocks, noisy_half_hidden

TINY_MODEL = dict(family="sdar", attention="block_causal", block_size=4, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, qk_norm=True,
                  tie_word_embeddings=True)


def tiny_overrides(tmp_steps=6):
    return [f"train.steps={tmp_steps}", "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=3",
            "train.eval_every=0", "train.warmup_steps=2", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_layers=2", "model.head_dim=8", "model.block_size=4", "train.init_from=null"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(path)
    return load_tokenizer(path)


def test_batches_are_a_function_of_seed_and_step(tokenizer):
    a = make_batch(sample_examples({"toy-arith": 1, "toy-constraint": 1}, 8, 0, 5), tokenizer, seq_len=64, block=8, pad_id=0)
    b = make_batch(sample_examples({"toy-arith": 1, "toy-constraint": 1}, 8, 0, 5), tokenizer, seq_len=64, block=8, pad_id=0)
    c = make_batch(sample_examples({"toy-arith": 1, "toy-constraint": 1}, 8, 0, 6), tokenizer, seq_len=64, block=8, pad_id=0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens) or a.tokens.shape != c.tokens.shape


def test_encode_row_fills_the_eos_block_and_marks_the_target():
    tokens, valid, target = encode_row([5, 6, 7], [8, 9], eos_id=1, pad_id=0, seq_len=16, block=4)
    assert tokens.tolist() == [5, 6, 7, 8, 9, 1, 1, 1] + [0] * 8  # EOS to the end of its block, then padding
    assert valid.tolist() == [True] * 8 + [False] * 8
    assert target.tolist() == [False] * 3 + [True] * 5 + [False] * 8
    ar_tokens, ar_valid, _ = encode_row([5, 6, 7], [8, 9], eos_id=1, pad_id=0, seq_len=8, block=None)
    assert ar_tokens[:6].tolist() == [5, 6, 7, 8, 9, 1] and ar_valid.sum() == 6
    with pytest.raises(DataError, match="raise seq_len"):
        encode_row(list(range(10)), [1, 2], eos_id=1, pad_id=0, seq_len=8, block=4)


@pytest.mark.parametrize("shift", [False, True])
def test_block_diffusion_layout_matches_decoding(shift):
    """The noisy copy of block b sees exactly what decoding sees: clean blocks < b and the noisy
    block itself; so the logits that score its tokens equal a plain block-causal forward over
    [clean < b, noisy b], also for a shifted-logit model (Fast-dLLM v2), whose block's first
    position is scored from the clean block before (`noisy_half_hidden`)."""
    cfg = ModelConfig(vocab_size=40, mask_token_id=2, eos_token_ids=(1,), pad_token_id=0, shift_logits=shift,
                      **TINY_MODEL)
    model = init_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, 40, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    target = positions >= 3
    noisy, masked, _ = mask_blocks(jax.random.key(1), tokens, target, positions, block=4, mask_id=2)
    valid = jnp.ones((2, 12), bool)
    out = model(jnp.concatenate([noisy, tokens], 1), jnp.concatenate([positions, positions], 1),
                visible_bll=block_diffusion_visibility(positions, valid, 4), compute_logits=False)
    logits = model.lm_logits(noisy_half_hidden(out.hidden, 4, shift))
    for b in range(3):
        seq = jnp.concatenate([tokens[:, : 4 * b], noisy[:, 4 * b : 4 * b + 4]], axis=1)
        ref = model(seq).logits[:, 4 * b : 4 * b + 4]
        np.testing.assert_allclose(logits[:, 4 * b : 4 * b + 4], ref, atol=1e-5)


def test_loss_weightings_and_bad_weighting(tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id, eos_token_ids=(tokenizer.eos_id,),
                      pad_token_id=tokenizer.pad_id, **TINY_MODEL)
    model = init_model(cfg)
    batch = vars(make_batch(sample_examples({"toy-arith": 1}, 4, 0, 1), tokenizer, seq_len=64, block=4, pad_id=0))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    plain, _ = block_diffusion_loss(model, batch, jax.random.key(0), block=4, mask_id=cfg.mask_token_id)
    weighted, _ = block_diffusion_loss(model, batch, jax.random.key(0), block=4, mask_id=cfg.mask_token_id,
                                       weighting="inverse_t")
    assert np.isfinite(plain) and np.isfinite(weighted) and not np.isclose(plain, weighted)
    assert abs(float(plain) - np.log(cfg.vocab_size)) < 0.5  # random init: about uniform
    with pytest.raises(ValueError, match="inverse_t"):
        block_diffusion_loss(model, batch, jax.random.key(0), block=4, mask_id=cfg.mask_token_id, weighting="1/t")


@pytest.mark.parametrize("objective", ["block_diffusion", "next_token"])
def test_the_losses_hold_a_chunk_of_logits_and_equal_full_cross_entropy(tokenizer, monkeypatch, objective):
    """Both objectives read log p(token) and the argmax a chunk of positions' logits at a time
    (losses.label_scores_from_hidden; 7 positions of each of the 2 rows here): loss, accuracy and
    gradient equal one chunk over every position, the compiled loss-and-gradient holds no wider
    vocabulary array, and the next-token loss equals optax's cross-entropy of the model's logits.
    (The invariant numerics mode, on an accelerator, computes whole tiles of rows: 2 here.)"""
    import optax

    from dlmjax import losses
    from dlmjax.train.objectives import next_token_loss
    from hlo import logits_rows

    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id, eos_token_ids=(tokenizer.eos_id,),
                      pad_token_id=tokenizer.pad_id, **TINY_MODEL)
    graphdef, state = nnx.split(init_model(cfg, seed=2))
    batch = vars(make_batch(sample_examples({"toy-arith": 1}, 2, 0, 1), tokenizer, seq_len=64, block=4, pad_id=0))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    loss_fn = {"block_diffusion": lambda m: block_diffusion_loss(m, batch, jax.random.key(0), block=4,
                                                                 mask_id=cfg.mask_token_id),
               "next_token": lambda m: next_token_loss(m, batch)}[objective]
    runs = {}
    for width in (7, 64):  # 64: every position of a row in one chunk
        monkeypatch.setattr(losses, "LOGITS_CHUNK_BYTES", 2 * width * 4 * cfg.vocab_size)
        run = jax.jit(lambda st: jax.value_and_grad(lambda x: loss_fn(nnx.merge(graphdef, x)), has_aux=True)(st))
        with dlmjax.numerics(row_tile=2):
            runs[width] = run(state), max(logits_rows(run.lower(state).compile().as_text(), cfg))
    ((loss, metrics), grads), made = runs[7]
    ((whole, whole_metrics), whole_grads), whole_made = runs[64]
    assert made == 14 and whole_made > 14
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-6)
    assert float(metrics["token_accuracy"]) == float(whole_metrics["token_accuracy"])
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    if objective == "next_token":
        logits = nnx.merge(graphdef, state)(batch["tokens"], valid_bl=batch["valid"]).logits[:, :-1]
        m = batch["target"][:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        np.testing.assert_allclose(float(loss), float(jnp.sum(ce * m) / jnp.sum(m)), rtol=1e-5)


def test_config_overrides_and_errors(tmp_path):
    run = load_run_config("configs/toy-sdar.yaml", ["train.lr=1e-4", "data.tasks={toy-arith: 1}", "model.block_size=4"])
    assert run.train.lr == 1e-4 and run.data.tasks == {"toy-arith": 1} and run.model["block_size"] == 4
    with pytest.raises(RunConfigError, match="known:.*steps"):
        load_run_config("configs/toy-sdar.yaml", ["train.stpes=5"])
    with pytest.raises(RunConfigError, match="key=value"):
        load_run_config("configs/toy-sdar.yaml", ["train.steps"])
    with pytest.raises(RunConfigError, match="inverse_t"):
        load_run_config("configs/toy-sdar.yaml", ["train.loss_weighting=elbo"])
    with pytest.raises(RunConfigError, match="not found"):
        load_run_config(tmp_path / "nope.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(RunConfigError, match="empty.yaml is empty; start from one in configs/"):
        load_run_config(tmp_path / "empty.yaml")
    with pytest.raises(RunConfigError, match="block_causal"):
        load_run_config("configs/toy-sdar.yaml", ["model.attention=causal"])
    # the model section: numbers as YAML writes them, its errors named with the file at load
    run = load_run_config("configs/toy-sdar.yaml", ["model.rope_theta=1e6", "model.rms_norm_eps=1e-5",
                                                    "data.tasks={toy-arith: 1e-1}"])
    assert run.model["rope_theta"] == 1e6 and run.model["rms_norm_eps"] == 1e-5 and run.data.tasks["toy-arith"] == 0.1
    for override, message in [("model.vocab_size=100", r"model keys \['vocab_size'\] come from the toy character "
                                                       "tokenizer"),
                               ("model.eos_token_ids=[3]", r"\['eos_token_ids'\] come from the toy"),
                               ("model.family=qwen", r"model: model.family='qwen' is unknown; families: qwen3, "),
                               ("model.num_heads=3", r"configs/toy-sdar.yaml with the overrides model.num_heads=3: model: num_attention_heads=3 is not a "
                                                     "multiple")]:
        with pytest.raises(RunConfigError, match=message):
            load_run_config("configs/toy-sdar.yaml", [override])
    # a section left empty in the file still takes overrides
    empty = tmp_path / "empty-train.yaml"
    empty.write_text(Path("configs/toy-sdar.yaml").read_text().split("train:")[0] + "train:\n  # steps: 100\n")
    assert load_run_config(empty, ["train.steps=100"]).train.steps == 100


def _read_tb_scalars(tb_dir):
    """Parse TensorBoard event files (TFRecord framing + Event protos) into {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.parametrize("config", ["configs/toy-sdar.yaml", "configs/toy-ar.yaml"])
def test_interrupted_training_resumes_exactly(tmp_path, config):
    run = load_run_config(config, tiny_overrides())
    straight = train(run, tmp_path / "straight", progress=False)
    first = train(run, tmp_path / "resumed", stop_at=4, progress=False)  # as if killed after step 4
    assert first.step == 4 and first.model_dir is None
    shutil.rmtree(tmp_path / "resumed" / "tb")  # a kill loses the events TensorBoard's writer still queued
    second = train(run, tmp_path / "resumed", progress=False)
    assert sorted(second.losses) == [5, 6]
    for step in (5, 6):
        assert second.losses[step] == straight.losses[step]  # same next loss, bit for bit
    a = load_model(straight.model_dir)
    b = load_model(second.model_dir)
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))

    lines = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(lines[0])
    scalars = _read_tb_scalars(tmp_path / "straight" / "tb")
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5, 6]
    assert scalars["loss"][-1][1] == pytest.approx(straight.losses[6], rel=1e-6)
    resumed = _read_tb_scalars(tmp_path / "resumed" / "tb")  # rebuilt from metrics.jsonl on resume
    assert [s for s, _ in resumed["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in resumed["loss"]] == pytest.approx([v for _, v in scalars["loss"]], rel=1e-6)
    assert (straight.model_dir / "tokenizer.json").is_file()


def test_a_step_that_fails_on_the_device_reports_its_own_error_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """Step 5 fails while running (here a host callback in its loss raises): its inputs, step 4's
    state, were donated to it, so step 4 cannot be checkpointed. The error raised is the step's
    (it was hidden behind the save's "Array has been deleted"), no half-written checkpoint is
    left, and a rerun resumes from step 3 exactly."""
    import jax
    import jax.numpy as jnp

    import dlmjax.train.loop as loop

    # one device: the host callback runs once a step (on 8, a device whose callback raised would
    # leave the others waiting in the gradient's all-reduce)
    run = load_run_config("configs/toy-sdar.yaml", tiny_overrides() + ["mesh.data=1"])
    straight = train(run, tmp_path / "straight", progress=False)
    real, calls = loop.make_loss, []

    def failing_loss(run, cfg):
        loss_fn = real(run, cfg)

        def fail_on_fifth_call(x):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("the device failed in step 5")
            return np.float32(0)

        def loss(model, batch, key):
            value, metrics = loss_fn(model, batch, key)
            extra = jax.pure_callback(fail_on_fifth_call, jax.ShapeDtypeStruct((), jnp.float32),
                                      jax.lax.stop_gradient(value))
            return value, {**metrics, "loss": metrics["loss"] + extra}

        return loss

    monkeypatch.setattr(loop, "make_loss", failing_loss)
    with pytest.raises(Exception, match="the device failed in step 5"):
        train(run, tmp_path / "failed", progress=False)
    assert "step 4 was not checkpointed" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "failed" / "checkpoints").iterdir()) == ["3"]
    monkeypatch.setattr(loop, "make_loss", real)
    resumed = train(run, tmp_path / "failed", progress=False)
    assert sorted(resumed.losses) == [4, 5, 6]
    assert all(resumed.losses[step] == straight.losses[step] for step in (4, 5, 6))


def test_a_run_stopped_by_a_data_error_takes_the_fix_it_names(tmp_path, capsys):
    """Toy rows longer than data.seq_len stop the run before its first step with "raise seq_len".
    Found where a batch first held one (here step 15, after checkpoints at 5 and 10, for toy-arith
    drawn one step in ten), the raised seq_len was refused as another run's config."""
    from dlmjax.train.data import DataError

    base = ["backbone=random-sdar", "train.steps=3", "train.batch_size=8", "train.eval_every=0", "mrp.num_layers=1",
            "data.tasks={toy-arith: 0.1, toy-constraint: 0.9}", "train.checkpoint_every=1"]
    with pytest.raises(DataError, match=r"rows of 48 tokens but data.seq_len=40; raise data.seq_len in the config "
                                        r"\(e.g. seq_len=48\)"):
        train(load_run_config("configs/mrp/toy-sdar.yaml", base + ["data.seq_len=40"]), tmp_path, progress=False)
    assert not [p for p in (tmp_path / "checkpoints").glob("*") if p.name.isdigit()]
    run = load_run_config("configs/mrp/toy-sdar.yaml", base + ["data.seq_len=48"])
    fixed = train(run, tmp_path, progress=False)
    assert fixed.step == 3 and fixed.model_dir is not None
    # the config's warmup outlasts these 3 steps: the run says its rate never reaches train.lr, and
    # names the rate its last step applied (step s applies schedule(s))
    note = re.search(r"train.warmup_steps=\d+ > train.steps=3: the learning rate rises for the whole run and "
                     r"peaks at ([0-9.e-]+), not train.lr=", capsys.readouterr().err)
    assert note and float(note.group(1)) == pytest.approx(float(make_optimizer(run.train)[1](3)), rel=5e-3)


def test_a_resume_refuses_a_changed_backbone_and_finds_it_from_any_directory(tmp_path, monkeypatch):
    """The frozen backbone an MRP head trains against is recorded (sha256) like its data: a backbone
    re-exported between a kill and the resume is refused, not trained against silently. It is
    recorded by its absolute path, so the resume may run from another working directory."""
    from dlmjax.io.safetensors import SafetensorsFile, save_file
    from dlmjax.presets import resolve_model
    from dlmjax.validation import InputError

    shutil.copytree(resolve_model("toy-sdar"), tmp_path / "bb")
    monkeypatch.chdir(tmp_path)
    overrides = ["backbone=bb", "train.steps=3", "train.batch_size=8", "train.eval_every=0", "mrp.num_layers=1",
                 "train.checkpoint_every=1"]
    run = load_run_config(Path(__file__).parents[1] / "configs/mrp/toy-sdar.yaml", overrides)
    assert run.backbone == str(tmp_path / "bb")
    train(run, tmp_path / "run", stop_at=1, progress=False)
    monkeypatch.chdir(tmp_path / "run")  # elsewhere: the stored config still names the backbone
    again = load_run_config("config.yaml")
    assert again == run
    shard = tmp_path / "bb" / "model.safetensors"
    shutil.copy(shard, tmp_path / "kept.safetensors")
    tensors = {k: np.array(SafetensorsFile(shard).get(k)) for k in SafetensorsFile(shard).keys()}
    save_file({k: v * 0.5 if k.endswith("norm.weight") else v for k, v in tensors.items()}, shard)
    with pytest.raises(InputError, match=r"backbone file .*bb/model.safetensors has changed since this run began"):
        train(again, tmp_path / "run", progress=False)
    shutil.copy(tmp_path / "kept.safetensors", shard)  # restored: the run resumes
    assert train(again, tmp_path / "run", progress=False).step == 3


def logged_steps_after_a_ctrl_c(tmp_path, monkeypatch, owner, name, interrupting):
    """A toy-sdar run (logging every 2 steps) stopped by `owner.name = interrupting` raising
    KeyboardInterrupt, then resumed: (the resumed run's result, the steps of metrics.jsonl's rows)."""
    run = load_run_config("configs/toy-sdar.yaml", tiny_overrides() + ["train.log_every=2", "train.checkpoint_every=5"])
    monkeypatch.setattr(owner, name, interrupting)
    with pytest.raises(KeyboardInterrupt):
        train(run, tmp_path / "run", progress=False)
    monkeypatch.undo()
    resumed = train(run, tmp_path / "run", progress=False)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return resumed, [line["step"] for line in lines if "loss" in line]


def test_ctrl_c_right_after_a_log_step_keeps_its_checkpoint_and_its_log_row(tmp_path, monkeypatch):
    """Ctrl-C between a step and its log row: the step is checkpointed and its row written, so the
    resumed run's metrics.jsonl has every log step once."""
    import dlmjax.train.loop as loop

    class CtrlCAfterStep4(loop.tqdm):
        steps = 0

        def update(self, n=1):
            super().update(n)
            CtrlCAfterStep4.steps += n
            if CtrlCAfterStep4.steps == 4:  # step 4 is done, its row not yet written
                raise KeyboardInterrupt

    resumed, logged = logged_steps_after_a_ctrl_c(tmp_path, monkeypatch, loop, "tqdm", CtrlCAfterStep4)
    assert resumed.losses.keys() == {6}  # resumed after step 4
    assert logged == [2, 4, 6]


def test_ctrl_c_during_a_log_rows_tensorboard_flush_writes_the_row_once(tmp_path, monkeypatch):
    """Ctrl-C after step 4's row reached metrics.jsonl, while TensorBoard flushed it: the row was
    written again on the way out (the resumed log held step 4 twice)."""
    from dlmjax.train.metrics import MetricsLog

    flush = MetricsLog._add_scalars

    def ctrl_c_at_step_4(self, row):
        flush(self, row)
        if row["step"] == 4 and "loss" in row and not getattr(self, "stopped", False):
            self.stopped = True
            raise KeyboardInterrupt

    _, logged = logged_steps_after_a_ctrl_c(tmp_path, monkeypatch, MetricsLog, "_add_scalars", ctrl_c_at_step_4)
    assert logged == [2, 4, 6]


def test_stops_anywhere_leave_the_log_of_the_uninterrupted_run(tmp_path, monkeypatch):
    """Stopped after a step that logs nothing (stop_at=3), by Ctrl-C inside step 4's evaluation,
    and killed mid-write of a log line: the resumed run's metrics.jsonl has the uninterrupted run's
    rows, evaluations included (an interrupted evaluation runs again on resume)."""
    import dlmjax.train.loop as loop

    run = load_run_config("configs/toy-sdar.yaml", tiny_overrides() + [
        "train.log_every=2", "train.eval_every=2", "train.eval_examples=2", "train.checkpoint_every=5"])

    def rows(run_dir):
        return [(r["step"], "eval" if any(k.startswith("eval/") for k in r) else "train")
                for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]

    train(run, tmp_path / "straight", progress=False)
    train(run, tmp_path / "run", stop_at=3, progress=False)
    assert rows(tmp_path / "run") == [(2, "train"), (2, "eval")]  # no row for step 3, which logs nothing
    calls = []

    def ctrl_c_in_the_second_evaluation(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return 0.5

    monkeypatch.setattr(loop, "toy_accuracy", ctrl_c_in_the_second_evaluation)
    with pytest.raises(KeyboardInterrupt):
        train(run, tmp_path / "run", progress=False)
    monkeypatch.undo()
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.2')  # a kill mid-write
    train(run, tmp_path / "run", progress=False)
    assert rows(tmp_path / "run") == rows(tmp_path / "straight") == [
        (2, "train"), (2, "eval"), (4, "train"), (4, "eval"), (6, "train"), (6, "eval")]


def test_each_step_applies_the_rate_it_logs_and_the_first_one_moves_the_weights():
    """With its moments zeroed, Adam's update at step s is lr * a_s * sign(gradient), a_s the ratio
    of the bias corrections (1 at the first step; a vector takes no weight decay), so the change of
    each step reads off the rate it applied."""
    import jax
    import optax

    from dlmjax.train.config import OptimConfig
    from dlmjax.train.loop import make_optimizer

    cfg = OptimConfig(steps=4, lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    tx, schedule = make_optimizer(cfg)
    assert float(schedule(1)) > 0
    for step in range(1, cfg.steps + 1):
        params = {"v": jnp.zeros(3)}
        state = tx.init(params)
        for _ in range(step - 1):  # the moments are reset below, so only the rate carries over
            state = tx.update({"v": jnp.zeros(3)}, state, params)[1]
        state = jax.tree.map(lambda x: jnp.zeros_like(x) if x.dtype == jnp.float32 else x, state)
        updates, _ = tx.update({"v": jnp.array([1.0, -2.0, 3.0])}, state, params)
        moved = optax.apply_updates(params, updates)["v"]
        bias = (1 - 0.9) / (1 - 0.9**step) / np.sqrt((1 - 0.99) / (1 - 0.99**step))  # AdamW's b1, b2
        np.testing.assert_allclose(np.abs(np.asarray(moved)), float(schedule(step)) * bias, rtol=1e-4)
    assert float(schedule(cfg.steps)) == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # the last step: the final rate


def test_resume_refuses_a_different_config(tmp_path):
    train(load_run_config("configs/toy-sdar.yaml", tiny_overrides(2)), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"different config \(train.steps: 2 -> 3\); use a new --out"):
        train(load_run_config("configs/toy-sdar.yaml", tiny_overrides(3)), tmp_path / "run", progress=False)


def test_a_run_stopped_by_a_mistake_before_its_first_checkpoint_takes_the_corrected_config(tmp_path):
    """A mistake found once the run directory is claimed (here: examples longer than seq_len) leaves
    no checkpoint, so rerunning with the fix into the same --out starts the run, not a refusal."""
    from dlmjax.validation import InputError

    with pytest.raises(InputError, match="seq_len"):
        train(load_run_config("configs/toy-sdar.yaml", tiny_overrides(2) + ["data.seq_len=4"]), tmp_path / "run",
              progress=False)
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert train(load_run_config("configs/toy-sdar.yaml", tiny_overrides(2)), tmp_path / "run", progress=False).step == 2


def test_training_lowers_the_loss(tmp_path):
    run = load_run_config("configs/toy-sdar.yaml",
                          tiny_overrides(40) + ["train.lr=1e-2", "data.tasks={toy-constraint: 1}"])
    losses = [loss for _, loss in sorted(train(run, tmp_path / "run", progress=False).losses.items())]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0  # 3.95 -> 1.88 when written


def test_init_from_starts_at_the_source_weights_and_refuses_other_shapes_and_settings(tmp_path):
    source = train(load_run_config("configs/toy-ar.yaml", tiny_overrides(2)), tmp_path / "ar", progress=False)
    run = load_run_config("configs/toy-sdar.yaml", tiny_overrides(0) + [f"train.init_from={source.model_dir}"])
    result = train(run, tmp_path / "sdar", progress=False)  # zero steps: the export is the starting point
    a, b = load_model(source.model_dir), load_model(result.model_dir)
    assert b.config.attention == "block_causal"
    np.testing.assert_array_equal(np.asarray(a.embed[...]), np.asarray(b.embed[...]))
    wider = load_run_config("configs/toy-sdar.yaml", tiny_overrides(1) + ["model.hidden_size=64",
                                                                         f"train.init_from={source.model_dir}"])
    with pytest.raises(ValueError, match="hidden_size: 32 vs 64"):
        train(wider, tmp_path / "wider", progress=False)
    other_rope = load_run_config("configs/toy-sdar.yaml", tiny_overrides(1) + [
        "model.rope_theta=100", "model.rms_norm_eps=0.1", f"train.init_from={source.model_dir}"])
    with pytest.raises(ValueError, match=r"other settings its weights were trained with .*rms_norm_eps: 1e-06 vs "
                                         r"0.1, rope_theta: 10000.0 vs 100"):
        train(other_rope, tmp_path / "other-rope", progress=False)
    # a bf16 source starts a float32 run in float32, as its resume restores it (and losses stay bitwise)
    from dlmjax.io.hf import export_model
    from dlmjax.train.loop import backbone_trainee

    export_model(load_model(source.model_dir, dtype="bfloat16"), tmp_path / "bf16")
    from_bf16 = load_run_config("configs/toy-sdar.yaml", tiny_overrides(1) + [f"train.init_from={tmp_path / 'bf16'}"])
    started = backbone_trainee(from_bf16, tmp_path / "from_bf16").build()
    assert {str(v.get_value().dtype) for _, v in nnx.to_flat_state(nnx.state(started, nnx.Param))} == {"float32"}

    # Resuming restores the checkpoint and does not read init_from again (it may be gone by then).
    staged = load_run_config("configs/toy-sdar.yaml", tiny_overrides(2) + [f"train.init_from={source.model_dir}"])
    assert train(staged, tmp_path / "staged", stop_at=1, progress=False).step == 1
    shutil.rmtree(source.model_dir)
    assert train(staged, tmp_path / "staged", progress=False).step == 2
