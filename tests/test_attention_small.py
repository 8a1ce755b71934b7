"""The numeric core's small-problem path (kernels._small_block): one block whose rows are first
exponentiated unshifted and kept only where that is exact; any other row is computed again as the
textbook softmax. Rows of both kinds in one problem agree with the float64 reference, keep the
guarantees (masked weights exactly 0, rows summing to 1), and a row's bits never depend on which
kind its neighbours are."""

from __future__ import annotations

import numpy as np
import pytest

from service.core import ScoreOverflow, attention
from service.core import kernels as core

from .oracle import reference  # the whole (..., T, S) softmax in float64


def count_calls(monkeypatch, name: str = "_block") -> list:
    """A list that grows by one at each call of kernels.<name>."""
    calls = []
    real = getattr(core, name)
    monkeypatch.setattr(core, name, lambda *args: (calls.append(1), real(*args))[1])
    return calls


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
def test_rows_out_of_the_unshifted_range_are_computed_as_the_textbook(monkeypatch, rng, dtype, causal, return_weights):
    calls, second = count_calls(monkeypatch), count_calls(monkeypatch, "_small_shifted")
    q, k, v = mixed_rows(rng, dtype)
    out, w = attention(q, k, v, causal=causal, return_weights=return_weights)
    assert len(calls) == 1 and len(second) == 1  # still one block: the second pass is within it
    expect_out, expect_w = reference(q, k, v, causal=causal)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expect_out, atol=tol * 10, rtol=tol * 10)
    if return_weights:
        np.testing.assert_allclose(w, expect_w, atol=tol)
        np.testing.assert_allclose(w.sum(-1), 1, atol=tol)
        assert (w[expect_w == 0] == 0).all()  # masked weights exactly 0, in both kinds of row


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_an_ordinary_row_keeps_its_bits_whatever_its_neighbours(rng, dtype, return_weights):
    """The rows that take the second pass change no bit of the rows that do not, and vice versa."""
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
def test_a_masked_score_that_overflows_is_not_overflow(monkeypatch, rng, return_weights):
    """Keys that only masked positions see may overflow the scores (to inf, or NaN for inf - inf):
    the mask sets their weights to exactly 0 after exp, and no row changes."""
    q, k, v = (rng.standard_normal((2, 8, 4)).astype(np.float32) for _ in range(3))
    q = np.abs(q) + np.float32(1.5)  # every q_t . M overflows; q_t . (M, M, -M, -M): inf or NaN, by the sum's order
    mask = np.ones((8, 8), bool)
    mask[:, 5:] = False  # no row sees keys 5..7
    k_huge = k.copy()
    k_huge[:, 5] = np.finfo(np.float32).max  # q . k overflows (to inf or -inf)
    k_huge[:, 6, :2], k_huge[:, 6, 2:] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    out, w = attention(q, k, v, mask, return_weights=return_weights)
    second = count_calls(monkeypatch, "_small_shifted")
    with np.errstate(all="ignore"):
        raw = q @ np.swapaxes(k_huge, -1, -2)
    assert np.isposinf(raw[..., 5]).all() and not np.isfinite(raw[..., 6]).any()
    out_huge, w_huge = attention(q, k_huge, v, mask, return_weights=return_weights)
    assert not second  # every row stays on the first pass
    np.testing.assert_array_equal(out_huge, out)
    if return_weights:
        np.testing.assert_array_equal(w_huge, w)
        assert (w_huge[..., 5:] == 0).all()
    with pytest.raises(ScoreOverflow):  # unmasked, the same keys overflow
        attention(q, k_huge, v, return_weights=return_weights)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T", [64, 128])
def test_the_serving_shapes_agree_with_the_float64_reference_and_the_blocks(monkeypatch, rng, dtype, T):
    """B=1, H=8, d=64 causal (one block up to 2**19 scores): what the blocked path and the
    float64 reference give, with and without weights, the same bits whatever the threads."""
    calls = count_calls(monkeypatch)
    q, k, v = (rng.standard_normal((1, 8, T, 64)).astype(dtype) for _ in range(3))
    out, w = attention(q, k, v, causal=True)
    out_nw, _ = attention(q, k, v, causal=True, return_weights=False, threads=2)
    assert len(calls) == 2
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


