"""One computation split across threads (attention(..., threads=n, pool=...)): the same bits as
one thread, over every variant of the core (masks, causal, window, grouped-query heads, bias,
ALiBi, key_lengths, weights on and off, float16/32/64), its errors raised from any thread, and
a pool busy with other work never waited for."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.core import ScoreOverflow, attention, mha

from .helpers import set_blocks


@pytest.fixture(params=[(2**9, 4), (2**7, 1)], ids=["blocks of 4 rows", "single rows and items"])
def blocks(request, monkeypatch):
    """Small blocks, so that small arrays make many blocks to share (split by batch item and by
    rows); checked after the test: some problem was in more than one block."""
    plans = set_blocks(monkeypatch, *request.param)
    yield request.param
    assert any(p.count > 1 for p in plans), "no problem was split in blocks"


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(3) as p:
        yield p


def assert_same_bits(one, split):
    """The outputs of one thread and of the split, bit for bit (-0.0 and 0.0 differ)."""
    for a, b in zip(one, split, strict=True):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def inputs(rng, dtype, *, B=2, H=4, Hkv=4, T=13, S=11, d=8, dv=5):
    q = rng.standard_normal((B, H, T, d)) * 2
    k = rng.standard_normal((B, Hkv, S, d)) * 2
    v = rng.standard_normal((B, Hkv, S, dv))
    return tuple(a.astype(dtype) for a in (q, k, v))


# name -> (shape options, attention options built from rng): every variant the core has.
VARIANTS = {
    "plain": ({}, lambda rng: {}),
    "causal": ({}, lambda rng: {"causal": True}),
    "causal bottom_right, T<S": ({"T": 7, "S": 15}, lambda rng: {"causal": "bottom_right"}),
    "mask (B,H,T,S)": ({}, lambda rng: {"mask": rng.random((2, 4, 13, 11)) < 0.7}),
    "mask (H,T,S), gathered": ({}, lambda rng: {"mask": rng.random((4, 13, 11)) < 0.6}),
    "mask (T,S) and causal": ({}, lambda rng: {"mask": rng.random((13, 11)) < 0.8, "causal": True}),
    "window": ({"T": 17, "S": 17}, lambda rng: {"window": (3, 2)}),
    "window and causal": ({"T": 17, "S": 17}, lambda rng: {"window": (4, -1), "causal": True}),
    "key_lengths": ({}, lambda rng: {"key_lengths": np.array([[11, 3, 0, 7], [5, 11, 1, 9]])}),
    "gqa": ({"Hkv": 2}, lambda rng: {"enable_gqa": True, "causal": True}),
    "gqa, one kv head": ({"Hkv": 1}, lambda rng: {"enable_gqa": True}),
    "bias (B,H,T,S)": ({}, lambda rng: {"bias": rng.standard_normal((2, 4, 13, 11))}),
    "bias (H,1,S) and causal": ({}, lambda rng: {"bias": rng.standard_normal((4, 1, 11)), "causal": True}),
    "alibi": ({}, lambda rng: {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}),
    "alibi, window, gqa": (
        {"Hkv": 2, "T": 16, "S": 16},
        lambda rng: {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]), "window": (5, 0), "enable_gqa": True},
    ),
    "everything": (
        {"Hkv": 2, "T": 12, "S": 14},
        lambda rng: {
            "mask": rng.random((2, 4, 12, 14)) < 0.8,
            "causal": "bottom_right",
            "key_lengths": np.array([[14, 9, 0, 12], [3, 14, 13, 1]]),
            "bias": rng.standard_normal((12, 14)),
            "alibi_slopes": np.array([0.3, 0.2, 0.1, 0.05]),
            "window": (6, 1),
            "enable_gqa": True,
        },
    ),
    "average_weights": ({}, lambda rng: {"average_weights": True, "causal": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_split_is_bit_identical_to_one_thread(blocks, pool, variant, dtype, return_weights):
    rng = np.random.default_rng(7)
    shape, options = VARIANTS[variant]
    q, k, v = inputs(rng, dtype, **shape)
    kw = {k_: (a.astype(dtype) if k_ in ("bias", "alibi_slopes") else a) for k_, a in options(rng).items()}
    kw["return_weights"] = return_weights
    one = attention(q, k, v, **kw)
    for threads in (2, 4):
        assert_same_bits(one, attention(q, k, v, threads=threads, pool=pool, **kw))
    assert_same_bits(one, attention(q, k, v, threads=2, **kw))  # a pool of its own


@given(
    B=st.integers(1, 3),
    H=st.sampled_from([1, 2, 4]),
    T=st.integers(1, 40),
    S=st.integers(1, 40),
    causal=st.sampled_from([False, True, "bottom_right"]),
    return_weights=st.booleans(),
    threads=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_split_property_any_shape(B, H, T, S, causal, return_weights, threads, seed):
    """Any shape, default block sizes: small shapes are one block (nothing to share), larger
    ones several; either way the split gives one thread's bits."""
    rng = np.random.default_rng(seed)
    q, k, v = inputs(rng, np.float32, B=B, H=H, Hkv=H, T=T, S=S)
    kw = {"causal": causal, "return_weights": return_weights}
    with ThreadPoolExecutor(threads - 1) as p:
        assert_same_bits(attention(q, k, v, **kw), attention(q, k, v, threads=threads, pool=p, **kw))


def test_large_default_blocks_bit_identical(pool):
    """At the service's sizes (default blocks: batch items and rows both split)."""
    rng = np.random.default_rng(3)
    q, k, v = inputs(rng, np.float32, B=1, H=8, Hkv=8, T=1024, S=1024, d=64, dv=64)
    for return_weights in (True, False):
        one = attention(q, k, v, causal=True, return_weights=return_weights)
        assert_same_bits(one, attention(q, k, v, causal=True, return_weights=return_weights, threads=2, pool=pool))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("return_weights", [True, False], ids=["weights", "no weights"])
def test_mha_split_is_bit_identical(blocks, pool, kv_heads, return_weights):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 19, 16)).astype(np.float32)
    wq, wo = (rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(2))
    wk, wv = (rng.standard_normal((16, 4 * kv_heads)).astype(np.float32) / 4 for _ in range(2))
    kw = {"causal": True, "return_weights": return_weights, "kv_heads": kv_heads}
    one = mha(x, wq, wk, wv, wo, 4, **kw)
    assert_same_bits(one, mha(x, wq, wk, wv, wo, 4, threads=2, pool=pool, **kw))


def test_an_overflow_in_any_thread_is_raised(blocks, pool):
    """A score overflow found by a pool thread is raised in the caller, as on one thread."""
    rng = np.random.default_rng(0)
    q, k, v = inputs(rng, np.float16, T=13, S=11)
    q[1, 3, 12] = 300  # the last block of the last items: found by whichever thread takes it
    k[1, 3] = 300
    with pytest.raises(ScoreOverflow):
        attention(q, k, v)
    for threads in (2, 4):
        with pytest.raises(ScoreOverflow):
            attention(q, k, v, threads=threads, pool=pool)


def test_a_busy_pool_is_not_waited_for(blocks):
    """A pool whose only thread is held by other work: the caller computes every block itself and
    returns, its queued task cancelled (so a split never waits behind another request's work)."""
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, np.float32)
    held, done = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as busy:
        busy.submit(held.wait, 60)  # the timeout only stops a hang
        try:
            out = attention(q, k, v, threads=2, pool=busy)
            done.set()
        finally:
            held.set()
    assert done.is_set()
    assert_same_bits(attention(q, k, v), out)
