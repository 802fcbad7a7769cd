"""Pallas kernels (dlmjax.kernels) against their pure-jnp references, in Pallas interpret mode on
CPU, over hypothesis-drawn shapes; the switch and its logged fallbacks. On a GPU or TPU
(scripts/test.sh --device gpu) the decoder and compiled-program tests run the device's own
kernels, and the kernels are also checked at model shapes there."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlmjax
from dlmjax import kernels
from dlmjax.kernels.residual_argmax import reference as argmax_reference
from dlmjax.kernels.residual_argmax import residual_argmax, residual_argmax_tpu

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# The mode of the tests that compare a kernel path with the reference path: interpret mode on CPU,
# the device's compiled kernels on a GPU or TPU.
KERNEL = "interpret" if jax.default_backend() == "cpu" else "on"
pytestmark = pytest.mark.usefixtures("kernel_numerics")  # conftest.py


@st.composite
def argmax_cases(draw):
    tile_v = draw(st.sampled_from([8, 16, 32]))
    vocab = draw(st.sampled_from([tile_v + 3, 2 * tile_v, 3 * tile_v - 1]))  # mostly not a multiple of the tile
    edges = [0, tile_v - 1, tile_v, vocab - 1, (vocab // tile_v) * tile_v - 1]  # the mask at tile edges; or none
    return dict(
        rows=draw(st.sampled_from([1, 5, 16])), dim=draw(st.sampled_from([8, 16])), vocab=vocab, tile_v=tile_v,
        mask_id=draw(st.sampled_from([None] + [e for e in edges if 0 <= e < vocab])), norm=draw(st.booleans()),
        residual=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def _argmax_inputs(case, dtype):
    k = jax.random.split(jax.random.key(case["seed"]), 4)
    m, d, v = case["rows"], case["dim"], case["vocab"]
    x = jax.random.normal(k[0], (m, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, v)) * 1.5).astype(dtype)  # peaked enough that ties are unlikely
    norm = (1.0 + 0.2 * jax.random.normal(k[2], (d,))).astype(dtype), 1e-6
    residual = jax.random.normal(k[3], (m, d)).astype(dtype), 0.5
    return x, w, dict(mask_id=case["mask_id"], norm=norm if case["norm"] else None,
                      residual=residual if case["residual"] else None)


def _check_argmax(case, dtype, tpu: bool = False):
    x, w, kw = _argmax_inputs(case, dtype)
    expected = argmax_reference(x, w, **kw)
    if tpu:  # kernel_tpu in interpret mode, row tiles of 8 (a partial last one padded)
        got = residual_argmax_tpu(x, w, tile_m=8, tile_v=case["tile_v"], interpret=True, **kw)
    else:
        with kernels.use("interpret"):
            got = residual_argmax(x, w, tile_m=8, tile_v=case["tile_v"], tile_d=8, split_v=2 * case["tile_v"], **kw)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    if case["mask_id"] is not None:
        assert not np.any(np.asarray(got.tokens) == case["mask_id"])
    for name in ("confidence", "entropy", "margin"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=0, atol=TOL[dtype],
                                   err_msg=name)


@settings(max_examples=5, deadline=None)
@given(argmax_cases())
def test_residual_argmax_equals_its_reference_fp32(case):
    _check_argmax(case, "float32")


@settings(max_examples=3, deadline=None)
@given(argmax_cases())
def test_residual_argmax_equals_its_reference_bf16(case):
    _check_argmax(case, "bfloat16")


@settings(max_examples=5, deadline=None)
@given(argmax_cases(), st.sampled_from(["float32", "bfloat16"]))
def test_the_tpu_shaped_residual_argmax_equals_its_reference(case, dtype):
    _check_argmax(case, dtype, tpu=True)


def test_residual_argmax_keeps_the_first_of_tied_columns_across_tiles():
    """Two columns in different tiles and vocabulary slices with the same (largest) logit: the first
    wins, as in jnp.argmax, and the margin is 0 (both kernels)."""
    w = jnp.zeros((8, 40)).at[:, 5].set(1.0).at[:, 37].set(1.0)
    x = jnp.ones((3, 8))
    with kernels.use("interpret"):
        got = residual_argmax(x, w, mask_id=0, tile_v=16, split_v=32)
    on_tpu = residual_argmax_tpu(x, w, mask_id=0, norm=None, residual=None, tile_m=8, tile_v=16, interpret=True)
    for scores in (got, on_tpu):
        np.testing.assert_array_equal(scores.tokens, [5, 5, 5])
        np.testing.assert_array_equal(scores.margin, [0.0, 0.0, 0.0])


def test_residual_argmax_with_minus_inf_and_hugely_negative_logits():
    """A -inf logit (a banned column) counts 0 in the entropy, not 0 * -inf = NaN; when every
    logit is below the kernel's hidden-column value, the argmax is still a real column, never the
    excluded mask id (both kernels)."""
    x = jnp.ones((1, 4))
    banned = jnp.tile(jnp.arange(6.0)[None] / 4, (4, 1)).at[:, 2].set(-jnp.inf)
    tiny = (-2e30 + jnp.arange(6.0) * 1e25)[None].repeat(4, 0) / 4
    for w in (banned, tiny):
        expected = argmax_reference(x, w, mask_id=0)
        with kernels.use("interpret"):
            got = residual_argmax(x, w, mask_id=0)
        on_tpu = residual_argmax_tpu(x, w, mask_id=0, interpret=True)
        for scores in (got, on_tpu):
            np.testing.assert_array_equal(scores.tokens, expected.tokens)
            if w is banned:
                np.testing.assert_allclose(scores.entropy, expected.entropy, rtol=1e-5)


def test_reference_runs_where_the_kernel_cannot_with_the_reason_logged(caplog):
    """On CPU "on" finds no Pallas kernel and runs the reference, saying why; on a GPU or TPU
    (scripts/test.sh --device gpu) the kernel runs unless the numerics are batch-invariant."""
    x, w, kw = _argmax_inputs(dict(rows=3, dim=8, vocab=20, mask_id=0, norm=False, residual=False, seed=0), "float32")
    expected = argmax_reference(x, w, **kw)
    backend = jax.default_backend()
    kernel_runs = backend in kernels.ACCELERATORS and not dlmjax.arithmetic.current().invariant
    kernels._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="dlmjax.kernels"):
        with kernels.use("on"):  # on CPU: no Pallas kernel, the reference runs
            got = residual_argmax(x, w, **kw)
        with dlmjax.numerics(invariant=True):  # invariant numerics keep their fixed-tile paths
            expected_invariant = argmax_reference(x, w, **kw)
            with kernels.use("interpret"):
                got_invariant = residual_argmax(x, w, **kw)
    assert "batch-invariant" in caplog.text
    assert ("no Pallas kernel on" in caplog.text) == (backend not in kernels.ACCELERATORS)
    # asked for and not given: a warning, which a CLI user sees without configuring logging
    assert {r.levelno for r in caplog.records} == {logging.WARNING}
    for a, b in zip(got_invariant, expected_invariant):
        np.testing.assert_array_equal(a, b)
    if kernel_runs:  # the Pallas kernel: same tokens, statistics to float32 rounding
        np.testing.assert_array_equal(got.tokens, expected.tokens)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOL["float32"])
    else:
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_the_switch_refuses_unknown_modes():
    with pytest.raises(dlmjax.validation.InputError, match="choose one of"):
        with kernels.use("fast"):
            pass


def test_a_bad_DLMJAX_KERNELS_is_an_input_error_when_read_not_at_import(monkeypatch, capsys):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dlmjax.cli import main

    monkeypatch.setenv("DLMJAX_KERNELS", "fast")
    with pytest.raises(dlmjax.validation.InputError,
                       match=r"DLMJAX_KERNELS='fast' is not a kernel mode; set it to one of auto, on, interpret, off"):
        kernels.current()
    assert main(["generate", "--model", "toy-sdar", "--prompt", "1+1"]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("dlmjax generate: error: DLMJAX_KERNELS='fast'") and "Traceback" not in err
    with kernels.use("off"):  # a mode given explicitly does not read the variable
        assert kernels.current() == "off"
    monkeypatch.setenv("DLMJAX_KERNELS", " Interpret ")
    assert kernels.current() == "interpret"
    env = {**os.environ, "DLMJAX_KERNELS": "fast", "PYTHONPATH": str(Path(__file__).parents[1])}
    help_run = subprocess.run([sys.executable, "-m", "dlmjax.cli", "--help"], capture_output=True, text=True, env=env,
                              timeout=120)
    assert help_run.returncode == 0 and "generate" in help_run.stdout, help_run.stderr


KERNEL_CASES = {  # every decoder -> (model, spec): toy-sdar carries an MRP head and a TSPD controller
    "static": ("toy-sdar", "static"),
    "threshold": ("toy-sdar", "threshold:tau=0.5"),
    "entropy": ("peaky-llada", "entropy:block=4,cache=dual"),
    "psd": ("toy-sdar", "psd:depth=2"),
    "mrp-direct": ("toy-sdar", "mrp-direct:mrp_steps=1"),
    "mrp-spec": ("toy-sdar", "mrp-spec:drafts=2"),
    "mrp-remask": ("toy-sdar", "mrp-remask:tau=0.5,delta=1.0"),
    "tspd": ("toy-sdar", "tspd:controller=toy-sdar"),
    "ce": ("toy-sdar", "ce:tau=0.7,depth=2"),
    "tspd+ce": ("toy-sdar", "tspd+ce:controller=toy-sdar,depth=2"),
    "learn2pd": ("toy-sdar", "learn2pd:controller={block_filter},threshold=0.5"),
    "llada2": ("toy-sdar", "llada2:tau=0.7,editing_threshold=0.3,max_post_steps=2"),
    "fast-dllm-v2": ("random-fast-dllm-v2", "fast-dllm-v2"),
    "ar": ("toy-ar", "ar"),
    "drafter": ("toy-ar", "drafter"),
}


def test_every_decoder_has_a_kernel_case():
    from dlmjax.decoding.spec import decoder_names

    assert sorted(KERNEL_CASES) == decoder_names()


@pytest.fixture(scope="module")
def kernel_models(tmp_path_factory):
    """name -> (model, prompts as token ids, MRP head, drafter); a random Learn2PD block filter."""
    from test_decoding import PROMPTS, peaky_model

    from dlmjax.heads.controller import BLOCK_FEATURES, Controller, model_fingerprint, save_controller
    from dlmjax.io.dflash import resolve_drafter
    from dlmjax.presets import load_checkpoint

    cache = tmp_path_factory.mktemp("cache")
    models = {"peaky-llada": (peaky_model("llada", seed=3), PROMPTS[:3], None, None)}
    for name in ("toy-sdar", "toy-ar", "random-fast-dllm-v2"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("DLMJAX_CACHE", str(cache))  # where the random preset is written
            path, model, tokenizer, head = load_checkpoint(name)
        drafter = resolve_drafter(path, model.config) if name == "toy-ar" else None
        prompts = [tokenizer.encode(p) for p in ("12+7=", "3*4=", "ab")]
        models[name] = (model, prompts, head, drafter)
    sdar = models["toy-sdar"][0].config
    block_filter = save_controller(Controller(sdar.block_size, outputs=sdar.block_size, seed=1),
                                   cache / "block_filter.safetensors",
                                   features=BLOCK_FEATURES, threshold=0.5, model=model_fingerprint(sdar))
    return models, str(block_filter)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_decoders_give_the_same_tokens_with_kernels_on_and_off(kernel_models, name):
    """Interpret mode on CPU, every decoder: the greedy diffusion decoders score from the hidden
    state through residual_argmax (their forwards keep no logits; MRP's head steps add their
    residual in the kernel, mrp-remask's veto reads token columns), every attention goes
    through the flash kernel; `ar` and the drafter take their greedy tokens there too; tokens and
    NFE equal those with the kernels off."""
    from dlmjax.decoding.api import generate
    from dlmjax.decoding.spec import parse_decoder

    models, block_filter = kernel_models
    source, spec = KERNEL_CASES[name]
    spec = spec.format(block_filter=block_filter)
    model, prompts, head, drafter = models[source]
    kw = dict(decoder=spec, max_new_tokens=8, head=head, drafter=drafter)
    with kernels.use("off"):
        off = generate(model, prompts, **kw)
    with kernels.use(KERNEL):
        diffusion = name not in ("ar", "drafter")
        scores_from_hidden = getattr(parse_decoder(spec), "scores_from_hidden", lambda model: False)  # ar, drafter
        assert scores_from_hidden(model) == diffusion
        on = generate(model, prompts, **kw)
    assert [r.tokens for r in on.rows] == [r.tokens for r in off.rows]
    assert [r.nfe for r in on.rows] == [r.nfe for r in off.rows]


@pytest.mark.parametrize("spec", ["mrp-spec:drafts=3", "psd:depth=2", "mrp-remask:tau=0.5,delta=1.0"])
def test_speculative_rounds_hold_no_logits_on_the_kernel_path(kernel_models, spec):
    """Where residual_argmax serves, PSD's verification copies, MRP's drafts (two head steps,
    their residual added in the kernel) and mrp-remask's veto are scored from hidden states: the
    compiled decode holds no [..., V] float array but the lm_head itself. With the kernels off it
    holds the logits."""
    from dlmjax.decoding import engine
    from dlmjax.decoding.api import generate
    from hlo import logits_rows, program_under_kernels

    models, _ = kernel_models
    model, prompts, head, _ = models["toy-sdar"]

    def logits_made(mode):
        hlo, _ = program_under_kernels(mode, engine, "decode",
                                       lambda: generate(model, prompts, decoder=spec, head=head, max_new_tokens=8))
        return logits_rows(hlo, model.config)

    assert logits_made("off"), "with the kernels off the program must hold the logits this test looks for"
    assert logits_made(KERNEL) == []


@pytest.mark.parametrize("decoder", ["ar", "drafter"])
def test_the_autoregressive_loops_hold_no_logits_on_the_kernel_path(kernel_models, decoder):
    """Greedy `ar` steps, and the drafter's drafts, verifications and first token, take the
    target's argmax through residual_argmax (over the whole vocabulary: the target is
    autoregressive): the compiled loop holds no [..., V] float array but the lm_head itself. With
    the kernels off it holds the logits."""
    from dlmjax.decoding import ar, speculative
    from dlmjax.decoding.api import generate
    from hlo import logits_rows, program_under_kernels

    models, _ = kernel_models
    model, prompts, _, drafter = models["toy-ar"]
    owner = ar if decoder == "ar" else speculative

    def logits_made(mode):
        hlo, _ = program_under_kernels(mode, owner, "_generate", lambda: generate(
            model, prompts, decoder=decoder, drafter=drafter, max_new_tokens=8))
        return logits_rows(hlo, model.config)

    assert logits_made("off"), "with the kernels off the program must hold the logits this test looks for"
    assert logits_made(KERNEL) == []


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_shifted_logit_model_scores_from_hidden_states_on_the_kernel_path(cache):
    """Dream scores position p from the column before it: on the kernel path the engine scores
    those columns' hidden states (the block's first from the column before the block), so its
    compiled decode holds no [..., V] float array but the lm_head, and the tokens and NFE equal
    those of the logits path, in every cache mode."""
    from dlmjax.decoding import engine
    from dlmjax.decoding.api import generate
    from hlo import logits_rows, program_under_kernels
    from test_decoding import PROMPTS, peaky_model

    model = peaky_model("dream", seed=5)
    runs = {}
    for mode in ("off", KERNEL):
        hlo, result = program_under_kernels(mode, engine, "decode", lambda: generate(
            model, PROMPTS[:3], decoder=f"threshold:tau=0.7,block=4,cache={cache}", max_new_tokens=8))
        runs[mode] = ([r.tokens for r in result.rows], [r.nfe for r in result.rows], logits_rows(hlo, model.config))
    assert runs[KERNEL][:2] == runs["off"][:2]
    assert runs["off"][2], "with the kernels off the program must hold the logits this test looks for"
    assert runs[KERNEL][2] == []


def test_corrected_token_probabilities_from_hidden_states_equal_those_from_logits():
    """mrp-remask's veto reads a proposed token's probability under logits + s lm_head(h_p) (the
    mask excluded). From hidden states (the kernel path: p_a exp(z_t - z_a) with the kernel's
    argmax a) it equals the softmax of the logits, for argmax tokens and for others."""
    from dlmjax.decoding.engine import BlockForwards
    from test_decoding import MASK, peaky_model

    model = peaky_model("sdar", seed=4)
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (3, 4, model.config.hidden_size))
    h_p = jax.random.normal(k[1], hidden.shape) * 0.3
    logits = model.lm_logits(hidden)
    corrected = (logits + 0.7 * model.lm_logits(h_p)).at[..., MASK].set(-jnp.inf)
    other = jax.random.randint(k[2], (3, 4), 0, MASK)
    tokens = jnp.where(jnp.arange(4) % 2 == 0, jnp.argmax(corrected, axis=-1), other).astype(jnp.int32)
    xla = BlockForwards(model, None, None, "exact", MASK).token_probs(logits, hidden, tokens, (h_p, 0.7))
    with kernels.use(KERNEL):
        fast = BlockForwards(model, None, None, "exact", MASK, scores_from_hidden=True).token_probs(
            logits[..., :0], hidden, tokens, (h_p, 0.7))
    np.testing.assert_allclose(fast, xla, rtol=1e-5, atol=1e-7)
    expected = jnp.take_along_axis(jax.nn.softmax(corrected, axis=-1), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(xla, expected, rtol=1e-6, atol=1e-7)
    assert float(xla.max()) > 0.3 and float(xla.min()) < 0.1  # argmax tokens and unlikely ones


def test_the_lossless_decoders_equal_their_references_on_the_kernel_path(kernel_models):
    """mrp-spec = static and PSD = its policy one step per forward, both scored from hidden states
    (the kernel path a TPU takes by default, a GPU with --kernels on), with drafts accepted."""
    from dlmjax.decoding.api import generate

    models, _ = kernel_models
    model, prompts, head, _ = models["toy-sdar"]
    with kernels.use(KERNEL):
        for lossless, reference in [("mrp-spec:drafts=3", "static"), ("psd:policy=topk,depth=3", "static")]:
            fast, slow = (generate(model, prompts, decoder=spec, head=head, max_new_tokens=8)
                          for spec in (lossless, reference))
            assert [r.tokens for r in fast.rows] == [r.tokens for r in slow.rows], lossless
            assert fast.forwards < slow.forwards, f"{lossless}: no draft was accepted, the test is vacuous"


# -- attention ---------------------------------------------------------------------------------

from dlmjax.kernels.attention import attention as attention_dispatch  # noqa: E402
from dlmjax.kernels.attention import DECODE_TILES, PREFILL_TILES, flash, flash_tpu, tiles_for  # noqa: E402
from dlmjax.kernels.attention import reference as attention_reference  # noqa: E402
from dlmjax.models.layers import Visibility  # noqa: E402


@st.composite
def attention_cases(draw):
    """Rows of different written lengths (and holes: left padding, unwritten slots), packed copies
    (query segments 1..N over a shared context of segment 0), every topology with or without a
    sliding window, several parts. The
    shapes come from a few (each compiles once in interpret mode); what they hold is drawn."""
    shape = draw(st.sampled_from([  # (rows, kv heads, group, copies, width, cache slots, tile_q, tile_k)
        (1, 1, 2, 1, 3, 0, 4, 4), (3, 2, 2, 3, 2, 21, 4, 8), (2, 2, 1, 2, 4, 13, 8, 4)]))
    b, hkv, group, copies, width, cache, tile_q, tile_k = shape
    return dict(b=b, hkv=hkv, h=hkv * group, copies=copies, width=width, cache=cache, tile_q=tile_q, tile_k=tile_k,
                attention=draw(st.sampled_from(["causal", "block_causal", "bidirectional"])),
                window=draw(st.sampled_from([None, None, 1, 3])), seed=draw(st.integers(0, 2**16)))


def _attention_inputs(case, dtype=jnp.float32):
    """q of `copies` packed copies of a `width`-token block after a cache of `cache` slots, each row
    written to its own length; parts: [cache (if any), the copies]."""
    rng = np.random.default_rng(case["seed"])
    b, h, hkv, d, n, w, s = case["b"], case["h"], case["hkv"], case.get("head_dim", 8), case["copies"], case["width"], case["cache"]
    l = n * w
    lengths = rng.integers(0, s + 1, b)
    pad = np.minimum(rng.integers(0, 3, b), lengths)
    k_pos = np.broadcast_to(np.arange(s), (b, s)) - pad[:, None]
    k_valid = (np.arange(s)[None] >= pad[:, None]) & (np.arange(s)[None] < lengths[:, None])
    q_pos = np.tile(np.arange(w), (b, n)) + (lengths - pad)[:, None]
    q_seg = np.repeat(np.arange(1, n + 1), w)[None].repeat(b, 0)
    q_valid = rng.random((b, l)) > 0.1
    kvs = [jnp.asarray(rng.normal(size=shape), dtype) for shape in [(b, l, h, d), (b, s, hkv, d), (b, s, hkv, d),
                                                                     (b, l, hkv, d), (b, l, hkv, d)]]
    q, k_cache, v_cache, k_self, v_self = kvs
    topo = dict(attention=case["attention"], block_size=2, window=case.get("window"))
    parts = [] if s == 0 else [(k_cache, v_cache, Visibility(
        jnp.asarray(q_pos), jnp.asarray(q_seg), jnp.asarray(k_pos), jnp.zeros((b, s), jnp.int32), jnp.asarray(k_valid),
        **topo))]
    parts.append((k_self, v_self, Visibility(jnp.asarray(q_pos), jnp.asarray(q_seg), jnp.asarray(q_pos),
                                             jnp.asarray(q_seg), jnp.asarray(q_valid), **topo)))
    return q, parts


def _seen(parts):
    """[B, L] whether each query sees at least one key (the others' outputs are never read)."""
    return np.any(np.concatenate([np.asarray(vis.matrix()) for _, _, vis in parts], axis=-1), axis=-1)


def test_a_prefill_and_a_decode_chunk_take_their_own_measured_tiles_unless_given():
    assert tiles_for(2048) == PREFILL_TILES != DECODE_TILES == tiles_for(16)
    assert tiles_for(4 * 4) == tiles_for(DECODE_TILES["tile_q"]) == DECODE_TILES  # 4 packed copies of a block
    assert tiles_for(2048, tile_k=128, warps=None) == {**PREFILL_TILES, "tile_k": 128}


@settings(max_examples=8, deadline=None)
@given(attention_cases())
def test_flash_attention_equals_the_xla_einsum(case):
    q, parts = _attention_inputs(case)
    _check_flash(q, parts, flash(q, parts, tile_q=case["tile_q"], tile_k=case["tile_k"], split_k=2 * case["tile_k"],
                                 interpret=True))


def _check_flash(q, parts, got):
    """A kernel's output equals the einsum's within 1e-5 at every query that sees a key, and is
    finite everywhere."""
    expected, got, seen = np.asarray(attention_reference(q, parts)), np.asarray(got), _seen(parts)
    np.testing.assert_allclose(got[seen], expected[seen], rtol=0, atol=1e-5)
    assert np.all(np.isfinite(got))


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="the device's compiled kernels at model shapes: "
                    "a GPU or TPU (scripts/test.sh --device gpu); interpret mode covers them on CPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_kernels_equal_their_references_at_model_shapes(dtype):
    """The device compiles both kernels (no fallback) and they equal their references: residual_argmax
    over Qwen3's vocabulary (151,936, hidden 2,048, 64 positions, final norm, an MRP residual, the
    mask excluded), flash attention for a 2,048-token block-causal prefill and for 4 packed copies of
    a 4-token block over 1,000 cached slots in rows of different lengths (head_dim 128, 16 query
    heads over 8). Tokens equal wherever the reference's top-2 margin exceeds the dtype's rounding."""
    kernels._COMPILES.clear()
    kernels._LOGGED.clear()
    k = jax.random.split(jax.random.key(0), 4)
    m, d, v = 64, 2048, 151_936
    x = jax.random.normal(k[0], (m, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, v)) * 3 / d**0.5).astype(dtype)
    kw = dict(mask_id=v - 1, norm=((1.0 + 0.2 * jax.random.normal(k[2], (d,))).astype(dtype), 1e-6),
              residual=(jax.random.normal(k[3], (m, d)).astype(dtype), 0.5))
    expected = argmax_reference(x, w, **kw)
    with kernels.use("on"):
        got = residual_argmax(x, w, **kw)
    assert not kernels._LOGGED, f"a kernel fell back: {kernels._LOGGED}"
    clear = np.asarray(expected.margin) > TOL[dtype]
    assert clear.sum() > m // 2
    np.testing.assert_array_equal(np.asarray(got.tokens)[clear], np.asarray(expected.tokens)[clear])
    for name in ("confidence", "entropy"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=0, atol=TOL[dtype], err_msg=name)
    shape = dict(h=16, hkv=8, head_dim=128, attention="block_causal", window=None, seed=1)
    for case in (dict(b=1, copies=1, width=2048, cache=0), dict(b=4, copies=4, width=4, cache=1000)):
        q, parts = _attention_inputs({**shape, **case}, jnp.dtype(dtype))
        with kernels.use("on"):
            got = attention_dispatch(q, parts)
        assert not kernels._LOGGED, f"a kernel fell back: {kernels._LOGGED}"
        seen = _seen(parts)
        expected = np.asarray(attention_reference(q, parts), np.float32)[seen]
        np.testing.assert_allclose(np.asarray(got, np.float32)[seen], expected, rtol=0, atol=TOL[dtype],
                                   err_msg=str(case))


