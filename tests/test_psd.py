"""PSD: lossless against its policy run one step per forward, fewer forwards, and drafts that
make no model call."""

import jax
import jax.numpy as jnp
import pytest

from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.decoding.psd import PSD
from dlmjax.decoding.spec import DecoderSpecError, parse_decoder
from test_decoding import EOS, MASK, MAX_NEW, PAD, PROMPTS, peaky_model

POLICIES = ["threshold,tau=0.5", "topk,k=1", "decay,tau=0.4,decay=0.1", "margin,margin=0.3"]


@pytest.fixture(scope="module")
def sdar():
    return peaky_model("sdar", seed=1)


def tokens(result):
    return [row.tokens for row in result.rows]


@pytest.mark.parametrize("policy", POLICIES)
def test_psd_equals_its_policy_one_step_per_forward(sdar, policy):
    stepwise = generate(sdar, PROMPTS, decoder=f"psd:policy={policy},depth=1", max_new_tokens=MAX_NEW)
    speculative = generate(sdar, PROMPTS, decoder=f"psd:policy={policy},depth=4", max_new_tokens=MAX_NEW)
    assert tokens(speculative) == tokens(stepwise)
    assert speculative.forwards <= stepwise.forwards
    assert all(s.nfe <= p.nfe for s, p in zip(speculative.rows, stepwise.rows))


def test_psd_saves_forwards_and_is_batch_invariant(sdar):
    stepwise = generate(sdar, PROMPTS, decoder="psd:policy=topk,depth=1", max_new_tokens=MAX_NEW)
    speculative = generate(sdar, PROMPTS, decoder="psd:policy=topk,depth=4", max_new_tokens=MAX_NEW)
    assert speculative.tpf > stepwise.tpf == 1.0, "no draft was ever accepted: the test is vacuous"
    # Results report the accepted length (tokens per verifying forward) of speculative decoders only.
    assert all(r.mean_accepted_length == r.tpf for r in speculative.rows)
    assert all(r.mean_accepted_length is None for r in stepwise.rows)
    for i in (1, 5):  # two prompts with the same layout alone: batch 1
        alone = generate(sdar, [PROMPTS[i]], decoder="psd:policy=topk,depth=4", max_new_tokens=MAX_NEW)
        assert alone.rows[0].tokens == speculative.rows[i].tokens
        assert alone.rows[0].nfe == speculative.rows[i].nfe


def test_psd_threshold_policy_is_the_threshold_decoder(sdar):
    baseline = generate(sdar, PROMPTS, decoder="threshold:tau=0.5", max_new_tokens=MAX_NEW)
    speculative = generate(sdar, PROMPTS, decoder="psd:policy=threshold,tau=0.5,depth=3", max_new_tokens=MAX_NEW)
    assert tokens(speculative) == tokens(baseline)


@pytest.mark.parametrize("family,cache", [("llada", "none"), ("llada", "dual"), ("dream", "prefix")])
def test_psd_on_bidirectional_cache_modes(family, cache):
    model = peaky_model(family, seed=2)
    spec = f"psd:policy=topk,block=4,cache={cache}"
    stepwise = generate(model, PROMPTS[:4], decoder=f"{spec},depth=1", max_new_tokens=MAX_NEW)
    speculative = generate(model, PROMPTS[:4], decoder=f"{spec},depth=4", max_new_tokens=MAX_NEW)
    assert tokens(speculative) == tokens(stepwise)
    assert speculative.tpf > stepwise.tpf  # fewer forwards per row (the batch waits for its slowest row)


def eos_prone(model):
    """`model` with its EOS logit scaled up: rows stop inside blocks, at different places."""
    if model.lm_head is None:
        model.embed[...] = model.embed[...].at[EOS].multiply(3.0)
    else:
        model.lm_head.kernel[...] = model.lm_head.kernel[...].at[:, EOS].multiply(3.0)
    return model


@pytest.mark.parametrize("policy,options", [("threshold,tau=0.5", ""), ("topk,k=1", ""),
                                            ("threshold,tau=0.5", ",eos_last=true"), ("topk,k=1", ",no_eos=true")])
