"""CE (confidence extrapolation): the Kalman filter against the closed-form update, exact
forecasts of a constant-velocity series, and the `ce` decoder (progress, batch invariance,
fewer forwards than static, per-block reset, option errors)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.decoding import engine, policies
from dlmjax.decoding.api import generate
from dlmjax.decoding.spec import DecoderSpecError, parse_decoder
from dlmjax.decoding.tspd import Kalman, Trajectory, kalman_forecast, kalman_update, observe
from test_decoding import MAX_NEW, PROMPTS, peaky_model

Q, R = 1e-3, 1e-2


def closed_form(series, q, r):
    """The textbook filter in numpy: two-point start, then x- = A x, P- = A P A^T + Q,
    K = P- H^T (H P- H^T + r)^-1, x = x- + K (z - H x-), P = (I - K H) P-."""
    a, h, qm = np.array([[1.0, 1.0], [0.0, 1.0]]), np.array([[1.0, 0.0]]), q * np.eye(2)
    x = np.array([series[1], series[1] - series[0]])
    p = np.array([[r, r], [r, 2 * r]])
    for z in series[2:]:
        x, p = a @ x, a @ p @ a.T + qm
        gain = p @ h.T / (h @ p @ h.T + r)
        x = x + (gain * (z - h @ x)).ravel()
        p = (np.eye(2) - gain @ h) @ p
    return x, p


def run_filter(series, q=Q, r=R):
    state = Kalman.init((1,))
    for z in series:
        state = kalman_update(state, jnp.asarray([z], jnp.float32), q=q, r=r)
    return state


def test_kalman_matches_the_closed_form_update():
    series = [0.2, 0.35, 0.3, 0.55, 0.62, 0.58, 0.8]
    state = run_filter(series)
    x, p = closed_form(series, Q, R)
    np.testing.assert_allclose(np.asarray(state.x[0]), x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.p[0]), p, rtol=1e-5, atol=1e-7)
    assert int(state.n[0]) == len(series)


def test_hand_computed_first_update():
    # start from z=0.2, 0.4: x = [0.4, 0.2], P = [[r, r], [r, 2r]]; then z = 0.5 with q = 0, r = 0.01:
    # x- = [0.6, 0.2], P- = [[5r, 3r], [3r, 2r]], S = 6r, K = [5/6, 1/2];
    # x = [0.6 - 5/6 * 0.1, 0.2 - 0.05] = [0.516667, 0.15]; P00 = (1 - 5/6) * 5r = 5r/6
    state = run_filter([0.2, 0.4, 0.5], q=0.0, r=0.01)
    np.testing.assert_allclose(np.asarray(state.x[0]), [0.6 - 0.1 * 5 / 6, 0.15], rtol=1e-5)
    np.testing.assert_allclose(float(state.p[0, 0, 0]), 0.05 / 6, rtol=1e-5)


def test_constant_velocity_series_is_forecast_exactly():
    series = [0.1 + 0.07 * t for t in range(5)]
    state = run_filter(series)
    for k in (1, 3):
        mean, var = kalman_forecast(state, k, q=Q)
        np.testing.assert_allclose(float(mean[0]), 0.1 + 0.07 * (4 + k), rtol=1e-5)
        assert 0 < float(var[0]) < 0.1
    # the variance grows with the horizon; before two observations it is infinite
    assert float(kalman_forecast(state, 3, q=Q)[1][0]) > float(kalman_forecast(state, 1, q=Q)[1][0])
    assert np.isinf(float(kalman_forecast(run_filter([0.5]), 1, q=Q)[1][0]))


def test_oscillation_flag():
    assert bool(run_filter([0.3, 0.6, 0.2, 0.7]).flipped[0])  # velocity 0.3 -> -0.04 -> 0.09
    assert not bool(run_filter([0.3, 0.4, 0.5, 0.6]).flipped[0])
    state = Kalman.init((1,))
    for z in [0.3, 0.6, 0.2, 0.7]:  # the same velocity changes, below osc_eps, do not count
        state = kalman_update(state, jnp.asarray([z], jnp.float32), q=Q, r=R, osc_eps=0.5)
    assert not bool(state.flipped[0])


def test_trajectory_features_and_reset():
    scores = lambda tok, conf: policies.Scores(tokens=jnp.asarray([tok], jnp.int32),  # noqa: E731
                                               confidence=jnp.asarray([conf], jnp.float32),
                                               entropy=jnp.zeros((1, 2)), margin=jnp.zeros((1, 2)))
    pos = jnp.asarray([[10, 11]])
    traj = Trajectory.init(1, 2)
    f, traj = observe(traj, scores([5, 6], [0.5, 0.2]), jnp.asarray([0]), pos)
    assert f["momentum"].tolist() == [[0.0, 0.0]] and f["stable"].tolist() == [[0, 0]]
    f, traj = observe(traj, scores([5, 7], [0.7, 0.1]), jnp.asarray([0]), pos)
    np.testing.assert_allclose(np.asarray(f["momentum"]), [[0.2, -0.1]], atol=1e-6)
    assert f["stable"].tolist() == [[1, 0]] and f["abs_pos"].tolist() == [[10, 11]]
    f, traj = observe(traj, scores([5, 7], [0.9, 0.1]), jnp.asarray([0]), pos)
    assert f["stable"].tolist() == [[2, 1]] and f["block_pos"].tolist() == [[0, 1]]
    f, traj = observe(traj, scores([5, 7], [0.9, 0.1]), jnp.asarray([1]), pos)  # next block: start over
    assert f["stable"].tolist() == [[0, 0]] and f["momentum"].tolist() == [[0.0, 0.0]]
    assert traj.rounds.tolist() == [[1, 1]]


@pytest.fixture(scope="module")
def sdar():
    return peaky_model("sdar", seed=1)


def test_ce_decodes_with_progress_batch_invariance_and_fewer_forwards(sdar):
    spec = "ce:tau=0.7,horizon=2"
    batch = generate(sdar, PROMPTS, decoder=spec, max_new_tokens=MAX_NEW)
    static = generate(sdar, PROMPTS, decoder="static", max_new_tokens=MAX_NEW)
    for row in batch.rows:
        assert 1 <= row.nfe <= MAX_NEW + 2  # at least one commit per forward: never more forwards than static
    assert batch.forwards < static.forwards
    assert all(c.nfe <= s.nfe for c, s in zip(batch.rows, static.rows))  # >= 1 commit per forward
    alone = generate(sdar, [PROMPTS[5]], decoder=spec, max_new_tokens=MAX_NEW)
    assert alone.rows[0].tokens == batch.rows[5].tokens and alone.rows[0].nfe == batch.rows[5].nfe


def test_ce_rules_are_options_and_reduce_to_threshold(sdar):
    threshold = generate(sdar, PROMPTS[:4], decoder="threshold:tau=0.7", max_new_tokens=MAX_NEW)
    plain = generate(sdar, PROMPTS[:4], decoder="ce:tau=0.7,lookahead=false,stabilize=false", max_new_tokens=MAX_NEW)
    assert [r.tokens for r in plain.rows] == [r.tokens for r in threshold.rows]
    assert [r.nfe for r in plain.rows] == [r.nfe for r in threshold.rows]


def test_ce_carry_resets_per_block(sdar):
    """Run the engine by hand: the carry's block follows each row's block and its rounds restart."""
    from dlmjax.decoding.api import _prepare

    req = _prepare(sdar, PROMPTS[:2], tokenizer=None, decoder="ce:tau=0.7", max_new_tokens=MAX_NEW, row_ids=None,
                   head=None)
    geometry, canvas, rows = req.layout
    fwd = engine.BlockForwards(sdar, rows, geometry, "exact", req.mask_id)
    decoder = parse_decoder("ce:tau=0.7")
    state = engine.start(fwd, jnp.asarray(canvas), decoder)
    step = jax.jit(lambda st: engine.decode_round(decoder, fwd, st, seed_key=None))
    prev, resets = None, 0
    for _ in range(3 * MAX_NEW):
        if bool(jnp.all(state.done)):
            break
        before = state.block
        state = step(state)
        traj = state.carry["traj"]
        assert traj.block.tolist() == before.tolist()  # the carry describes the block the round planned
        if prev is not None:
            changed = np.asarray(traj.block != prev.block)
            rounds, prev_rounds = np.asarray(traj.rounds), np.asarray(prev.rounds)
            assert (rounds[changed] == 1).all()  # a new block's trajectory starts over
            assert (rounds[~changed] == prev_rounds[~changed] + 1).all()
            resets += int(changed.sum())
        prev = traj
    assert resets >= 2, "no row ever moved to another block: the reset is untested"


def test_ce_option_errors():
    for bad in ("ce:tau=1.5", "ce:horizon=0", "ce:r=0", "ce:floor=2", "ce:lookahead=maybe"):
        with pytest.raises(DecoderSpecError):
            parse_decoder(bad)
    with pytest.raises(DecoderSpecError, match="controller=PATH"):
        parse_decoder("tspd")


@pytest.mark.parametrize("family,cache", [("llada", "dual")])
def test_ce_on_bidirectional_cache_modes(family, cache):
    """Rows wait for each other at block ends there (a shared refresh): the carry still resets per row."""
    model = peaky_model(family, seed=2)
    spec = f"ce:tau=0.7,block=4,cache={cache}"
    batch = generate(model, PROMPTS[:4], decoder=spec, max_new_tokens=MAX_NEW)
    assert all(r.nfe <= MAX_NEW + 2 for r in batch.rows)  # >= 1 commit per forward
    alone = generate(model, [PROMPTS[2]], decoder=spec, max_new_tokens=MAX_NEW)
    assert alone.rows[0].tokens == batch.rows[2].tokens


def test_ce_in_continuous_batching_equals_each_prompt_alone(sdar):
    """api.Stream scatters new rows' initial carry into freed slots: each row's trajectory is its own."""
    from dlmjax.decoding.api import Stream

    spec = "ce:tau=0.7"
    alone = generate(sdar, PROMPTS, decoder=spec, max_new_tokens=MAX_NEW)  # rows never see each other
    rows = dict(Stream(sdar, PROMPTS, batch_size=3, refill=1, decoder=spec, max_new_tokens=MAX_NEW))
    assert sorted(rows) == list(range(len(PROMPTS)))
    for i, row in rows.items():
        assert row.tokens == alone.rows[i].tokens and row.nfe == alone.rows[i].nfe