@settings(max_examples=8, deadline=None)
@given(attention_cases())
def test_the_tpu_shaped_flash_kernel_equals_the_xla_einsum(case):
    """kernel_tpu (key tiles on the grid, skipped past each row's length; a partial last tile) in
    interpret mode: the same cases as the loop-over-tiles kernel."""
    q, parts = _attention_inputs(case)
    _check_flash(q, parts, flash_tpu(q, parts, tile_q=case["tile_q"], tile_k=case["tile_k"], interpret=True))


def _small_tiles(kernel: str, q, parts, split_k: int = 8):
    """The "loop" kernel (`flash`) or the "tpu" one (`flash_tpu`) in interpret mode, in tiles of 4
    queries and 4 keys."""
    if kernel == "tpu":
        return flash_tpu(q, parts, tile_q=4, tile_k=4, interpret=True)
    return flash(q, parts, tile_q=4, tile_k=4, split_k=split_k, interpret=True)


@pytest.mark.parametrize("kernel", ["loop", "tpu"])
def test_a_sliding_window_hides_the_keys_behind_it(kernel):
    """A drafter's sliding-window layers: both kernels equal the einsum with a window of 2 over a
    cache and packed copies (whatever hypothesis draws, this case always runs)."""
    case = dict(b=3, h=4, hkv=2, copies=2, width=3, cache=11, attention="causal", window=2, seed=7)
    q, parts = _attention_inputs(case)
    assert _seen(parts).sum() > 0 and not np.asarray(parts[0][2].matrix()).all()
    _check_flash(q, parts, _small_tiles(kernel, q, parts))


