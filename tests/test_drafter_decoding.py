"""Speculative decoding with a drafter: greedy output equals the target's own greedy output, and
per-round accepted lengths equal the PyTorch reference's; sampled mode keeps the target's
distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dlmjax
from dlmjax.decoding.ar import generate_ar
from dlmjax.decoding.speculative import accept_sampled, generate_with_drafter
from dlmjax.io.dflash import load_drafter
from dlmjax.validation import InputError
from drafter_reference import RefDrafter, speculative_greedy
from test_drafter import tiny_drafter_config, write_reference_drafter
from tiny_models import torch_model

SMALL_VOCAB = 12  # random drafts get accepted often enough to exercise every acceptance length


def _prompts(batch, vocab, seed=0, lo=3, hi=12):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, vocab - 1, rs.randint(lo, hi)).tolist() for _ in range(batch)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(torch target, dlmjax target, drafter dir factory) on a small-vocab random Qwen3 target."""
    tm = torch_model("qwen3", seed=5, num_hidden_layers=6, vocab_size=SMALL_VOCAB)
    path = tmp_path_factory.mktemp("target")
    tm.save_pretrained(path)
    ours = dlmjax.load_model(path)

    def drafter(block_size=8, layer_types=None, window=None, seed=2, mask_embedding=False, target=None, dtype=None):
        raw = tiny_drafter_config(block_size=block_size, layer_types=layer_types, sliding_window=window)
        raw["vocab_size"] = SMALL_VOCAB
        raw["dflash_config"]["mask_token_id"] = SMALL_VOCAB - 1
        d = tmp_path_factory.mktemp("drafter")
        ref = write_reference_drafter(d, raw, seed=seed)
        if mask_embedding:  # a drafter shipping its own mask embedding, read by the reference as vLLM reads it
            torch.manual_seed(seed)
            torch.save(torch.randn(raw["hidden_size"]), d / "mask_embedding.pt")
            ref = RefDrafter.load(d)
        return ref, load_drafter(d, (target or ours).config, dtype=dtype)

    return tm, ours, drafter


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_target_greedy(pair, batch):
    _, ours, make = pair
    _, drafter = make()
    prompts = _prompts(batch, SMALL_VOCAB, seed=batch)
    ar = generate_ar(ours, prompts, max_new_tokens=24, eos_ids=(), pad_id=0)
    spec = generate_with_drafter(ours, drafter, prompts, max_new_tokens=24, eos_ids=(), pad_id=0)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_generated), np.asarray(ar.num_generated))
    assert int(spec.target_forwards) <= 23 and spec.mean_accepted_length > 1.0  # some drafts were accepted
    if batch == 1:  # a block that is no integer >= 2 is refused (0 meant the drafter's own, 2.7 became 2)
        for block, message in ((0, "block=0 must be >= 1"), (2.7, "block=2.7 must be an integer"),
                               (1, "at least 2 tokens")):
            with pytest.raises(InputError, match=message):
                generate_with_drafter(ours, drafter, prompts, max_new_tokens=4, block=block)
        again = generate_with_drafter(ours, drafter, prompts, max_new_tokens=24, eos_ids=(), pad_id=0,
                                      block=np.int64(drafter.config.block_size))
        np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(spec.tokens))


def test_bf16_greedy_equals_target_greedy_in_the_invariant_mode(pair, tmp_path):
    """In bf16 the verification forward (K tokens per row) and `ar` (one) sum in other orders, so
    a near-tie can flip (a review found 1 row of 32 on this target, from its 31st token); the
    invariant mode computes each row at one shape, which makes them equal."""
    tm, _, make = pair
    tm.save_pretrained(tmp_path)
    target = dlmjax.load_model(tmp_path, dtype="bfloat16")
    _, drafter = make(block_size=4, target=target, dtype="bfloat16")
    prompts = _prompts(32, SMALL_VOCAB, seed=0, lo=2, hi=30)
    with dlmjax.numerics(invariant=True):
        ar = generate_ar(target, prompts, max_new_tokens=40, eos_ids=(), pad_id=0)
        spec = generate_with_drafter(target, drafter, prompts, max_new_tokens=40, eos_ids=(), pad_id=0)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))


