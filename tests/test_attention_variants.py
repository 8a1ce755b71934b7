"""The attention variants of the numeric core: grouped-query heads (enable_gqa), sliding windows,
float biases, ALiBi slopes and head-averaged weights. Against PyTorch's SDPA and FlashAttention's
published formulas in float64 (tests/oracle.py's reference), as hypothesis properties, and on the
textbook's multi-head listing; and the window's cost: O(T * W) scores, not O(T * S)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.core import attention, causal_mask, mha
from service.core import kernels as core

from . import oracle
from .helpers import set_blocks


@pytest.fixture(params=[(2**40, 16), (24, 3), (7, 1)], ids=["one block", "blocks of 3 rows", "rows and batch split"])
def blocks(request, monkeypatch):
    """Block sizes: one block for everything, small blocks whose edges fall inside the band, and
    blocks of a single row and key/value item; every problem in blocks, however small (checked
    after the test: none went to reference())."""
    plans = set_blocks(monkeypatch, *request.param)
    yield request.param
    assert plans and not any(p.reference for p in plans), "the blocked path never ran"


@pytest.fixture(scope="module")
def torch():
    import torch  # pinned in requirements-dev.txt; imported only where used (it takes a second)

    return torch


def allowed_by(T, S, causal=False, window=None):
    """Boolean (T, S) of the causal mask AND FlashAttention's window, from their definitions."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    allowed = np.ones((T, S), bool) if not causal else causal_mask(T, S, "top_left" if causal is True else causal)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (s >= t + S - T - left)
        if right >= 0:
            allowed = allowed & (s <= t + S - T + right)
    return allowed


def both_paths(q, k, v, **kw):
    """(out, weights) with weights, and out without them: the two block paths."""
    out, w = attention(q, k, v, **kw)
    out_nw, none = attention(q, k, v, return_weights=False, **kw)
    assert none is None
    return out, out_nw, w


# --- against PyTorch's scaled_dot_product_attention ----------------------------------------------


def sdpa(torch, q, k, v, *, causal=False, bias=None, enable_gqa=False):
    """torch's SDPA in float64. is_causal is top-left; bottom_right, and any causal mask beside a
    bias, goes in as an explicit mask (SDPA refuses is_causal with attn_mask)."""
    T, S = q.shape[-2], k.shape[-2]
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    mask, is_causal = None, causal in (True, "top_left") and bias is None
    if bias is not None:
        hidden = ~causal_mask(T, S, "top_left" if causal is True else causal) if causal else np.zeros((T, S), bool)
        mask = torch.from_numpy(np.where(hidden, -np.inf, bias))
    elif causal == "bottom_right":
        mask = torch.from_numpy(causal_mask(T, S, "bottom_right").copy())
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)
    return out.numpy()


def assert_equals_sdpa(out, expect, has_key):
    """Rows with a key equal SDPA's; a row without one is 0 here (SDPA's softmax of nothing is NaN
    or 0 depending on the backend)."""
    np.testing.assert_allclose(out[..., has_key, :], expect[..., has_key, :], atol=1e-12, rtol=0)
    assert (out[..., ~has_key, :] == 0).all()


SHAPES = [(5, 9), (9, 5), (8, 8)]
CAUSAL = [False, "top_left", "bottom_right"]