@pytest.mark.parametrize("kernel", ["loop", "tpu"])
def test_a_sliding_window_layer_reads_only_its_window(kernel):
    """Key tiles wholly behind every query's window are not read: keys and values there are NaN,
    which any read would carry into the output (0 x NaN), and both kernels still equal the einsum
    over clean keys. 40 cached slots in tiles of 4, window 3 at the cache's end; decode-like
    chunks (split over programs) and a two-tile query chunk."""
    for width, split_k in [(3, 8), (8, 8)]:
        case = dict(b=3, h=4, hkv=2, copies=2, width=width, cache=40, attention="causal", window=3, seed=11)
        q, parts = _attention_inputs(case)
        (k, v, vis), rest = parts[0], parts[1:]
        seen_by_any = np.asarray(vis.matrix()).any(axis=1)  # [B, S]
        first = np.where(seen_by_any.any(axis=1), seen_by_any.argmax(axis=1), 40)
        assert first.max() >= 8, "the case must hold whole tiles behind the window"
        behind = (np.arange(40)[None] < (first // 4 * 4)[:, None])[:, :, None, None]
        poisoned = [(jnp.where(behind, jnp.nan, k), jnp.where(behind, jnp.nan, v), vis)] + rest
        _check_flash(q, parts, _small_tiles(kernel, q, poisoned, split_k))


def test_a_part_with_every_key_hidden_adds_exact_zeros():
    """What the row-asynchronous engine relies on (tests/test_row_async.py): a store part whose
    keys are all hidden changes no bit of the kernel path's output either."""
    case = dict(b=2, h=4, hkv=2, copies=2, width=3, cache=9, attention="block_causal", seed=5)
    q, parts = _attention_inputs(case)
    k, v, vis = parts[-1]
    hidden = (k * 3.0, v * 2.0, vis.replace(k_valid=jnp.zeros_like(vis.k_valid)))
    with kernels.use("interpret"):
        alone = attention_dispatch(q, parts, tile_q=4, tile_k=4)
        with_hidden = attention_dispatch(q, parts[:-1] + [hidden, parts[-1]], tile_q=4, tile_k=4)
    np.testing.assert_array_equal(alone, with_hidden)


def _prefill_part(length: int, attention: str, seed: int = 0, keys: int | None = None):
    """q [1, length, 4, 8] at positions 0.. and one part of `keys` (default: as many) keys at
    positions 0.. (the queries' own keys in a prefill), every key valid."""
    rng = np.random.default_rng(seed)
    keys = keys or length
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, h, 8)), jnp.float32) for n, h in ((length, 4), (keys, 2), (keys, 2)))
    q_pos, k_pos = jnp.arange(length)[None], jnp.arange(keys)[None]
    vis = Visibility(q_pos, jnp.zeros_like(q_pos), k_pos, jnp.zeros_like(k_pos), jnp.ones((1, keys), bool),
                     attention=attention, block_size=4)
    return q, [(k, v, vis)]


