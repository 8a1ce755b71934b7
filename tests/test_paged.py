"""The step over pages (service.core.paged_attention): equal to the float64 oracle over the whole
sequence, for any page size and any scratch (chunks merged by lse), in float32 and float64, with
grouped-query attention, causal alignments, windows and ALiBi (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service import core

from . import oracle


def paged(k: np.ndarray, v: np.ndarray, P: int, cuts: list[int] | None = None) -> list[core.Page]:
    """k (Hkv, S, d), v (Hkv, S, dv) cut into pages of P tokens, the last padded with garbage; with
    cuts, the pages come as runs (m, Hkv, P, ...) split at those page indices (views of one array)."""
    Hkv, S, _ = k.shape
    pages = []
    for p0 in range(0, S, P):
        kp = np.full((Hkv, P, k.shape[-1]), np.inf, k.dtype)  # garbage past S (a freed page's): must never be seen
        vp = np.full((Hkv, P, v.shape[-1]), np.nan, v.dtype)
        n = min(P, S - p0)
        kp[:, :n], vp[:, :n] = k[:, p0 : p0 + n], v[:, p0 : p0 + n]
        pages.append((kp, vp))
    if cuts is None:
        return pages
    ks, vs = np.stack([kp for kp, _ in pages]), np.stack([vp for _, vp in pages])
    bounds = sorted({0, len(pages), *(c for c in cuts if 0 < c < len(pages))})
    return [(ks[a:b], vs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


@st.composite
def problems(draw):
    Hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    H, T, S = Hkv * g, draw(st.integers(1, 5)), draw(st.integers(1, 40))
    d, dv, P = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    elems = st.floats(-3, 3, allow_nan=False, width=32)
    q = draw(hnp.arrays(dtype, (H, T, d), elements=elems))
    k = draw(hnp.arrays(dtype, (Hkv, S, d), elements=elems))
    v = draw(hnp.arrays(dtype, (Hkv, S, dv), elements=elems))
    kw = {"causal": draw(st.sampled_from([False, True, "top_left", "bottom_right"]))}
    if draw(st.booleans()):
        kw["window"] = draw(st.tuples(st.integers(-1, 8), st.integers(-1, 8)))
    if draw(st.booleans()):
        kw["alibi_slopes"] = draw(hnp.arrays(dtype, (H,), elements=st.floats(0, 1, width=32)))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.1, 2))
    scratch = draw(st.sampled_from([1, H * T * P * 2, core.paged.SCRATCH_ELEMENTS]))
    cuts = draw(st.none() | st.lists(st.integers(0, 12), max_size=4))
    return q, k, v, P, kw, scratch, cuts


@settings(max_examples=300, deadline=None)
@given(problems())
def test_equal_to_the_oracle_over_the_whole_sequence(problem):
    q, k, v, P, kw, scratch, cuts = problem
    S = k.shape[1]
    out, weights, lse = core.paged_attention(
        q, paged(k, v, P, cuts), S, return_weights=True, return_lse=True, scratch_elements=scratch, **kw
    )
    want_out, want_w, want_lse = oracle.reference(q, k, v, enable_gqa=True, return_lse=True, **kw)
    tol = 2e-5 if q.dtype == np.float32 else 1e-12
    assert out.dtype == q.dtype and out.shape == want_out.shape
    np.testing.assert_allclose(out, want_out, rtol=tol * 10, atol=tol * 10)
    np.testing.assert_allclose(weights, want_w, rtol=tol * 10, atol=tol)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=tol * 10, atol=tol * 10)
    assert (lse[~seen] == np.finfo(q.dtype).min).all()  # a row with no key: the lowest finite value
    assert (weights[~np.broadcast_to(seen[..., None], weights.shape)] == 0).all()


def test_without_weights_the_same_out():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((8, 3, 16)), rng.standard_normal((2, 300, 16)), rng.standard_normal((2, 300, 8))
    pages = paged(k, v, 64)
    out, none = core.paged_attention(q, pages, 300)
    assert none is None
    np.testing.assert_allclose(out, oracle.reference(q, k, v, enable_gqa=True, causal="bottom_right")[0], rtol=1e-12, atol=1e-12)


def test_a_score_past_float32_is_an_overflow():
    q, k, v = np.full((1, 1, 2), 3e19, np.float32), np.full((1, 4, 2), 3e19, np.float32), np.ones((1, 4, 1), np.float32)
    with pytest.raises(core.ScoreOverflow):
        core.paged_attention(q, paged(k, v, 2), 4)


def test_stop_between_chunks():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 1, 4)), rng.standard_normal((1, 64, 4)), rng.standard_normal((1, 64, 4))
    with pytest.raises(core.Stopped):
        core.paged_attention(q, paged(k, v, 8), 64, scratch_elements=8, stop=lambda: True)
