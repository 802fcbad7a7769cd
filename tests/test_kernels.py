"""Pallas kernels (dlmjax.kernels) against their pure-jnp references, in Pallas interpret mode on
CPU, over hypothesis-drawn shapes; the switch and its logged fallbacks."""

from __future__ import annotations

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
from dlmjax.kernels.residual_argmax import residual_argmax

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@st.composite
def argmax_cases(draw):
    tile_v = draw(st.sampled_from([8, 16, 32]))
    vocab = draw(st.integers(tile_v, 5 * tile_v + 7))  # mostly not a multiple of the tile
    edges = [0, tile_v - 1, tile_v, vocab - 1, (vocab // tile_v) * tile_v - 1]  # the mask at tile edges
    return dict(
        rows=draw(st.integers(1, 20)), dim=draw(st.sampled_from([8, 16])), vocab=vocab, tile_v=tile_v,
        mask_id=draw(st.sampled_from([e for e in edges if 0 <= e < vocab])), norm=draw(st.booleans()),
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


def _check_argmax(case, dtype):
    x, w, kw = _argmax_inputs(case, dtype)
    expected = argmax_reference(x, w, **kw)
    with kernels.use("interpret"):
        got = residual_argmax(x, w, tile_m=8, tile_v=case["tile_v"], **kw)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    assert not np.any(np.asarray(got.tokens) == case["mask_id"])
    for name in ("confidence", "entropy", "margin"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=0, atol=TOL[dtype],
                                   err_msg=name)


@settings(max_examples=10, deadline=None)
@given(argmax_cases())
def test_residual_argmax_equals_its_reference_fp32(case):
    _check_argmax(case, "float32")


@settings(max_examples=5, deadline=None)
@given(argmax_cases())
def test_residual_argmax_equals_its_reference_bf16(case):
    _check_argmax(case, "bfloat16")


def test_residual_argmax_keeps_the_first_of_tied_columns_across_tiles():
    """Two columns in different tiles with the same (largest) logit: the first wins, as in jnp.argmax,
    and the margin is 0."""
    w = jnp.zeros((8, 40)).at[:, 5].set(1.0).at[:, 37].set(1.0)
    x = jnp.ones((3, 8))
    with kernels.use("interpret"):
        got = residual_argmax(x, w, mask_id=0, tile_v=16)
    np.testing.assert_array_equal(got.tokens, [5, 5, 5])
    np.testing.assert_array_equal(got.margin, [0.0, 0.0, 0.0])


def test_reference_runs_where_the_kernel_cannot_with_the_reason_logged(caplog):
    x, w, kw = _argmax_inputs(dict(rows=3, dim=8, vocab=20, mask_id=0, norm=False, residual=False, seed=0), "float32")
    expected = argmax_reference(x, w, **kw)
    kernels._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="dlmjax.kernels"):
        with kernels.use("on"):  # on CPU: no Pallas kernel, the reference runs
            got = residual_argmax(x, w, **kw)
        with dlmjax.numerics(invariant=True):  # invariant numerics keep their fixed-tile paths
            expected_invariant = argmax_reference(x, w, **kw)
            with kernels.use("interpret"):
                got_invariant = residual_argmax(x, w, **kw)
    assert "no Pallas kernel on cpu" in caplog.text and "batch-invariant" in caplog.text
    for a, b in zip(got + got_invariant, expected + expected_invariant):
        np.testing.assert_array_equal(a, b)


def test_the_switch_refuses_unknown_modes():
    with pytest.raises(dlmjax.validation.InputError, match="choose one of"):
        with kernels.use("fast"):
            pass