@pytest.mark.parametrize("attention, tiles_read", [("causal", 10), ("block_causal", 10), ("bidirectional", 16)])
def test_a_prefill_query_tile_reads_the_keys_up_to_its_frontier(attention, tiles_read):
    """key_ranges: in a causal or block-causal prefill of 32 tokens (query and key tiles of 8), query
    tile t reads key tiles 0..t, 10 of the 16 pairs (about half the square, as the FLOP count of
    benchmarks/decode_gpu.py assumes); a bidirectional one reads all 16."""
    from dlmjax.kernels.attention import key_ranges

    _, [(_, _, vis)] = _prefill_part(32, attention)
    starts, ends = (np.asarray(a) for a in key_ranges(vis, tile_q=8))
    assert starts.shape == (1, 4) and np.all(starts == 0)
    assert np.sum(-(-ends // 8)) == tiles_read


@pytest.mark.parametrize("kernel", ["loop", "tpu"])
def test_a_query_tile_reads_no_key_past_its_frontier(kernel):
    """Both kernels skip the key tiles no query of a tile can see: 8 causal queries at positions 0..7
    over 32 keys whose last 24 are NaN (any read would carry NaN into the output: 0 x NaN) equal the
    einsum over clean keys. Before, a row read every key up to its written length."""
    q, parts = _prefill_part(8, "causal", keys=32)
    (k, v, vis), = parts
    past = (jnp.arange(32) >= 8)[None, :, None, None]
    poisoned = [(jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), vis)]
    _check_flash(q, parts, _small_tiles(kernel, q, poisoned))


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_skipping_the_tiles_past_the_frontier_changes_no_bit(attention):
    """The loop kernel with each query tile's key range equals, bitwise, the same kernel reading
    every key of the row (the row's whole length as every tile's range): the skipped tiles hold only
    hidden keys, which add exact zeros."""
    from dlmjax.kernels.attention import _part_args
    from dlmjax.kernels.attention import kernel as attention_kernel

    q, parts = _prefill_part(32, attention, seed=3)
    (k, v, vis), = parts
    args = _part_args(q, k, v, vis, 8)
    whole_rows = (jnp.zeros((1, 4), jnp.int32), jnp.full((1, 4), 32, jnp.int32))
    call = functools.partial(attention_kernel.flash_part, attention=attention, block_size=4, tile_q=8, tile_k=8,
                             split_k=32, interpret=True)
    assert not np.array_equal(args[-1], whole_rows[1])
    np.testing.assert_array_equal(attention_kernel.combine([call(*args)]),
                                  attention_kernel.combine([call(*args[:-2], *whole_rows)]))


def test_a_loss_differentiates_through_the_flash_kernel_with_the_reference_gradient():
    """A next-token loss (per-row validity, so attention takes the kernel) has the gradient it has
    without kernels: the kernel's forward, the einsum's backward (a Pallas call has no VJP; before,
    training with objective next_token failed on every GPU and TPU)."""
    from flax import nnx

    from dlmjax.train.objectives import next_token_loss

    model = dlmjax.load_model("toy-ar")
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 40, (2, 24)), jnp.int32)
    valid = jnp.arange(24)[None] >= jnp.asarray([[0], [5]])  # the second row left-padded
    batch = {"tokens": tokens, "valid": valid, "target": valid}

    def loss(p):
        return next_token_loss(nnx.merge(graphdef, p), batch)[0]

    grads = {}
    for mode in ("off", KERNEL):
        with kernels.use(mode):
            grads[mode] = jax.jit(jax.grad(loss))(params)
    with_kernel = jax.tree_util.tree_leaves(grads[KERNEL])
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(grads["off"]), with_kernel):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads[KERNEL])) > 1e-3


