"""Drafter training: each loss on a hand-computed example, the chain loss's gradient at the
extremes, the block layout, and a short run on a tiny target that lowers the loss, resumes
exactly and exports a DFlash directory that decodes identically."""

from __future__ import annotations

from functools import partial

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlmjax
from dlmjax.decoding.ar import generate_ar
from dlmjax.decoding.speculative import generate_with_drafter
from dlmjax.io.dflash import load_drafter
from dlmjax.io.hf import load_model
from dlmjax.losses import (
    LossWeights, chain_loss, decay_ce, drafter_loss, first_error_focal, first_error_onehot, label_scores, uniform_ce,
)
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.train.drafter import block_inputs, sample_anchors
from dlmjax.train.loop import train
from test_mrp_train import tiny_backbone


CONFIG = "configs/drafter/toy-ar.yaml"

# Two blocks of K = 3 over a 2-token vocabulary. Block 0: p(label) = 0.8 at k=1, 0.25 at k=2
# (argmax wrong there: the first error). Block 1: p = 0.9, 0.9 (no error).
PROBS = np.array([
    [[0.5, 0.5], [0.8, 0.2], [0.75, 0.25]],
    [[0.5, 0.5], [0.9, 0.1], [0.9, 0.1]],
], np.float32)
LOGITS = jnp.log(jnp.asarray(PROBS))
LABELS = jnp.array([[0, 0, 1], [0, 0, 0]], jnp.int32)
MASK = jnp.array([[False, True, True], [False, True, True]])
SCORES = label_scores(LOGITS, LABELS)
L = math.log


def test_uniform_ce_by_hand():
    expected = (-L(0.8) - L(0.25) - L(0.9) - L(0.9)) / 4
    assert float(uniform_ce(SCORES, MASK)) == pytest.approx(expected, rel=1e-5)


def test_decay_ce_by_hand():
    w2 = math.exp(-1 / 2.0)  # gamma 2: w_1 = 1, w_2 = exp(-1/2)
    expected = (-L(0.8) - w2 * L(0.25) - L(0.9) - w2 * L(0.9)) / (2 + 2 * w2)
    assert float(decay_ce(SCORES, MASK, 2.0)) == pytest.approx(expected, rel=1e-5)


def test_first_error_focal_by_hand():
    np.testing.assert_array_equal(np.asarray(first_error_onehot(SCORES, MASK)),
                                  [[False, False, True], [False, False, False]])
    expected = (1 - 0.25) ** 2 * -L(0.25)  # one block has an error; it is the mean's only term
    assert float(first_error_focal(SCORES, MASK, 2.0)) == pytest.approx(expected, rel=1e-5)


def test_chain_loss_by_hand():
    expected = -((0.8 + 0.8 * 0.25) + (0.9 + 0.9 * 0.9)) / 2
    assert float(chain_loss(SCORES, MASK)) == pytest.approx(expected, rel=1e-5)
    # an unsupervised position ends the chain
    cut = MASK.at[0, 1].set(False)
    assert float(chain_loss(SCORES, cut)) == pytest.approx(-(0.0 + 0.9 + 0.81) / 2, rel=1e-5)


def test_losses_compose_additively():
    w = LossWeights(ce_weight=1.0, decay_gamma=2.0, focal_alpha=0.3, focal_gamma=2.0, chain_alpha=4.0)
    total, parts = drafter_loss(SCORES, MASK, w)
    expected = (decay_ce(SCORES, MASK, 2.0) + 0.3 * first_error_focal(SCORES, MASK, 2.0)
                + 4.0 * chain_loss(SCORES, MASK))
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    base, _ = drafter_loss(SCORES, MASK, LossWeights())
    assert float(base) == pytest.approx(float(uniform_ce(SCORES, MASK)), rel=1e-6)


@pytest.mark.parametrize("label_logit", [-60.0, 60.0], ids=["p->0", "p->1"])
def test_chain_loss_gradient_finite_at_extremes(label_logit):
    logits = jnp.zeros((1, 4, 5)).at[..., 0].set(label_logit)
    labels = jnp.zeros((1, 4), jnp.int32)
    mask = jnp.array([[False, True, True, True]])
    focal = [partial(first_error_focal, focal_gamma=g) for g in (0.0, 0.5, 2.0)]
    for fn in (chain_loss, *focal):
        grad = jax.grad(lambda x: fn(label_scores(x, labels), mask))(logits)
        assert np.isfinite(np.asarray(grad)).all()
    # a confidently right position before the first error (p == 1 in float32) leaves the focal
    # gradient finite for gamma < 1 too, whose (1 - p)^gamma has an infinite slope at p = 1
    right_then_wrong = logits.at[0, 1, 0].set(40.0).at[0, 2].set(jnp.array([0.0, 3.0, 0.0, 0.0, 0.0]))
    for fn in focal:
        grad = jax.grad(lambda x: fn(label_scores(x, labels), mask))(right_then_wrong)
        assert np.isfinite(np.asarray(grad)).all()
    value = float(chain_loss(label_scores(logits, labels), mask))
    assert value == pytest.approx(-3.0 if label_logit > 0 else 0.0, abs=1e-6)


