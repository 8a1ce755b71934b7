"""The blocked fast path of the numeric core: every block size, causal alignment, mask,
key_lengths and T != S gives what the straightforward whole-matrix softmax and the float64 loop
oracle give, with and without weights, and the small-score shortcut changes no guarantee."""

from __future__ import annotations

import numpy as np
import pytest

from service.core import ScoreOverflow, Stopped, attention, causal_mask
from service.core import kernels as core

from . import oracle
from .helpers import assert_rows_sum_to_one, set_blocks


def straightforward(q, k, v, mask=None, *, causal=False, key_lengths=None, scale=None):
    """The whole (..., T, S) score matrix at once: mask, subtract the row max, exp, normalise."""
    d, T, S = q.shape[-1], q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    allowed = np.ones(scores.shape, bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= causal_mask(T, S, "top_left" if causal is True else causal)
    if key_lengths is not None:
        allowed &= np.arange(S) < np.asarray(key_lengths)[..., None, None]
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    top[~np.isfinite(top)] = 0
    e = np.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    w = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return w @ v, w


@pytest.fixture(params=[(2**40, 16), (24, 3), (7, 1)], ids=["one block", "blocks of 3 rows", "rows and batch split"])
def blocks(request, monkeypatch):
    """Block sizes: one block for everything, small blocks whose edges fall mid-diagonal, and
    blocks of a single row and batch item; every problem in blocks, however small (checked after
    the test: none went to reference())."""
    plans = set_blocks(monkeypatch, *request.param)
    yield request.param
    assert plans and not any(p.reference for p in plans), "the blocked path never ran"


CASES = [
    # (lead, T, S, mask shape or None, causal, key_lengths shape or None)
    ((2,), 7, 7, None, False, None),
    ((2, 2), 7, 7, None, "top_left", None),
    ((2,), 5, 9, None, "top_left", None),  # T < S
    ((2,), 9, 5, None, "top_left", None),  # T > S: rows past S see every key
    ((3,), 5, 9, None, "bottom_right", None),
    ((3,), 11, 4, None, "bottom_right", None),  # T > S: the first 7 rows see nothing
    ((2, 3), 8, 8, (8, 8), True, None),
    ((2, 3), 6, 10, (2, 1, 6, 10), False, None),
    ((2, 3), 6, 10, (1, 10), "bottom_right", None),
    ((2, 3), 6, 10, (6, 1), False, None),
    ((4,), 9, 9, None, "top_left", (4,)),
    ((2, 2), 9, 6, (9, 6), "bottom_right", (2, 1)),
]
IDS = [
    "plain",
    "causal",
    "causal T<S",
    "causal T>S",
    "bottom_right T<S",
    "bottom_right T>S",
    "mask + causal",
    "mask per batch",
    "key mask + bottom_right",
    "query mask",
    "key_lengths",
    "all three",
]


@pytest.mark.parametrize("lead, T, S, mask_shape, causal, lengths_shape", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_blocks_equal_straightforward_and_oracle(blocks, rng, lead, T, S, mask_shape, causal, lengths_shape, dtype):
    q = rng.standard_normal((*lead, T, 3)).astype(dtype)
    k = rng.standard_normal((*lead, S, 3)).astype(dtype)
    v = rng.standard_normal((*lead, S, 2)).astype(dtype)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.6
    lengths = None if lengths_shape is None else rng.integers(0, S + 1, lengths_shape)
    if lengths is not None:
        lengths.flat[0] = 0  # one batch item with no key at all
    out, w = attention(q, k, v, mask, causal=causal, key_lengths=lengths)
    out_nw, none = attention(q, k, v, mask, causal=causal, key_lengths=lengths, return_weights=False)
    plain_out, plain_w = straightforward(q, k, v, mask, causal=causal, key_lengths=lengths)
    expect_out, expect_w = oracle.attention(q, k, v, mask, causal=causal, key_lengths=lengths)
    assert none is None
    assert out.dtype == out_nw.dtype == w.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-6
    for got in (out, out_nw):
        np.testing.assert_allclose(got, plain_out, atol=tol * 10)
        np.testing.assert_allclose(got, expect_out, atol=tol * 10)
    np.testing.assert_allclose(w, plain_w, atol=tol)
    np.testing.assert_allclose(w, expect_w, atol=tol)
    assert (w[expect_w == 0] == 0).all()  # masked weights exactly 0
    has_key = expect_w.sum(-1) > 0
    assert_rows_sum_to_one(w, has_key)
    assert (out[~has_key] == 0).all() and (out_nw[~has_key] == 0).all()  # never NaN


@pytest.mark.parametrize("S", [3, 1000, 2**16])
@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0], ids=["near-uniform", "ordinary", "peaked"])
@pytest.mark.parametrize("small", [True, False], ids=["reference", "blocks"])
def test_float32_rows_sum_to_one_within_the_promise(monkeypatch, rng, S, spread, small):
    """docs/api.md: a row's float32 weights sum to 1 within 1e-6 (summed in float64), however many
    keys, on either path, with and without a causal mask."""
    monkeypatch.setattr(core, "SMALL_SHARE", 1 if small else 2**62)  # every problem to one path
    monkeypatch.setattr(core, "BLOCK_ELEMENTS", 2**40 if small else 2**14)
    T = max(2, min(32, 2**20 // S))
    q = (rng.standard_normal((2, T, 8)) * spread).astype(np.float32)
    k, v = rng.standard_normal((2, S, 8)).astype(np.float32), rng.standard_normal((2, S, 4)).astype(np.float32)
    for causal in (False, "bottom_right"):
        assert core.plan(2, T, S, 4, causal=causal).reference == small
        _, w = attention(q, k, v, causal=causal)
        assert w.dtype == np.float32
        assert_rows_sum_to_one(w, causal_mask(T, S, "bottom_right").any(-1) if causal else True)


def test_fully_masked_rows_in_every_block(blocks):
    q = np.ones((2, 9, 4), np.float32)
    out, w = attention(q, q[:, :3], q[:, :3], causal="bottom_right")  # rows 0..5 see no key
    out_nw, _ = attention(q, q[:, :3], q[:, :3], causal="bottom_right", return_weights=False)
    for o in (out, out_nw):
        assert np.isfinite(o).all() and (o[:, :6] == 0).all()
        np.testing.assert_allclose(o[:, 6:], 1, atol=1e-6)
    assert (w[:, :6] == 0).all()
    np.testing.assert_allclose(w[:, 6:].sum(-1), 1, atol=1e-6)


@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_large_and_small_rows_mixed_in_one_block(blocks, rng, return_weights):
    """Rows whose scores reach 1e4 subtract their maximum; small rows beside them take the
    shortcut; each is what the oracle gives."""
    q = rng.standard_normal((2, 9, 3))
    k = rng.standard_normal((2, 9, 3))
    v = rng.standard_normal((2, 9, 2))
    q[:, 2] *= 1e4
    k[:, 1] *= 30
    out, w = attention(q, k, v, causal=True, return_weights=return_weights)
    expect_out, expect_w = oracle.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, expect_out, atol=1e-10)
    if return_weights:
        np.testing.assert_allclose(w, expect_w, atol=1e-12)
    out32, _ = attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal=True, return_weights=return_weights)
    assert np.isfinite(out32).all()
    np.testing.assert_allclose(out32, expect_out, atol=1e-4)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_past_bit_identical_when_the_future_grows(blocks, rng, causal, return_weights):
    """A future key of huge norm turns off the shortcut for later rows only: earlier rows, even in
    the same block, keep every bit."""
    q, k, v = (rng.standard_normal((3, 10, 4)).astype(np.float32) for _ in range(3))
    out, _ = attention(q, k, v, causal=causal, return_weights=return_weights)
    k2, v2 = k.copy(), v.copy()
    k2[:, 6:] *= 1e3  # keys 6.. : rows up to 5 (top_left) never see them
    v2[:, 6:] += 100
    out2, _ = attention(q, k2, v2, causal=causal, return_weights=return_weights)
    np.testing.assert_array_equal(out2[:, :6], out[:, :6])