def test_rows_hitting_eos_at_different_steps(pair):
    _, ours, make = pair
    _, drafter = make(block_size=4)
    prompts = _prompts(8, SMALL_VOCAB, seed=11)
    free = np.asarray(generate_ar(ours, prompts, max_new_tokens=20, eos_ids=(), pad_id=0).tokens)
    # an EOS id that every-other row emits, at different steps
    firsts = {t: [int(np.argmax(row == t)) if (row == t).any() else None for row in free] for t in range(SMALL_VOCAB)}
    eos = max(firsts, key=lambda t: len({s for s in firsts[t] if s is not None}))
    assert len({s for s in firsts[eos] if s is not None}) >= 3
    ar = generate_ar(ours, prompts, max_new_tokens=20, eos_ids=(eos,), pad_id=0)
    spec = generate_with_drafter(ours, drafter, prompts, max_new_tokens=20, eos_ids=(eos,), pad_id=0)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_generated), np.asarray(ar.num_generated))
    assert len(set(np.asarray(ar.num_generated).tolist())) >= 3


def test_the_drafter_loop_updates_the_caches_in_place(pair, monkeypatch):
    """No round copies the target's or the drafter's KV cache (or its positions): each round's
    write waits for the verification's outcome, after the forwards have read the cache (written
    as soon as a layer's keys were ready, every cache tensor was copied twice a round)."""
    from dlmjax.decoding import speculative
    from hlo import first_program, loop_copies

    _, ours, make = pair
    _, drafter = make(block_size=4)
    prompts = _prompts(2, SMALL_VOCAB, seed=3)
    hlo, args, _ = first_program(monkeypatch, speculative, "_generate", lambda: generate_with_drafter(
        ours, drafter, prompts, max_new_tokens=16, eos_ids=(), pad_id=0))
    capacity = args[4].shape[1] + 16 + 4
    caches = {f"f32[2,{capacity},{cfg.num_kv_heads},{cfg.head_dim}]"
              for cfg in (ours.config, drafter.config.layer_model_config())}
    for shape in caches | {f"s32[2,{capacity}]"}:
        assert f"{shape}{{" in hlo, f"the program must hold the {shape} this test looks for"
        assert loop_copies(hlo, shape) == 0, shape


@pytest.mark.parametrize(
    "block_size, layer_types, window, mask_embedding",
    [(4, None, None, False), (8, None, None, False), (16, None, None, False),
     (8, ["sliding_attention", "full_attention"], 6, False), (8, None, None, True)],
    ids=["b4", "b8", "b16", "b8-sliding", "b8-mask-embedding"],
)
def test_accepted_lengths_match_reference(pair, block_size, layer_types, window, mask_embedding):
    tm, ours, make = pair
    ref, drafter = make(block_size=block_size, layer_types=layer_types, window=window, mask_embedding=mask_embedding)
    prompts = _prompts(3, SMALL_VOCAB, seed=block_size, lo=2, hi=15)
    spec = generate_with_drafter(ours, drafter, prompts, max_new_tokens=30, eos_ids=(), pad_id=0)
    lengths = spec.accepted_lengths()
    for row, prompt in enumerate(prompts):
        tokens, steps = speculative_greedy(ref, tm, prompt, 30, block_size)
        assert np.asarray(spec.tokens)[row].tolist() == tokens
        assert lengths[row] == steps
    assert max(max(r) for r in lengths) >= 2  # some drafts were accepted


# ----------------------------------------------------------------------------------------------
# sampled mode


