"""The numeric core's small problems: computed by reference(), the textbook softmax (the row
maximum subtracted). Rows of every range (scores far too large or too small to exponentiate
unshifted, ordinary ones) agree with the float64 oracle, keep the guarantees (masked weights
exactly 0, rows summing to 1), a row's bits never depend on its neighbours, and the API answers
the edges the earlier unshifted path had to check for as the textbook does."""

from __future__ import annotations

import numpy as np
import pytest

from service.core import ScoreOverflow, attention
from service.core import kernels as core

from .helpers import assert_rows_sum_to_one
from .oracle import reference  # the whole (..., T, S) softmax in float64


def is_small(q, k, v, **options) -> bool:
    """Whether attention() computes this problem as reference() (core.plan)."""
    *lead, T, d = q.shape
    return core.plan(int(np.prod(lead)), T, k.shape[-2], v.shape[-1], itemsize=q.dtype.itemsize, **options).reference


def mixed_rows(rng, dtype, T=16, H=3, d=4):
    """q, k, v (H, T, d) whose rows 3 and 9 have scores far too large to exponentiate unshifted
    and whose row 6 has scores far below the exp's range; the other rows are ordinary."""
    q = rng.standard_normal((H, T, d))
    k = 1 + 0.05 * rng.standard_normal((H, T, d))  # every key near (1, .., 1): q_t . k_s ~ sum(q_t)
    v = rng.standard_normal((H, T, d))
    big = 1e3 if dtype == np.float32 else 1e4
    q[:, 3] = big
    q[:, 9] = big / 2
    q[:, 6] = -big  # exp of every score of row 6 underflows to 0
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_rows_out_of_the_unshifted_range_agree_with_the_oracle(rng, dtype, causal, return_weights):
    q, k, v = mixed_rows(rng, dtype)
    assert is_small(q, k, v, causal=causal, return_weights=return_weights)
    out, w = attention(q, k, v, causal=causal, return_weights=return_weights)
    expect_out, expect_w = reference(q, k, v, causal=causal)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expect_out, atol=tol * 10, rtol=tol * 10)
    if return_weights:
        np.testing.assert_allclose(w, expect_w, atol=tol)
        assert_rows_sum_to_one(w, True)
        assert (w[expect_w == 0] == 0).all()  # masked weights exactly 0, in both kinds of row


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_an_ordinary_row_keeps_its_bits_whatever_its_neighbours(rng, dtype, return_weights):
    """Rows of scores too large or too small change no bit of the ordinary rows."""
    q, k, v = mixed_rows(rng, dtype)
    plain = q.copy()
    plain[:, [3, 6, 9]] = rng.standard_normal((3, 3, 4)).astype(dtype)  # every row ordinary
    out, w = attention(q, k, v, causal=True, return_weights=return_weights)
    out_plain, w_plain = attention(plain, k, v, causal=True, return_weights=return_weights)
    ordinary = [t for t in range(16) if t not in (3, 6, 9)]
    np.testing.assert_array_equal(out[:, ordinary], out_plain[:, ordinary])
    if return_weights:
        np.testing.assert_array_equal(w[:, ordinary], w_plain[:, ordinary])
    alone = attention(q[:, 3:4], k[:, :4], v[:, :4], causal="bottom_right", return_weights=return_weights)[0]
    np.testing.assert_allclose(out[:, 3:4], alone, rtol=1e-6)  # the large row, as a problem of its own


@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_a_masked_score_that_overflows_is_not_overflow(rng, return_weights):
    """Keys that only masked positions see may overflow the scores (to inf, or NaN for inf - inf):
    the mask hides them (-inf, so weights of exactly 0), and no row changes."""
    q, k, v = (rng.standard_normal((2, 8, 4)).astype(np.float32) for _ in range(3))
    q = np.abs(q) + np.float32(1.5)  # every q_t . M overflows; q_t . (M, M, -M, -M): inf or NaN, by the sum's order
    mask = np.ones((8, 8), bool)
    mask[:, 5:] = False  # no row sees keys 5..7
    k_huge = k.copy()
    k_huge[:, 5] = np.finfo(np.float32).max  # q . k overflows (to inf or -inf)
    k_huge[:, 6, :2], k_huge[:, 6, 2:] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    out, w = attention(q, k, v, mask, return_weights=return_weights)
    with np.errstate(all="ignore"):
        raw = q @ np.swapaxes(k_huge, -1, -2)
    assert np.isposinf(raw[..., 5]).all() and not np.isfinite(raw[..., 6]).any()
    out_huge, w_huge = attention(q, k_huge, v, mask, return_weights=return_weights)
    np.testing.assert_array_equal(out_huge, out)
    if return_weights:
        np.testing.assert_array_equal(w_huge, w)
        assert (w_huge[..., 5:] == 0).all()
    with pytest.raises(ScoreOverflow):  # unmasked, the same keys overflow
        attention(q, k_huge, v, return_weights=return_weights)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [64, 128])