def test_anchors_and_block_layout():
    tokens = jnp.array([[10, 11, 12, 13, 14, 15, 0, 0]], jnp.int32)
    valid = jnp.array([[1, 1, 1, 1, 1, 1, 0, 0]], bool)
    gen = jnp.array([[0, 0, 1, 1, 1, 1, 0, 0]], bool)  # prompt 10 11, generated 12..15
    anchors, ok = sample_anchors(jax.random.key(0), valid, gen, 4)
    assert sorted(np.asarray(anchors)[0][np.asarray(ok)[0]].tolist()) == [2, 3, 4]  # 5 has no label after it
    # more anchors than the batch is wide (its width follows its rows): the extra ones are not ok
    wide, wide_ok = sample_anchors(jax.random.key(0), valid, gen, 12)
    assert wide.shape == wide_ok.shape == (1, 12) and int(wide_ok.sum()) == 3
    blk, pos, labels, mask = block_inputs(tokens, valid, tokens, jnp.array([[4]]), jnp.array([[True]]), block=4,
                                          mask_id=2)
    assert blk.tolist() == [[[14, 2, 2, 2]]] and pos.tolist() == [[[4, 5, 6, 7]]]
    assert labels[0, 0, :2].tolist() == [14, 15] and mask.tolist() == [[[False, True, False, False]]]


def test_config_errors():
    with pytest.raises(RunConfigError, match="backbone"):
        load_run_config(CONFIG, ["backbone=null"])
    with pytest.raises(RunConfigError, match="drafter.labels"):
        load_run_config(CONFIG, ["drafter.labels=oracle"])
    with pytest.raises(RunConfigError, match="unknown drafter keys"):
        load_run_config(CONFIG, ["drafter.foo=1"])
    # settings that would be ignored, or train nothing
    with pytest.raises(RunConfigError, match=r"target_layer_ids=\[\] names no target layer"):
        load_run_config(CONFIG, ["drafter.target_layer_ids=[]"])
    with pytest.raises(RunConfigError, match="the loss is 0 and nothing would train"):
        load_run_config(CONFIG, ["drafter.ce_weight=0", "drafter.focal_alpha=0", "drafter.chain_alpha=0"])
    with pytest.raises(RunConfigError, match="focal_gamma=3 shapes the first-error focal term"):
        load_run_config(CONFIG, ["drafter.focal_alpha=0", "drafter.focal_gamma=3"])


# ----------------------------------------------------------------------------------------------
# a short run on a tiny causal target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_backbone(tmp_path_factory.mktemp("target"), attention="causal", num_layers=4, weight_std=0.3)


def overrides(target_dir, steps):
    return [f"backbone={target_dir}", f"train.steps={steps}", "train.batch_size=8", "train.log_every=1",
            "train.checkpoint_every=4", "train.eval_every=0", "train.warmup_steps=2", "train.lr=1e-2",
            "data.tasks={toy-constraint: 1}", "drafter.block_size=4", "drafter.target_layer_ids=[1, 2]",
            "drafter.anchors_per_row=4", "drafter.chain_alpha=0.5"]


@pytest.fixture(scope="module")
def straight(target_dir, tmp_path_factory):
    run = load_run_config(CONFIG, overrides(target_dir, 12))
    return run, train(run, tmp_path_factory.mktemp("straight") / "run", progress=False)


def test_a_drafter_for_a_bf16_target_trains_in_float32(tmp_path):
    """The drafter's weights are float32 on a bf16 target (exported in drafter.export_dtype)."""
    from dlmjax.train.drafter import drafter_trainee
    from test_mrp_train import _dtypes

    bf16_target = tiny_backbone(tmp_path / "t", attention="causal", num_layers=4, dtype="bfloat16")
    trainee = drafter_trainee(load_run_config(CONFIG, overrides(bf16_target, 2)), tmp_path / "run")
    assert trainee.frozen.config.dtype == "bfloat16"
    assert _dtypes(trainee.build()) == _dtypes(trainee.abstract) == {"float32"}


def test_training_lowers_the_loss(straight):
    _, result = straight
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1


def test_resume_is_exact(straight, target_dir, tmp_path):
    run, full = straight
    first = train(run, tmp_path / "run", stop_at=5, progress=False)
    assert first.step == 5 and first.model_dir is None
    rest = train(run, tmp_path / "run", progress=False)
    assert rest.step == 12 and min(rest.losses) == 6
    for step, loss in rest.losses.items():
        assert loss == pytest.approx(full.losses[step], rel=1e-5, abs=1e-6)