def test_rejection_sampling_step_preserves_p():
    """One verification position: the emitted token (accepted draft or residual resample) is
    distributed as p, for a q far from p (exact expectation, no sampling noise)."""
    p = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    q = np.array([0.1, 0.1, 0.2, 0.6], np.float32)
    import jax
    import jax.numpy as jnp

    n_samples = 20000
    keys = jax.random.split(jax.random.key(0), 2)
    draft = jax.random.categorical(keys[0], jnp.log(jnp.asarray(q)), shape=(n_samples,)).astype(jnp.int32)[:, None]
    p_b = jnp.broadcast_to(jnp.asarray(p), (n_samples, 2, 4))
    q_b = jnp.broadcast_to(jnp.asarray(q), (n_samples, 1, 4))
    n, bonus = accept_sampled(draft, q_b, p_b, jax.random.split(keys[1], n_samples))
    token = np.where(np.asarray(n) == 1, np.asarray(draft)[:, 0], np.asarray(bonus))
    freq = np.bincount(token, minlength=4) / n_samples
    chi2 = n_samples * (((freq - p) ** 2) / p).sum()
    assert chi2 < 16.27  # chi-square, 3 dof, p = 0.001


def test_sampled_next_tokens_match_target_distribution(pair):
    """Over many seeds, the first tokens after the prefill's token follow the target's sampling
    distribution (a chi-square test at a fixed budget). The second token comes from a
    verification round, so it exercises the rejection sampler."""
    tm, ours, make = pair
    _, drafter = make(block_size=4)
    prompt = [3, 1, 4, 1, 5]
    temperature = 1.0
    rows = 256
    out = generate_with_drafter(ours, drafter, [prompt] * rows, max_new_tokens=3, temperature=temperature, seed=7,
                                eos_ids=(), pad_id=0)
    toks = np.asarray(out.tokens)
    first = toks[:, 0]
    # target distribution of the 2nd token given the most frequent first token
    t0 = int(np.bincount(first).argmax())
    sel = toks[first == t0, 1]
    with torch.no_grad():
        logits = tm(torch.tensor([prompt + [t0]])).logits[0, -1].double()
    p = torch.softmax(logits / temperature, -1).numpy()
    with torch.no_grad():
        p0 = torch.softmax(tm(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1).numpy()
    for observed, probs in ((first, p0), (sel, p)):
        counts = np.bincount(observed, minlength=SMALL_VOCAB)
        expected = probs * len(observed)
        big = expected >= 5  # pool the rare tokens into one cell
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        chi2 = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
        dof = keep.sum() - 1
        from scipy.stats import chi2 as chi2_dist

        assert chi2_dist.sf(chi2, dof) > 0.001, (chi2, dof)


def test_sampled_sequences_follow_the_targets_joint_distribution_with_top_p(tmp_path):
    """Every three-token continuation over a 5-token vocabulary, its exact probability under the
    target's tempered nucleus distribution against 4,096 drafter-sampled rows (chi-square): the
    rejection sampler with top_p keeps the whole joint, and nothing outside the nucleus is drawn."""
    import itertools

    from scipy.stats import chi2 as chi2_dist

    vocab, temperature, top_p, length = 5, 0.7, 0.8, 3
    tm = torch_model("qwen3", seed=5, num_hidden_layers=6, vocab_size=vocab)
    tm.save_pretrained(tmp_path / "target")
    ours = dlmjax.load_model(tmp_path / "target")
    raw = tiny_drafter_config(block_size=3)
    raw["vocab_size"], raw["dflash_config"]["mask_token_id"] = vocab, vocab - 1
    write_reference_drafter(tmp_path / "drafter", raw, seed=2)
    drafter = load_drafter(tmp_path / "drafter", ours.config)
    prompt = [3, 1, 2, 1, 0]

    def nucleus(logits):  # the target's tempered top-p distribution (ties at the cut kept)
        z = logits.double() / temperature
        ranked = torch.sort(z, descending=True).values
        cut = ranked[int((torch.cumsum(torch.softmax(ranked, -1), -1) < top_p).sum())]
        return torch.softmax(torch.where(z < cut, -torch.inf, z), -1)

    exact = {}
    with torch.no_grad():
        for head in itertools.product(range(vocab), repeat=length - 1):
            steps = [nucleus(lg) for lg in tm(torch.tensor([prompt + list(head)])).logits[0, len(prompt) - 1:]]
            p_head = float(np.prod([steps[j][t] for j, t in enumerate(head)]))
            for last in range(vocab):
                exact[head + (last,)] = p_head * float(steps[-1][last])
    out = generate_with_drafter(ours, drafter, [prompt] * 4096, max_new_tokens=length, temperature=temperature,
                                top_p=top_p, seed=0, eos_ids=(), pad_id=0)
    counts = dict.fromkeys(exact, 0)
    for row in np.asarray(out.tokens).tolist():
        counts[tuple(row)] += 1
    assert sum(counts[s] for s in exact if exact[s] == 0) == 0
    observed, expected = np.array([counts[s] for s in exact]), np.array([exact[s] for s in exact]) * 4096
    big = expected >= 5  # pool the rare sequences into one cell
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    chi2 = (((obs - exp) ** 2)[exp > 0] / exp[exp > 0]).sum()
    assert chi2_dist.sf(chi2, (exp > 0).sum() - 1) > 0.001, chi2
    assert out.mean_accepted_length > 1.0  # drafts were accepted: the rejection sampler ran


def test_bad_sampling_options_are_refused_not_decoded_greedily(pair):
    """generate_with_drafter and generate_ar are public: a negative or NaN temperature decoded
    greedily, top_p outside (0, 1] decoded unfiltered, max_new_tokens=2.5 decoded 2 tokens."""
    _, ours, make = pair
    _, drafter = make(block_size=4)
    for bad, message in [(dict(temperature=-1.0), "temperature=-1.0"), (dict(temperature=float("nan")), "temperature"),
                         (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
                         (dict(max_new_tokens=2.5), "max_new_tokens=2.5")]:
        options = dict(max_new_tokens=4, temperature=1.0) | bad
        with pytest.raises(InputError, match=message):
            generate_with_drafter(ours, drafter, [[1, 2, 3]], **options)
        with pytest.raises(InputError, match=message):
            generate_ar(ours, [[1, 2, 3]], **options)


def test_a_row_that_verified_no_draft_has_no_accepted_length(pair):
    """max_new_tokens=1: the prefill gives the only token, no round verifies a draft; the row's
    mean accepted length is None (it was 0.0, and a run's mean, which averages the rows', fell
    below the least possible 1)."""
    from dlmjax.decoding.api import generate

    _, ours, make = pair
    _, drafter = make(block_size=4)
    one = generate(ours, [[1, 2, 3], [4, 5]], decoder="drafter", drafter=drafter, max_new_tokens=1)
    assert [row.mean_accepted_length for row in one.rows] == [None, None]
    more = generate(ours, [[1, 2, 3], [4, 5]], decoder="drafter", drafter=drafter, max_new_tokens=6)
    assert all(row.mean_accepted_length >= 1.0 for row in more.rows)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_other_target_families(family, tmp_path):
    """The drafter's layers are Qwen3-style whatever the target's family (a Llama target too)."""
    tm = torch_model(family, seed=6, num_hidden_layers=6, vocab_size=SMALL_VOCAB)
    tm.save_pretrained(tmp_path / "t")
    ours = dlmjax.load_model(tmp_path / "t")
    raw = tiny_drafter_config(block_size=4)
    raw["vocab_size"] = SMALL_VOCAB
    raw["dflash_config"]["mask_token_id"] = SMALL_VOCAB - 1
    ref = write_reference_drafter(tmp_path / "d", raw, seed=4)
    drafter = load_drafter(tmp_path / "d", ours.config)
    prompts = _prompts(2, SMALL_VOCAB, seed=21)
    spec = generate_with_drafter(ours, drafter, prompts, max_new_tokens=16, eos_ids=(), pad_id=0)
    ar = generate_ar(ours, prompts, max_new_tokens=16, eos_ids=(), pad_id=0)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    tokens, steps = speculative_greedy(ref, tm, prompts[0], 16, 4)
    assert spec.accepted_lengths()[0] == steps and np.asarray(spec.tokens)[0].tolist() == tokens