def test_psd_equals_its_policy_with_stops_inside_blocks_and_a_partial_last_block(policy, options):
    """EOS inside blocks, the stop-token options, and 7 new tokens at block 4 (the last block cut)."""
    model = eos_prone(peaky_model("sdar", seed=4))
    stepwise = generate(model, PROMPTS, decoder=f"psd:policy={policy},depth=1{options}", max_new_tokens=7)
    speculative = generate(model, PROMPTS, decoder=f"psd:policy={policy},depth=4{options}", max_new_tokens=7)
    assert tokens(speculative) == tokens(stepwise)
    assert all(s.nfe <= p.nfe for s, p in zip(speculative.rows, stepwise.rows))
    if not options:  # rows stop at EOS inside a block, not all at the budget
        assert any(EOS in row.tokens and len(row.tokens) < 7 for row in stepwise.rows), "no early stop"


class CountingModel:
    """Wraps a model and counts its calls."""

    def __init__(self, model):
        self.model, self.config, self.calls = model, model.config, 0

    def lm_logits(self, hidden):
        return self.model.lm_logits(hidden)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_drafts_make_no_model_call_and_a_round_is_one_forward(sdar):
    """Drafts are built without the model; the round's only forward is the packed verification,
    and it counts as one forward."""
    geometry, canvas, rows = engine.plan_layout([PROMPTS[1]], block=4, max_new_tokens=MAX_NEW, block_causal=True,
                                                pad_id=PAD, mask_id=MASK)
    model = CountingModel(sdar)
    fwd = engine.BlockForwards(model, rows, geometry, "exact", MASK, eos_ids=(EOS,))
    state = engine.start(fwd, jnp.asarray(canvas))
    assert int(state.forwards) == 1 and int(state.nfe[0]) == 1  # the prefill yields block 0's logits
    decoder = PSD(policy="topk", depth=4)
    tokens = fwd.block_tokens(state.canvas, state.block)
    model.calls = 0
    plan = decoder.plan(fwd, state, tokens, tokens == MASK, None)
    assert model.calls == 0 and plan.copies.shape == (1, 4, 4)
    after = engine.decode_round(decoder, fwd, state, seed_key=jax.random.key(0))
    assert int(after.forwards) == 2 and int(after.nfe[0]) == 2
    assert int(after.committed[0]) >= 2, "the verification accepted no draft beyond the first commit"


def test_bad_psd_options():
    with pytest.raises(DecoderSpecError, match="policy='greedy'; choose one of threshold, topk, decay, margin"):
        parse_decoder("psd:policy=greedy")
    with pytest.raises(DecoderSpecError, match="psd is greedy"):
        parse_decoder("psd:temperature=0.7")
    with pytest.raises(DecoderSpecError, match="depth=0"):
        parse_decoder("psd:depth=0")
    # another policy's option would run the default policy under a label that names it
    with pytest.raises(DecoderSpecError, match=r"k=8 is not an option of policy=threshold .* \(topk\)"):
        parse_decoder("psd:k=8")
    with pytest.raises(DecoderSpecError, match=r"tau=0.1 is not an option of policy=topk .* \(threshold, decay\)"):
        parse_decoder("psd:policy=topk,tau=0.1")
    for options in ("top_p=0.5", "sampled_scores=true"):  # sampling options of a greedy decoder
        with pytest.raises(DecoderSpecError, match="top_p and sampled_scores shape sampling"):
            parse_decoder(f"psd:{options}")
        with pytest.raises(DecoderSpecError, match="depth=2 is PSD"):  # sampling CE: not over PSD
            parse_decoder(f"ce:depth=2,temperature=0.5,{options}")
        with pytest.raises(DecoderSpecError, match="shape sampling, and temperature=0 is greedy"):
            parse_decoder(f"ce:depth=2,{options}")
    assert parse_decoder("ce:top_p=0.5,temperature=0.5").top_p == 0.5  # one step per forward: it samples


def test_a_depth_deeper_than_the_block_is_refused(sdar):
    """Each draft commits at least one more token, so a block of K holds at most K drafts; a deeper
    PSD only made its forwards slower."""
    block = sdar.config.block_size
    generate(sdar, PROMPTS[:1], decoder=f"psd:depth={block}", max_new_tokens=MAX_NEW)
    with pytest.raises(DecoderSpecError, match=f"depth={block + 1} cannot fit a block of {block} tokens"):
        generate(sdar, PROMPTS[:1], decoder=f"psd:depth={block + 1}", max_new_tokens=MAX_NEW)
