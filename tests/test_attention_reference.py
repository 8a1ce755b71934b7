"""reference(), the core's textbook, and the blocked path beside it: for every variant (mask,
key_lengths, causal, window, bias, ALiBi, GQA, averaged weights) the blocks give what reference()
gives, and reference() gives what the independent float64 oracle (tests/oracle.py) gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.core import ResultOverflow, ScoreOverflow, attention, reference
from service.core import kernels as core

from . import oracle
from .helpers import assert_rows_sum_to_one, set_blocks

CAUSAL = [False, True, "top_left", "bottom_right"]


@st.composite
def problems(draw):
    """q, k, v and the options of one random problem, every variant drawn or left out."""
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    H, T, S = Hkv * group, draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d, dv = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    elems = st.floats(-4, 4, allow_nan=False, width=64)
    q = draw(hnp.arrays(np.float64, (*batch, H, T, d), elements=elems))
    k = draw(hnp.arrays(np.float64, (*batch, Hkv, S, d), elements=elems))
    v = draw(hnp.arrays(np.float64, (*batch, Hkv, S, dv), elements=elems))
    options = {"causal": draw(st.sampled_from(CAUSAL)), "enable_gqa": True}
    if draw(st.booleans()):
        options["window"] = draw(st.tuples(st.integers(-1, 10), st.integers(-1, 10)))
    if draw(st.booleans()):
        options["mask"] = draw(hnp.arrays(bool, (T, S)))
    if draw(st.booleans()):
        options["key_lengths"] = draw(hnp.arrays(np.int64, (H,), elements=st.integers(0, S)))
    if draw(st.booleans()):
        options["bias"] = draw(hnp.arrays(np.float64, (T, S), elements=st.floats(-3, 3)))
    if draw(st.booleans()):
        options["alibi_slopes"] = draw(hnp.arrays(np.float64, (H,), elements=st.floats(0, 1)))
    options["average_weights"] = draw(st.booleans())
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), options


def oracle_of(q, k, v, options, return_lse=False):
    """The oracle's (out, weights[, lse]) for the same options, weights averaged."""
    o = dict(options)
    mask, average = o.pop("mask", None), o.pop("average_weights")
    out, w, *lse = oracle.reference(q, k, v, mask, return_lse=return_lse, **o)
    return out, (w.mean(-3) if average else w), *lse


@settings(max_examples=150, deadline=None)
@given(problems(), st.booleans())
def test_the_blocks_equal_the_reference_and_the_reference_the_oracle(problem, return_weights):
    q, k, v, options = problem
    mask = options.get("mask")
    kw = {name: value for name, value in options.items() if name != "mask"}
    ref_out, ref_w = reference(q, k, v, mask, return_weights=return_weights, **kw)
    with pytest.MonkeyPatch.context() as mp:
        set_blocks(mp, 12, 2)  # every problem in blocks, small ones of a few rows
        out, w = attention(q, k, v, mask, return_weights=return_weights, **kw)
    expect_out, expect_w = oracle_of(q, k, v, options)
    tol = 1e-5 if q.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(ref_out, expect_out, atol=tol, rtol=tol)
    assert out.dtype == ref_out.dtype == q.dtype
    if return_weights:
        np.testing.assert_allclose(w, ref_w, atol=tol, rtol=tol)
        np.testing.assert_allclose(ref_w, expect_w, atol=tol, rtol=tol)
        assert (ref_w[expect_w == 0] == 0).all() and (w[expect_w == 0] == 0).all()  # hidden keys: exactly 0
        if not options["average_weights"]:  # (an average over heads sums to the share of heads with a key)
            assert_rows_sum_to_one(w, expect_w.sum(-1) > 0)
            assert_rows_sum_to_one(ref_w, expect_w.sum(-1) > 0)
    else:
        assert w is None and ref_w is None


@settings(max_examples=150, deadline=None)
@given(problems(), st.booleans())
def test_lse_equals_the_oracle_on_either_path(problem, return_weights):
    """lse (..., T), heads kept under average_weights, in the compute dtype: the float64 oracle's
    log-sum-exp of the scores each row may see; a row with no key has the dtype's lowest finite
    value. out and weights are those of the call without return_lse, bit for bit."""
    q, k, v, options = problem
    mask = options.get("mask")
    kw = {name: value for name, value in options.items() if name != "mask"}
    _, _, expect = oracle_of(q, k, v, options, return_lse=True)
    lowest = np.finfo(q.dtype).min
    tol = 1e-5 if q.dtype == np.float32 else 1e-12
    for blocks in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if blocks:
                set_blocks(mp, 12, 2)
            out, w, lse = attention(q, k, v, mask, return_weights=return_weights, return_lse=True, **kw)
            plain_out, plain_w = attention(q, k, v, mask, return_weights=return_weights, **kw)
        assert lse.shape == q.shape[:-1] and lse.dtype == q.dtype
        none = np.isneginf(expect)
        assert (lse[none] == lowest).all()
        np.testing.assert_allclose(lse[~none], expect[~none], atol=tol, rtol=tol)
        np.testing.assert_array_equal(out, plain_out)
        np.testing.assert_array_equal(w, plain_w)
    ref = reference(q, k, v, mask, return_weights=return_weights, return_lse=True, **kw)
    np.testing.assert_allclose(ref[2][~none], expect[~none], atol=tol, rtol=tol)
    assert (ref[2][none] == lowest).all()