@pytest.mark.parametrize("T, S", SHAPES, ids=["T<S", "T>S", "T=S"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("Hkv", [6, 3, 2, 1])
def test_gqa_equals_sdpa(blocks, rng, torch, T, S, causal, Hkv):
    q = rng.standard_normal((2, 6, T, 8))
    k = rng.standard_normal((2, Hkv, S, 8))
    v = rng.standard_normal((2, Hkv, S, 5))
    expect = sdpa(torch, q, k, v, causal=causal, enable_gqa=True)
    has_key = allowed_by(T, S, causal).any(-1)
    out, out_nw, w = both_paths(q, k, v, causal=causal, enable_gqa=True)
    assert out.shape == (2, 6, T, 5) and w.shape == (2, 6, T, S)
    for o in (out, out_nw):
        assert_equals_sdpa(o, expect, has_key)
    _, expect_w = oracle.reference(q, k, v, causal=causal, enable_gqa=True)
    np.testing.assert_allclose(w, expect_w, atol=1e-13, rtol=0)


@pytest.mark.parametrize("T, S", SHAPES, ids=["T<S", "T>S", "T=S"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("bias_shape", ["S", "1S", "T1", "TS", "H1S", "HTS", "B1TS", "BHTS"])
def test_bias_equals_sdpa_float_mask(blocks, rng, torch, T, S, causal, bias_shape):
    shape = {
        "S": (S,),
        "1S": (1, S),
        "T1": (T, 1),
        "TS": (T, S),
        "H1S": (3, 1, S),
        "HTS": (3, T, S),
        "B1TS": (2, 1, T, S),
        "BHTS": (2, 3, T, S),
    }[bias_shape]
    q, k, v = rng.standard_normal((2, 3, T, 4)), rng.standard_normal((2, 3, S, 4)), rng.standard_normal((2, 3, S, 3))
    bias = rng.standard_normal(shape) * 3
    expect = sdpa(torch, q, k, v, causal=causal, bias=np.broadcast_to(bias, (2, 3, T, S)))
    has_key = allowed_by(T, S, causal).any(-1)
    out, out_nw, w = both_paths(q, k, v, causal=causal, bias=bias)
    for o in (out, out_nw):
        assert_equals_sdpa(o, expect, has_key)
    _, expect_w = oracle.reference(q, k, v, causal=causal, bias=bias)
    np.testing.assert_allclose(w, expect_w, atol=1e-13, rtol=0)


@pytest.mark.parametrize("causal", CAUSAL)
def test_gqa_and_bias_together_equal_sdpa(blocks, rng, torch, causal):
    q, k, v = rng.standard_normal((2, 4, 6, 4)), rng.standard_normal((2, 2, 10, 4)), rng.standard_normal((2, 2, 10, 3))
    bias = rng.standard_normal((4, 6, 10))
    expect = sdpa(torch, q, k, v, causal=causal, bias=np.broadcast_to(bias, (2, 4, 6, 10)), enable_gqa=True)
    for o in both_paths(q, k, v, causal=causal, bias=bias, enable_gqa=True)[:2]:
        assert_equals_sdpa(o, expect, allowed_by(6, 10, causal).any(-1))


# --- against FlashAttention's formulas (window_size, alibi_slopes) -------------------------------

WINDOWS = [(0, 0), (2, 0), (0, 2), (3, 1), (1, 4), (-1, 0), (-1, 2), (2, -1), (0, -1), (-1, -1), (40, 40)]


def check_against_reference(q, k, v, **kw):
    out, out_nw, w = both_paths(q, k, v, **kw)
    expect_out, expect_w = oracle.reference(q, k, v, **kw)
    for o in (out, out_nw):
        np.testing.assert_allclose(o, expect_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(w, expect_w, atol=1e-13, rtol=0)
    assert (w[expect_w == 0] == 0).all()  # masked and out-of-window weights exactly 0
    has_key = expect_w.sum(-1) > 0
    assert (out[~has_key] == 0).all() and (out_nw[~has_key] == 0).all()
    return w


@pytest.mark.parametrize("T, S", [(7, 12), (12, 7), (10, 10)], ids=["T<S", "T>S", "T=S"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window_equals_flash_formula(blocks, rng, T, S, causal, window):
    q, k, v = rng.standard_normal((2, 2, T, 4)), rng.standard_normal((2, 2, S, 4)), rng.standard_normal((2, 2, S, 3))
    w = check_against_reference(q, k, v, causal=causal, window=window)
    assert (w[..., ~allowed_by(T, S, causal, window)] == 0).all()


@pytest.mark.parametrize("T, S", [(7, 12), (12, 7), (10, 10)], ids=["T<S", "T>S", "T=S"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("slopes_shape", [(3,), (2, 3), (2, 1), ()], ids=["H", "BH", "B1", "scalar"])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 2)], ids=str)
def test_alibi_equals_flash_formula(blocks, rng, T, S, causal, slopes_shape, window):
    q, k, v = rng.standard_normal((2, 3, T, 4)), rng.standard_normal((2, 3, S, 4)), rng.standard_normal((2, 3, S, 3))
    slopes = rng.random(slopes_shape) * 2
    check_against_reference(q, k, v, causal=causal, window=window, alibi_slopes=slopes)


def test_alibi_slopes_of_bloom_shape_match_explicit_loop(rng):
    """The slopes of ALiBi's paper (2^(-8 h / H)) and its distance written out row by row."""
    H, T, S = 4, 3, 5
    slopes = 2.0 ** (-8 * np.arange(1, H + 1) / H)
    q, k, v = rng.standard_normal((H, T, 2)), rng.standard_normal((H, S, 2)), rng.standard_normal((H, S, 2))
    _, w = attention(q, k, v, alibi_slopes=slopes)
    for h in range(H):
        for t in range(T):
            scores = [q[h, t] @ k[h, s] / np.sqrt(2) - slopes[h] * abs(t + S - T - s) for s in range(S)]
            e = np.exp(np.array(scores) - max(scores))
            np.testing.assert_allclose(w[h, t], e / e.sum(), atol=1e-14)


def test_everything_at_once(blocks, rng):
    """mask, key_lengths, causal, window, bias, ALiBi and GQA all ANDed or added, with weights averaged."""
    q, k, v = rng.standard_normal((2, 4, 9, 3)), rng.standard_normal((2, 2, 11, 3)), rng.standard_normal((2, 2, 11, 2))
    mask = rng.random((4, 9, 11)) < 0.8
    lengths = np.array([[11, 7, 11, 0], [5, 11, 9, 11]])
    bias, slopes = rng.standard_normal((9, 11)), rng.random(4)
    kw = dict(causal="bottom_right", window=(4, 1), bias=bias, alibi_slopes=slopes, enable_gqa=True)
    out, w = attention(q, k, v, mask, key_lengths=lengths, **kw)
    out_nw, _ = attention(q, k, v, mask, key_lengths=lengths, return_weights=False, **kw)
    keyed = mask & (np.arange(11) < lengths[..., None, None])
    expect_out, expect_w = oracle.reference(q, k, v, keyed, **kw)
    np.testing.assert_allclose(out, expect_out, atol=1e-12)
    np.testing.assert_allclose(out_nw, expect_out, atol=1e-12)
    np.testing.assert_allclose(w, expect_w, atol=1e-13)
    _, avg = attention(q, k, v, mask, key_lengths=lengths, average_weights=True, **kw)
    np.testing.assert_array_equal(avg, w.mean(-3))


@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_overflow_outside_the_window_is_not_overflow(blocks, return_weights):
    """A key whose score overflows is harmless where no row's window reaches it, and raises where one does."""
    q = np.ones((1, 6, 2), np.float32)
    k = np.ones((1, 9, 2), np.float32)
    k[0, 0] = np.finfo(np.float32).max  # q . k = 2 * max: query t sees keys t + 3 - left .. t + 3
    out, w = attention(q, k, k, window=(2, 0), scale=1.0, return_weights=return_weights)
    assert np.isfinite(out).all()
    if return_weights:
        assert (w[..., 0] == 0).all()
    with pytest.raises(core.ScoreOverflow):
        attention(q, k, k, window=(3, 0), scale=1.0, return_weights=return_weights)


# --- properties ------------------------------------------------------------------------------


@st.composite
def variants(draw, bound: float = 5.0):
    """A random problem with H = Hkv * group query heads and a random window and causal setting."""
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    T, S = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    d, dv = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    elems = st.floats(-bound, bound, allow_nan=False, width=64)
    q = draw(hnp.arrays(np.float64, (*batch, Hkv * group, T, d), elements=elems))
    k = draw(hnp.arrays(np.float64, (*batch, Hkv, S, d), elements=elems))
    v = draw(hnp.arrays(np.float64, (*batch, Hkv, S, dv), elements=elems))
    window = draw(st.none() | st.tuples(st.integers(-1, 12), st.integers(-1, 12)))
    causal = draw(st.sampled_from(CAUSAL))
    return q, k, v, window, causal


@settings(max_examples=150, deadline=None)
@given(variants())
def test_rows_sum_to_one_and_the_band_is_respected(problem):
    q, k, v, window, causal = problem
    T, S = q.shape[-2], k.shape[-2]
    out, out_nw, w = both_paths(q, k, v, causal=causal, window=window, enable_gqa=True)
    allowed = allowed_by(T, S, causal, window)
    has_key = allowed.any(-1)
    sums = w.sum(-1)
    np.testing.assert_allclose(sums[..., has_key], 1, atol=1e-12)
    assert (sums[..., ~has_key] == 0).all()
    assert (out[..., ~has_key, :] == 0).all() and (out_nw[..., ~has_key, :] == 0).all()
    assert (w[..., ~allowed] == 0).all()  # outside the band: exactly 0
    assert np.isfinite(out).all() and np.isfinite(out_nw).all()


@settings(max_examples=100, deadline=None)
@given(variants(), st.tuples(st.integers(0, 6), st.integers(0, 6)), st.booleans(), st.data())
def test_output_unchanged_by_keys_outside_the_window(problem, window, return_weights, data):
    """Query t's output keeps every bit when keys and values outside its window change, even
    to values of huge norm that turn off the small-score shortcut for other rows."""
    q, k, v, _, causal = problem
    T, S = q.shape[-2], k.shape[-2]
    t = data.draw(st.integers(0, T - 1))
    left, right = window
    seen = np.zeros(S, bool)
    seen[max(0, t + S - T - left) : max(0, t + S - T + right + 1)] = True
    k2, v2 = k.copy(), v.copy()
    k2[..., ~seen, :] = k2[..., ~seen, :] * 1e3 + 1
    v2[..., ~seen, :] += 100
    kw = dict(causal=causal, window=window, enable_gqa=True, return_weights=return_weights)
    out, _ = attention(q, k, v, **kw)
    out2, _ = attention(q, k2, v2, **kw)
    np.testing.assert_array_equal(out2[..., t, :], out[..., t, :])


@settings(max_examples=100, deadline=None)
@given(variants())
def test_gqa_equals_plain_attention_with_heads_repeated(problem):
    q, k, v, window, causal = problem
    group = q.shape[-3] // k.shape[-3]
    out, w = attention(q, k, v, causal=causal, window=window, enable_gqa=True)
    plain_out, plain_w = attention(q, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3), causal=causal, window=window)
    np.testing.assert_allclose(out, plain_out, atol=1e-13, rtol=0)
    np.testing.assert_allclose(w, plain_w, atol=1e-14, rtol=0)


@settings(max_examples=60, deadline=None)
@given(variants())
def test_average_weights_is_the_mean_over_heads(problem):
    q, k, v, window, causal = problem
    out, w = attention(q, k, v, causal=causal, window=window, enable_gqa=True)
    out_avg, avg = attention(q, k, v, causal=causal, window=window, enable_gqa=True, average_weights=True)
    assert avg.shape == w.shape[:-3] + w.shape[-2:]
    np.testing.assert_array_equal(avg, w.mean(-3))
    np.testing.assert_array_equal(out_avg, out)


@settings(max_examples=60, deadline=None)
@given(variants(), st.data())
def test_variants_equal_reference(problem, data):
    q, k, v, window, causal = problem
    T, S = q.shape[-2], k.shape[-2]
    bias = data.draw(st.none() | hnp.arrays(np.float64, (T, S), elements=st.floats(-5, 5)))
    slopes = data.draw(st.none() | hnp.arrays(np.float64, (q.shape[-3],), elements=st.floats(0, 2)))
    check_against_reference(q, k, v, causal=causal, window=window, bias=bias, alibi_slopes=slopes, enable_gqa=True)


# --- mha: general widths, no output projection, scale, kv_heads ---------------------------------


def test_textbook_listing():
    """The textbook's multi-head listing: x (3, 4) projected to width 3, scale 1, no wo."""
    x = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], np.float64)
    wq = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], np.float64)
    wk = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], np.float64)
    wv = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], np.float64)
    out, w = mha(x, wq, wk, wv, None, 1, causal=False, scale=1.0)
    assert out.shape == (3, 3) and w.shape == (1, 3, 3)
    np.testing.assert_allclose(out[0], [1.9366, 6.6831, 1.5951], atol=1e-4)
    np.testing.assert_allclose(w[0, 0], [0.0634, 0.4683, 0.4683], atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("window", [None, (2, 0)], ids=str)
def test_mha_general_widths_equal_reference(rng, heads, kv_heads, window):
    d, dk, dv, d_out, n = 5, 3, 2, 7, 6
    x = rng.standard_normal((2, n, d))
    wq, wk = rng.standard_normal((d, heads * dk)), rng.standard_normal((d, kv_heads * dk))
    wv, wo = rng.standard_normal((d, kv_heads * dv)), rng.standard_normal((heads * dv, d_out))
    out, w = mha(x, wq, wk, wv, wo, heads, kv_heads=kv_heads, window=window, scale=0.7)
    concat, _ = mha(x, wq, wk, wv, None, heads, kv_heads=kv_heads, window=window, scale=0.7)
    assert out.shape == (2, n, d_out) and concat.shape == (2, n, heads * dv) and w.shape == (2, heads, n, n)
    group = heads // kv_heads
    heads_of = lambda t, h: np.swapaxes(t.reshape(2, n, h, -1), 1, 2)  # (2, n, h * w) -> (2, h, n, w)
    q, k, v = heads_of(x @ wq, heads), heads_of(x @ wk, kv_heads), heads_of(x @ wv, kv_heads)
    expect, expect_w = oracle.reference(q, np.repeat(k, group, 1), np.repeat(v, group, 1), causal=True, window=window, scale=0.7)
    expect = np.swapaxes(expect, 1, 2).reshape(2, n, heads * dv)
    np.testing.assert_allclose(concat, expect, atol=1e-12)
    np.testing.assert_allclose(out, expect @ wo, atol=1e-11)
    np.testing.assert_allclose(w, expect_w, atol=1e-13)


def test_mha_without_new_arguments_is_the_gpt_block(rng):
    x = rng.standard_normal((6, 12))
    ws = [rng.standard_normal((12, 12)) / 4 for _ in range(4)]
    out, w = mha(x, *ws, 3)
    out2, w2 = mha(x, *ws, 3, scale=1 / np.sqrt(4), kv_heads=3, window=None)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(w, w2)


# --- dtypes, errors, cost ------------------------------------------------------------------------


def test_float16_inputs(rng):
    """float16 arrays compute in float16 (no shortcut: EXP_SAFE is 0 there); mixed with float32,
    in float32."""
    q, k, v = (rng.standard_normal((2, 4, n, 8)) for n in (6, 9, 9))
    expect, expect_w = oracle.reference(q, k, v, causal="bottom_right", window=(3, 0), alibi_slopes=[0.5, 0.25, 0.1, 0])
    kw = dict(causal="bottom_right", window=(3, 0), alibi_slopes=np.array([0.5, 0.25, 0.1, 0]))
    for return_weights in (True, False):
        out, w = attention(*(a.astype(np.float16) for a in (q, k, v)), return_weights=return_weights, **kw)
        assert out.dtype == np.float16 and np.isfinite(out).all()
        np.testing.assert_allclose(out, expect, atol=2e-2)
        if return_weights:
            assert w.dtype == np.float16
            np.testing.assert_allclose(w, expect_w, atol=5e-3)
    out, _ = attention(q.astype(np.float16), k.astype(np.float32), v.astype(np.float16), **kw)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expect, atol=1e-2)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda q: attention(q, q[:, :4], q[:, :4], enable_gqa=True), ["4", "6"]),  # 4 kv heads do not divide 6
        (lambda q: attention(q, q[:, :3], q[:, :3]), ["enable_gqa"]),  # a head mismatch suggests it
        (lambda q: attention(q[0, 0], q[0, 0], q[0, 0], enable_gqa=True), ["rank"]),
        (lambda q: attention(q, q, q, window=(-2, 0)), ["window", "-1"]),
        (lambda q: attention(q, q, q, window=(1.5, 0)), ["window"]),
        (lambda q: attention(q, q, q, window=3), ["window"]),
        (lambda q: attention(q[0, 0], q[0, 0], q[0, 0], average_weights=True), ["average_weights", "rank"]),
        (lambda q: mha(q[0, 0], *[np.ones((4, 6))] * 3, None, 3, kv_heads=2), ["kv_heads", "2", "3"]),
        (lambda q: mha(q[0, 0], *[np.ones((4, 6))] * 3, None, 4), ["4"]),
    ],
    ids=[
        "gqa does not divide",
        "head mismatch",
        "gqa rank 2",
        "window below -1",
        "window not int",
        "window not a pair",
        "average rank 2",
        "kv_heads does not divide",
        "width not heads * dk",
    ],
)
def test_bad_arguments_raise_clear_errors(call, words):
    q = np.ones((1, 6, 5, 4))
    with pytest.raises(ValueError) as err:
        call(q)
    for word in words:
        assert word in str(err.value)