def test_the_cudnn_call_equals_the_xla_einsum_where_it_serves():
    """jax.nn.dot_product_attention serves plain bidirectional forwards on GPU (cuDNN); its XLA
    implementation on CPU checks the call (head layout, grouped heads, scaling) against ours."""
    from dlmjax.kernels.attention import _cudnn_serves, dot_product_attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 7, h, 8)), jnp.float32) for h in (4, 2, 2))
    pos, seg = jnp.broadcast_to(jnp.arange(7), (2, 7)), jnp.zeros((2, 7), jnp.int32)
    parts = [(k, v, Visibility(pos, seg, pos, seg, jnp.ones((2, 7), bool), attention="bidirectional",
                               block_size=None, plain=True))]
    assert _cudnn_serves(parts)
    assert not _cudnn_serves([(k, v, parts[0][2].replace(attention="causal"))])
    np.testing.assert_allclose(dot_product_attention("xla")(q, k, v), attention_reference(q, parts), rtol=0,
                               atol=1e-5)


def test_on_a_gpu_cudnn_serves_the_head_dims_the_pallas_kernel_does_not(monkeypatch):
    """A plain bidirectional prefill with head dim 96 goes to cuDNN (which takes multiples of 8),
    not past it to the einsum because the Pallas kernel wants a power of two; a window keeps it
    from cuDNN (which would run without it)."""
    import dlmjax.kernels.attention as dispatch

    called = []
    monkeypatch.setattr(dispatch, "dot_product_attention", lambda impl: lambda q, k, v: called.append(impl) or q)
    monkeypatch.setattr(kernels, "compile_error", lambda *args: None)  # as if the device compiled it
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    pos, seg = jnp.broadcast_to(jnp.arange(8), (1, 8)), jnp.zeros((1, 8), jnp.int32)
    plain = Visibility(pos, seg, pos, seg, jnp.ones((1, 8), bool), attention="bidirectional", block_size=None,
                       plain=True)
    for head_dim in (128, 96):
        q = jnp.ones((1, 8, 2, head_dim), jnp.bfloat16)
        called.clear()
        with kernels.use("auto"):
            dispatch.attention(q, [(q, q, plain)])
        assert called == ["cudnn"], head_dim
    assert not dispatch._cudnn_serves([(q, q, plain.replace(window=4))])
    assert not dispatch._cudnn_serves([(q, q, plain.matrix())])


def test_a_kernel_that_does_not_compile_falls_back_with_the_reason(caplog):
    """The compile probe: a kernel call the device refuses is reported, not raised."""

    def refuses(x, *, width):
        raise NotImplementedError(f"no lowering for width {width}")

    kernels._COMPILES.clear()
    assert kernels.compile_error("demo", functools.partial(refuses, width=3), jnp.ones(2)) == \
        "does not compile here: NotImplementedError: no lowering for width 3"
    assert kernels.compile_error("demo", functools.partial(lambda x, width: x * width, width=3), jnp.ones(2)) is None


