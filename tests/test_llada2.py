"""`llada2` (LLaDA2's decoding: threshold with a per-step quota; LLaDA2.1's token editing) against
a plain reference loop written here from the procedure of the model cards' generate(): no cache,
one full forward per step. Tokens and per-row forwards equal, batch 1 and batch N."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlmjax
from dlmjax.decoding.api import generate
from dlmjax.decoding.spec import DecoderSpecError, decoder_spec, parse_decoder

MASK, EOS, PAD, VOCAB = 39, 38, 0, 40
BLOCK, MAX_NEW = 8, 12
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [3], [5, 9, 14, 2, 2, 7, 30, 8, 1, 2], [20, 21]]


def peaked_sdar(seed: int):
    """A tiny random block-causal model with weights scaled up, so that its distributions are
    peaked (near-ties would make the cached and the full forward pick differently)."""
    cfg = dlmjax.ModelConfig(
        family="sdar", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=BLOCK, qk_norm=True, mask_token_id=MASK,
        eos_token_ids=(EOS,), pad_token_id=PAD, max_position_embeddings=128,
    )
    graphdef, state = nnx.split(dlmjax.init_model(cfg, seed=seed))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, state))
    head = model.embed if model.lm_head is None else model.lm_head.kernel
    head[...] = head[...] * 4.0
    return model


CANVAS = 32  # every reference canvas, padded with masks: block-causal, so padding after it changes nothing


def full_probs(model, seq):
    """[len(seq), V] fp32 probabilities of one full forward (the mask token excluded)."""
    forward = _FORWARDS.setdefault(id(model), nnx.jit(lambda m, t: jax.nn.softmax(
        m(t).logits.astype(jnp.float32).at[..., MASK].set(-jnp.inf), axis=-1)))
    padded = jnp.asarray([list(seq) + [MASK] * (CANVAS - len(seq))], jnp.int32)
    return np.asarray(forward(model, padded)[0, : len(seq)])


_FORWARDS = {}


def reference_llada2(model, prompt, *, tau, steps, editing_threshold=None, max_post_steps=16, max_new=MAX_NEW,
                     stops=(EOS,)):
    """(tokens, forwards, committed tokens, edits, post-step limit hits, stopped early) of the
    procedure, one full forward per step; `stops`: the ids a row ends at."""

    def first_stop(tokens):
        return next((i for i, t in enumerate(tokens) if t in stops), None)

    block = BLOCK
    start = (len(prompt) // block) * block
    num_blocks = math.ceil((len(prompt) - start + max_new) / block)
    seq = list(prompt) + [MASK] * (start + num_blocks * block - len(prompt))
    steps = min(steps, max_new)
    quota = [block // steps + (s < block % steps) for s in range(steps)]
    forwards = committed = edits = limit_hits = 0
    for b in range(num_blocks):
        cols = range(start + b * block, start + (b + 1) * block)
        step = post = 0
        while True:
            masked = [c for c in cols if seq[c] == MASK]
            if not masked:
                if editing_threshold is None:
                    break
                post += 1
                if post > max_post_steps:
                    limit_hits += 1
                    break
            probs = full_probs(model, seq)
            forwards += 1
            pred = {c: int(probs[c].argmax()) for c in cols}
            conf = {c: float(probs[c].max()) for c in cols}
            chosen = []
            if masked:
                q = 1 if editing_threshold is not None else quota[min(step, steps - 1)]  # LLaDA2.1: always 1
                high = [c for c in masked if conf[c] > tau]
                chosen = high if len(high) >= q else sorted(masked, key=lambda c: (-conf[c], c))[:q]
            edited = []
            if editing_threshold is not None:
                edited = [c for c in cols if c >= len(prompt) and seq[c] != MASK and conf[c] > editing_threshold
                          and pred[c] != seq[c]]
            for c in chosen + edited:
                seq[c] = pred[c]
            committed, edits = committed + len(chosen), edits + len(edited)
            generated = seq[len(prompt):]
            if (editing_threshold is None and any(seq[c] in stops for c in chosen)
                    and MASK not in generated[: first_stop(generated)]):  # LLaDA2.0's early stop
                out = generated[: min(first_stop(generated) + 1, max_new)]
                return out, forwards, committed, edits, limit_hits, True
            if not masked and not edited:
                break
            step += bool(masked)
        if first_stop(seq[len(prompt) : cols[-1] + 1]) is not None:
            break
    out = seq[len(prompt) : len(prompt) + max_new]
    end = first_stop(out)
    return (out if end is None else out[: end + 1]), forwards, committed, edits, limit_hits, False


@pytest.fixture(scope="module")
def model():
    return peaked_sdar(seed=3)


CASES = {  # spec -> reference options
    "llada2:tau=0.9,steps=3": dict(tau=0.9, steps=3),  # quotas 3, 3, 2 over a block of 8
    "llada2:tau=0.95": dict(tau=0.95, steps=32),  # steps capped at 12 > block: quota 1, then 0
    "llada2:tau=0.7,editing_threshold=0.3,max_post_steps=2": dict(tau=0.7, steps=32, editing_threshold=0.3,
                                                                  max_post_steps=2),
    "llada2:tau=0.7,editing_threshold=0.0,max_post_steps=0": dict(tau=0.7, steps=32, editing_threshold=0.0,
                                                                  max_post_steps=0),
}


ALONE = (0, 3)  # rows also decoded alone: one that starts mid-block, one whose prompt spans a block (each a
# compile of its own, so not all of them)


def matches_reference(model, spec):
    """Tokens, per-row forwards and committed tokens (TPF) of `spec` equal the reference loop's, in
    a batch and alone (rows ALONE); the reference's (edits, post-step limit hits, stopped early)
    per row."""
    together = generate(model, PROMPTS, decoder=spec, max_new_tokens=MAX_NEW)
    stats = []
    for i, prompt in enumerate(PROMPTS):
        tokens, forwards, committed, *row_stats = reference_llada2(model, prompt, **CASES[spec],
                                                                   stops=model.config.eos_token_ids)
        stats.append(row_stats)
        row = together.rows[i]
        assert row.tokens == tokens, (spec, i)
        assert row.nfe == forwards, (spec, i)
        assert row.tpf == pytest.approx(committed / forwards), (spec, i)
        if i in ALONE:
            alone = generate(model, [prompt], decoder=spec, max_new_tokens=MAX_NEW).rows[0]
            assert (alone.tokens, alone.nfe) == (row.tokens, row.nfe), (spec, i)
    assert together.tpf > 1.0 or "steps=3" not in spec
    return stats


@pytest.mark.parametrize("spec", list(CASES))
def test_llada2_matches_reference_loop_batch_and_alone(model, spec):
    stats = matches_reference(model, spec)
    if "editing" in spec:  # the edits and the post-step limit must have been exercised
        assert sum(e for e, _, _ in stats) > 0, "no token was ever edited: the test is vacuous"
        if "max_post_steps=2" in spec:
            assert sum(h for _, h, _ in stats) > 0, "no block reached max_post_steps"


@pytest.mark.parametrize("stops", [(EOS,), (EOS, 23)])
@pytest.mark.parametrize("spec", [s for s in CASES if "editing" not in s])
def test_llada2_stops_right_after_an_eos_with_nothing_masked_before_it(spec, stops):
    """LLaDA2.0's generate() returns after the step that commits an EOS with every generated
    position before it filled; the masks after it are never decoded (a model that writes EOS early;
    any of its stop ids)."""
    model = peaked_sdar(seed=4)
    model.config = model.config.replace(eos_token_ids=stops)
    stats = matches_reference(model, spec)
    assert sum(early for _, _, early in stats) >= 2, "no row stopped early: the test is vacuous"


def test_default_is_one_token_per_step_at_block_32():
    """Block 32, steps 32: quota 1 per step (LLaDA2.0's quota is the even `step_counts`)."""
    from dlmjax.decoding.policies import step_counts

    assert step_counts(32, 32) == (1,) * 32


def test_random_llada2_moe_preset(tmp_path, monkeypatch):
    """The LLaDA2 family's tiny random preset (block 32) decodes with the default spec as the loop
    does, and with editing."""
    from dlmjax.presets import load_checkpoint

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    _, moe, tokenizer, _ = load_checkpoint("random-llada2-moe")
    prompt = tokenizer.encode("ab")
    # steps capped at max_new_tokens = 8 (as generate() caps them at gen_length): quota 32 / 8 = 4
    # per step; the untrained model passes no 0.95, so the block of 30 masks takes 8 forwards
    row = generate(moe, [prompt], decoder="llada2", max_new_tokens=8).rows[0]
    assert (row.nfe, len(row.tokens), row.tpf) == (8, 8, 30 / 8)
    # LLaDA2.1 (editing) commits one token per step where nothing passes tau, whatever the steps
    edited = generate(moe, [prompt], decoder="llada2:editing_threshold=0.0,max_post_steps=3", max_new_tokens=8)
    assert 30 < edited.rows[0].nfe <= 30 + 3 and len(edited.rows[0].tokens) == 8


def test_options_typed_and_ranged():
    from dlmjax.presets import load_eval_preset

    for name in ("llada2.0-mini", "llada2.1-mini"):  # the presets' decoder specs parse
        for spec in load_eval_preset(name).decoders:
            parse_decoder(spec)
    assert decoder_spec(parse_decoder("llada2:editing_threshold=0.5,tau=0.7")) == "llada2:tau=0.7,editing_threshold=0.5"
    for spec, message in [("llada2:steps=0", r"steps=0 must be in \[1, 65536\]"),
                          ("llada2:editing_threshold=1.5", r"editing_threshold=1.5 must be in \[0, 1\]"),
                          ("llada2:tau=0", r"tau=0.0 must be in \(0, 1\]"),
                          ("llada2:max_post_steps=-1", "max_post_steps=-1 must be >= 0"),
                          ("llada2:max_post_steps=4", "set editing_threshold too"),
                          ("llada2:editing_threshold=0.5,steps=4", "with editing_threshold .*LLaDA2.1.*drop steps"),
                          ("llada2:editing_threshold=high", "not a valid float")]:
        with pytest.raises(DecoderSpecError, match=message):
            parse_decoder(spec)