def test_the_serving_shapes_agree_with_the_float64_reference_and_the_blocks(monkeypatch, rng, dtype, T):
    """B=1, H=8, d=64 causal (reference() up to 2**19 scores): what the blocked path and the
    float64 oracle give, with and without weights, the same bits whatever the threads."""
    q, k, v = (rng.standard_normal((1, 8, T, 64)).astype(dtype) for _ in range(3))
    assert is_small(q, k, v, causal=True) and is_small(q, k, v, causal=True, return_weights=False)
    out, w = attention(q, k, v, causal=True)
    out_nw, _ = attention(q, k, v, causal=True, return_weights=False, threads=2)
    expect_out, expect_w = reference(q, k, v, causal=True)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, expect_out, atol=tol)
    np.testing.assert_allclose(out_nw, expect_out, atol=tol)
    np.testing.assert_allclose(w, expect_w, atol=tol)
    assert (w[expect_w == 0] == 0).all()
    assert attention(q, k, v, causal=True, threads=2)[0].tobytes() == out.tobytes()
    monkeypatch.setattr(core, "SMALL_SHARE", 2**62)  # the blocked path
    blocked, blocked_w = attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, blocked, atol=tol)
    np.testing.assert_allclose(w, blocked_w, atol=tol)


def test_float16_takes_the_reference_too(rng):
    """float16 has no room to exponentiate unshifted; reference() subtracts every row's max."""
    q, k, v = (rng.standard_normal((2, 6, 4)).astype(np.float16) for _ in range(3))
    assert is_small(q, k, v, causal=True)
    out, w = attention(q, k, v, causal=True)
    assert out.dtype == w.dtype == np.float16
    np.testing.assert_allclose(out, reference(q, k, v, causal=True)[0], atol=2e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_small_problem_is_the_reference_while_its_scores_fit_2_mib(dtype):
    """8 heads at T=256 causal: 2**19 scores are the reference in float32 (2 MiB) and 16-row
    blocks in float64 (4 MiB), as plan() says when told the itemsize."""
    itemsize = np.dtype(dtype).itemsize
    p = core.plan(8, 256, 256, 4, causal=True, itemsize=itemsize, return_weights=False)
    assert p.reference == (itemsize == 4)
    assert p.count == (1 if itemsize == 4 else 16)
    assert p.scores == (8 * 256 * 256 if itemsize == 4 else 8 * 16 * 16 * 136)


@pytest.mark.parametrize("dtype, score, value", [(np.float32, -50.0, 1e-25), (np.float64, -600.0, 1e-65)])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_tiny_values_under_a_small_row_sum_keep_their_precision(dtype, score, value, return_weights):
    """A row whose scores are all far below 0: exponentiated unshifted, each exp(s) v of values
    ~1e-25 (float64: 1e-65) would underflow (to 0, or a denormal of a few bits) before the
    division; the textbook subtracts the row's max and gives v to its precision."""
    T = 4
    q = np.full((2, T, 1), score, dtype)  # every score of every row is `score` (k = 1, scale 1)
    k = np.ones((2, T, 1), dtype)
    v = (value * np.linspace(1, 2, 2 * T * 3).reshape(2, T, 3)).astype(dtype)
    v[1] *= 1e20  # the other item: ordinary products, kept unshifted
    out, w = attention(q, k, v, causal=True, scale=1.0, return_weights=return_weights)
    expect_out, _ = reference(q, k, v, causal=True, scale=1.0)
    np.testing.assert_allclose(out, expect_out, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=0)


def test_values_of_no_width_under_a_small_row_sum():
    """v (..., S, 0): out (..., T, 0), and the weights of a row of equal scores."""
    q = np.full((1, 2, 1), -50.0, np.float32)
    k = np.ones((1, 2, 1), np.float32)
    out, w = attention(q, k, np.ones((1, 2, 0), np.float32), scale=1.0)
    assert out.shape == (1, 2, 0)
    np.testing.assert_allclose(w, 0.5)


@pytest.mark.parametrize("keys", [2, 65])
def test_a_scaled_query_that_overflows_raises_whatever_the_other_rows(monkeypatch, keys):
    """q · scale past float32's range (q = 1e30, scale = 1e10) against keys of 1e-40: the textbook
    scales q first and overflows (scaling k instead would answer), on either path and whatever
    S and the other rows."""
    q = np.ones((2, 2, 1), np.float32)
    q[0, 0] = 1e30
    k = np.full((2, keys, 1), 1e-40, np.float32)
    v = np.ones((2, keys, 1), np.float32)
    for share in (1, 2**62):  # the reference, and the blocks
        monkeypatch.setattr(core, "SMALL_SHARE", share)
        with pytest.raises(ScoreOverflow):
            attention(q, k, v, scale=1e10)
        with pytest.raises(ScoreOverflow):
            attention(q, k, v, scale=1e10, return_weights=False)
        with pytest.raises(ScoreOverflow):  # row 0 sees key 0 alone: the copy of k again
            attention(q, k, v, scale=1e10, causal=True)


EDGES = {  # name: (request fields beyond q, k, v; the status the API must answer)
    "q · scale overflows": ({"q": [[1e30], [1.0]], "k": [[1e-40], [1e-40]], "v": [[1.0], [1.0]], "scale": 1e10}, 422),
    "scores of 89 unshifted": ({"q": [[89.5], [-89.5]], "k": [[1.0], [1.0]], "v": [[1.0], [2.0]], "scale": 1.0}, 200),
    "scores of -50, values of 1e-25": (
        {"q": [[-50.0], [-50.0]], "k": [[1.0], [1.0]], "v": [[1e-25], [2e-25]], "scale": 1.0, "causal": True},
        200,
    ),
    "values near float32's limit": ({"q": [[30.0], [1.0]], "k": [[1.0], [1.0]], "v": [[3e38], [3e38]], "scale": 1.0}, 200),
    "scale 1e30": ({"q": [[1.0], [-1.0]], "k": [[1.0], [0.5]], "v": [[1.0], [2.0]], "scale": 1e30}, 200),
    "scale 1e-30": ({"q": [[1.0], [-1.0]], "k": [[1.0], [0.5]], "v": [[1.0], [2.0]], "scale": 1e-30}, 200),
    "bottom_right, S < T": ({"q": [[1.0], [2.0], [3.0]], "k": [[1.0]], "v": [[5.0]], "causal": "bottom_right"}, 200),
    "-0.0": ({"q": [[-0.0], [-0.0]], "k": [[-0.0], [1.0]], "v": [[-0.0], [1.0]]}, 200),
}


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no weights"])
@pytest.mark.parametrize("name", list(EDGES))
def test_the_api_answers_the_small_paths_edges_or_refuses_them(client, name, weights):
    """Through the API: 422 non_finite where the textbook overflows, else a 200 whose out is the
    float64 oracle's (never a 500, never a 200 with a wrong or non-finite number)."""
    from . import oracle  # here, not at the top: main changes this module's imports (a merge stays clean)
    from .helpers import post, tensor

    body, status = EDGES[name]
    r = post(client, {**body, "return_weights": weights})
    assert r.status_code == status, r.json
    if status == 422:
        assert r.json["error"]["code"] == "non_finite", r.json
        return
    expect = oracle.reference(body["q"], body["k"], body["v"], causal=body.get("causal", False), scale=body.get("scale"))[0]
    np.testing.assert_allclose(tensor(r.json["out"]), expect, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_without_weights_out_is_divided_by_its_row_sum_where_that_is_as_exact(rng, dtype):
    """No weights and S > dv: the reference path divides out, not the weights. A row whose
    unshifted scores sum below 1 over values near the smallest normal, and a row whose values are
    so large that e v overflows before the division, give what the oracle gives as the ordinary
    rows do, and change no bit of them."""
    T, S, dv = 6, 8, 2
    q = rng.standard_normal((2, T, 1)).astype(dtype)
    k = np.ones((2, S, 1), dtype)
    v = rng.standard_normal((2, S, dv)).astype(dtype)
    tiny = np.finfo(dtype).tiny
    q[0, 1], q[0, 2] = -30, 40  # row 1 sums to ~e**-30 (< 1); row 2's exp(s) ~e**40 times values near the max overflows
    v[1] *= 1e8 * tiny  # the other item's values near the smallest normal: its rows sum ~e**-30 too
    q[1] = -30
    v_big = v.copy()
    v_big[0, :, 0] = np.finfo(dtype).max / 2 * np.sign(v[0, :, 0])
    for values in (v, v_big):
        assert core.plan(2, T, S, dv, return_weights=False, itemsize=q.dtype.itemsize).reference
        out, _ = attention(q, k, values, scale=1.0, return_weights=False)
        expect, _ = reference(q, k, values, scale=1.0)
        np.testing.assert_allclose(out, expect, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=0)
    ordinary = [0, 3, 4, 5]
    plain = q.copy()
    plain[0, 1:3] = 0.5
    np.testing.assert_array_equal(
        attention(plain, k, v, scale=1.0, return_weights=False)[0][0, ordinary],
        attention(q, k, v, scale=1.0, return_weights=False)[0][0, ordinary],
    )
