"""The numeric core against a float64 loop oracle, its worked examples, and its laws as properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.core import ResultOverflow, ScoreOverflow, attention, causal_mask, mha

from . import oracle
from .helpers import WORKED_OUT, WORKED_WEIGHTS, Q, V

# --- the seed's worked examples ----------------------------------------------------------


def test_worked_example_causal():
    q, v = np.array(Q, dtype=np.float64), np.array(V, dtype=np.float64)
    out, w = attention(q, q, v, causal=True)
    np.testing.assert_allclose(w, WORKED_WEIGHTS, atol=0.01)
    np.testing.assert_allclose(out, WORKED_OUT, atol=0.01)
    assert (w[np.triu_indices(3, 1)] == 0).all()  # masked weights exactly 0


def test_gpt_block(rng):
    x = rng.standard_normal((6, 12))
    ws = [rng.standard_normal((12, 12)) / 4 for _ in range(4)]
    out, a = mha(x, *ws, 3)
    assert out.shape == (6, 12) and a.shape == (3, 6, 6)
    np.testing.assert_allclose(a.sum(-1), 1, atol=1e-12)
    assert (a[:, 0, 1:] == 0).all()
    x2 = x.copy()
    x2[-1] = rng.standard_normal(12) * 100
    out2, _ = mha(x2, *ws, 3)
    np.testing.assert_array_equal(out2[:5], out[:5])  # the past does not see the future
    expect_out, expect_a = oracle.mha(x, *ws, 3)
    np.testing.assert_allclose(out, expect_out, atol=1e-10)
    np.testing.assert_allclose(a, expect_a, atol=1e-12)


@pytest.mark.parametrize("s, expected", [(0.5, 0.16), (2, 0.89), (8, 1.0)], ids=["blurry", "sharp", "exact"])
def test_soft_lookup(s, expected):
    keys = np.eye(8) * s
    _, w = attention(keys, keys, keys, scale=1.0)
    assert round(float(np.diag(w).mean()), 2) == expected


def test_causal_mask_alignments():
    np.testing.assert_array_equal(causal_mask(2, 4), [[1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(causal_mask(2, 4, "bottom_right"), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 2, "bottom_right"), [[0, 0], [0, 0], [1, 0], [1, 1]])
    with pytest.raises(ValueError):
        causal_mask(2, 2, "diagonal")


# --- against the oracle --------------------------------------------------------------------

CASES = [
    # (lead, T, S, d, dv, mask shape or None, causal, key_lengths shape or None)
    ((), 5, 5, 4, 4, None, False, None),
    ((2,), 3, 7, 5, 2, None, False, None),
    ((2, 3), 6, 6, 4, 3, None, True, None),
    ((2, 3), 4, 7, 4, 5, None, "bottom_right", None),
    ((2, 3), 7, 4, 4, 5, None, "bottom_right", None),  # T > S: the first rows see nothing
    ((1, 2), 5, 8, 3, 3, (5, 8), False, None),
    ((2, 2), 5, 5, 3, 6, (2, 1, 5, 5), "top_left", None),
    ((2, 3), 4, 6, 2, 2, None, False, (2, 1)),
    ((3,), 6, 9, 4, 4, (1, 9), "bottom_right", (3,)),
    ((2, 1, 2), 3, 4, 2, 3, (3, 4), True, ()),
]
IDS = [
    "plain",
    "T<S dv<d",
    "causal",
    "bottom_right T<S",
    "bottom_right T>S",
    "mask 2d",
    "mask broadcast + causal",
    "key_lengths",
    "all three",
    "rank 5",
]


@pytest.mark.parametrize("lead, T, S, d, dv, mask_shape, causal, lengths_shape", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_oracle(rng, lead, T, S, d, dv, mask_shape, causal, lengths_shape, dtype):
    q = rng.standard_normal((*lead, T, d)).astype(dtype)
    k = rng.standard_normal((*lead, S, d)).astype(dtype)
    v = rng.standard_normal((*lead, S, dv)).astype(dtype)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.7
    lengths = None if lengths_shape is None else rng.integers(0, S + 1, lengths_shape)
    out, w = attention(q, k, v, mask, causal=causal, key_lengths=lengths)
    expect_out, expect_w = oracle.attention(q, k, v, mask, causal=causal, key_lengths=lengths)
    assert out.dtype == dtype and w.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(w, expect_w, atol=tol)
    np.testing.assert_allclose(out, expect_out, atol=tol * 10)
    assert (w[expect_w == 0] == 0).all()  # masked weights are exactly zero


def test_fully_masked_rows_are_zero_not_nan():
    q = np.ones((1, 3, 2), np.float32)
    mask = np.array([[True, False], [False, False], [True, True]])
    out, w = attention(q, q[:, :2], q[:, :2], mask)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    assert (w[0, 1] == 0).all() and (out[0, 1] == 0).all()


def test_large_scores_are_stable():
    q = np.array([[1e2, 0], [0, 1e2]], np.float32)
    out, w = attention(q, q, q, scale=1.0)  # scores of 1e4
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w, np.eye(2), atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_overflowing_scores_raise(dtype):
    big = np.finfo(dtype).max ** 0.5 * 4
    q = np.array([[big, big]], dtype)
    with pytest.raises(ScoreOverflow):
        attention(q, q, q, scale=1.0)
    with pytest.raises(ScoreOverflow):
        attention(q, -q, q, scale=1.0)  # -inf in an allowed row is overflow too


def test_float32_has_no_float64_temporaries():
    q = np.ones((2, 4, 8), np.float32)
    out, w = attention(q, q, q, scale=0.1)
    assert out.dtype == np.float32 and w.dtype == np.float32


def test_return_weights_false():
    q = np.ones((2, 4, 8))
    out, w = attention(q, q, q, causal=True, return_weights=False)
    assert w is None and out.shape == (2, 4, 8)


def test_mha_batched_equals_per_item(rng):
    x = rng.standard_normal((2, 5, 8))
    ws = [rng.standard_normal((8, 8)) for _ in range(4)]
    out, w = mha(x, *ws, 2)
    assert out.shape == (2, 5, 8) and w.shape == (2, 2, 5, 5)
    for b in range(2):
        ob, wb = mha(x[b], *ws, 2)
        np.testing.assert_allclose(out[b], ob, atol=1e-12)
        np.testing.assert_allclose(w[b], wb, atol=1e-12)


# --- laws, as properties ---------------------------------------------------------------------


@st.composite
def problems(draw, bound: float = 10.0, dtype=np.float64):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    T, S = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    elems = st.floats(-bound, bound, allow_nan=False, width=64)
    q = draw(hnp.arrays(dtype, (*lead, T, d), elements=elems))
    k = draw(hnp.arrays(dtype, (*lead, S, d), elements=elems))
    v = draw(hnp.arrays(dtype, (*lead, S, dv), elements=elems))
    mask = draw(st.none() | hnp.arrays(bool, (T, S)))
    causal = draw(st.sampled_from([False, "top_left", "bottom_right"]))
    return q, k, v, mask, causal


def _row_has_key(T, S, mask, causal):
    allowed = np.ones((T, S), bool) if mask is None else mask
    if causal:
        allowed = allowed & causal_mask(T, S, causal)
    return allowed, allowed.any(-1)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_rows_sum_to_one_and_masked_are_zero(problem):
    q, k, v, mask, causal = problem
    T, S = q.shape[-2], k.shape[-2]
    out, w = attention(q, k, v, mask, causal=causal)
    allowed, has_key = _row_has_key(T, S, mask, causal)
    sums = w.sum(-1)
    np.testing.assert_allclose(sums[..., has_key], 1, atol=1e-12)
    assert (sums[..., ~has_key] == 0).all() and (out[..., ~has_key, :] == 0).all()
    assert (np.broadcast_to(w, w.shape)[..., ~allowed] == 0).all()
    assert np.isfinite(out).all()


@settings(max_examples=100, deadline=None)
@given(problems(), st.data())
def test_past_unchanged_by_future(problem, data):
    q, k, v, _, causal = problem
    T, S = q.shape[-2], k.shape[-2]
    causal = causal or "top_left"
    t = data.draw(st.integers(0, T - 1))
    out, _ = attention(q, k, v, causal=causal)
    # the last key query t may see; everything after it (and every later query) is the future
    last_seen = t if causal == "top_left" else t + S - T
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[..., t + 1 :, :] += 5
    k2[..., max(last_seen + 1, 0) :, :] -= 3
    v2[..., max(last_seen + 1, 0) :, :] *= 7
    out2, _ = attention(q2, k2, v2, causal=causal)
    np.testing.assert_array_equal(out2[..., : t + 1, :], out[..., : t + 1, :])


@settings(max_examples=100, deadline=None)
@given(problems(bound=3.0))  # scores up to ~50: float32's rounding of them stays under 1e-5 in the weights
def test_float32_agrees_with_float64(problem):
    q, k, v, mask, causal = problem
    out64, w64 = attention(q, k, v, mask, causal=causal)
    out32, w32 = attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), mask, causal=causal)
    np.testing.assert_allclose(w32, w64, atol=1e-5)
    np.testing.assert_allclose(out32, out64, atol=1e-5 * max(1.0, float(np.abs(v).max())))


@settings(max_examples=60, deadline=None)
@given(problems())
def test_equals_oracle(problem):
    q, k, v, mask, causal = problem
    out, w = attention(q, k, v, mask, causal=causal)
    eo, ew = oracle.attention(q, k, v, mask, causal=causal)
    np.testing.assert_allclose(w, ew, atol=1e-12)
    np.testing.assert_allclose(out, eo, atol=1e-10)


# --- overflow: never a wrong answer -------------------------------------------------------------


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("v_value", [1e12, 3e38, -3e38])
def test_large_values_do_not_overflow(weights, v_value):
    """exp(63) v overflows float32 for |v| > 5e10, and S |v| for |v| near the maximum: both paths
    must still give the convex combination of the values."""
    q = np.array([[63.0], [1.0]], np.float32)
    k = np.array([[1.0], [1.0], [0.5]], np.float32)
    v = np.full((3, 1), v_value, np.float32)
    out, _ = attention(q, k, v, scale=1.0, return_weights=weights)
    np.testing.assert_allclose(out, np.full((2, 1), v_value), rtol=1e-6)


def test_an_overflowing_projection_raises():
    eye = np.eye(2, dtype=np.float32)
    with pytest.raises(ResultOverflow):
        mha(np.ones((2, 2), np.float32), eye, eye, eye, np.full((2, 2), 3e38, np.float32), 1)


_SMALL = st.floats(-8, 8, width=32)
_F32_MAX = float(np.finfo(np.float32).max)
_ANY_FINITE = st.floats(-_F32_MAX, _F32_MAX, width=32)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5), st.integers(1, 3), st.integers(1, 3)),
    data=st.data(),
    scale=st.sampled_from([1.0, 0.25, 4.0]),
    causal=st.sampled_from([False, True, "bottom_right"]),
    weights=st.booleans(),
)
def test_finite_inputs_match_the_float64_oracle(shape, data, scale, causal, weights):
    """For any finite float32 values (scores kept within float32's reach), out equals the float64
    oracle whenever the oracle is finite in float32, with and without weights. Where the oracle is
    within the comparison's tolerance of float32's largest value, float32 rounding may carry the
    sum past it: there, and only there, refusing the result (ResultOverflow, a 422) is right too."""
    B, T, S, d, dv = shape
    q = data.draw(hnp.arrays(np.float32, (B, T, d), elements=_SMALL))
    k = data.draw(hnp.arrays(np.float32, (B, S, d), elements=_SMALL))
    v = data.draw(hnp.arrays(np.float32, (B, S, dv), elements=_ANY_FINITE))
    expect, _ = oracle.attention(q, k, v, causal=causal, scale=scale)
    if not np.isfinite(expect.astype(np.float32)).all():
        return
    v_max = float(np.abs(v.astype(np.float64)).max())
    atol = 1e-3 * v_max + 1e-30
    try:
        out, _ = attention(q, k, v, causal=causal, scale=scale, return_weights=weights)
    except ResultOverflow:
        assert float(np.abs(expect).max()) * (1 + 1e-3) + atol >= _F32_MAX, "refused a result well inside float32's range"
        return
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expect, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("scale", [0.25, 1.0, 4.0])
def test_values_at_float32s_limit_are_answered_or_refused_never_inf(scale):
    """Found by the property above: v all at float32's largest value; the weights sum to 1 within
    an ulp, so the float32 sum may round past the limit. The answer is that value (to float32's
    rounding: an ulp below it where the weights sum an ulp below 1) or a refusal, never inf."""
    q, k = np.array([[1.0]], np.float32), np.array([[1.5], [0.0]], np.float32)
    v = np.full((2, 1), _F32_MAX, np.float32)
    for weights in (True, False):
        try:
            out, _ = attention(q, k, v, scale=scale, return_weights=weights)
        except ResultOverflow:
            continue
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, [[_F32_MAX]], rtol=2 * np.finfo(np.float32).eps, atol=0)
