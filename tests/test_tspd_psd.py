"""PSD over the stateful policies (ce, tspd): `depth=N` drafts N steps of the policy per forward
and gives, token for token, the policy run one step per forward (depth=1), with no more forwards;
drafts make no model call and a round is one forward; bad options are clear errors."""

import jax
import jax.numpy as jnp
import pytest

from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.decoding.spec import DecoderSpecError, parse_decoder
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.heads.controller import FEATURES, Controller, model_fingerprint, save_controller
from dlmjax.presets import load_checkpoint
from test_decoding import EOS, MASK, MAX_NEW, PAD, PROMPTS, peaky_model
from test_psd import CountingModel

ALONE = 5  # the prompt also decoded at batch 1


@pytest.fixture(scope="module")
def sdar():
    return peaky_model("sdar", seed=1)


@pytest.fixture(scope="module")
def peaky_controller(sdar, tmp_path_factory):
    """An untrained token controller for the peaked model (its features standardised to about
    N(0, 1)): the PSD walk must follow whatever the controller decides."""
    path = tmp_path_factory.mktemp("ctl") / "ctl.safetensors"
    controller = Controller(len(FEATURES), 16, seed=0, mean=[0.5, 0.5, 0.0, 1.0, 1.5, 8.0],
                            std=[0.3, 0.5, 0.2, 1.0, 1.2, 5.0])
    return save_controller(controller, path, features=FEATURES, threshold=0.5, model=model_fingerprint(sdar.config))


@pytest.fixture(scope="module")
def toy():
    _, model, tokenizer, _ = load_checkpoint("toy-sdar")
    tasks = load_eval_set("toy-arith", limit=8)
    return model, tokenizer, [item.prompt for item in tasks.items], tasks.max_new_tokens


def tokens(result):
    return [row.tokens for row in result.rows]


def assert_psd_is_the_policy_with_fewer_forwards(stepwise, speculative):
    assert tokens(speculative) == tokens(stepwise)
    assert speculative.forwards <= stepwise.forwards
    assert all(s.nfe <= p.nfe for s, p in zip(speculative.rows, stepwise.rows))
    assert speculative.tpf > stepwise.tpf, "no draft was ever accepted: the test is vacuous"


def check_batch_and_alone(model, prompts, policy, max_new_tokens, tokenizer=None):
    kw = dict(tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    stepwise = generate(model, prompts, decoder=policy, **kw)
    speculative = generate(model, prompts, decoder=f"{policy},depth=4", **kw)
    assert_psd_is_the_policy_with_fewer_forwards(stepwise, speculative)
    alone = generate(model, [prompts[ALONE]], decoder=f"{policy},depth=4", **kw).rows[0]
    assert alone.tokens == stepwise.rows[ALONE].tokens and alone.nfe == speculative.rows[ALONE].nfe


def test_psd_over_ce_is_ce_one_step_per_forward(sdar):
    check_batch_and_alone(sdar, PROMPTS, "ce:tau=0.7", MAX_NEW)


def test_psd_over_tspd_is_tspd_one_step_per_forward(sdar, peaky_controller):
    check_batch_and_alone(sdar, PROMPTS, f"tspd:controller={peaky_controller}", MAX_NEW)


def test_psd_over_the_shipped_toy_sdar_controller(toy):
    model, tokenizer, prompts, max_new = toy
    check_batch_and_alone(model, prompts, "tspd:controller=toy-sdar", max_new, tokenizer)


def test_psd_over_ce_on_toy_sdar(toy):
    model, tokenizer, prompts, max_new = toy
    stepwise = generate(model, prompts, tokenizer=tokenizer, decoder="ce:tau=0.9", max_new_tokens=max_new)
    speculative = generate(model, prompts, tokenizer=tokenizer, decoder="ce:tau=0.9,depth=4", max_new_tokens=max_new)
    assert_psd_is_the_policy_with_fewer_forwards(stepwise, speculative)


def test_drafts_make_no_model_call_and_a_round_is_one_forward(sdar):
    geometry, canvas, rows = engine.plan_layout([PROMPTS[1]], block=4, max_new_tokens=MAX_NEW, block_causal=True,
                                                pad_id=PAD, mask_id=MASK)
    model = CountingModel(sdar)
    fwd = engine.BlockForwards(model, rows, geometry, "exact", MASK, eos_ids=(EOS,))
    decoder = parse_decoder("ce:tau=0.7,depth=4")
    state = engine.start(fwd, jnp.asarray(canvas), decoder)
    block = fwd.block_tokens(state.canvas, state.block)
    model.calls = 0
    plan = decoder.plan(fwd, state, block, block == MASK, None)
    assert model.calls == 0 and plan.copies.shape == (1, 4, 4)
    after = engine.decode_round(decoder, fwd, state, seed_key=jax.random.key(0))
    assert int(after.forwards) == 2 and int(after.nfe[0]) == 2
    # the round calls the model where ce one step per forward does (its forward's cache branches)
    traced, model.calls = model.calls, 0
    engine.decode_round(parse_decoder("ce:tau=0.7"), fwd, state, seed_key=jax.random.key(0))
    assert traced == model.calls
    # the carry has observed the seed and the logits of the accepted copy's predecessors: as many
    # rounds as the accepted depth (the accepted copy's own logits seed the next round)
    resolved = fwd.block_tokens(after.canvas, state.block)[0]
    depths = [d + 1 for d in range(4) if bool(jnp.all(plan.copies[0, d] == resolved))]
    observed = after.carry["traj"].rounds[0].tolist()
    assert observed == [observed[0]] * 4 and observed[0] in depths
    assert observed[0] >= 2, "the verification accepted no draft beyond the first step"


def test_bad_depth_options():
    with pytest.raises(DecoderSpecError, match="depth=0 must be >= 1"):
        parse_decoder("ce:depth=0")
    with pytest.raises(DecoderSpecError, match="not a valid int"):
        parse_decoder("ce:depth=two")
    with pytest.raises(DecoderSpecError, match="greedy"):
        parse_decoder("ce:depth=4,temperature=0.7")
    assert parse_decoder("ce:temperature=0.7").depth == 1  # one step per forward may sample
    with pytest.raises(DecoderSpecError, match="tspd:controller=toy-sdar,depth=4"):
        parse_decoder("psd:policy=tspd")
