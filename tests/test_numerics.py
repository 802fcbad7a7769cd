"""The numerics switch (`dlmjax.numerics`): matmul precision, and the batch-invariant mode in which a
row's logits are bitwise the same alone, in a batch and as one of N packed copies.

On CPU the fast mode already breaks bitwise invariance in fp32 (XLA picks matmul and reduction
code by shape: measured 4e-6..9e-6 between a row alone and in a batch of 7), so these tests prove
the mode on CPU too, not only on accelerators."""

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlmjax
from dlmjax import arithmetic
from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.decoding.spec import parse_decoder
from dlmjax.heads.mrp import init_head
from dlmjax.models.transformer import KVCache
from dlmjax.validation import InputError
from test_decoding import MAX_NEW, PROMPTS, peaky_model

BLOCK, PROMPT_LEN, VOCAB = 4, 12, 384


def plain_model(dtype: str):
    """A small random SDAR model, not sharpened: its logits have the near-ties that real models have."""
    cfg = dlmjax.ModelConfig(
        family="sdar", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, attention="block_causal", block_size=BLOCK, qk_norm=True,
        mask_token_id=VOCAB - 1, eos_token_ids=(VOCAB - 2,), pad_token_id=0, max_position_embeddings=64, dtype=dtype,
    )
    return dlmjax.init_model(cfg, seed=3)


def block_logits(model, prompts_bp, copies_bnk, *, left_pad=0, spare_slots=0):
    """Logits [B, N, K, V] of N packed candidate copies of each row's next block, after a prefill of
    its prompt: the layout of PSD and MRP verification (engine.BlockForwards.verify). `left_pad`
    hidden slots before the prompt and `spare_slots` empty ones after the block widen the cache,
    as a longer neighbour row does in the engine (its prefix, or a block more of canvas)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_block_logits(graphdef, state, prompts_bp, copies_bnk, left_pad=left_pad,
                                    spare_slots=spare_slots))


@partial(arithmetic.jit, static_argnames=("graphdef", "left_pad", "spare_slots"))
def _block_logits(graphdef, state, prompts_bp, copies_bnk, left_pad, spare_slots):
    model = nnx.merge(graphdef, state)
    b, n, k = copies_bnk.shape
    cache = KVCache.init(model.config, b, left_pad + PROMPT_LEN + k + spare_slots)
    tokens = jnp.pad(prompts_bp, ((0, 0), (left_pad, 0)))
    positions = jnp.broadcast_to(jnp.maximum(jnp.arange(left_pad + PROMPT_LEN) - left_pad, 0), tokens.shape)
    prefill = model(tokens, positions, valid_bl=jnp.broadcast_to(jnp.arange(tokens.shape[1]) >= left_pad, tokens.shape),
                    cache=cache, write_cache=True)
    positions = jnp.tile(jnp.arange(PROMPT_LEN, PROMPT_LEN + k), (b, n))
    segments = jnp.broadcast_to(jnp.repeat(jnp.arange(1, n + 1), k), (b, n * k))
    out = model(copies_bnk.reshape(b, n * k), positions, segments_bl=segments, cache=prefill.cache,
                chunk_parts=engine.copy_parts(n, k))
    return out.logits.astype(jnp.float32).reshape(b, n, k, -1)


def layouts(model):
    """Row 0's block logits alone, in a batch of 7, in a batch of 64, and as copy 3 of 4."""
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(1, VOCAB - 2, (64, PROMPT_LEN)), jnp.int32)
    copies = jnp.asarray(rng.integers(1, VOCAB - 2, (64, 4, BLOCK)), jnp.int32)
    own = copies[:, 2:3]
    return {
        "alone": block_logits(model, prompts[:1], own[:1])[0, 0],
        "batch 7": block_logits(model, prompts[:7], own[:7])[0, 0],
        "batch 64": block_logits(model, prompts, own)[0, 0],
        "copy 3 of 4": block_logits(model, prompts[:1], copies[:1])[0, 2],
        "cache a block wider": block_logits(model, prompts[:7], own[:7], spare_slots=BLOCK)[0, 0],
        "left-padded by 5": block_logits(model, prompts[:7], copies[:7], left_pad=5)[0, 2],
    }