def test_lse_of_large_scores_and_of_rows_with_no_key(monkeypatch):
    """Scores of 1e4 (max subtracted) give lse = 1e4 + log(count); a row with no key (key_lengths 0,
    bottom_right with T > S) has lse the lowest finite value and out 0, in either dtype and path."""
    for dtype in (np.float32, np.float64):
        for share in (1, 2**62):
            monkeypatch.setattr(core, "SMALL_SHARE", share)
            q = np.full((2, 3, 1), 100.0, dtype)
            k = np.full((2, 2, 1), 100.0, dtype)
            out, _, lse = attention(q, k, k, scale=1.0, return_lse=True, key_lengths=np.array([2, 0]), causal="bottom_right")
            np.testing.assert_allclose(lse[0, 1:], 1e4 + np.log([1, 2]), rtol=1e-6)
            assert lse[0, 0] == lse[1, 0] == lse[1, 2] == np.finfo(dtype).min and lse.dtype == dtype
            assert (out[1] == 0).all() and (out[0, 0] == 0).all()


@pytest.mark.parametrize(
    "q, k, v, options, error",
    [
        (np.full((2, 3, 2), 1e30, np.float32), np.full((2, 3, 2), 1e30, np.float32), np.ones((2, 3, 1), np.float32), {}, ScoreOverflow),
        (np.ones((1, 2, 1)), np.ones((1, 2, 1)), np.full((1, 2, 1), np.inf), {}, ResultOverflow),
        (np.ones((1, 4, 2)), np.ones((1, 3, 2)), np.ones((1, 3, 2)), {"window": (1, 2, 3)}, ValueError),
        (np.ones((1, 4, 2)), np.ones((1, 3, 2)), np.ones((1, 3, 2)), {"causal": "middle"}, ValueError),
        (np.ones((4, 2)), np.ones((3, 2)), np.ones((3, 2)), {"average_weights": True}, ValueError),
        (np.ones((1, 3, 4, 2)), np.ones((1, 2, 3, 2)), np.ones((1, 2, 3, 2)), {"enable_gqa": True}, ValueError),
    ],
    ids=["score overflow", "values not finite", "window not a pair", "causal unknown", "average rank 2", "gqa does not divide"],
)
@pytest.mark.parametrize("small", [True, False], ids=["reference", "blocks"])
def test_the_same_errors_on_either_path(monkeypatch, q, k, v, options, error, small):
    """reference() and the blocks raise the same error with the same message."""
    monkeypatch.setattr(core, "SMALL_SHARE", 1 if small else 2**62)
    with pytest.raises(error) as by_attention:
        attention(q, k, v, **options)
    with pytest.raises(error) as by_reference:
        reference(q, k, v, **options)
    assert str(by_attention.value) == str(by_reference.value)


def test_a_row_with_no_key_is_exactly_zero():
    """key_lengths 0 and a fully masked row: weights and out exactly 0, not NaN."""
    q, k, v = np.ones((2, 3, 2), np.float32), np.ones((2, 4, 2), np.float32), np.ones((2, 4, 5), np.float32)
    mask = np.ones((3, 4), bool)
    mask[1] = False
    out, w = reference(q, k, v, mask, key_lengths=np.array([0, 4]))
    assert (out[0] == 0).all() and (w[0] == 0).all()
    assert (out[1, 1] == 0).all() and (w[1, 1] == 0).all()
    np.testing.assert_array_equal(w[1, 0], 0.25)


def test_empty_shapes():
    """No keys, no queries or no items: the shapes attention() gives, nothing computed."""
    for q, k, v in [
        (np.ones((2, 3, 2)), np.ones((2, 0, 2)), np.ones((2, 0, 4))),
        (np.ones((2, 0, 2)), np.ones((2, 5, 2)), np.ones((2, 5, 4))),
        (np.ones((0, 3, 2)), np.ones((0, 5, 2)), np.ones((0, 5, 4))),
    ]:
        out, w = reference(q, k, v, causal=True)
        assert out.shape == q.shape[:-1] + (4,) and w.shape == q.shape[:-1] + (k.shape[-2],)
        assert not out.any()
