"""Exported heads and controllers give the same outputs in small PyTorch references written from the
specification (tests/torch_reference_mrp.py, tests/torch_reference_tspd.py), fp32: the shipped
toy-sdar MRP head and TSPD controller, and random ones of other shapes (several modules, a residual
scale, untied embeddings, a Learn2PD block controller). DFlash drafters have theirs in
tests/drafter_reference.py (tests/test_drafter.py, tests/test_drafter_toy.py)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlmjax.config import ModelConfig
from dlmjax.heads.controller import BLOCK_FEATURES, Controller, load_controller, mlp_outputs, save_controller
from dlmjax.heads.mrp import init_head, load_head, residual_step, save_head
from dlmjax.io.hf import export_model, load_model
from dlmjax.models.transformer import init_model
from dlmjax.presets import resolve_model
from torch_reference_mrp import RefMRPHead
from torch_reference_tspd import RefController


def _block_causal(length: int, block: int):
    q, k = np.arange(length)[:, None], np.arange(length)[None, :]
    return (k // block) <= (q // block)


def _chain_both(ckpt_dir, tokens, states, block):
    """Corrected logits after each chain step: (dlmjax, the torch reference), from the same
    backbone hidden state and logits (the backbone's own parity is tests/test_hf_roundtrip.py)."""
    model = load_model(ckpt_dir, dtype="float32")
    head = load_head(ckpt_dir, model.config)
    b, l = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    visible = jnp.broadcast_to(jnp.asarray(_block_causal(l, block)), (b, l, l))
    hidden = model(jnp.asarray(tokens), positions, visible_bll=visible, compute_logits=False).hidden
    logits = model.lm_logits(hidden)
    ours = []
    h, lg = hidden, logits
    for k, state in enumerate(states):
        lg, h, _ = residual_step(head, model, k, jnp.asarray(state), h, lg, positions, visible_bll=visible)
        ours.append(np.asarray(lg))

    ref = RefMRPHead.load(ckpt_dir)
    mask = torch.from_numpy(np.where(_block_causal(l, block), 0.0, np.finfo(np.float32).min).astype(np.float32))
    with torch.no_grad():
        theirs = ref.chain([torch.from_numpy(np.asarray(s)).long() for s in states],
                           torch.from_numpy(np.array(hidden)), torch.from_numpy(np.array(logits)),
                           torch.from_numpy(np.array(positions)).long(), mask[None, None].expand(b, 1, l, l))
    return ours, [t.numpy() for t in theirs], np.asarray(logits)


def _states(tokens, mask_id, rng, steps):
    """The block after each chain step: masked positions revealed one at a time."""
    masked = rng.random(tokens.shape) < 0.5
    state = np.where(masked, mask_id, tokens)
    states = []
    for _ in range(steps):
        for row in range(tokens.shape[0]):
            idx = np.flatnonzero(state[row] == mask_id)
            if len(idx):
                state[row, rng.choice(idx)] = tokens[row, idx[0]]
        states.append(state.copy())
    return states


def test_shipped_toy_sdar_mrp_head_equals_the_torch_reference():
    ckpt = resolve_model("toy-sdar")
    cfg = json.loads((ckpt / "config.json").read_text())
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, cfg["vocab_size"], (3, 24))
    ours, theirs, base = _chain_both(ckpt, tokens, _states(tokens, cfg["mask_token_id"], rng, 2), cfg["block_size"])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(base).max())
    assert np.abs(ours[0] - base).max() > 1e-3  # the residual is not zero: the head did something


def test_random_multi_module_head_with_residual_scale_equals_the_torch_reference(tmp_path):
    cfg = ModelConfig(family="sdar", vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True,
                      mask_token_id=79, rope_theta=1000.0, tie_word_embeddings=False)
    out = export_model(init_model(cfg, seed=3), tmp_path / "ckpt")
    save_head(init_head(cfg, num_layers=2, num_modules=2, residual_scale=0.7, init_std=0.1, seed=4), out)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 79, (2, 12))
    ours, theirs, base = _chain_both(out, tokens, _states(tokens, 79, rng, 3), 4)  # steps 1, 2 use module 1
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(base).max())


def _features(rng, n, width):
    return np.concatenate([rng.random((n, 2)), rng.normal(size=(n, 1)) * 0.1, rng.integers(0, 8, (n, 1)),
                           rng.integers(0, 32, (n, 1)), rng.integers(0, 256, (n, 1))], axis=1)[:, :width]


def test_shipped_toy_sdar_tspd_controller_equals_the_torch_reference():
    weights = load_controller(str(resolve_model("toy-sdar")))
    ref = RefController.load(resolve_model("toy-sdar"))
    assert ref.features == list(weights.features) and ref.threshold == pytest.approx(weights.threshold)
    x = _features(np.random.default_rng(2), 512, len(weights.features)).astype(np.float32)
    ours = np.asarray(mlp_outputs(weights.jax_params(), jnp.asarray(x)))
    with torch.no_grad():
        theirs = ref(torch.from_numpy(x)).numpy()
        commits = ref.commits(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(1 / (1 + np.exp(-ours)) > weights.threshold, commits)
    assert 0 < commits.mean() < 1  # both decisions occur on these features


def test_block_controller_equals_the_torch_reference(tmp_path):
    k = 8
    controller = Controller(k, 16, outputs=k, seed=5, mean=np.full(k, 0.6), std=np.full(k, 0.3))
    path = save_controller(controller, tmp_path, features=BLOCK_FEATURES, threshold=0.9, model={"family": "sdar"})
    x = np.random.default_rng(3).random((64, k)).astype(np.float32)
    ours = np.asarray(mlp_outputs(load_controller(str(path)).jax_params(), jnp.asarray(x)))
    with torch.no_grad():
        theirs = RefController.load(path)(torch.from_numpy(x)).numpy()
    assert theirs.shape == (64, k)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