def test_float16_keeps_the_blocks_path(monkeypatch, rng):
    """float16 has no room to exponentiate unshifted: its one block subtracts every row's max."""
    monkeypatch.setattr(core, "_small_block", None)  # would fail if called
    q, k, v = (rng.standard_normal((2, 6, 4)).astype(np.float16) for _ in range(3))
    out, w = attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, causal=True)[0], atol=2e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_small_problem_is_one_block_while_its_scores_fit_2_mib(monkeypatch, dtype):
    """8 heads at T=256 causal: 2**19 scores are one block in float32 (2 MiB) and 16-row blocks in
    float64 (4 MiB), as block_count says when told the itemsize."""
    calls = count_calls(monkeypatch)
    q = np.ones((8, 256, 4), dtype)
    attention(q, q, q, causal=True, return_weights=False)
    itemsize = np.dtype(dtype).itemsize
    assert len(calls) == core.block_count(8, 256, 256, True, itemsize=itemsize) == (1 if itemsize == 4 else 16)
    assert core.score_count(8, 256, 256, True, itemsize=itemsize) == (8 * 256 * 256 if itemsize == 4 else 8 * 16 * 16 * 136)


@pytest.mark.parametrize("dtype, score, value", [(np.float32, -50.0, 1e-25), (np.float64, -600.0, 1e-65)])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_tiny_values_under_a_small_row_sum_keep_their_precision(dtype, score, value, return_weights):
    """A row whose scores are all far below 0 sums to ~exp(score), above SUM_FLOOR: unshifted, each
    exp(s) v of values ~1e-25 (float64: 1e-65) underflowed (to 0, or a denormal of a few bits)
    before the division, so out came back 0 or percents off where the textbook gives v exactly."""
    T = 4
    q = np.full((2, T, 1), score, dtype)  # every score of every row is `score` (k = 1, scale 1)
    k = np.ones((2, T, 1), dtype)
    v = (value * np.linspace(1, 2, 2 * T * 3).reshape(2, T, 3)).astype(dtype)
    v[1] *= 1e20  # the other item: ordinary products, kept unshifted
    out, w = attention(q, k, v, causal=True, scale=1.0, return_weights=return_weights)
    expect_out, _ = reference(q, k, v, causal=True, scale=1.0)
    np.testing.assert_allclose(out, expect_out, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=0)


def test_values_of_no_width_under_a_small_row_sum():
    """v (..., S, 0): out (..., T, 0), as before the check of a small sum's exp(s) v (which
    reshaped out with -1: a ValueError for an empty out)."""
    q = np.full((1, 2, 1), -50.0, np.float32)
    k = np.ones((1, 2, 1), np.float32)
    out, w = attention(q, k, np.ones((1, 2, 0), np.float32), scale=1.0)
    assert out.shape == (1, 2, 0)
    np.testing.assert_allclose(w, 0.5)


@pytest.mark.parametrize("keys", [2, 65], ids=["k's scaled copy", "q's scaled copy"])
def test_a_scaled_query_that_overflows_raises_whatever_the_other_rows(monkeypatch, keys):
    """q · scale past float32's range (q = 1e30, scale = 1e10) against keys of 1e-40: the textbook
    scales q first and overflows; up to COPY_KEYS keys the one block scaled k instead (1.4e-30)
    and answered, unless some other row took the second pass, which then raised: whether a
    request failed depended on the other rows, and on S."""
    q = np.ones((2, 2, 1), np.float32)
    q[0, 0] = 1e30
    k = np.full((2, keys, 1), 1e-40, np.float32)
    v = np.ones((2, keys, 1), np.float32)
    for share in (1, 2**62):  # the one block, and the blocks
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
