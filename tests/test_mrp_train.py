"""MRP head training: the losses' states, learning beats the no-residual baseline, exact resume,
config errors, and the exported backbone + head directory."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import dlmjax
from dlmjax.config import ModelConfig
from dlmjax.heads.mrp import load_head
from dlmjax.io.hf import export_model, load_model
from dlmjax.models.fused import split_gate_up, split_qkv
from dlmjax.models.transformer import init_model
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.train import unfused
from dlmjax.train.loop import make_optimizer, train
from dlmjax.train.mrp import kl_per_position, per_position_loss, reveal
from dlmjax.train.objectives import mask_blocks


CONFIG = "configs/mrp/toy-sdar.yaml"
TINY = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
            max_position_embeddings=128, qk_norm=True, tie_word_embeddings=True)


def tiny_backbone(path, attention="block_causal", num_layers=2, weight_std=0.02, **changes):
    """A random toy-tokenizer backbone (matrices ~ N(0, weight_std)) exported as a checkpoint directory."""
    ids = save_char_tokenizer(path)
    fields = dict(vocab_size=ids["vocab_size"], mask_token_id=ids["mask"], eos_token_ids=(ids["eos"],),
                  pad_token_id=ids["pad"], family="sdar" if attention == "block_causal" else "qwen3",
                  attention=attention, block_size=4, num_layers=num_layers, **TINY)
    cfg = ModelConfig(**{**fields, **changes})
    graphdef, state = nnx.split(init_model(cfg, seed=0))  # matrices ~ N(0, 0.02)
    state = jax.tree.map(lambda x: x * (weight_std / 0.02) if x.ndim >= 2 else x, state)
    return export_model(nnx.merge(graphdef, state), path)  # the tokenizer is already there


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return tiny_backbone(tmp_path_factory.mktemp("backbone"))


def tiny_overrides(backbone_dir, steps=6):
    # One task: its batches have one width, so each run compiles its step once.
    return [f"backbone={backbone_dir}", "mrp.num_layers=1", f"train.steps={steps}", "train.batch_size=8",
            "train.log_every=1", "train.checkpoint_every=3", "train.eval_every=0", "train.warmup_steps=2",
            "data.tasks={toy-constraint: 1}", "mrp.loss=kd_diff_sum", "mrp.chain_steps=2"]


def test_the_training_step_makes_logits_for_the_noisy_half_only(backbone):
    """The head's loss and gradient over [noisy ; clean] (two chain steps) hold no vocabulary-wide
    array with more rows than batch x length: the clean half's residual logits are not made. (The
    invariant numerics mode, on an accelerator, computes whole tiles of rows: 2 here.)"""
    from dlmjax.heads.mrp import init_head
    from hlo import logits_rows
    from dlmjax.train.mrp import mrp_loss

    model = load_model(backbone)
    cfg = model.config
    b, l = 2, 24
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size - 1, (b, l)), jnp.int32)
    batch = dict(tokens=tokens, valid=jnp.ones((b, l), bool), target=jnp.ones((b, l), bool))
    graphdef, state = nnx.split(init_head(cfg, num_layers=1, num_modules=2, seed=0))

    def loss(state):
        return mrp_loss(nnx.merge(graphdef, state), model, batch, jax.random.key(0), block=cfg.block_size,
                        mask_id=cfg.mask_token_id, loss="kd_diff_sum", chain_steps=2)[0]

    with dlmjax.numerics(row_tile=2):
        hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    made = logits_rows(hlo, cfg)
    assert made and max(made) <= b * l, made


@pytest.fixture(scope="module")
def straight(backbone, tmp_path_factory):
    """A 6-step run, uninterrupted."""
    run = load_run_config(CONFIG, tiny_overrides(backbone))
    return run, train(run, tmp_path_factory.mktemp("straight") / "run", progress=False)


def flat(module):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module))}


def test_reveal_uncovers_gt_topk_masked_positions_per_block():
    clean = jnp.arange(10, 26, dtype=jnp.int32).reshape(2, 8)
    masked = jnp.array([[1, 1, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]], bool)
    noisy = jnp.where(masked, 2, clean)
    tokens, still = reveal(jax.random.key(0), clean, noisy, masked, block=4, count=2)
    revealed = np.asarray(masked & ~still)
    assert revealed.reshape(2, 2, 4).sum(-1).tolist() == [[2, 1], [0, 2]]  # 2 per block, all if fewer
    np.testing.assert_array_equal(np.asarray(tokens)[revealed], np.asarray(clean)[revealed])
    np.testing.assert_array_equal(np.asarray(tokens)[np.asarray(still)], 2)


def test_mask_rate_is_one_per_row_by_default_and_one_per_block_on_request():
    """The MRP reference draws one noise level per sample (row); the backbone objective one per
    (row, block). Rows of 64 tokens in blocks of 4; prompt tokens are never masked."""
    b, l = 6, 64
    tokens = jnp.arange(b * l, dtype=jnp.int32).reshape(b, l) % 50 + 3
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    target = positions >= 8
    rates = {}
    for rate in ("per_row", "per_block"):
        noisy, masked, t = mask_blocks(jax.random.key(3), tokens, target, positions, block=4, mask_id=1, rate=rate)
        t = np.asarray(t)
        assert ((t >= 1e-3) & (t <= 1)).all()
        np.testing.assert_array_equal(np.asarray(noisy), np.where(np.asarray(masked), 1, np.asarray(tokens)))
        assert not np.asarray(masked)[:, :8].any()
        rates[rate] = t
    assert (rates["per_row"] == rates["per_row"][:, :1]).all()
    per_block = rates["per_block"].reshape(b, -1, 4)
    assert (per_block == per_block[..., :1]).all() and len(np.unique(per_block[0, :, 0])) == l // 4
    assert load_run_config(CONFIG, []).mrp.mask_rate == "per_block"  # the shipped head's recipe
    assert load_run_config(CONFIG, ["mrp.mask_rate=per_row"]).mrp.mask_rate == "per_row"
    with pytest.raises(RunConfigError, match="per_row"):
        load_run_config(CONFIG, ["mrp.mask_rate=per_sample"])
    with pytest.raises(ValueError, match="per_row"):
        mask_blocks(jax.random.key(3), tokens, target, positions, block=4, mask_id=1, rate="per_sample")


def test_per_position_losses():
    rng = np.random.default_rng(0)
    logits, target = (jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32) for _ in range(2))
    tokens = jnp.asarray(rng.integers(0, 7, (2, 3)), jnp.int32)
    for kind in ("kd_diff", "mse"):
        np.testing.assert_allclose(per_position_loss(kind, target, target, tokens, 2.0), 0.0, atol=1e-6)
        assert (per_position_loss(kind, logits, target, tokens, 2.0) > 0).all()
    kl_t2 = per_position_loss("kd_diff", logits, target, tokens, 2.0)
    np.testing.assert_allclose(kl_t2, kl_per_position(target / 2, logits / 2) * 4, rtol=1e-5)  # T^2 KL at T
    ce = per_position_loss("ce", logits, target, tokens, 1.0)
    np.testing.assert_allclose(ce, -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0],
                               rtol=1e-5)
    with pytest.raises(ValueError, match="kd_diff_sum"):
        per_position_loss("kl", logits, target, tokens, 1.0)


def test_training_beats_the_no_residual_baseline(tmp_path):
    """A one-layer head on a one-layer random backbone, trained for 100 steps, predicts the
    backbone's logits after a reveal far better than the logits before it. (The backbone's weights
    are large, std 0.3, so that a reveal visibly moves the other positions' logits; at std 0.02 it
    barely does.)"""
    backbone = tiny_backbone(tmp_path / "backbone", num_layers=1, weight_std=0.3)
    run = load_run_config(CONFIG, tiny_overrides(backbone, steps=100) + [
        "train.batch_size=16", "train.lr=1e-2", "train.warmup_steps=5", "train.checkpoint_every=1000",
        "train.eval_every=100", "train.eval_examples=16", "mrp.init_norm_scale=0", "mrp.loss=kd_diff",
        "mrp.chain_steps=1",
    ])
    train(run, tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl"] == records[0]["kl_baseline"]  # init_norm_scale 0: no residual at step 1
    late = [r for r in records if r["step"] > 60 and "kl" in r]  # the training batches of the last 40 steps
    kl, baseline = np.mean([r["kl"] for r in late]), np.mean([r["kl_baseline"] for r in late])
    assert kl < 0.5 * baseline, (kl, baseline)
    held_out = records[-1]  # eval on fixed held-out batches at the last step
    assert held_out["eval/toy-constraint/kl"] < 0.7 * held_out["eval/toy-constraint/kl_baseline"], held_out


def test_interrupted_training_resumes_exactly(tmp_path, straight):
    run, straight = straight
    first = train(run, tmp_path / "resumed", stop_at=4, progress=False)  # as if killed after step 4
    assert first.step == 4 and first.model_dir is None
    second = train(run, tmp_path / "resumed", progress=False)
    assert sorted(second.losses) == [5, 6]
    for step in (5, 6):
        assert second.losses[step] == straight.losses[step]  # bit for bit
    a, b = flat(load_head(straight.model_dir)), flat(load_head(second.model_dir))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    lines = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "kl", "kl_baseline", "grad_norm", "lr", "tokens_per_s"} <= set(lines[0])


def _unfuse_last_checkpoint(run_dir, num_kv_heads=2, head_dim=8):
    """Rewrite the run's last checkpoint as a run from before q/k/v and gate/up were fused wrote it
    (params and optimiser moments under attn.{q,k,v} and mlp.{gate,up})."""
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), item_handlers=ocp.StandardCheckpointHandler())
    step = manager.latest_step()
    saved = manager.restore(step, args=ocp.args.StandardRestore())  # as saved: nested dicts and lists
    splits = {"qkv": (("q", "k", "v"), lambda a: split_qkv(a, num_kv_heads, head_dim)),
              "gate_up": (("gate", "up"), split_gate_up)}

    def unfuse(node):
        if isinstance(node, (list, tuple)):
            return [unfuse(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in splits:
                names, split = splits[key]
                for i, name in enumerate(names):
                    out[name] = jax.tree.map(lambda a, i=i: np.ascontiguousarray(split(np.asarray(a))[i]), value)
            else:
                out[key] = unfuse(value)
        return out

    manager.delete(step)
    manager.save(step, args=ocp.args.StandardSave(unfuse(saved)))
    manager.wait_until_finished()
    manager.close()
    return step


def test_a_run_saved_before_fused_projections_resumes_exactly(tmp_path, straight):
    run, straight = straight
    train(run, tmp_path / "old", stop_at=4, progress=False)
    step = _unfuse_last_checkpoint(tmp_path / "old")
    manager = ocp.CheckpointManager((tmp_path / "old" / "checkpoints").absolute(),
                                    item_handlers=ocp.StandardCheckpointHandler())
    assert unfused.is_unfused(manager, step)  # the old layout really is on disk
    manager.close()
    resumed = train(run, tmp_path / "old", progress=False)  # converted on restore
    assert sorted(resumed.losses) == list(range(step + 1, 7))
    for s in resumed.losses:
        assert resumed.losses[s] == straight.losses[s]  # bit for bit
    a, b = flat(load_head(straight.model_dir)), flat(load_head(resumed.model_dir))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_export_holds_the_frozen_backbone_and_the_trained_head(backbone, straight):
    run, result = straight
    model = load_model(result.model_dir)
    source = load_model(backbone)
    for name, value in flat(source).items():
        np.testing.assert_array_equal(flat(model)[name], value, err_msg=name)  # frozen: unchanged
    assert (result.model_dir / "tokenizer.json").is_file()

    head = load_head(result.model_dir, model.config)
    assert head.config.num_layers == 1 and head.config.num_modules == 1
    # The head equals the trained params of the last checkpoint (restored into the head's structure).
    params = nnx.state(head)
    tx, _ = make_optimizer(run.train)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            {"params": params, "opt_state": jax.eval_shape(tx.init, params)})
    manager = ocp.CheckpointManager((result.run_dir / "checkpoints").absolute())
    trained = manager.restore(6, args=ocp.args.StandardRestore(abstract))["params"]
    expected = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(trained)}
    loaded = flat(head)
    assert loaded.keys() == expected.keys()
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert np.abs(loaded["mrp_modules.0.norm.scale"]).max() > 0  # trained away from its init (init_norm_scale 0)


def _dtypes(module) -> set[str]:
    return {str(v.get_value().dtype) for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def test_a_head_on_a_bf16_backbone_trains_in_float32(tmp_path):
    """The head's weights (and so its Adam moments) are float32 whatever the backbone computes in:
    in bf16 an update below 2^-9 of a weight near 1 rounds away (a norm scale never moved)."""
    from dlmjax.train.loop import mrp_trainee

    run = load_run_config(CONFIG, tiny_overrides(tiny_backbone(tmp_path / "b", dtype="bfloat16")))
    trainee = mrp_trainee(run, tmp_path / "run")
    assert trainee.frozen.config.dtype == "bfloat16"
    assert _dtypes(trainee.build()) == _dtypes(trainee.abstract) == {"float32"}


@pytest.mark.parametrize("config, overrides, message", [
    (CONFIG, ["drafter.block_size=4"], "the `drafter` section belongs to objective drafter, not mrp"),
    (CONFIG, ["tspd.hidden=8"], "the `tspd` section belongs to objective tspd, not mrp"),
    ("configs/drafter/toy-ar.yaml", ["tspd.hidden=8"], "the `tspd` section belongs to objective tspd, not drafter"),
    (CONFIG, ["train.loss_weighting=inverse_t"], "objective mrp does not read it"),
    ("configs/drafter/toy-ar.yaml", ["train.eval_examples=8"], "evaluates on drafter.eval_prompts"),
    ("configs/tspd/toy-sdar.yaml", ["data.seq_len=32"], "data.tasks, data.files and data.seq_len are not read"),
    (CONFIG, ["mrp.num_modules=3", "mrp.chain_steps=1"], "modules 1..2 would never train"),
    (CONFIG, ["mrp.residual_scale=0"], "mrp.residual_scale"),
], ids=["mrp+drafter", "mrp+tspd", "drafter+tspd", "loss_weighting", "eval_examples", "tspd-data", "untrained-modules",
        "no-residual"])
def test_settings_that_would_be_ignored_or_train_nothing_are_refused(config, overrides, message):
    with pytest.raises(RunConfigError, match=message):
        load_run_config(config, overrides)


@pytest.mark.parametrize("loss, gt_topk, chain_steps", [("kd_diff_sum", 4, 1), ("kd_diff", 2, 2),
                                                      ("kd_diff_sum", 2, 2)])
def test_reveals_that_leave_nothing_masked_are_refused(tmp_path, backbone, loss, gt_topk, chain_steps):
    """gt_topk reveals per chain step; on blocks of 4 these leave no position to supervise at the
    last step (a _sum loss's last step would add a zero term, and its module would never train)."""
    run = load_run_config(CONFIG, tiny_overrides(backbone) + [f"mrp.loss={loss}", f"mrp.gt_topk={gt_topk}",
                                                              f"mrp.chain_steps={chain_steps}"])
    with pytest.raises(RunConfigError, match="reveals every position of the backbone's blocks of 4"):
        train(run, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_config_errors_are_clear(tmp_path, backbone):
    run = load_run_config(CONFIG, ["mrp.num_layers=2", "mrp.loss=ce_sum"])
    assert run.mrp.num_layers == 2 and run.mrp.loss == "ce_sum" and run.backbone == "toy-sdar"
    with pytest.raises(RunConfigError, match="model section must be empty"):
        load_run_config(CONFIG, ["model.hidden_size=64"])
    with pytest.raises(RunConfigError, match="known:.*num_layers"):
        load_run_config(CONFIG, ["mrp.num_layer=2"])
    with pytest.raises(RunConfigError, match="kd_diff_sum"):
        load_run_config(CONFIG, ["mrp.loss=kl"])
    with pytest.raises(RunConfigError, match="objective mrp"):
        load_run_config("configs/toy-sdar.yaml", ["backbone=toy-sdar"])
    with pytest.raises(RunConfigError, match="needs `backbone:`"):
        load_run_config(CONFIG, ["backbone=null"])
    causal = tiny_backbone(tmp_path / "causal", attention="causal")
    with pytest.raises(RunConfigError, match="block-causal"):
        train(load_run_config(CONFIG, tiny_overrides(causal)), tmp_path / "run", progress=False)
    with pytest.raises(RunConfigError, match="neither a checkpoint directory nor a preset"):
        train(load_run_config(CONFIG, tiny_overrides(tmp_path / "missing")), tmp_path / "run2", progress=False)
    shifted = tiny_backbone(tmp_path / "shifted", family="fast_dllm_v2", shift_logits=True, qkv_bias=True,
                            qk_norm=False)
    with pytest.raises(RunConfigError, match="shifts its logits"):
        train(load_run_config(CONFIG, tiny_overrides(shifted)), tmp_path / "run3", progress=False)