@pytest.fixture
def decode_gpu():
    """benchmarks/decode_gpu.py, imported from the checkout (benchmarks/ is not installed)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from benchmarks import decode_gpu

    return decode_gpu


def test_the_gpu_benchmark_runs_at_its_tiny_shape(tmp_path, decode_gpu):
    """benchmarks/decode_gpu.py --tiny on CPU (the prefill section reuses code tested elsewhere and
    is skipped here for time): every section writes what it measured."""
    import json

    results = decode_gpu.main(["--tiny", "--batches", "1", "--skip", "prefill", "--out", str(tmp_path)])
    assert [(r["batch"], r["kernels"]) for r in results["step"]] == [(1, "auto"), (1, "off")]
    with kernels.use("auto"):  # the reference on CPU; on a GPU the kernel unless the numerics are invariant
        auto_path = decode_gpu.path_of("attention", len(kernels.refusals("attention")))
    assert [r["path"] for r in results["step"]] == [auto_path, "reference"]
    assert all(r["ms"] > 0 and r["roofline_ms"] > 0 for r in results["step"])
    assert [r["kernels"] for r in results["argmax"]] == ["on", "off"]
    (decoder,) = results["decoders"]  # threshold at batch 1: the first call's time, then the timed batches
    assert decoder["batch"] == 1 and decoder["first_call_s"] > 0 and decoder["tokens_per_s"] > 0
    assert [r["batch"] for r in results["transformers"]] == [1] and results["transformers"][0]["ms"] > 0
    kernel_path = "interpret" if jax.default_backend() == "cpu" else "kernel"  # the tiles section's kernels
    assert [(r["kernel"], r["tiles"], r["path"]) for r in results["tiles"]] == [
        ("attention", "XLA einsum", "reference"), ("attention", "tile_q=16,tile_k=16", kernel_path),
        ("attention", "tile_q=32,tile_k=16", kernel_path), ("residual_argmax", "XLA logits + scoring", "reference"),
        ("residual_argmax", "tile_m=8,tile_v=128", kernel_path),
        ("residual_argmax", "tile_m=16,tile_v=256", kernel_path)]
    assert all(r["ms"] > 0 for r in results["tiles"])
    with pytest.raises(SystemExit):  # a tile option the kernel does not take is refused when parsed
        decode_gpu.parse_args(["--tiny", "--argmax-tiles", "tile_q=8"])
    tag = f"{jax.devices()[0].platform}-tiny"
    saved = json.loads((tmp_path / f"{tag}.json").read_text())
    assert saved["step"] == results["step"] and "| batch | ms |" in (tmp_path / f"{tag}.md").read_text()


def test_the_gpu_benchmark_stopped_mid_section_writes_the_rows_it_measured(tmp_path, decode_gpu, monkeypatch):
    """A lent machine's stage stops the benchmark with SIGINT (KeyboardInterrupt) at its time limit:
    the rows of the section it cut off are written too, not only the log's."""
    import json

    measure = decode_gpu.step_ms
    calls = []

    def stopped_at_the_second_row(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(decode_gpu, "step_ms", stopped_at_the_second_row)
    with pytest.raises(KeyboardInterrupt):
        decode_gpu.main(["--tiny", "--batches", "1", "--repeats", "2", "--out", str(tmp_path),
                         "--skip", "prefill", "argmax", "tiles", "decoders", "transformers"])
    tag = f"{jax.devices()[0].platform}-tiny"
    saved = json.loads((tmp_path / f"{tag}.json").read_text())
    assert saved["finished"] is False and [r["kernels"] for r in saved["step"]] == ["auto"]
    table = (tmp_path / f"{tag}.md").read_text()
    assert "| 1 | auto |" in table and "Stopped before the end" in table


def test_the_gpu_benchmark_writes_a_profile_of_the_step(tmp_path, decode_gpu):
    """`--profile DIR`: a jax profiler trace of the timed step per batch and kernel mode (issue 13's
    owed decode-step profile, for a lent machine)."""
    decode_gpu.main(["--tiny", "--batches", "1", "--kernels", "off", "--skip", "prefill", "tiles", "argmax",
                     "decoders", "transformers", "--profile", str(tmp_path / "profile"), "--out", str(tmp_path)])
    (trace,) = (tmp_path / "profile" / "step-batch1-off").rglob("*.xplane.pb")
    assert trace.stat().st_size > 0


def test_the_gpu_benchmark_runs_the_moe_shapes(tmp_path, decode_gpu):
    """Issue 21's GPU benchmark: the MoE shapes translate through dlmjax's config reader at their
    published sizes; the step's roofline reads only the experts that random routing hits; a tiny MoE
    runs the step and a decoder on CPU; a checkpoint's own config.json can be given as the shape."""
    import json

    from flax import nnx

    from dlmjax.config import from_hf_config
    from dlmjax.models import abstract_model

    sizes = {}
    for name in ("llada-moe-7b-a1b", "llada2.0-mini"):
        cfg = from_hf_config(decode_gpu.MOE_CONFIGS[name])
        total = sum(x.size for x in jax.tree.leaves(nnx.split(abstract_model(cfg))[1]))
        experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * len(cfg.moe_layers)
        sizes[name] = round(total / 1e9, 1), round((total - (cfg.num_experts - cfg.num_experts_per_tok) * experts
                                                    - cfg.vocab_size * cfg.hidden_size) / 1e9, 1)
    assert sizes == {"llada-moe-7b-a1b": (7.4, 1.4), "llada2.0-mini": (16.3, 1.1)}  # total; active (lm_head in)

    results = decode_gpu.main(["--tiny", "--shape", "tiny-moe", "--batches", "1", "--skip", "prefill", "tiles",
                               "argmax", "--moe-experts", "grouped", "dense", "--out", str(tmp_path)])
    assert [(r["kernels"], r["experts"]) for r in results["step"]] == [
        ("auto", "grouped"), ("auto", "dense"), ("off", "grouped"), ("off", "dense")]
    assert all(r["ms"] > 0 for r in results["step"])
    assert "| 1 | auto, experts dense | " in (tmp_path / "cpu-tiny-moe.md").read_text()
    assert results["decoders"][0]["tokens_per_s"] > 0 and results["transformers"] == []
    model, _, name = decode_gpu.build_model("tiny-moe")
    cfg = model.config
    assert (cfg.family, cfg.num_experts, name) == ("llada2_moe", 8, "random tiny-moe (float32)")
    experts = sum(m.experts_gate_up[...].nbytes + m.experts_down[...].nbytes
                  for _, m in nnx.iter_graph(model) if isinstance(m, decode_gpu.MoE))
    hit = decode_gpu.experts_read(8, 2, 4) / 8  # 4 tokens, top-2 of 8: 1 - (3/4)^4 of the experts
    assert hit == pytest.approx(1 - 0.75 ** 4)
    assert decode_gpu.weight_bytes(model, tokens=4) == int(decode_gpu.weight_bytes(model) - (1 - hit) * experts)

    config_json = tmp_path / "my-checkpoint" / "config.json"
    config_json.parent.mkdir()
    config_json.write_text(json.dumps(decode_gpu.MOE_CONFIGS["tiny-moe"]))
    assert decode_gpu.build_model(str(config_json))[2] == "random my-checkpoint (bfloat16)"
    with pytest.raises(SystemExit):
        decode_gpu.parse_args(["--shape", "llada-moe"])


def test_the_gpu_benchmark_stopped_at_its_limit_writes_the_sections_it_finished(tmp_path, monkeypatch, decode_gpu):
    """A lent machine's stage stops the benchmark with SIGINT at its time limit: the results files
    are written all the same, with the sections finished before it, marked unfinished. A run that
    fails writes none."""
    import json

    def stopped(*args):
        raise KeyboardInterrupt

    def failed(*args):
        raise ValueError("a bad --decoders spec")

    argv = ["--tiny", "--batches", "1", "--kernels", "off", "--skip", "prefill", "tiles", "argmax", "transformers"]
    monkeypatch.setattr(decode_gpu, "section_decoders", failed)
    with pytest.raises(ValueError):  # a failed run writes nothing (the committed results stay)
        decode_gpu.main([*argv, "--out", str(tmp_path / "failed")])
    assert not (tmp_path / "failed").exists()
    monkeypatch.setattr(decode_gpu, "section_decoders", stopped)
    with pytest.raises(KeyboardInterrupt):
        decode_gpu.main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "cpu-tiny.json").read_text())
    assert results["finished"] is False and results["decoders"] == [] and results["step"][0]["ms"] > 0
    assert "Stopped before the end" in (tmp_path / "cpu-tiny.md").read_text()