@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_a_shifted_row_keeps_its_bits_whatever_its_neighbours(blocks, rng, return_weights):
    """A row of large scores subtracts its maximum (and, in a block of base-2 rows, goes to base 2
    after): the same bits whether the other rows of its block are small (no shift, log2(e) in
    their scale) or large too."""
    q, k, v = (rng.standard_normal((2, 9, 4)) for _ in range(3))
    q[:, 4] *= 1e3  # row 4's scores reach ~1e3: never provably small
    q_big = q * np.array([1e3] * 4 + [1] + [1e3] * 4)[:, None]  # every row large, row 4 unchanged
    for dtype in (np.float32, np.float64):
        args = [a.astype(dtype) for a in (k, v)]
        out, w = attention(q.astype(dtype), *args, return_weights=return_weights)
        out_big, w_big = attention(q_big.astype(dtype), *args, return_weights=return_weights)
        np.testing.assert_array_equal(out_big[:, 4], out[:, 4])
        if return_weights:
            np.testing.assert_array_equal(w_big[:, 4], w[:, 4])
        np.testing.assert_allclose(out, oracle.attention(q, k, v)[0], rtol=1e-4, atol=1e-5)


def test_overflow_is_found_in_any_block(blocks):
    q = np.zeros((1, 9, 2), np.float32)
    q[0, 7] = np.finfo(np.float32).max ** 0.5 * 4
    with pytest.raises(ScoreOverflow):
        attention(q, q, q, scale=1.0, return_weights=False)
    with pytest.raises(ScoreOverflow):
        attention(q, q, q, scale=1.0, causal=True)