def test_export_is_a_dflash_dir_that_decodes_like_ar(straight, target_dir):
    _, result = straight
    config = json.loads((result.model_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [1, 2] and config["num_target_layers"] == 4
    target = load_model(target_dir)
    drafter = load_drafter(result.model_dir, target.config)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    spec = generate_with_drafter(target, drafter, prompts, max_new_tokens=16, eos_ids=(1,), pad_id=0)
    ar = generate_ar(target, prompts, max_new_tokens=16, eos_ids=(1,), pad_id=0)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))


@pytest.mark.usefixtures("kernel_numerics")
def test_target_labels_come_without_the_targets_logits_on_the_kernel_path(target_dir):
    """The frozen target's greedy labels of a training batch come through residual_argmax: in
    interpret mode (the path a TPU takes, and a GPU with --kernels on) they equal the argmax of
    its logits, the loss and the drafter's gradient compute, and the compiled target pass holds
    no [B, L, V] array (with the kernels off it holds the logits)."""
    from dlmjax import kernels
    from dlmjax.heads.drafter import DrafterConfig, init_drafter
    from dlmjax.train.drafter import DrafterTrainSpec, drafter_train_loss, target_pass
    from hlo import logits_rows

    target = load_model(target_dir)
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2),
                                   mask_token_id=target.config.vocab_size - 1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, target.config.vocab_size - 1, (2, 24)), jnp.int32)
    valid = jnp.ones((2, 24), bool)
    passes = {}
    for mode in ("off", "interpret"):
        with kernels.use(mode):
            run = jax.jit(lambda t, v: target_pass(target, cfg, t, v))
            passes[mode] = (run(tokens, valid)[1], logits_rows(run.lower(tokens, valid).compile().as_text(),
                                                               target.config))
    np.testing.assert_array_equal(passes["interpret"][0], passes["off"][0])
    assert passes["off"][1], "with the kernels off the pass must hold the logits this test looks for"
    assert passes["interpret"][1] == []
    drafter = init_drafter(cfg, seed=0)
    batch = {"tokens": tokens, "valid": valid, "target": jnp.arange(24)[None].repeat(2, 0) >= 8}
    spec = DrafterTrainSpec(block_size=4, anchors_per_row=2, labels="target", weights=LossWeights())
    with kernels.use("interpret"):
        loss_of = lambda d: drafter_train_loss(d, target, batch, jax.random.key(0), spec=spec)  # noqa: E731
        (loss, _), grads = nnx.jit(nnx.value_and_grad(loss_of, has_aux=True))(drafter)
    assert np.isfinite(float(loss)) and any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))


def test_the_training_loss_makes_logits_a_chunk_at_a_time(target_dir, monkeypatch):
    """The drafter's loss reads its predictions through label_scores_from_hidden: logits of 3
    positions of each row at a time here (8 block positions a row: 3 chunks, the last padded),
    made again in the backward pass. Loss and gradient equal those of one chunk holding every
    position's logits, and the compiled loss-and-gradient holds no vocabulary-wide array beyond
    one chunk's (2 rows x 3; the invariant numerics mode, on an accelerator, computes whole tiles of
    rows: 2 here)."""
    from dlmjax import losses
    from dlmjax.heads.drafter import DrafterConfig, init_drafter
    from dlmjax.train.drafter import DrafterTrainSpec, drafter_train_loss
    from hlo import logits_rows

    target = load_model(target_dir)
    vocab = target.config.vocab_size
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2),
                                   mask_token_id=vocab - 1)
    graphdef, state = nnx.split(init_drafter(cfg, seed=0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, vocab - 1, (2, 24)), jnp.int32)
    batch = {"tokens": tokens, "valid": jnp.ones((2, 24), bool), "target": jnp.arange(24)[None].repeat(2, 0) >= 8}
    spec = DrafterTrainSpec(block_size=4, anchors_per_row=2, labels="data",
                            weights=LossWeights(decay_gamma=2.0, focal_alpha=0.3, chain_alpha=1.0))

    def loss_and_grad(state):
        loss_of = lambda st: drafter_train_loss(nnx.merge(graphdef, st), target, batch, jax.random.key(0),  # noqa: E731
                                                spec=spec)[0]
        return jax.value_and_grad(loss_of)(state)

    runs = {}
    for width in (3, 8):
        monkeypatch.setattr(losses, "LOGITS_CHUNK_BYTES", 2 * width * 4 * vocab)
        run = jax.jit(lambda state: loss_and_grad(state))  # a new function: traced again under the new size
        with dlmjax.numerics(row_tile=2):
            runs[width] = run(state), logits_rows(run.lower(state).compile().as_text(), target.config)
    (loss, grads), made = runs[3]
    (whole_loss, whole_grads), whole_made = runs[8]
    assert max(made) == 6 and max(whole_made) == 16
    np.testing.assert_allclose(float(loss), float(whole_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