def test_the_gpu_benchmark_reports_a_kernel_the_device_refused(monkeypatch, decode_gpu):
    """Where the dispatcher chooses a kernel but the device's compile probe refused it in the call
    measured (so the reference ran), decode_gpu's path column says so instead of "kernel"; a
    refusal of an earlier call (another shape or tile choice) does not mark later ones."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "_COMPILES", {})
    with kernels.use("on"):
        assert decode_gpu.path_of("attention", 0) == "kernel"
        kernels._COMPILES[("attention/cudnn", None, None, ())] = None  # compiled: not a refusal
        assert decode_gpu.path_of("attention", 0) == "kernel"
        before = len(kernels.refusals("attention"))
        kernels._COMPILES[("attention", None, None, ())] = "does not compile here: LoweringError: ..."
        assert decode_gpu.path_of("attention", before) == "reference (refused)"
        assert decode_gpu.path_of("attention", len(kernels.refusals("attention"))) == "kernel"  # a later call
        assert decode_gpu.path_of("residual_argmax", 0) == "kernel"


# ------------------------------------------------------------------------------------------------ grouped_matmul


@st.composite
def grouped_cases(draw):
    """Rows routed to a few of the experts (most experts get none), some past the last expert
    (padding: in no tile), one expert's rows spanning several tiles."""
    return dict(rows=draw(st.sampled_from([1, 7, 40])), experts=draw(st.sampled_from([3, 8])),
                tile_m=draw(st.sampled_from([4, 16])), k=draw(st.sampled_from([16, 24])),
                n=draw(st.sampled_from([16, 48])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=8, deadline=None)
@given(grouped_cases(), st.sampled_from(["float32", "bfloat16"]))
def test_grouped_matmul_equals_its_reference(case, dtype):
    from dlmjax.kernels import grouped_matmul as gm

    rng = np.random.default_rng(case["seed"])
    m, e, t = case["rows"], case["experts"], case["tile_m"]
    expert_m = rng.integers(0, e + 1, m)  # e: padding
    expert_m[: m // 2] = 1  # expert 1 takes half the rows: several tiles when they exceed one
    row_it, tiles_end_e = gm.tile_layout(jnp.asarray(expert_m, jnp.int32), e, t)
    x = jnp.asarray(rng.normal(size=(row_it.size, case["k"])), dtype)
    w = jnp.asarray(rng.normal(size=(e, case["k"], case["n"])) * 0.3, dtype)
    want = gm.reference(x, tiles_end_e, w, tile_m=t)
    with kernels.use(KERNEL):
        got = jax.jit(functools.partial(gm.grouped_matmul, tile_m=t))(x, tiles_end_e, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL[dtype], atol=TOL[dtype])
    rows = np.asarray(row_it)
    assert sorted(rows[rows < m].tolist()) == [r for r in range(m) if expert_m[r] < e], "each routed row in one slot"
    for tile, owner in enumerate(np.asarray(gm.tile_expert(tiles_end_e, rows.shape[0]))):
        assert all(expert_m[r] == owner for r in rows[tile] if r < m), "a tile holds its expert's rows only"


def test_grouped_matmul_gradient_is_the_references():
    """The kernel path is differentiable (an MoE backbone or head trains with kernels on): its
    gradient is the reference's."""
    from dlmjax.kernels import grouped_matmul as gm

    rng = np.random.default_rng(0)
    row_it, tiles_end_e = gm.tile_layout(jnp.asarray([2, 0, 2, 2, 5], jnp.int32), 5, 4)
    x = jnp.asarray(rng.normal(size=(row_it.size, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 16, 16)), jnp.float32)

    def loss(fn):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, tiles_end_e, w, tile_m=4))), argnums=(0, 1))(x, w)

    with kernels.use(KERNEL):
        got = loss(gm.grouped_matmul)
    for g, want in zip(got, loss(gm.reference)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_grouped_matmul_kernel_lowers_to_triton_at_moe_shapes():
    """Without a GPU: the kernel lowers through Pallas' Triton backend (jax.export for CUDA) at
    LLaDA-MoE-7B-A1B's and LLaDA2.0-mini's expert shapes, bf16, a batch-16 decode step's rows: its
    dynamic expert loop, scalar reads and tile writes are all ops that backend lowers (a GPU still
    compiles the Triton IR to PTX)."""
    from jax import export

    from dlmjax.kernels.grouped_matmul import kernel as gm_kernel

    allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for experts, d, f in ((64, 2048, 1024), (256, 2048, 512)):
        tile = 64 if experts == 64 else 16
        rows = (16 * 32 * 8 // tile + experts) * tile
        for k, n in ((d, 2 * f), (f, d)):
            call = functools.partial(gm_kernel.grouped_matmul, tile_m=tile, tile_n=128, tile_k=64, interpret=False,
                                     triton=True)
            specs = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((experts,), jnp.int32),
                     jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16))
            text = export.export(jax.jit(call), platforms=["cuda"], disabled_checks=allow)(*specs).mlir_module()
            assert "__gpu$xla.gpu.triton" in text and f"grid_x = {experts}" in text


def test_flash_attention_memory_is_linear_in_length():
    """Compiled scratch memory of one attention at L and 2L keys (block-causal self-attention): the
    XLA einsum's grows 4x (its [H, L, L] scores), the flash kernel's (interpret mode) 2x."""
    def scratch(length, mode):
        def f(q, k, v):
            pos, seg = jnp.broadcast_to(jnp.arange(length), (1, length)), jnp.zeros((1, length), jnp.int32)
            vis = Visibility(pos, seg, pos, seg, jnp.ones((1, length), bool), attention="block_causal", block_size=4)
            with kernels.use(mode):
                return attention_dispatch(q, [(k, v, vis)])

        q, kv = (jax.ShapeDtypeStruct((1, length, h, 16), jnp.float32) for h in (4, 2))
        return jax.jit(f).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    assert scratch(1024, "off") / scratch(512, "off") > 3.5
    assert scratch(1024, "interpret") / scratch(512, "interpret") < 2.2


def test_the_key_ranges_memory_is_linear_in_length():
    """key_ranges finds each query tile's keys a few tiles at a time: its scratch memory doubles
    with the length (it held [B, L / tile_q, S] booleans: 80 MiB a row at 32k, 4x per doubling,
    too small at 512 tokens for the test above to see)."""
    from dlmjax.kernels.attention import key_ranges

    def scratch(length):
        def f(pos):
            seg = jnp.zeros_like(pos)
            return key_ranges(Visibility(pos, seg, pos, seg, pos >= 0, attention="block_causal", block_size=4), 64)

        return jax.jit(f).lower(jax.ShapeDtypeStruct((1, length), jnp.int32)).compile().memory_analysis(
        ).temp_size_in_bytes

    assert scratch(16384) / scratch(8192) < 2.2


