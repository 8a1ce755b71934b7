"""Attention states in the client (contract: "Attention states"): merge_states merges the (out,
lse) of key segments into one call's answer; the client's key splitting, over a live server whose
limits are small, answers what one call would over every variant; replicas share the blocks, and
a replica that is busy or dead hands its block to another."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attention_client import AttentionClient, AttentionError, _split, merge_states
from service import core, replicas

from . import oracle
from .helpers import JsonHandler, free_port, free_ports, serving, wait_until

CAUSAL = [False, True, "bottom_right"]
# Small enough that the problems below split over keys and rows, and one row's keys do not fit.
LIMITS = {
    "ATTN_MAX_T": "8",
    "ATTN_MAX_S": "8",
    "ATTN_MAX_SCORE_ELEMENTS": "256",
    "ATTN_MAX_WEIGHTS_ELEMENTS": "256",
    "ATTN_WARMUP": "0",
    "WEB_CONCURRENCY": "1",
}
# Key-split float32 answers against one float32 call: the merge in float64 adds a rounding or two.
RTOL = 2e-6


# --- merge_states: pure ------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_merge_of_key_segments_is_one_call(data):
    """Segments of the keys, each with its mask and bias slices, merged: one call's out, lse and
    weights, in float64 to 1e-12; a row that sees no key of any segment keeps out 0 and lse lowest."""
    H, T, S, d = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 12)), data.draw(st.integers(1, 4))
    elems = st.floats(-3, 3, allow_nan=False)
    q, k, v = (data.draw(hnp.arrays(np.float64, shape, elements=elems)) for shape in ((H, T, d), (H, S, d), (H, S, 2)))
    mask = data.draw(hnp.arrays(bool, (H, T, S)))
    bias = data.draw(hnp.arrays(np.float64, (T, S), elements=elems))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, S - 1), max_size=3)))) if S > 1 else []
    edges = [0, *cuts, S]
    parts = [
        core.attention(q, k[:, a:b], v[:, a:b], mask[..., a:b], bias=bias[:, a:b], return_lse=True)
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    out, lse, weights = merge_states([p[0] for p in parts], [p[2] for p in parts], [p[1] for p in parts])
    want_out, want_w, want_lse = core.attention(q, k, v, mask, bias=bias, return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights, want_w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    none = ~mask.any(-1)
    assert (lse[none] == np.finfo(np.float64).min).all() and (out[none] == 0).all()


def test_merge_of_float32_states_keeps_lowest_and_dtype():
    out = np.ones((1, 2, 3), np.float32)
    out[0, 1] = 0  # a row with no key has out 0
    lowest = np.finfo(np.float32).min
    merged, lse = merge_states([out * 0, out], [np.full((1, 2), lowest, np.float32), np.array([[0.5, lowest]], np.float32)])
    assert merged.dtype == lse.dtype == np.float32
    np.testing.assert_array_equal(merged[0, 0], 1)
    assert lse[0, 0] == np.float32(0.5) and lse[0, 1] == lowest and (merged[0, 1] == 0).all()


@pytest.mark.parametrize("lo, hi", [(None, 0), (-2, 3), (None, 5), (-3, None), (1, 1)])
def test_a_blocks_band_is_the_band_over_its_rows_and_keys(lo, hi):
    """_split.band re-expresses lo <= s - t <= hi for every block: as a window or a mask, exactly."""
    T, S = 9, 11
    d = np.arange(S)[None, :] - np.arange(T)[:, None]
    full = np.ones((T, S), bool) & ((d >= lo) if lo is not None else True) & ((d <= hi) if hi is not None else True)
    for t0, t1, s0, s1 in [(0, 9, 0, 11), (3, 6, 2, 8), (0, 4, 5, 11), (5, 9, 0, 3), (2, 3, 7, 9)]:
        window, mask = _split.band(lo, hi, t0, t1, s0, s1)
        tb, sb = t1 - t0, s1 - s0
        got = np.ones((tb, sb), bool) if mask is None else mask
        if window is not None:
            got = got & core.reference.__globals__["visible"](tb, sb, False, window)
        np.testing.assert_array_equal(got, full[t0:t1, s0:s1])
        assert _split.sees_band(lo, hi, t0, t1, s0, s1) == full[t0:t1, s0:s1].any()


def test_plan_keys_covers_every_visible_pair_once_within_the_limits():
    """Blocks of at most 30 keys and 600 scores over (3, 40, 100), causal: every (item, row, key)
    a row may see is in exactly one block, none past the limits, none wholly above the diagonal;
    key_chunks asks for at least that many key ranges."""

    def fits(b, t, s):
        return s <= 30 and b * t * s <= 600

    lo, hi = _split.diagonals(40, 100, "bottom_right", None)
    for chunks in (None, 5):
        blocks = _split.plan_keys(3, 40, 100, fits, chunks, lambda b: _split.sees_band(lo, hi, b.t0, b.t1, b.s0, b.s1))
        seen = np.zeros((3, 40, 100), int)
        for b in blocks:
            assert fits(b.b1 - b.b0, b.t1 - b.t0, b.s1 - b.s0)
            seen[b.b0 : b.b1, b.t0 : b.t1, b.s0 : b.s1] += 1
        visible = core.causal_mask(40, 100, "bottom_right")
        assert (seen[:, visible] == 1).all() and seen.max() == 1
        assert len({(b.s0, b.s1) for b in blocks}) >= (5 if chunks else 4)
    assert _split.plan_keys(1, 1, 10, lambda b, t, s: False) is None


# --- the client's key split against a live server ------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    with serving(LIMITS) as server:
        yield server.url


@st.composite
def problems(draw):
    """Arguments of one attention call past the small limits, every variant drawn or left out."""
    Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H, T, S, d = Hkv * group, draw(st.integers(1, 20)), draw(st.integers(9, 24)), draw(st.integers(1, 3))
    elems = st.floats(-2, 2, allow_nan=False, width=32)
    q = draw(hnp.arrays(np.float32, (H, T, d), elements=elems))
    k = draw(hnp.arrays(np.float32, (Hkv, S, d), elements=elems))
    v = draw(hnp.arrays(np.float32, (Hkv, S, 2), elements=elems))
    kw = {"causal": draw(st.sampled_from(CAUSAL)), "enable_gqa": True, "return_weights": draw(st.booleans())}
    if draw(st.booleans()):
        kw["window"] = draw(st.tuples(st.integers(-1, 8), st.integers(-1, 8)))
    if draw(st.booleans()):
        kw["mask"] = draw(hnp.arrays(bool, (T, S)))
    if draw(st.booleans()):
        kw["key_lengths"] = draw(hnp.arrays(np.int64, (H,), elements=st.integers(0, S)))
    if draw(st.booleans()):
        kw["bias"] = draw(hnp.arrays(np.float32, (H, 1, S), elements=st.floats(-2, 2, width=32)))
    if draw(st.booleans()):
        kw["alibi_slopes"] = draw(hnp.arrays(np.float32, (H,), elements=st.floats(0, 1, width=32)))
    kw["average_weights"] = kw["return_weights"] and draw(st.booleans())
    chunks = draw(st.none() | st.integers(2, 5))
    return q, k, v, kw, chunks


@pytest.mark.live
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(problems())
def test_key_split_answers_equal_one_call(small, problem):
    """S over ATTN_MAX_S: blocks of rows and key ranges, merged; equal to the core's one call to
    RTOL, and to the float64 oracle to float32's tolerance; lse too."""
    q, k, v, kw, chunks = problem
    with AttentionClient(small, timeout=60) as api:
        out, weights, lse = api.attention(q, k, v, return_lse=True, key_chunks=chunks, **kw)
    want_out, want_w, want_lse = core.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=RTOL)
    if kw["return_weights"]:
        np.testing.assert_allclose(weights, want_w, rtol=RTOL, atol=RTOL)
    else:
        assert weights is None
    o = {name: kw[name] for name in ("causal", "window", "mask", "key_lengths", "bias", "alibi_slopes") if name in kw}
    exact_out, _, exact_lse = oracle.reference(q, k, v, o.pop("mask", None), enable_gqa=True, return_lse=True, **o)
    np.testing.assert_allclose(out, exact_out, rtol=1e-4, atol=1e-5)
    none = np.isneginf(exact_lse)
    assert (lse[none] == np.finfo(np.float32).min).all()


