"""Commit policies and the top-p filter on hand-made scores."""

import jax.numpy as jnp
import numpy as np

from dlmjax.decoding import policies


def scores(conf, entropy=None, margin=None):
    conf = jnp.asarray([conf], jnp.float32)
    zeros = jnp.zeros_like(conf)
    return policies.Scores(tokens=jnp.zeros(conf.shape, jnp.int32), confidence=conf,
                           entropy=zeros if entropy is None else jnp.asarray([entropy], jnp.float32),
                           margin=zeros if margin is None else jnp.asarray([margin], jnp.float32))


def as_list(mask):
    return np.asarray(mask)[0].tolist()


def test_nucleus_keeps_smallest_set_reaching_top_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(np.asarray(policies.nucleus_filter(logits, 0.7))).tolist() == [[True, True, False, False]]
    assert np.isfinite(np.asarray(policies.nucleus_filter(logits, 0.4))).tolist() == [[True, False, False, False]]
    assert np.isfinite(np.asarray(policies.nucleus_filter(logits, 0.99))).all()


def test_sampling_tempers_then_filters_and_llada2_takes_the_sampled_distributions_confidence():
    """Sampling draws from the nucleus of the tempered distribution (transformers' order, Dream's,
    LLaDA2's, and the `ar` decoder's): at temperature 0.5 the probabilities [0.6, 0.25, 0.15]
    become [0.809, 0.140, 0.051], whose 0.9-nucleus drops the third token, which the untempered
    nucleus keeps. A sampled token's confidence is its untempered probability, or, with
    `sampled_scores` (LLaDA2, Dream), its probability under the filtered tempered distribution,
    whose entropy the position's entropy then is (Dream's alg="entropy")."""
    import jax

    probs = np.asarray([0.6, 0.25, 0.15])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (1000, 1, 3))
    keys = jax.random.split(jax.random.key(0), 1000)
    plain = policies.score(logits, mask_id=None, temperature=0.5, top_p=0.9, keys_b=keys)
    llada2 = policies.score(logits, mask_id=None, temperature=0.5, top_p=0.9, keys_b=keys, sampled_scores=True)
    tokens = np.asarray(plain.tokens)[:, 0]
    assert set(tokens.tolist()) == {0, 1} and np.array_equal(tokens, np.asarray(llada2.tokens)[:, 0])
    np.testing.assert_allclose(np.asarray(plain.confidence)[:, 0], probs[tokens], rtol=1e-5)
    kept = probs[:2] ** 2 / np.sum(probs[:2] ** 2)
    np.testing.assert_allclose(np.asarray(llada2.confidence)[:, 0], kept[tokens], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(plain.entropy), -np.sum(probs * np.log(probs)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(llada2.entropy), -np.sum(kept * np.log(kept)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(llada2.margin), kept[0] - kept[1], rtol=1e-5)
    # eos_last on top: the confidence of the same distribution without the last token's mass
    last = policies.score(logits, mask_id=None, temperature=0.5, top_p=0.9, keys_b=keys, sampled_scores=True,
                          last=(1,))
    np.testing.assert_allclose(np.asarray(last.confidence)[:, 0], np.where(tokens == 1, 0.0, 1.0), atol=1e-6)
    untempered = policies.score(logits, mask_id=None, temperature=0.5, top_p=0.9, keys_b=keys, last=(1,))
    without = probs / (1 - probs[1])
    np.testing.assert_allclose(np.asarray(untempered.confidence)[:, 0], np.where(tokens == 1, 0.0, without[0]),
                               atol=1e-6)


def test_static_picks_top_k_masked_first_index_on_ties():
    masked = jnp.asarray([[True, True, False, True]])
    assert as_list(policies.static_commit(scores([0.5, 0.5, 0.9, 0.5]), masked, 1)) == [True, False, False, False]
    assert as_list(policies.static_commit(scores([0.2, 0.6, 0.9, 0.4]), masked, 2)) == [False, True, False, True]


def test_static_takes_a_count_per_row_and_ranks_as_top_k():
    """A count per row [B] commits each row's count of top-ranked masked positions, with the same
    ranking (first index on ties) as a fixed k."""
    masked = jnp.asarray([[True, True, False, True], [True, True, True, True]])
    s = scores([0.5, 0.5, 0.9, 0.5])
    s = s.replace(confidence=jnp.asarray([[0.5, 0.5, 0.9, 0.5], [0.1, 0.7, 0.7, 0.3]]))
    got = policies.static_commit(s, masked, jnp.asarray([2, 3]))
    assert np.asarray(got).tolist() == [[True, True, False, False], [False, True, True, True]]
    for k in (1, 2, 3):
        np.testing.assert_array_equal(policies.static_commit(s, masked, jnp.asarray([k, k])),
                                      policies.static_commit(s, masked, k))


def dream_counts_in_torch(masked: int, steps: int, eps: float = 1e-3) -> list[int]:
    """Dream's generate() (generation_utils._sample), the count of each step, as it runs in torch."""
    import torch

    timesteps = torch.linspace(1, eps, steps + 1)
    counts = []
    for i in range(steps):
        num_mask_token = torch.tensor(masked - sum(counts)) / 1  # mask_index.sum() / batch
        t, s = timesteps[i], timesteps[i + 1]
        counts.append(int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token))
    return counts


def llada_counts_in_torch(masked: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one row."""
    import torch

    mask_num = torch.tensor([[masked]])
    num = torch.zeros(1, steps, dtype=torch.int64) + mask_num // steps
    num[:, : int(mask_num % steps)] += 1
    return num[0].tolist()


def test_step_schedules_equal_llada_and_dream_in_torch():
    """`static:steps=S` spreads a block as LLaDA's get_num_transfer_tokens does (`even`) or as
    Dream's generate() does (`linear`: float32 in torch, its steps that commit nothing left out),
    for every block up to 70 and every step count up to block + 2, and the seeds' lengths."""
    sizes = [(m, s) for m in range(1, 71) for s in range(1, m + 3)]
    sizes += [(m, s) for m in (128, 256, 512, 1024) for s in (m // 8, m // 4, m // 2, m - 1, m)]
    zero_steps = 0
    for masked, steps in sizes:
        dream = dream_counts_in_torch(masked, steps)
        assert policies.step_counts(masked, steps, "linear") == tuple(n for n in dream if n), (masked, steps)
        zero_steps += dream.count(0)
        llada = llada_counts_in_torch(masked, steps)
        assert policies.step_counts(masked, steps, "even") == tuple(n for n in llada if n), (masked, steps)
    assert zero_steps > 0, "no Dream step committed nothing: leaving them out is untested"
    assert dream_counts_in_torch(512, 512)[:3] == [0, 1, 1] and dream_counts_in_torch(512, 512)[-1] == 2


def test_progress_guard_commits_top1_only_when_nothing_else():
    masked = jnp.asarray([[True, True, True, False]])
    s = scores([0.3, 0.6, 0.1, 0.99])
    none = jnp.zeros((1, 4), bool)
    assert as_list(policies.with_progress_guard(none, s, masked)) == [False, True, False, False]
    some = jnp.asarray([[True, False, False, False]])
    assert as_list(policies.with_progress_guard(some, s, masked)) == [True, False, False, False]
    assert as_list(policies.with_progress_guard(none, s, jnp.zeros((1, 4), bool))) == [False] * 4


def test_threshold_decay_margin_and_entropy():
    masked = jnp.asarray([[True, True, True, True]])
    s = scores([0.95, 0.92, 0.5, 0.97], entropy=[0.1, 0.3, 2.0, 0.2], margin=[0.9, 0.2, 0.1, 0.6])
    assert as_list(policies.threshold_commit(s, masked, 0.9)) == [True, True, False, True]
    # tau rises 0.03 per position right of the leftmost mask: 0.9, 0.93, 0.96, 0.99
    assert as_list(policies.decaying_threshold_commit(s, masked, 0.9, 0.03)) == [True, False, False, False]
    assert as_list(policies.margin_commit(s, masked, 0.5)) == [True, False, False, True]
    # lowest entropies first while the running sum stays <= 0.35: 0.1, 0.2 (0.3 would reach 0.6)
    assert as_list(policies.entropy_commit(s, masked, 0.35)) == [True, False, False, True]


def test_entropy_commits_the_lowest_entropy_position_when_every_one_is_over_gamma():
    """dInfer's and SDAR's entropy-bounded sampler keep at least the lowest-entropy position (their
    `max(1, ...)`), also where another position is more confident; the decoder does the same."""
    from dlmjax.decoding.spec import Entropy

    masked = jnp.asarray([[True, True, False]])
    s = scores([0.45, 0.50, 0.99], entropy=[0.95, 1.67, 0.01])
    assert as_list(policies.entropy_commit(s, masked, 0.5)) == [True, False, False]
    assert as_list(Entropy(gamma=0.5).commit_set(s, masked)) == [True, False, False]
    assert as_list(policies.entropy_commit(s, jnp.zeros((1, 3), bool), 0.5)) == [False] * 3


def test_static_ranks_by_confidence_margin_or_entropy():
    """`static:order=margin|entropy` are Dream's topk_margin and entropy algs: k positions per
    step, the highest margin or the lowest entropy first, whatever the confidence says."""
    from dlmjax.decoding.spec import DecoderSpecError, Static, parse_decoder

    masked = jnp.asarray([[True, True, True, False]])
    s = scores([0.9, 0.6, 0.5, 0.99], entropy=[0.8, 0.3, 0.5, 0.0], margin=[0.1, 0.4, 0.3, 0.99])
    assert as_list(Static().commit_set(s, masked)) == [True, False, False, False]
    assert as_list(parse_decoder("static:order=margin").commit_set(s, masked)) == [False, True, False, False]
    assert as_list(parse_decoder("static:order=entropy,k=2").commit_set(s, masked)) == [False, True, True, False]
    import pytest

    with pytest.raises(DecoderSpecError, match="order"):
        parse_decoder("static:order=random")