def test_chunk_parts_that_leave_keys_out_are_refused():
    model = plain_model("float32")
    tokens = jnp.ones((1, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"chunk_parts=\(2, 2\) must add up to the chunk's 6 tokens"):
        model(tokens, chunk_parts=(2, 2))
    assert model(tokens, chunk_parts=(2, 4)).logits.shape[:2] == (1, 6)


def test_DLMJAX_INVARIANT_is_a_switch_read_when_used(monkeypatch, capsys):
    """1/true/on and 0/false/off/unset; anything else is refused where it is read (the CLI: one
    line, exit 2), not taken as "on" (`false` used to turn the 7-10x slower mode on)."""
    from dlmjax.cli import main

    for value, on in (("false", False), ("0", False), ("", False), ("off", False), ("1", True), (" On ", True),
                      ("true", True)):
        monkeypatch.setenv("DLMJAX_INVARIANT", value)
        assert arithmetic.current().invariant is on, value
    monkeypatch.setenv("DLMJAX_INVARIANT", "maybe")
    with pytest.raises(InputError, match="DLMJAX_INVARIANT='maybe' is not a switch; set it to 1 .on. or 0 .off."):
        arithmetic.current()
    assert main(["generate", "--model", "toy-sdar", "--prompt", "1+1"]) == 2
    assert capsys.readouterr().err.startswith("dlmjax generate: error: DLMJAX_INVARIANT='maybe'")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_mode_gives_a_row_bitwise_the_same_logits_in_any_layout(dtype):
    model = plain_model(dtype)
    with dlmjax.numerics(invariant=True):
        logits = layouts(model)
    for layout, value in logits.items():
        np.testing.assert_array_equal(value, logits["alone"], err_msg=f"{layout} differs from the row alone")


AT_DEFAULT_LEVEL = """
import numpy as np, dlmjax
from test_numerics import layouts, plain_model
for dtype in ("float32", "bfloat16"):
    with dlmjax.numerics(invariant=True):
        logits = layouts(plain_model(dtype))
    for layout, value in logits.items():
        diff = float(np.abs(value - logits["alone"]).max())
        print(dtype, layout, diff)
        assert diff == 0, (dtype, layout, diff)
"""


def test_invariant_mode_holds_at_xlas_default_optimisation_level():
    """The test above in a fresh process compiled as users compile. The suite compiles at LLVM level
    0 (conftest, for speed), where these layouts were equal; at XLA's default level LLVM contracts
    products into FMAs, and which product depended on whether a tiled loop ran once or more: a row
    alone differed from itself in a batch by 3e-7 in fp32 until every tiled loop ran at least twice
    (`Numerics.min_tiles`)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", AT_DEFAULT_LEVEL], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count(" 0.0\n") == 12


def test_fast_mode_is_not_bitwise_invariant_here_so_the_test_above_can_fail():
    with dlmjax.numerics(invariant=False):  # `scripts/test.sh --device` turns the invariant mode on
        logits = layouts(plain_model("float32"))
    differs = [name for name, value in logits.items() if not np.array_equal(value, logits["alone"])]
    if not differs:
        pytest.skip("this platform's fast mode happens to be bitwise invariant for these shapes")
    assert max(np.abs(logits[name] - logits["alone"]).max() for name in differs) < 1e-3


@pytest.mark.parametrize("family, cache", [("llada", "none"), ("dream", "none"), ("llada", "dual")])
def test_invariant_mode_packed_copies_of_a_bidirectional_canvas_are_a_lone_copys_logits(family, cache):
    """PSD's layout on LLaDA and Dream: copies of the whole canvas packed in one verification
    forward. Without a cache each copy is a lone attention part; a one-part softmax compiled one ulp
    apart from a many-part one until a hidden one-key part made them one program (found in review)."""
    model = peaky_model(family, seed=2)
    cfg = model.config
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 36, size=n)) for n in (5, 9, 2)]
    geometry, canvas, rows = engine.plan_layout(prompts, block=8, max_new_tokens=16, block_causal=False, pad_id=0,
                                                mask_id=cfg.mask_token_id)
    fwd = engine.BlockForwards(model, rows, geometry, cache, cfg.mask_token_id)
    verify = jax.jit(fwd.verify)
    with dlmjax.numerics(invariant=True):
        state = engine.start(fwd, jnp.asarray(canvas))
        block = np.array(fwd.block_tokens(state.canvas, state.block))
        copies = np.stack([block] * 4, 1)
        for d in range(4):
            copies[:, d, : d + 1] = 7
        packed, _ = verify(state.canvas, jnp.asarray(copies), state.cache, state.block)
        for d in range(4):
            alone, _ = verify(state.canvas, jnp.asarray(copies[:, d : d + 1]), state.cache, state.block)
            np.testing.assert_array_equal(np.asarray(alone[:, 0]), np.asarray(packed[:, d]), err_msg=f"copy {d}")


@pytest.mark.parametrize("decoder", ["psd:policy=topk,depth=4", "psd:policy=threshold,tau=0.3,depth=3"])
def test_invariant_mode_psd_equals_its_policy_and_rows_equal_themselves_alone(decoder):
    model = plain_model("float32")
    prompts = [[t % (VOCAB - 3) + 1 for t in p] for p in PROMPTS]
    policy = decoder.replace("depth=4", "depth=1").replace("depth=3", "depth=1")
    with dlmjax.numerics(invariant=True):
        speculative = generate(model, prompts, decoder=decoder, max_new_tokens=2 * MAX_NEW)
        stepwise = generate(model, prompts, decoder=policy, max_new_tokens=2 * MAX_NEW)
        alone = [generate(model, [p], decoder=decoder, max_new_tokens=2 * MAX_NEW).rows[0] for p in prompts[:3]]
    assert [r.tokens for r in speculative.rows] == [r.tokens for r in stepwise.rows]
    assert speculative.forwards < stepwise.forwards, "no draft was accepted: the test is vacuous"
    assert [r.tokens for r in alone] == [r.tokens for r in speculative.rows[:3]]
    assert [r.nfe for r in alone] == [r.nfe for r in speculative.rows[:3]]


def test_invariant_mode_mrp_spec_equals_static():
    model = plain_model("float32")
    head = init_head(model.config, num_layers=1, init_std=0.2, seed=1)
    prompts = [[t % (VOCAB - 3) + 1 for t in p] for p in PROMPTS]
    with dlmjax.numerics(invariant=True):
        spec = generate(model, prompts, decoder="mrp-spec:drafts=3", max_new_tokens=2 * MAX_NEW, head=head)
        static = generate(model, prompts, decoder="static", max_new_tokens=2 * MAX_NEW)
    assert [r.tokens for r in spec.rows] == [r.tokens for r in static.rows]
    assert spec.forwards < static.forwards, "no draft was accepted: the test is vacuous"


@partial(arithmetic.jit, static_argnames=("graphdef", "geometry", "decoder", "rounds"))
def _round_logits(graphdef, state, canvas, rows, geometry, decoder, rounds):
    """Every row's block logits after the prefill and after each of `rounds` engine rounds."""
    fwd = engine.BlockForwards(nnx.merge(graphdef, state), rows, geometry, "exact", VOCAB - 1, eos_ids=(VOCAB - 2,))
    start = engine.start(fwd, canvas, decoder)

    def one_round(st, _):
        st = engine.decode_round(decoder, fwd, st, seed_key=jax.random.key(0))
        return st, st.logits

    _, logits = jax.lax.scan(one_round, start, None, length=rounds)
    return jnp.concatenate([start.logits[None], logits])


def round_logits(model, prompts, rounds: int = 4):
    geometry, canvas, rows = engine.plan_layout(prompts, block=BLOCK, max_new_tokens=8, block_causal=True, pad_id=0,
                                                mask_id=VOCAB - 1)
    graphdef, state = nnx.split(model)
    return np.asarray(_round_logits(graphdef, state, jnp.asarray(canvas), jax.tree.map(jnp.asarray, rows),
                                    geometry=geometry, decoder=parse_decoder("threshold:tau=0.3"), rounds=rounds))


def test_invariant_mode_a_row_beside_a_row_a_block_wider_keeps_its_logits():
    """A 3-token prompt does not end on a block boundary, so its row needs a block more of canvas,
    and the whole batch's cache widens by a block. In invariant mode the 20-token row's logits
    stay bitwise its own alone through the engine's rounds (review, 2026-11-28: 2.7e-7 to 3.9e-7
    off in fp32 before, also at the suite's LLVM level)."""
    model = plain_model("float32")
    rng = np.random.default_rng(1)
    row = [int(t) for t in rng.integers(1, VOCAB - 3, 20)]
    with dlmjax.numerics(invariant=True):
        alone = round_logits(model, [row])[:, 0]
        beside = round_logits(model, [row, [5, 6, 7]])[:, 0]
    np.testing.assert_array_equal(beside, alone)


def causal_model(dtype: str):
    """plain_model's causal twin: an autoregressive target for `ar` and the drafters."""
    cfg = plain_model(dtype).config.replace(family="qwen3", attention="causal", block_size=None, mask_token_id=None)
    return dlmjax.init_model(cfg, seed=3)


@partial(arithmetic.jit, static_argnames=("graphdef", "steps", "left_pad"))
def _ar_step_logits(graphdef, state, prompt_bp, tokens_bk, steps, left_pad):
    """Logits of `steps` tokens as `ar` computes them: a prefill, then one token per forward
    against a cache of prompt + steps slots, the prompt after `left_pad` hidden slots."""
    model = nnx.merge(graphdef, state)
    b, p = prompt_bp.shape
    width = left_pad + p
    tokens = jnp.pad(prompt_bp, ((0, 0), (left_pad, 0)))
    positions = jnp.broadcast_to(jnp.maximum(jnp.arange(width) - left_pad, 0), (b, width))
    out = model(tokens, positions, valid_bl=jnp.broadcast_to(jnp.arange(width) >= left_pad, (b, width)),
                cache=KVCache.init(model.config, b, width + steps), write_cache=True)
    logits, cache = [out.logits[:, -1]], out.cache
    for i in range(steps - 1):
        out = model(tokens_bk[:, i:i + 1], jnp.full((b, 1), p + i), cache=cache, write_cache=True)
        logits.append(out.logits[:, -1])
        cache = out.cache
    return jnp.stack(logits, axis=1)


@partial(arithmetic.jit, static_argnames="graphdef")
def _verification_logits(graphdef, state, prompt_bp, tokens_bk):
    """The same logits as a drafter's verification computes them: one forward of the k tokens
    against the prompt's cache, which is wider than `ar`'s, as `speculative`'s is."""
    model = nnx.merge(graphdef, state)
    (b, p), k = prompt_bp.shape, tokens_bk.shape[1]
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    out = model(prompt_bp, positions, cache=KVCache.init(model.config, b, p + 3 * k), write_cache=True)
    chunk = model(tokens_bk[:, :-1], p + jnp.broadcast_to(jnp.arange(k - 1), (b, k - 1)), cache=out.cache)
    return jnp.concatenate([out.logits[:, -1:], chunk.logits], axis=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_mode_a_drafters_verification_gives_ars_logits(dtype):
    """`ar` attends token by token (the cache, then one key); a drafter's verification attends k
    tokens at once (a shorter cache, then k keys), with a wider cache. In invariant mode a query
    sums its keys in one order whatever holds them, so the logits are bitwise `ar`'s, and `ar`'s
    are the same for a row left-padded beside a longer one (review, 2026-11-28: 1.5e-7 to 2.6e-7 in
    fp32 before)."""
    graphdef, state = nnx.split(causal_model(dtype))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, VOCAB - 3, (1, 10)), jnp.int32)
    tokens = jnp.asarray(rng.integers(1, VOCAB - 3, (1, 6)), jnp.int32)
    with dlmjax.numerics(invariant=True):
        ar = np.asarray(_ar_step_logits(graphdef, state, prompt, tokens, steps=6, left_pad=0))
        verified = np.asarray(_verification_logits(graphdef, state, prompt, tokens))
        padded = np.asarray(_ar_step_logits(graphdef, state, prompt, tokens, steps=6, left_pad=7))
    np.testing.assert_array_equal(verified, ar)
    np.testing.assert_array_equal(padded, ar)