@pytest.mark.live
def test_blocks_no_row_sees_are_not_sent(small, rng):
    """Causal T = S = 24 over 8-key ranges: 6 of the 9 (rows, keys) blocks hold a key some row may see."""
    q = rng.standard_normal((24, 4), dtype=np.float32)
    with AttentionClient(small, timeout=60) as api:
        posts = spy(api)
        out, _ = api.attention(q, q, q, causal=True, return_weights=False)
    np.testing.assert_allclose(out, core.attention(q, q, q, causal=True)[0], rtol=RTOL, atol=RTOL)
    assert len(posts) == 6


def spy(api: AttentionClient, together: int = 0) -> list:
    """Record the connection pool (the replica) of every block the client sends. together=n: the
    first n blocks wait for each other before they are sent, so they are in flight at once (a
    client that sent them one after another would break the barrier and fail the call)."""
    seen, compute = [], api._compute
    barrier = threading.Barrier(together) if together else None

    def recording(path, body, http=None):
        seen.append(http)
        if barrier is not None and len(seen) <= together:
            barrier.wait(timeout=60)
        return compute(path, body, http)

    api._compute = recording
    return seen


# --- replicas ---------------------------------------------------------------------------------------


class Busy(JsonHandler):
    """A replica that answers every request 503 (its /limits: the small ones)."""

    posts = 0

    def do_GET(self):
        self._send(200, {"max_t": 8, "max_s": 8, "max_score_elements": 256, "max_weights_elements": 256, "max_body_bytes": 2**20})

    def do_POST(self):
        type(self).posts += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(503, {"error": "busy"}, {"Retry-After": "0", "X-Error-Code": "overloaded"})