def counting_blocks(monkeypatch):
    """Wrap core._block: record each block's computed scores, nb * g * tn * (hi - lo)."""
    scores = []
    real = core._block

    def block(ops, scratch, block):
        b0, b1, t0, t1 = block
        lo, hi = ops.masks.keys(t0, t1, ops.kt.shape[-1])
        scores.append((b1 - b0) * ops.q.shape[1] * (t1 - t0) * (hi - lo))
        return real(ops, scratch, block)

    monkeypatch.setattr(core, "_block", block)
    return scores


@pytest.mark.parametrize(
    "B, T, S, causal, window, groups",
    [
        (8, 2048, 2048, True, (256, 0), 1),
        (8, 2048, 2048, False, (64, 64), 1),
        (3, 100, 700, "bottom_right", (30, -1), 1),
        (8, 1024, 1024, False, (-1, 0), 1),
        (8, 512, 512, True, None, 4),
        (8, 600, 900, False, (100, 3), 2),
        (2, 50, 50, False, (10, 10), 1),
        (4, 64, 64, False, (0, -1), 1),
    ],
    ids=[
        "sliding causal",
        "both sides",
        "left only, T<S",
        "right 0 = bottom_right causal",
        "gqa causal",
        "gqa window T<S",
        "tiny",
        "right open",
    ],
)
def test_block_and_score_counts_are_what_attention_computes(monkeypatch, B, T, S, causal, window, groups):
    """The cost model counts blocks and scores with plan(); they must be what attention() runs."""
    scores = counting_blocks(monkeypatch)
    q = np.ones((B, T, 4), np.float32).reshape(B // groups, groups, T, 4)
    k = np.ones((B // groups, 1, S, 4), np.float32)
    attention(q, k, k, causal=causal, window=window, enable_gqa=True, return_weights=False)
    p = core.plan(B, T, S, 4, causal=causal, window=window, groups=groups, return_weights=False)
    assert not p.reference
    assert len(scores) == p.count
    assert sum(scores) == p.scores


def test_a_window_costs_t_times_w_not_t_squared():
    """T = 8192 under window (256, 0): each row sees 257 keys; the blocks compute under 1.3x that,
    not the 8192 * 8193 / 2 of a causal mask."""
    T, seen = 8192, 257
    computed = core.plan(1, T, T, 64, causal=True, window=(256, 0)).scores
    assert T * seen <= computed < 1.3 * T * seen
    assert core.plan(1, T, T, 64, causal=True).scores > 10 * computed  # T / 2 / 257 = 16 at best
    assert core.plan(1, T, T, 64, window=(256, 0)).scores == computed  # right 0 is causal already
    assert core.plan(2, T, T, 64, window=(-1, -1)).scores == 2 * T * T  # no window


def test_bias_is_not_broadcast_to_every_item():
    """A (T, S) or (H, T, S) bias over (B, H) items is read per block: the peak memory beyond the
    inputs stays far below one (B, H, T, S) array."""
    B, H, T = 8, 8, 256
    q = np.ones((B, H, T, 8))
    full = B * H * T * T * 8  # bytes of a materialised float64 (B, H, T, T)
    for bias in (np.ones((T, T)), np.ones((H, T, T)), np.ones((H, 1, T))):
        tracemalloc.start()
        attention(q, q, q, bias=bias, alibi_slopes=np.ones(H), window=(16, 16), return_weights=False)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < full / 4, (bias.shape, peak, full)