def test_invariant_mode_controller_outputs_of_a_row_do_not_depend_on_its_batch():
    """The TSPD controller and the Learn2PD block filter (dlmjax.heads.controller) decide commits:
    in invariant mode a row's P(final) is bitwise the same alone and in a batch."""
    from dlmjax.heads.controller import BLOCK_FEATURES, FEATURES, Controller, mlp_outputs

    for features in (len(FEATURES), len(BLOCK_FEATURES), 8):
        params = Controller(features, hidden=64, seed=3).params()
        x = jnp.asarray(np.random.default_rng(features).normal(size=(6, features)), jnp.float32)
        with dlmjax.numerics(invariant=True):
            run = arithmetic.jit(lambda c: mlp_outputs(params, c))
            batch = np.asarray(run(x))
            assert all(np.array_equal(np.asarray(run(x[i:i + 1]))[0], batch[i]) for i in range(6)), features


def test_invariant_mode_token_logits_of_a_row_do_not_depend_on_its_batch():
    """`token_logits` (mrp-remask's veto against delta, hidden log-probs) in fixed row tiles: a
    row's values alone, in a batch of 7 and of 64 are bitwise the same."""
    graphdef, params = nnx.split(plain_model("float32"))
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(64, 4, 128)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (64, 4)), jnp.int32)
    with dlmjax.numerics(invariant=True):
        run = arithmetic.jit(lambda p, h, t: nnx.merge(graphdef, p).token_logits(h, t))
        full = np.asarray(run(params, hidden, tokens))
        for n in (1, 7):
            np.testing.assert_array_equal(np.asarray(run(params, hidden[:n], tokens[:n])), full[:n])