@pytest.mark.live
def test_replicas_share_the_blocks_and_a_busy_or_dead_one_hands_them_on(small, rng):
    """Two live replicas take blocks each; beside a replica that always answers 503 and a port
    nobody listens on, every block is answered by the live one."""
    q = rng.standard_normal((2, 24, 4), dtype=np.float32)
    want = core.attention(q, q, q, causal="bottom_right")
    with serving(LIMITS) as other:
        with AttentionClient([small, other.url], timeout=60, max_workers=2) as api:
            posts = spy(api)
            out, weights = api.attention(q, q, q, causal="bottom_right")
        np.testing.assert_allclose(out, want[0], rtol=RTOL, atol=RTOL)
        np.testing.assert_allclose(weights, want[1], rtol=RTOL, atol=RTOL)
        assert {h.base_url for h in posts} == {small, other.url}
    busy = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=busy.serve_forever, daemon=True).start()
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        with AttentionClient([f"http://127.0.0.1:{busy.server_address[1]}", dead, small], timeout=60, retries=1) as api:
            api._sleep = lambda s: None
            out, _ = api.attention(q, q, q, causal="bottom_right")
    finally:
        busy.shutdown()
        busy.server_close()
    np.testing.assert_allclose(out, want[0], rtol=RTOL, atol=RTOL)
    assert Busy.posts > 0


@pytest.mark.live
def test_replicas_launcher_starts_n_replicas_on_consecutive_ports(rng):
    """python -m service.replicas: N servers at port, port + 1, ...; a long request split over them."""
    port = free_ports(2)
    procs = replicas.start(2, port, env=LIMITS, quiet=True)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]

    def both_ready() -> bool:
        """both replicas answer /readyz with 200 (and neither has exited)"""
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a replica exited: {[p.returncode for p in procs]}")
        return all(ready(url) for url in urls)

    try:
        wait_until(both_ready, timeout=120)
        q = rng.standard_normal((24, 4), dtype=np.float32)
        with AttentionClient(urls, timeout=60, max_workers=1) as api:  # one thread a replica, each keeps to its own
            posts = spy(api, together=2)  # the first two blocks must be in flight at once
            out, lse = api.attention(q, q, q, causal=True, return_weights=False, return_lse=True)[::2]
        want_out, _, want_lse = core.attention(q, q, q, causal=True, return_lse=True)
        np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=RTOL)
        np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=RTOL)
        assert {h.base_url for h in posts[:2]} == set(urls)  # two blocks at once: one on each replica
    finally:
        replicas.stop(procs)
    assert all(p.returncode is not None for p in procs)


def ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_a_replica_that_always_refuses_ends_in_its_503_not_a_loop(rng):
    """Blocks sent at once to a replica that answers every one 503: the client lowers what it sends
    there at once, then spends its retries and raises the 503 (no retry loop among its own blocks)."""
    busy = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=busy.serve_forever, daemon=True).start()
    q = rng.standard_normal((2, 24, 4), dtype=np.float32)
    errors: list[AttentionError] = []

    def call():
        with AttentionClient(f"http://127.0.0.1:{busy.server_address[1]}", timeout=30, retries=2) as api:
            api._sleep = lambda s: None
            try:
                api.attention(q, q, q)
            except AttentionError as err:
                errors.append(err)

    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(60)
        assert not caller.is_alive()
    finally:
        busy.shutdown()
        busy.server_close()
    assert [e.status for e in errors] == [503]


@pytest.mark.live
def test_a_request_no_row_may_see_sends_nothing(small, rng):
    """key_lengths 0 everywhere, past the limits: no block is sent; out and weights 0, lse lowest."""
    q = rng.standard_normal((2, 24, 4), dtype=np.float32)
    with AttentionClient(small, timeout=60) as api:
        posts = spy(api)
        out, weights, lse = api.attention(q, q, q, key_lengths=np.zeros(2, int), return_lse=True)
    assert posts == [] and (out == 0).all() and (weights == 0).all() and weights.shape == (2, 24, 24)
    assert (lse == np.finfo(np.float32).min).all() and lse.dtype == out.dtype == np.float32