def test_overflow_under_the_mask_is_not_overflow(blocks):
    """A score that overflows where the mask hides it never reaches the softmax."""
    q = np.ones((1, 9, 2), np.float32)
    k = np.ones((1, 9, 2), np.float32)
    k[0, 8] = np.finfo(np.float32).max / 2  # only the last query may see this key
    out, w = attention(q[:, :8], k, k, causal="top_left", scale=1.0)  # 8 queries: none sees key 8
    assert np.isfinite(out).all() and (w[..., 8] == 0).all()


def test_float64_stays_exact_on_long_rows(monkeypatch, rng):
    """Many blocks over rows of 300 keys: float64 matches the straightforward path to 1e-12."""
    monkeypatch.setattr(core, "BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(core, "MIN_ROWS", 1)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (37, 300, 300))
    for causal in (False, "top_left", "bottom_right"):
        for rw in (True, False):
            out, w = attention(q, k, v, causal=causal, return_weights=rw)
            po, pw = straightforward(q, k, v, causal=causal)
            np.testing.assert_allclose(out, po, atol=1e-12, rtol=0)
            if rw:
                np.testing.assert_allclose(w, pw, atol=1e-13, rtol=0)
                np.testing.assert_allclose(w.sum(-1), 1, atol=1e-12)


def test_repeated_calls_share_no_state(rng):
    """Cached masks and scratch buffers leave no trace from one call to the next."""
    a = [rng.standard_normal((2, 33, 5)).astype(np.float32) for _ in range(3)]
    b = [rng.standard_normal((2, 33, 5)).astype(np.float32) for _ in range(3)]
    first = attention(*a, causal=True, return_weights=False)[0]
    attention(*b, causal="bottom_right", key_lengths=np.array([3, 0]), return_weights=False)
    attention(*b, np.eye(33, dtype=bool), causal=True)
    np.testing.assert_array_equal(attention(*a, causal=True, return_weights=False)[0], first)


def test_cached_masks_are_read_only():
    with pytest.raises(ValueError):
        causal_mask(4, 4)[0, 1] = True
    with pytest.raises(ValueError):
        core._band(3, 3, 0)[0, 0] = True


def count_paths(monkeypatch) -> list:
    """A list that grows by "block" at each block attention() computes and by "reference" at
    each call of reference()."""
    calls = []
    block, ref = core._block, core.reference
    monkeypatch.setattr(core, "_block", lambda *args: (calls.append("block"), block(*args))[1])
    monkeypatch.setattr(core, "reference", lambda *args, **kw: (calls.append("reference"), ref(*args, **kw))[1])
    return calls


@pytest.mark.parametrize(
    "B, T, S, causal",
    [(8, 128, 128, True), (8, 2048, 2048, False), (3, 100, 700, "bottom_right"), (1, 5, 3, False)],
    ids=["small causal", "large full", "T < S bottom_right", "tiny"],
)
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_the_plan_is_what_attention_computes(monkeypatch, B, T, S, causal, return_weights):
    """The cost model counts blocks with plan(); its count must be the blocks attention() runs,
    and a reference plan one call of reference()."""
    calls = count_paths(monkeypatch)
    q, k, v = (np.ones((B, n, 4), np.float32) for n in (T, S, S))
    core.attention(q, k, v, causal=causal, return_weights=return_weights)
    p = core.plan(B, T, S, 4, causal=causal, return_weights=return_weights)
    assert len(calls) == p.count
    assert set(calls) == {"reference" if p.reference else "block"}


@pytest.mark.parametrize(
    "variant",
    [
        {"causal": True},
        {"causal": "bottom_right", "key_lengths": np.array([[5, 0, 9], [1, 9, 3]])},
        {"mask": np.tril(np.ones((7, 9), bool), 1)},
        {"bias": np.linspace(-3, 3, 7 * 9).reshape(7, 9), "alibi_slopes": np.array([0.5, 0.25, 0.125])},
        {"enable_gqa": True, "causal": True},
        {"window": (2, 1)},
    ],
    ids=["causal", "bottom_right key_lengths", "mask", "bias alibi", "gqa", "window"],
)
@pytest.mark.parametrize("return_weights", [True, False])
def test_a_small_problem_is_the_reference_and_agrees_with_the_blocks(monkeypatch, rng, variant, return_weights):
    """A small problem is computed by reference(), the same whatever the threads, and raises
    ScoreOverflow as the blocks do; it agrees with the blocked path (the oracle tests above run
    small problems through it too)."""
    calls = count_paths(monkeypatch)
    q = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
    kv_heads = 1 if variant.get("enable_gqa") else 3
    k, v = (rng.standard_normal((2, kv_heads, 9, 8)).astype(np.float32) for _ in range(2))
    one = attention(q, k, v, return_weights=return_weights, **variant)
    assert calls == (["block"] if "window" in variant else ["reference"])  # a window's left edge keeps the blocks
    split = attention(q, k, v, return_weights=return_weights, threads=2, **variant)
    for a, b in zip(one, split, strict=True):
        assert (a is None and b is None) or a.tobytes() == b.tobytes()
    with pytest.raises(ScoreOverflow):
        attention(q * np.float32(1e30), k * np.float32(1e30), v, return_weights=return_weights, **variant)
    monkeypatch.setattr(core, "SMALL_SHARE", 2**62)  # the blocked path
    monkeypatch.setattr(core, "MIN_ROWS", 2)
    monkeypatch.setattr(core, "CAUSAL_BLOCKS", 3)
    blocked = attention(q, k, v, return_weights=return_weights, **variant)
    for a, b in zip(one, blocked, strict=True):
        if a is not None:
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("grow", [1e30, 1e37], ids=["large values", "values near the limit"])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_past_bit_identical_when_future_values_grow(blocks, rng, grow, return_weights):
    """Future values of 1e30 lowered the shortcut's limit (the sum of exp(s) v must stay finite)
    for every row of the item, and values near float32's limit sent the whole item down the
    normalise-first path: rows before them changed bits."""
    q, k, v = (rng.standard_normal((3, 10, 4)).astype(np.float32) for _ in range(3))
    q *= 4  # scores up to ~20-40: within the shortcut's limit, not within a lowered one
    out, w = attention(q, k, v, causal=True, return_weights=return_weights)
    v2 = v.copy()
    v2[:, 6:] *= grow  # rows up to 5 never see them
    out2, w2 = attention(q, k, v2, causal=True, return_weights=return_weights)
    np.testing.assert_array_equal(out2[:, :6], out[:, :6])
    if return_weights:
        np.testing.assert_array_equal(w2[:, :6], w[:, :6])


@pytest.mark.parametrize("dtype, score, value", [(np.float32, -50.0, 1e-25), (np.float64, -600.0, 1e-65)])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_tiny_values_under_small_scores_keep_their_precision(blocks, dtype, score, value, return_weights):
    """Scores of -50 are within the shortcut's limit (|s| < 64): exponentiated unshifted, exp(s) v
    of values ~1e-25 underflowed before the division (without weights): out came back 0."""
    q = np.full((2, 9, 1), score, dtype)
    k = np.ones((2, 9, 1), dtype)
    v = (value * np.linspace(1, 2, 2 * 9 * 3).reshape(2, 9, 3)).astype(dtype)
    out, _ = attention(q, k, v, causal=True, scale=1.0, return_weights=return_weights)
    expect = oracle.reference(q, k, v, causal=True, scale=1.0)[0]
    np.testing.assert_allclose(out, expect, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_a_bounded_row_whose_base_2_scale_would_overflow_is_answered(blocks, return_weights):
    """q = 1e10, scale = 3e28, keys of 1e-40: scores of ~3e-2, q · scale = 3e38 is finite, but the
    shortcut's q · scale · log2(e) is not: the blocks answered ResultOverflow (a 422) where the
    textbook (and the one block) answers."""
    q = np.full((2, 9, 1), 1e10, np.float32)
    k = np.full((2, 9, 1), 1e-40, np.float32)
    v = np.arange(18, dtype=np.float32).reshape(2, 9, 1)
    out, _ = attention(q, k, v, causal=True, scale=3e28, return_weights=return_weights)
    expect = oracle.reference(q, k, v, causal=True, scale=3e28)[0]
    np.testing.assert_allclose(out, expect, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_stop_is_asked_before_each_block_and_abandons_the_rest(blocks, rng, threads):
    """stop() is called before every block: once it says True, Stopped is raised and no later
    block is computed; a stop() that never says True changes no bit."""
    q, k, v = (rng.standard_normal((2, 3, 40, 8)) for _ in range(3))
    asked = []
    out, w = attention(q, k, v, stop=lambda: asked.append(1) and False, threads=threads)
    bare_out, bare_w = attention(q, k, v)
    assert np.array_equal(out, bare_out) and np.array_equal(w, bare_w)
    planned = core.plan(6, 40, 40, 8, itemsize=8)
    n_blocks = 0 if planned.reference else len(planned.blocks)
    assert len(asked) == n_blocks + 1  # each block, and once before any work
    calls = []

    def stop_after_first_block():
        calls.append(1)
        return len(calls) > 2

    if n_blocks > 1:
        with pytest.raises(Stopped):
            attention(q, k, v, stop=stop_after_first_block, threads=threads)
        assert len(calls) <= 2 + threads  # each thread stops at its next block
    with pytest.raises(Stopped):
        attention(q, k, v, stop=lambda: True)  # the reference path and the blocks alike: before any work
    with pytest.raises(Stopped):
        core.mha(q[0, 0], *(np.eye(8),) * 4, heads=2, stop=lambda: True)