def test_the_cli_sets_the_kernel_mode(monkeypatch):
    """`--kernels MODE` on generate/eval/train/traces: the command runs under that mode."""
    from dlmjax import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "--model", "toy-sdar", "--prompt", "1+1", "--kernels", "fast"])
    seen = []
    args = cli.parse_args(["generate", "--model", "toy-sdar", "--prompt", "1+1", "--kernels", "off"])
    assert args.kernels == "off"
    monkeypatch.setattr(cli, "parse_args", lambda argv: args)
    args.func = lambda a: seen.append(kernels.current()) or 0
    assert cli.main(["generate"]) == 0 and seen == ["off"]


def test_the_kernels_lower_for_a_gpu_through_triton():
    """Lowered for CUDA from this CPU (no GPU needed): Pallas' Triton lowering accepts both kernels at
    SDAR-like shapes (power-of-two loads, the shifted last tile, the dynamic key loop). This is the
    lowering, not the GPU compile or a run: that is test_the_compiled_kernels_equal_their_references_at_model_shapes
    on a GPU. From jax 0.11 the Triton lowering reads the GPU's description, so without a GPU
    this skips there."""

    from dlmjax.kernels.attention import kernel as attention_kernel
    from dlmjax.kernels.residual_argmax import kernel as argmax_kernel

    def lowered(fn, *args):
        try:
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except RuntimeError as error:
            if "No supported GPU devices found" not in str(error):
                raise
            pytest.skip(f"jax {jax.__version__} lowers Pallas for Triton only with a GPU present ({error})")

    q, kv = jnp.zeros((1, 32, 4, 128), jnp.bfloat16), jnp.zeros((1, 300, 2, 128), jnp.bfloat16)
    pos, k_pos = jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 300), jnp.int32)
    flash_call = functools.partial(attention_kernel.flash_part, attention="block_causal", block_size=4, tile_q=16,
                                   tile_k=128, split_k=128, interpret=False, triton=True)
    ranges = jnp.array([[130, 140]], jnp.int32), jnp.array([[250, 300]], jnp.int32)  # two query tiles' keys
    assert "triton" in lowered(flash_call, q, kv, kv, pos, pos, k_pos, k_pos, jnp.ones((1, 300), bool), *ranges)
    argmax_call = functools.partial(argmax_kernel.residual_argmax_stats, mask_id=5000, eps=1e-6, residual_scale=1.0,
                                    tile_m=16, tile_v=128, tile_d=128, split_v=1024, interpret=False, triton=True)
    x = jnp.zeros((16, 256), jnp.bfloat16)
    assert "triton" in lowered(argmax_call, x, jnp.zeros((256, 5037), jnp.bfloat16), jnp.ones((256,), jnp.bfloat16), x)


def test_the_kernels_lower_for_a_tpu(monkeypatch):
    """Lowered for a TPU from this CPU: Pallas' Mosaic lowering accepts kernel_tpu at SDAR-like shapes
    (head dim 128, grouped heads, a decode chunk of 4 queries against a cache of 300 slots, a 512-token
    prefill, a partial last key tile) in every topology and with a sliding window, and residual_argmax's kernel_tpu at a
    Qwen3-sized vocabulary (partial last tile), with the norm or the residual. Mosaic's lowering asks the chip generation,
    which a CPU has none of: a v5e's is given. This is the lowering, not the TPU compile or a run."""

    from jax._src.pallas.mosaic import tpu_info

    from dlmjax.kernels.attention import kernel_tpu

    v5e = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda *a, **k: v5e)
    spec = jax.ShapeDtypeStruct
    for queries, keys, tile_q in [(4, 300, 4), (512, 512, 256), (16, 1200, 16)]:
        q, kv = spec((2, queries, 16, 128), jnp.bfloat16), spec((2, keys, 8, 128), jnp.bfloat16)
        q_vec, k_vec = spec((2, queries), jnp.int32), spec((2, keys), jnp.int32)
        for attention, window in [("block_causal", None), ("causal", None), ("bidirectional", None), ("causal", 64)]:
            call = functools.partial(kernel_tpu.flash_part, attention=attention, block_size=4, tile_q=tile_q,
                                     tile_k=min(512, keys), interpret=False, window=window)
            ranges = spec((2, queries // tile_q), jnp.int32)  # each query tile's first and one-past-last key
            text = jax.jit(call).trace(q, kv, kv, q_vec, q_vec, k_vec, k_vec, spec((2, keys), jnp.bool_), ranges,
                                       ranges).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text and "flash_attention_tpu" in text
    from dlmjax.kernels.residual_argmax import kernel_tpu as argmax_kernel

    for rows, tile_m, eps, residual in [(64, 64, 1e-6, None), (300, 256, None, 1.0)]:
        call = functools.partial(argmax_kernel.residual_argmax_stats, mask_id=5000, eps=eps, residual_scale=residual,
                                 tile_m=tile_m, tile_v=256, interpret=False)
        x = spec((rows - rows % tile_m or rows, 2048), jnp.bfloat16)
        text = jax.jit(call).trace(x, spec((2048, 151_700), jnp.bfloat16), spec((2048,), jnp.bfloat16),
                                   x).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text and "residual_argmax_tpu" in text


def test_auto_runs_each_kernel_where_it_was_measured_to_pay(monkeypatch, caplog):
    """kernels.AUTO: on a GPU "auto" runs flash attention but keeps residual_argmax's reference
    (measured faster there), saying why, and the greedy decoders then keep their logits path; "on"
    runs both; on a TPU "auto" runs both."""
    from dlmjax.decoding.spec import parse_decoder

    kernels._LOGGED.clear()
    static = parse_decoder("static")
    with caplog.at_level(logging.INFO, logger="dlmjax.kernels"):
        for backend, mode, expected in [("gpu", "auto", {"attention": "kernel", "residual_argmax": None}),
                                        ("gpu", "on", {"attention": "kernel", "residual_argmax": "kernel"}),
                                        ("tpu", "auto", {"attention": "kernel", "residual_argmax": "kernel"})]:
            monkeypatch.setattr(jax, "default_backend", lambda: backend)
            with kernels.use(mode):
                assert {name: kernels.choose(name) for name in expected} == expected, (backend, mode)
                assert static.scores_from_hidden(None) == (expected["residual_argmax"] is not None)
    assert "residual_argmax: reference path (on gpu the reference measured faster" in caplog.text


def test_on_a_tpu_the_dispatcher_takes_the_tpu_kernel_and_probes_it(monkeypatch, caplog):
    """With the backend reported as a TPU, `attention` builds kernel_tpu's calls (head dim 128) and
    compile-probes them; this CPU cannot compile a Mosaic kernel, so the reference runs, with the
    reason logged. A head dim that is not a multiple of 128 is refused before any call is built."""
    import logging

    from dlmjax.kernels import attention as attention_module

    calls, tpu_calls = [], attention_module.tpu_calls
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(attention_module, "tpu_calls", lambda *a, **k: calls.append(k) or tpu_calls(*a, **k))
    kernels._COMPILES.clear()
    kernels._LOGGED.clear()
    case = dict(b=2, h=4, hkv=2, copies=2, width=3, cache=9, attention="block_causal", seed=5)
    with caplog.at_level(logging.INFO, logger="dlmjax.kernels"), kernels.use("auto"):
        q, parts = _attention_inputs(case)
        assert not calls and np.array_equal(attention_dispatch(q, parts), attention_reference(q, parts))
        assert "head dim 8 is not a multiple of 128" in caplog.text
        wide = [(jnp.tile(k, 16), jnp.tile(v, 16), vis) for k, v, vis in parts]
        q = jnp.tile(q, 16)
        np.testing.assert_array_equal(attention_dispatch(q, wide), attention_reference(q, wide))
    assert calls == [dict(tile_q=256, tile_k=512, interpret=False)]
    assert "attention: reference path (does not compile here" in caplog.text