def test_invariant_mode_keeps_the_fast_modes_tokens_on_a_peaked_model():
    """The mode changes rounding only: where no near-tie exists, the tokens are the fast mode's."""
    model = peaky_model("sdar", seed=1)
    with dlmjax.numerics(invariant=False):
        fast = generate(model, PROMPTS, decoder="threshold:tau=0.5", max_new_tokens=MAX_NEW)
    with dlmjax.numerics(invariant=True):
        invariant = generate(model, PROMPTS, decoder="threshold:tau=0.5", max_new_tokens=MAX_NEW)
    assert [r.tokens for r in invariant.rows] == [r.tokens for r in fast.rows]


def test_compiled_functions_are_keyed_by_the_numerics():
    """A program traced in one mode is never reused in the other."""
    mode = arithmetic.jit(lambda x: x + int(arithmetic.current().invariant))
    with dlmjax.numerics(invariant=False):  # `scripts/test.sh --device` turns the invariant mode on
        assert int(mode(jnp.int32(0))) == 0
        with dlmjax.numerics(invariant=True):
            assert int(mode(jnp.int32(0))) == 1
        assert int(mode(jnp.int32(0))) == 0


def test_tile_loops_run_min_tiles_times_and_programs_are_keyed_by_it():
    """A batch that fits one tile still loops `min_tiles` times (2, see `arithmetic.row_tiles`);
    `min_tiles=1` compiles a program of its own, never one traced under 2."""
    tiles = arithmetic.jit(lambda x: arithmetic.row_tiles(x, 4).shape[0] + 0 * x.sum())
    x = jnp.ones((3, 2))
    assert int(tiles(x)) == 2
    with dlmjax.numerics(min_tiles=1):
        assert int(tiles(x)) == 1
    with dlmjax.numerics(min_tiles=3):
        assert arithmetic.row_tiles(jnp.ones((9, 2)), 4).shape == (3, 4, 2)
    assert int(tiles(x)) == 2


def test_precision_sets_jax_matmul_precision_inside_and_restores_it():
    before = jax.config.jax_default_matmul_precision
    with dlmjax.numerics(precision="highest") as setting:
        assert setting.precision == "highest"
        assert jax.config.jax_default_matmul_precision == "highest"
    assert jax.config.jax_default_matmul_precision == before


@pytest.mark.parametrize("options, message", [
    (dict(precision="tf32"), "choose one of default, highest"),
    (dict(row_tile=0), "row_tile=0: tile sizes and counts must be >= 1"),
    (dict(sequence_tile=0), "sequence_tile=0: tile sizes"),
    (dict(min_tiles=0, query_tile=-1, key_tile=0), "query_tile=-1, key_tile=0, min_tiles=0: tile sizes"),
])
def test_bad_numerics_options(options, message):
    with pytest.raises(InputError, match=message):
        with dlmjax.numerics(**options):
            pass


def test_the_device_suite_refuses_to_run_where_jax_has_no_such_device():
    """`scripts/test.sh --device gpu` with a python whose jax is CPU-only stops before any test,
    naming the fix, instead of running the "device" suite on the CPU."""
    env = {**os.environ, "DLMJAX_TEST_DEVICE": "gpu", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "test_numerics.py::test_bad_numerics_options"], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    assert "has no gpu backend, only cpu" in run.stdout + run.stderr
    assert "DLMJAX_PYTHON=python3 scripts/test.sh --device gpu" in run.stdout + run.stderr
    assert " passed" not in run.stdout
