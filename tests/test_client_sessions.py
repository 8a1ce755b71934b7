"""The client's sessions (contract 1.3, "Sessions"): api.session(), its steps, appends, forks and
truncations, api.attention_sessions(), retries made safe by `at`, placement on replicas and one
session's keys spread over several (shards), merged by lse.

Three parts. Pure: the alignment of a step's queries on each segment of a sharded session, merged
by merge_states, equals the float64 oracle over the whole sequence (numpy only). Stub: the
client's own decisions (placement, where new tokens go, the merge, what a 409 means, undoing a
failed step) against a small in-test stand-in for the /sessions resource that computes with the
oracle, and refuses unknown fields as the server does. Live: the same against the real server
(`live`)."""

from __future__ import annotations

import json
import re
import threading
import uuid
from contextlib import ExitStack
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attention_client import AttentionClient, AttentionError, merge_states, replicas
from attention_client._sessions import applied, segment_options
from examples import decode_loop

from . import oracle
from .helpers import JsonHandler, b64, serving, tensor

LOWEST = {"float32": float(np.finfo(np.float32).min), "float64": float(np.finfo(np.float64).min)}
TOL = {"float32": 2e-5, "float64": 1e-10}


def whole(q, K, V, *, causal="bottom_right", window=None, alibi_slopes=None, scale=None):
    """The float64 oracle over the whole sequence: out (H, t, dv), weights (H, t, S), lse (H, t)."""
    gqa = K.shape[0] != q.shape[0]
    return oracle.reference(
        q, K, V, causal=causal or False, window=window, alibi_slopes=alibi_slopes, scale=scale, enable_gqa=gqa, return_lse=True
    )


# --- pure: segments aligned and merged ------------------------------------------------------------------


def merged_segments(q, K, V, cuts, causal, window, slopes):
    """What a sharded step computes, with the oracle as each segment's server: the segments
    K[a:b], each asked as segment_options says, their lse moved by ALiBi's shift, merged."""
    H, t = q.shape[:2]
    S, edges = K.shape[1], [0, *cuts, K.shape[1]]
    outs, lses, ws = [], [], []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        aligned = segment_options(a, b, S, t, causal, window, slopes is not None)
        if aligned is None:
            outs.append(np.zeros((H, t, V.shape[2])))
            lses.append(np.full((H, t), LOWEST["float64"]))
            ws.append(np.zeros((H, t, b - a)))
            continue
        rows = aligned["rows"]
        out, w, lse = np.zeros((H, t, V.shape[2])), np.zeros((H, t, b - a)), np.full((H, t), -np.inf)
        out[:, :rows], w[:, :rows], lse[:, :rows] = whole(
            q[:, :rows], K[:, a:b], V[:, a:b], causal=aligned["causal"], window=aligned["window"], alibi_slopes=slopes
        )
        lse = np.where(np.isfinite(lse), lse, LOWEST["float64"])
        if slopes is not None:
            lse = np.where(lse > LOWEST["float64"] / 2, lse - slopes[:, None] * (S - b), lse)
        outs.append(out)
        lses.append(lse)
        ws.append(w)
    return merge_states(outs, lses, ws)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_segments_aligned_and_merged_are_the_whole(data):
    """Keys cut into segments anywhere (new tokens on both sides of a cut too), t queries at the
    end, causal bottom_right or none, a window, ALiBi at t=1, grouped-query heads: each segment
    asked as segment_options says, merged by lse, is the float64 oracle over the whole sequence,
    out, weights and lse; where segment_options refuses, the case is one it names."""
    Hkv, group = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    H, S, d = Hkv * group, data.draw(st.integers(1, 14)), data.draw(st.integers(1, 3))
    t = data.draw(st.integers(1, S))
    elems = st.floats(-2, 2, allow_nan=False)
    q = data.draw(hnp.arrays(np.float64, (H, t, d), elements=elems))
    K = data.draw(hnp.arrays(np.float64, (Hkv, S, d), elements=elems))
    V = data.draw(hnp.arrays(np.float64, (Hkv, S, 2), elements=elems))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, S - 1), max_size=3)))) if S > 1 else []
    causal = data.draw(st.sampled_from(["bottom_right", False]))
    window = data.draw(st.none() | st.tuples(st.integers(-1, S + 1), st.integers(-1, S + 1)))
    slopes = data.draw(st.none() | hnp.arrays(np.float64, (H,), elements=st.floats(0, 1)))
    try:
        out, lse, weights = merged_segments(q, K, V, cuts, causal, window, slopes)
    except ValueError as exc:
        assert cuts and slopes is not None and t > 1, exc
        return
    want_out, want_w, want_lse = whole(q, K, V, causal=causal, window=window, alibi_slopes=slopes)
    want_lse = np.where(np.isfinite(want_lse), want_lse, LOWEST["float64"])
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights, want_w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_decode_step_over_segments_is_the_whole_for_every_option():
    """The common case named: t=1 after a prefill, keys in three segments, each option alone and
    all together (a window narrower than the last segment hides the first: not asked)."""
    rng = np.random.default_rng(3)
    H, Hkv, S, d = 4, 2, 23, 5
    q, K, V = rng.standard_normal((H, 1, d)), rng.standard_normal((Hkv, S, d)), rng.standard_normal((Hkv, S, 3))
    slopes = rng.uniform(0, 0.5, H)
    for causal, window, alibi in [
        ("bottom_right", None, None),
        (False, None, None),
        ("bottom_right", (4, 0), None),
        ("bottom_right", None, slopes),
        (False, (9, 2), slopes),
    ]:
        out, lse, weights = merged_segments(q, K, V, [7, 15], causal, window, alibi)
        want_out, want_w, want_lse = whole(q, K, V, causal=causal, window=window, alibi_slopes=alibi)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(weights, want_w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert segment_options(0, 7, S, 1, "bottom_right", (4, 0), False) is None  # the window starts at key 22 - 4 = 18
    assert segment_options(15, 23, S, 1, "bottom_right", (4, 0), False) == {"causal": "bottom_right", "window": (4, 0), "rows": 1}
    assert segment_options(0, 7, S, 1, "bottom_right", None, False) == {"causal": False, "window": None, "rows": 1}


def test_what_a_segment_cannot_be_asked_is_refused():
    with pytest.raises(ValueError, match="top_left"):
        segment_options(0, 4, 8, 1, True, None, False)
    with pytest.raises(ValueError, match="t=1"):
        segment_options(0, 4, 8, 2, "bottom_right", None, True)
    # rows 0..3 start their windows at keys 2..5: rows 0 and 1 see keys 2, 3 and 3 of keys 0..3
    assert segment_options(0, 4, 8, 4, "bottom_right", (2, 0), False) == {"causal": False, "window": (0, -1), "rows": 2}
    assert segment_options(4, 8, 8, 4, "top_left", (1, 2), True) == {
        "causal": "top_left",
        "window": (1, 2),
        "rows": 4,
    }  # the last: as asked


def test_applied_reads_a_409_as_the_servers_length():
    """`at` + t in a 409 length_conflict means applied; any other length or error does not."""

    def err(status, code, doc):
        resp = requests.Response()
        resp.status_code, resp._content = status, json.dumps(doc).encode()
        return AttentionError(status, code, "m", resp)

    conflict = {"error": {"status": 409, "code": "length_conflict", "message": "m", "field": "at", "length": 12}}
    assert applied(err(409, "length_conflict", conflict), 10, 2)
    assert not applied(err(409, "length_conflict", conflict), 10, 3)
    assert not applied(err(409, "length_conflict", conflict), 12, 2)  # nothing of this request went in
    assert not applied(err(422, "shape_mismatch", conflict), 10, 2)
    assert not applied(err(409, "length_conflict", {"error": {"code": "length_conflict"}}), 10, 2)
    assert not applied(AttentionError(None, "connection_error", "m"), 10, 2)


# --- a stand-in for the /sessions resource, computing with the oracle --------------------------------------


STEP = {
    "q",
    "k",
    "v",
    "at",
    "causal",
    "scale",
    "window",
    "alibi_slopes",
    "return_weights",
    "weights_dtype",
    "return_lse",
    "response_encoding",
}
FIELDS = {  # each request's fields, as the contract lists them
    "create": {"heads", "kv_heads", "head_dim", "value_dim", "dtype", "max_tokens"},
    "append": {"k", "v", "at"},
    "attention": STEP,
    "batch": STEP | {"sessions"},
    "fork": {"length"},
    "truncate": {"length"},
}


class SessionStub(JsonHandler):
    """The contract's /sessions on one replica, in memory, computed by the float64 oracle and
    answered in the session's dtype. server.sessions, server.calls (path of each request);
    server.lose = n: the next n requests that change a session are applied, then the connection
    is closed without an answer (a lost answer); server.pool_tokens: the most tokens its sessions
    hold together (past it, 503 with Retry-After, as a full pool)."""

    def do_GET(self):
        self.route("GET", None)

    def do_DELETE(self):
        self.route("DELETE", None)

    def do_POST(self):
        self.route("POST", json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def fail(self, status, code, message, **extra):
        self._send(status, {"error": {"status": status, "code": code, "message": message, "field": extra.pop("field", None), **extra}})

    def route(self, method, body):
        srv = self.server
        srv.calls.append((method, self.path))
        m = re.fullmatch(r"/sessions(?:/([^/]+))?(?:/(\w+))?", self.path)
        if m is None:
            return self.fail(404, "not_found", "no such path")
        sid, action = m.groups()
        route = "create" if sid is None else "batch" if (sid, action) == ("attention", None) else action
        unknown = set(body or {}) - FIELDS.get(route, set())
        if unknown:
            return self.fail(422, "unknown_field", f"{sorted(unknown)} are not fields of this request", field=min(unknown))
        if sid is None:
            return self.create(body) if method == "POST" else self.fail(405, "method_not_allowed", method)
        if sid == "attention" and action is None:
            return self.batch(body)
        s = srv.sessions.get(sid)
        if s is None:
            return self.fail(404, "session_not_found", f"no session {sid}")
        if method == "GET":
            return self._send(200, self.describe(sid))
        if method == "DELETE":
            del srv.sessions[sid]
            return self._send(204, {})
        if action == "append":
            if not self.append(s, body):
                return None
            return self.answer({"length": len(s["K"][0])})
        if action == "attention":
            if "k" in body and not self.append(s, body):
                return None
            doc = self.compute(s, body)
            return self.answer(doc, changed="k" in body)
        if action == "fork":
            n = body.get("length", len(s["K"][0]))
            new = str(uuid.uuid4())
            srv.sessions[new] = {**s, "K": s["K"][:, :n], "V": s["V"][:, :n]}
            return self._send(201, self.describe(new))
        if action == "truncate":
            s["K"], s["V"] = s["K"][:, : body["length"]], s["V"][:, : body["length"]]
            return self._send(200, {"length": body["length"]})
        return self.fail(404, "not_found", "no such action")

    def describe(self, sid):
        s = self.server.sessions[sid]
        return {
            "id": sid,
            **{k: s[k] for k in ("heads", "kv_heads", "head_dim", "value_dim", "dtype", "max_tokens")},
            "length": s["K"].shape[1],
            "idle_expiry_s": 600,
        }

    def create(self, body):
        sid = str(uuid.uuid4())
        H, d = body["heads"], body["head_dim"]
        s = {"heads": H, "kv_heads": body.get("kv_heads", H), "head_dim": d, "value_dim": body.get("value_dim", d)}
        s.update(dtype=body.get("dtype", "float32"), max_tokens=body.get("max_tokens", 1000))
        s.update(K=np.zeros((s["kv_heads"], 0, d)), V=np.zeros((s["kv_heads"], 0, s["value_dim"])))
        self.server.sessions[sid] = s
        self._send(201, self.describe(sid), {"Location": f"/sessions/{sid}"})

    def append(self, s, body):
        k, v = tensor(body["k"]).astype(np.float64), tensor(body["v"]).astype(np.float64)
        n = s["K"].shape[1]
        if "at" in body and body["at"] != n:
            self.fail(409, "length_conflict", f"the session has {n} tokens, not {body['at']}", field="at", length=n)
            return False
        if n + k.shape[1] > s["max_tokens"]:
            self.fail(413, "too_long", "past max_tokens")
            return False
        held = sum(other["K"].shape[1] for other in self.server.sessions.values())
        if self.server.pool_tokens is not None and held + k.shape[1] > self.server.pool_tokens:
            self._send(
                503, {"error": {"status": 503, "code": "overloaded", "message": "the pool is full", "field": None}}, {"Retry-After": "0"}
            )
            return False
        s["K"], s["V"] = np.concatenate([s["K"], k], axis=1), np.concatenate([s["V"], v], axis=1)
        return True

    def compute(self, s, body):
        q = tensor(body["q"]).astype(np.float64)
        slopes = None if body.get("alibi_slopes") is None else tensor(body["alibi_slopes"])
        out, w, lse = whole(
            q,
            s["K"],
            s["V"],
            causal=body.get("causal", "bottom_right"),
            window=body.get("window"),
            alibi_slopes=slopes,
            scale=body.get("scale"),
        )
        dtype = s["dtype"]
        doc = {"out": b64(out, dtype), "length": s["K"].shape[1]}
        if body.get("return_weights"):
            doc["weights"] = b64(w, body.get("weights_dtype") or dtype)
        if body.get("return_lse"):
            doc["lse"] = b64(np.where(np.isfinite(lse), lse, LOWEST[dtype]), dtype)
        return doc

    def batch(self, body):
        ss = [self.server.sessions[sid] for sid in body["sessions"]]
        if "k" in body:
            ks, vs = tensor(body["k"]), tensor(body["v"])
            for i, s in enumerate(ss):
                if s["K"].shape[1] != body["at"][i]:
                    return self.fail(409, "length_conflict", "at", field="at", length=s["K"].shape[1])
            for i, s in enumerate(ss):
                self.append(s, {"k": b64(ks[i], "float64"), "v": b64(vs[i], "float64")})
        q = tensor(body["q"])
        docs = [self.compute(s, {**body, "q": b64(q[i], "float64")}) for i, s in enumerate(ss)]
        out = np.stack([tensor(doc["out"]) for doc in docs])
        lse = np.stack([tensor(doc["lse"]) for doc in docs])
        return self.answer(
            {"out": b64(out, out.dtype.name), "lse": b64(lse, lse.dtype.name), "lengths": [doc["length"] for doc in docs]},
            changed="k" in body,
        )

    def answer(self, doc, changed=True):
        if changed and self.server.lose > 0:
            self.server.lose -= 1
            self.close_connection = True  # applied, and no answer
            return
        self._send(200, doc)


@pytest.fixture
def stubs():
    """Three stand-in replicas; their URLs and servers."""
    servers = []
    for _ in range(3):
        server = ThreadingHTTPServer(("127.0.0.1", 0), SessionStub)
        server.sessions, server.calls, server.lose, server.pool_tokens = {}, [], 0, None
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers], servers
    for server in servers:
        server.shutdown()
        server.server_close()


def random_tokens(rng, H, Hkv, t, d, dv):
    return rng.standard_normal((H, t, d)), rng.standard_normal((Hkv, t, d)), rng.standard_normal((Hkv, t, dv))


def check(got, want, dtype, what=""):
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)


def run_decode_loop(api, rng, *, dtype, shards=1, max_tokens=None, H=4, Hkv=2, d=8, dv=6, window=None, slopes=None, steps=3):
    """Prefill, steps of 1, a step of 3 then truncate, a fork that diverges: every answer against
    the float64 oracle over the whole sequence. Returns the sessions' final lengths."""
    opts = {"window": window, "alibi_slopes": slopes}
    K, V = np.zeros((Hkv, 0, d)), np.zeros((Hkv, 0, dv))
    with api.session(heads=H, head_dim=d, kv_heads=Hkv, value_dim=dv, dtype=dtype, max_tokens=max_tokens, shards=shards) as s:
        assert (s.heads, s.kv_heads, s.head_dim, s.value_dim, s.dtype, s.length) == (H, Hkv, d, dv, dtype, 0)
        assert max_tokens is None or s.max_tokens == max_tokens * shards
        q, k, v = random_tokens(rng, H, Hkv, 7, d, dv)  # the prompt
        if slopes is None:
            K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
            out, w, lse = s.attention(q, k, v, return_weights=True, return_lse=True, window=window)
            want_out, want_w, want_lse = whole(q, K, V, window=window)
            check(out, want_out, dtype, "prefill")
            check(w, want_w, dtype, "prefill weights")
            check(lse, want_lse, dtype, "prefill lse")
        else:  # ALiBi over several segments asks t=1: the prompt one token at a time
            for i in range(7):
                K, V = np.concatenate([K, k[:, i : i + 1]], 1), np.concatenate([V, v[:, i : i + 1]], 1)
                check(
                    s.attention(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], **opts), whole(q[:, i : i + 1], K, V, **opts)[0], dtype
                )
        assert s.length == 7
        for step in range(steps):  # decode: one token a step
            q, k, v = random_tokens(rng, H, Hkv, 1, d, dv)
            K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
            out, w = s.attention(q, k, v, return_weights=True, **opts)
            want_out, want_w, _ = whole(q, K, V, **opts)
            check(out, want_out, dtype, f"step {step}")
            check(w, want_w, dtype, f"step {step} weights")
        if slopes is None:  # a draft of 3 tokens, verified in one step, 1 rejected
            q, k, v = random_tokens(rng, H, Hkv, 3, d, dv)
            K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
            check(s.attention(q, k, v, window=window), whole(q, K, V, window=window)[0], dtype, "draft")
            n = K.shape[1] - 1
            assert s.truncate(n) == n
            K, V = K[:, :n], V[:, :n]
        fork_at = K.shape[1] - 2
        with s.fork(fork_at) as f:  # a fork that diverges from its parent
            assert f.length == fork_at
            q, k, v = random_tokens(rng, H, Hkv, 1, d, dv)
            FK, FV = np.concatenate([K[:, :fork_at], k], 1), np.concatenate([V[:, :fork_at], v], 1)
            check(f.attention(q, k, v, **opts), whole(q, FK, FV, **opts)[0], dtype, "fork")
            q2, k2, v2 = random_tokens(rng, H, Hkv, 1, d, dv)
            K, V = np.concatenate([K, k2], 1), np.concatenate([V, v2], 1)
            check(s.attention(q2, k2, v2, **opts), whole(q2, K, V, **opts)[0], dtype, "parent after fork")
            check(f.attention(q2, **opts), whole(q2, FK, FV, **opts)[0], dtype, "fork, queries only")
            lengths = (s.length, f.length)
        q = rng.standard_normal((H, 2, d))
        check(s.attention(q, causal=False), whole(q, K, V, causal=False)[0], dtype, "queries only, no causal")
    return lengths


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shards", [1, 3])
def test_decode_loop_on_stub_replicas(stubs, rng, dtype, shards):
    """The whole loop, one segment or keys over three replicas (segments of 5 tokens)."""
    urls, servers = stubs
    with AttentionClient(urls) as api:
        max_tokens = 5 if shards > 1 else None
        assert run_decode_loop(api, rng, dtype=dtype, shards=shards, max_tokens=max_tokens) == (13, 11)
    assert all(not s.sessions for s in servers)  # every session (and fork) deleted
    touched = [s for s in servers if s.calls]
    assert len(touched) == shards  # one replica, or the three


@pytest.mark.parametrize(
    "window, slopes",
    [((4, 0), None), ((1, 0), None), (None, np.array([0.5, 0.25, 0.125, 0.0625])), ((5, 1), np.array([0.3, 0.2, 0.1, 0.0]))],
)
def test_windows_and_alibi_over_segments_on_stub_replicas(stubs, rng, window, slopes):
    urls, _ = stubs
    with AttentionClient(urls) as api:
        run_decode_loop(api, rng, dtype="float64", shards=3, max_tokens=5, window=window, slopes=slopes)


CALLS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["step", "append"]), st.integers(1, 4)),
        st.tuples(st.sampled_from(["truncate", "fork"]), st.floats(0, 1)),
        st.just(("query", 0)),
    ),
    max_size=10,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    calls=CALLS,
    shards=st.integers(1, 3),
    cap=st.integers(2, 5),
    window=st.none() | st.tuples(st.integers(-1, 3), st.integers(-1, 2)),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_calls_is_the_oracles(stubs, calls, shards, cap, window, seed):
    """Steps and appends of 1 to 4 tokens, truncations and forks anywhere (a fork replaces the
    session it came from), queries alone, with or without a window, on segments of `cap` tokens
    over up to 3 replicas: every answer (out, weights, lse) the float64 oracle's over the whole
    sequence, every length the sequence's, and nothing left on the replicas at the end."""
    urls, servers = stubs
    rng = np.random.default_rng(seed)
    H, Hkv, d = 2, 1, 3
    K, V = np.zeros((Hkv, 0, d)), np.zeros((Hkv, 0, d))
    with AttentionClient(urls) as api:
        s = api.session(heads=H, kv_heads=Hkv, head_dim=d, dtype="float64", max_tokens=cap, shards=shards)
        try:
            for call, n in calls:
                if call in ("step", "append") and s.length + n > s.max_tokens:
                    continue
                if call == "step":
                    q, k, v = random_tokens(rng, H, Hkv, n, d, d)
                    K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
                    got, want = s.attention(q, k, v, window=window, return_weights=True, return_lse=True), whole(q, K, V, window=window)
                    for g, w, what in zip(got, want, ("out", "weights", "lse"), strict=True):
                        check(g, np.where(np.isneginf(w), LOWEST["float64"], w), "float64", f"{call} {what}")
                elif call == "append":
                    _, k, v = random_tokens(rng, H, Hkv, n, d, d)
                    K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
                    assert s.append(k, v) == K.shape[1]
                elif call == "truncate":
                    keep = int(n * s.length)
                    assert s.truncate(keep) == keep
                    K, V = K[:, :keep], V[:, :keep]
                elif call == "fork":
                    keep = int(n * s.length)
                    f = s.fork(keep)
                    s.close()
                    s, K, V = f, K[:, :keep], V[:, :keep]
                elif K.shape[1]:
                    q = rng.standard_normal((H, 2, d))
                    check(s.attention(q, causal=False, window=window), whole(q, K, V, causal=False, window=window)[0], "float64", call)
                assert (
                    s.length == K.shape[1] == s.refresh() == sum(state["K"].shape[1] for srv in servers for state in srv.sessions.values())
                )
                assert len(s.segments) <= shards
        finally:
            s.close()
    assert all(not srv.sessions for srv in servers)


def test_sessions_are_placed_on_replicas_in_turn_and_stay(stubs, rng):
    urls, servers = stubs
    with AttentionClient(urls) as api:
        sessions = [api.session(heads=2, head_dim=4) for _ in range(3)]
        for s in sessions:
            for _ in range(2):
                s.attention(*random_tokens(rng, 2, 2, 1, 4, 4))
        assert sorted(url for s in sessions for url, _, _ in s.segments) == sorted(urls)
        for server in servers:
            (sid,) = server.sessions
            assert [c for c in server.calls if c[0] == "POST"] == [("POST", "/sessions")] + [("POST", f"/sessions/{sid}/attention")] * 2
        for s in sessions:
            s.close()
        assert all(not server.sessions for server in servers)
        with pytest.raises(ValueError, match="closed"):
            sessions[0].attention(*random_tokens(rng, 2, 2, 1, 4, 4))


def test_a_lost_answer_is_retried_and_applied_once(stubs, rng):
    """The server applies a step, its answer is lost: the client retries with the same `at`, reads
    the 409's length as applied, and computes the step again without appending."""
    urls, servers = stubs
    with AttentionClient(urls[0], backoff=0) as api, api.session(heads=2, head_dim=4, dtype="float64") as s:
        q, k, v = random_tokens(rng, 2, 2, 3, 4, 4)
        s.attention(q, k, v)
        servers[0].lose = 1
        q2, k2, v2 = random_tokens(rng, 2, 2, 1, 4, 4)
        out = s.attention(q2, k2, v2)
        (state,) = servers[0].sessions.values()
        assert s.length == 4 and state["K"].shape[1] == 4  # applied once
        np.testing.assert_allclose(out, whole(q2, state["K"], state["V"])[0], rtol=1e-12)
        assert servers[0].calls[-3:] == [("POST", f"/sessions/{s.id}/attention")] * 3  # lost, 409, computed again
        servers[0].lose = 1
        assert s.append(*random_tokens(rng, 2, 2, 2, 4, 4)[1:]) == 6 and state["K"].shape[1] == 6


def test_a_conflict_that_is_not_a_retry_is_raised(stubs, rng):
    urls, servers = stubs
    with AttentionClient(urls[0]) as api, api.session(heads=2, head_dim=4) as s:
        s.append(*random_tokens(rng, 2, 2, 2, 4, 4)[1:])
        (state,) = servers[0].sessions.values()
        state["K"], state["V"] = state["K"][:, :1], state["V"][:, :1]  # someone else truncated it
        with pytest.raises(AttentionError) as info:
            s.attention(*random_tokens(rng, 2, 2, 1, 4, 4))
        assert info.value.status == 409 and info.value.code == "length_conflict"
        assert s.refresh() == 1


def test_a_failed_step_over_segments_is_undone(stubs, rng):
    """A step whose tokens cross into a new segment and then fails (the last segment's max_tokens
    refuses): the earlier segment is truncated back and the new one deleted, so the call can be
    made again."""
    urls, servers = stubs
    with AttentionClient(urls) as api, api.session(heads=2, head_dim=4, max_tokens=4, shards=2) as s:
        s.append(*random_tokens(rng, 2, 2, 3, 4, 4)[1:])
        with pytest.raises(AttentionError) as info:
            s.attention(*random_tokens(rng, 2, 2, 6, 4, 4))  # 1 fits the first, 5 do not fit the second
        assert info.value.status == 413
        assert s.length == 3 and len(s.segments) == 1
        assert sorted(state["K"].shape[1] for srv in servers for state in srv.sessions.values()) == [3]
        q, k, v = random_tokens(rng, 2, 2, 4, 4, 4)
        s.attention(q, k, v)
        assert [n for _, _, n in s.segments] == [4, 3]


def test_a_batched_step_that_fails_on_one_replica_is_taken_back_on_the_others(stubs, rng):
    """Sessions on two replicas, the second's pool full: the step went in on the first, and is
    taken back there, so that the same call, made again once there is room, appends once."""
    urls, servers = stubs
    H, d = 2, 4
    with AttentionClient(urls[:2], retries=0, max_retry_after=0) as api:
        a, b = api.session(heads=H, head_dim=d, dtype="float64"), api.session(heads=H, head_dim=d, dtype="float64")
        assert {url for s in (a, b) for url, _, _ in s.segments} == set(urls[:2])
        for s in (a, b):
            s.append(*random_tokens(rng, H, H, 3, d, d)[1:])
        servers[1].pool_tokens = 3
        q, k, v = rng.standard_normal((2, H, 1, d)), rng.standard_normal((2, H, 1, d)), rng.standard_normal((2, H, 1, d))
        with pytest.raises(AttentionError) as info:
            api.attention_sessions([a, b], q, k, v)
        assert info.value.status == 503 and (a.length, b.length) == (3, 3) == (a.refresh(), b.refresh())
        servers[1].pool_tokens = None
        api.attention_sessions([a, b], q, k, v)
        assert (a.length, b.length) == (4, 4) == (a.refresh(), b.refresh())
        a.close()
        b.close()


def test_a_sequence_outgrows_one_replicas_pool(stubs, rng):
    """Replicas whose pools hold 6 tokens each: with shards=3 a sequence of 16 tokens goes on past
    the first's full pool (503) to the next replicas, every step the oracle's answer; with
    shards=1 the 7th token is refused."""
    urls, servers = stubs
    for server in servers:
        server.pool_tokens = 6
    H, Hkv, d = 4, 2, 4
    with AttentionClient(urls, retries=1, max_retry_after=0) as api:
        with api.session(heads=H, kv_heads=Hkv, head_dim=d, dtype="float64", shards=3) as s:
            q, K, V = random_tokens(rng, H, Hkv, 4, d, d)
            check(s.attention(q, K, V), whole(q, K, V)[0], "float64", "prefill")
            for step in range(12):
                q, k, v = random_tokens(rng, H, Hkv, 1 + (step == 5), d, d)  # one step of 2 across a full pool
                K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
                check(s.attention(q, k, v), whole(q, K, V)[0], "float64", f"step {step}")
            assert [n for _, _, n in s.segments] == [6, 6, 5] and len({url for url, _, _ in s.segments}) == 3
        with api.session(heads=H, kv_heads=Hkv, head_dim=d) as s:
            s.append(*random_tokens(rng, H, Hkv, 6, d, d)[1:])
            with pytest.raises(AttentionError) as info:
                s.attention(*random_tokens(rng, H, Hkv, 1, d, d))
            assert info.value.status == 503 and s.length == 6


def test_batched_step_over_replicas(stubs, rng):
    """Sessions of different lengths on three replicas and one of two segments: one step, each
    session's answer the oracle's; a lost answer in the batch is retried safely."""
    urls, servers = stubs
    H, Hkv, d = 4, 2, 4
    with AttentionClient(urls, backoff=0) as api:
        sessions = [api.session(heads=H, head_dim=d, kv_heads=Hkv, dtype="float64") for _ in range(4)]
        sessions.append(api.session(heads=H, head_dim=d, kv_heads=Hkv, dtype="float64", shards=2, max_tokens=4))
        caches = []
        for i, s in enumerate(sessions):
            _, k, v = random_tokens(rng, H, Hkv, i + 2, d, d)
            s.append(k, v)
            caches.append((k, v))
        servers[0].lose = 1  # sessions 0 and 3 share the first replica: their batch's answer is lost once
        q, k, v = rng.standard_normal((5, H, 1, d)), rng.standard_normal((5, Hkv, 1, d)), rng.standard_normal((5, Hkv, 1, d))
        out, lse = api.attention_sessions(sessions, q, k, v, return_lse=True)
        for i, s in enumerate(sessions):
            K, V = np.concatenate([caches[i][0], k[i]], 1), np.concatenate([caches[i][1], v[i]], 1)
            want_out, _, want_lse = whole(q[i], K, V)
            np.testing.assert_allclose(out[i], want_out, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(lse[i], want_lse, rtol=1e-10, atol=1e-12)
            assert s.length == i + 3 == s.refresh()
        assert len(sessions[4].segments) == 2
        for s in sessions:
            s.close()


@pytest.mark.parametrize("shards", [1, 3])
def test_the_decode_loop_example_on_stub_replicas(stubs, shards):
    """examples/decode_loop.py: the GPT decoding three prompts of different lengths through
    sessions (each prompt alone, then batched steps) gives the in-process loop's tokens and logits."""
    urls, _ = stubs
    model, prompts = decode_loop.TinyGPT(), [[3, 1, 4, 1, 5], [2, 7, 1], [8, 2, 8, 1, 8, 2, 8]]
    want, want_logits = decode_loop.generate(model, prompts, 12, decode_loop.in_process(model, 3))
    options = {"shards": shards, "max_tokens": 8 if shards > 1 else None}
    with AttentionClient(urls) as api, decode_loop.on_the_server(model, api, 3, "float64", **options) as attend:
        got, logits = decode_loop.generate(model, prompts, 12, attend)
    assert got == want and all(len(set(tokens)) > 1 for tokens in got)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-9, atol=1e-9)


# --- live: the real server's /sessions ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_replicas(live_server):
    """The live server and a second one: two replicas."""
    with serving() as other:
        yield [live_server, other.url]


@pytest.mark.live
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_live_decode_loop(live_server, rng, dtype):
    """Prefill, steps of 1 with weights, a draft of 3 then truncate, a fork that diverges, queries
    only: each answer the float64 oracle's over the whole sequence, with grouped-query heads."""
    with AttentionClient(live_server) as api:
        assert run_decode_loop(api, rng, dtype=dtype) == (13, 11)


@pytest.mark.live
@pytest.mark.parametrize(
    "window, slopes",
    [((4, 0), None), ((1, 0), None), (None, np.array([0.5, 0.25, 0.125, 0.0625])), ((5, 1), np.array([0.3, 0.2, 0.1, 0.0]))],
)
def test_live_decode_loop_with_window_and_alibi(live_server, rng, window, slopes):
    with AttentionClient(live_server) as api:
        run_decode_loop(api, rng, dtype="float64", window=window, slopes=slopes)


@pytest.mark.live
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_live_keys_spread_over_two_replicas(two_replicas, rng, dtype):
    """shards=3 over two replicas, 5 tokens a segment: the same loop, the same answers, and each
    replica holds some of the keys."""
    with AttentionClient(two_replicas) as api:
        assert run_decode_loop(api, rng, dtype=dtype, shards=3, max_tokens=5) == (13, 11)
        with api.session(heads=2, head_dim=4, max_tokens=3, shards=2) as s:
            s.append(rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4)))
            assert sorted(url for url, _, _ in s.segments) == sorted(two_replicas)
            assert [n for _, _, n in s.segments] == [3, 2]


@pytest.mark.live
def test_live_windows_and_alibi_over_segments(two_replicas, rng):
    with AttentionClient(two_replicas) as api:
        run_decode_loop(api, rng, dtype="float64", shards=3, max_tokens=5, window=(4, 0))
        run_decode_loop(api, rng, dtype="float64", shards=3, max_tokens=5, slopes=np.array([0.5, 0.25, 0.125, 0.0625]), window=(5, 1))


@pytest.mark.live
def test_live_a_replayed_append_is_recognised(live_server, rng):
    """A step whose tokens the server already holds (its first answer lost: here, sent past the
    client) is answered 409 with at + t; the client computes it again without appending. A
    conflict that is not a replay is raised, and nothing changes."""
    with AttentionClient(live_server) as api, api.session(heads=4, kv_heads=2, head_dim=8, dtype="float64") as s:
        q, k, v = random_tokens(rng, 4, 2, 5, 8, 8)
        s.attention(q, k, v)
        q2, k2, v2 = random_tokens(rng, 4, 2, 2, 8, 8)
        r = requests.post(
            f"{live_server}/sessions/{s.id}/append", json={"k": b64(k2, "float64"), "v": b64(v2, "float64"), "at": 5}, timeout=30
        )
        assert r.status_code == 200 and r.json()["length"] == 7
        out = s.attention(q2, k2, v2)  # the client still believes 5
        assert s.length == 7 == s.refresh()
        K, V = np.concatenate([k, k2], 1), np.concatenate([v, v2], 1)
        np.testing.assert_allclose(out, whole(q2, K, V)[0], rtol=1e-10, atol=1e-12)
        r = requests.post(
            f"{live_server}/sessions/{s.id}/append", json={"k": b64(k2, "float64"), "v": b64(v2, "float64"), "at": 7}, timeout=30
        )
        assert r.status_code == 200
        s._segments[0].length = 6  # a belief that is neither the length nor the length before these tokens
        with pytest.raises(AttentionError) as info:
            s.attention(*random_tokens(rng, 4, 2, 1, 8, 8))
        assert info.value.status == 409 and info.value.code == "length_conflict"
        assert s.refresh() == 9


@pytest.mark.live
def test_live_float16_tokens_travel_as_float16(live_server, rng):
    """float16 arrays go as they are (half the bytes) and are computed in the session's dtype."""
    with AttentionClient(live_server) as api, api.session(heads=2, head_dim=8, dtype="float64") as s:
        q, k, v = (a.astype(np.float16) for a in random_tokens(rng, 2, 2, 4, 8, 8))
        out = s.attention(q, k, v)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, whole(q, k, v)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.live
def test_live_batched_step(live_server, rng):
    """Four sessions of different lengths, one step: each its oracle's answer."""
    H, Hkv, d = 4, 2, 8
    with AttentionClient(live_server) as api, ExitStack() as stack:
        sessions = [stack.enter_context(api.session(heads=H, head_dim=d, kv_heads=Hkv, dtype="float64")) for _ in range(4)]
        caches = []
        for i, s in enumerate(sessions):
            _, k, v = random_tokens(rng, H, Hkv, 3 * i + 1, d, d)
            s.append(k, v)
            caches.append((k, v))
        q, k, v = rng.standard_normal((4, H, 1, d)), rng.standard_normal((4, Hkv, 1, d)), rng.standard_normal((4, Hkv, 1, d))
        out = api.attention_sessions(sessions, q, k, v)
        for i, s in enumerate(sessions):
            K, V = np.concatenate([caches[i][0], k[i]], 1), np.concatenate([caches[i][1], v[i]], 1)
            np.testing.assert_allclose(out[i], whole(q[i], K, V)[0], rtol=1e-10, atol=1e-12)
            assert s.length == 3 * i + 2


@pytest.mark.live
def test_live_leaving_the_block_deletes_the_session(live_server, rng):
    with AttentionClient(live_server) as api:
        with api.session(heads=2, head_dim=4) as s:
            s.append(*random_tokens(rng, 2, 2, 3, 4, 4)[1:])
            assert requests.get(f"{live_server}/sessions/{s.id}", timeout=30).json()["length"] == 3
        assert requests.get(f"{live_server}/sessions/{s.id}", timeout=30).status_code == 404
        with api.session(heads=2, head_dim=4) as s:
            requests.delete(f"{live_server}/sessions/{s.id}", timeout=30)  # gone under the client (expired, say)
            with pytest.raises(AttentionError) as info:
                s.refresh()
            assert info.value.status == 404 and info.value.code == "session_not_found"
        # leaving the block after that: the DELETE's 404 is not an error


@pytest.mark.live
@pytest.mark.parametrize("shards", [1, 3])
def test_live_the_decode_loop_example(live_server, two_replicas, shards):
    """examples/decode_loop.py against the real server, three prompts of different lengths (each
    alone, then batched steps): the in-process loop's tokens and logits."""
    model, prompts = decode_loop.TinyGPT(), [[3, 1, 4, 1, 5], [2, 7, 1], [8, 2, 8, 1, 8, 2, 8]]
    want, want_logits = decode_loop.generate(model, prompts, 12, decode_loop.in_process(model, 3))
    urls = two_replicas if shards > 1 else [live_server]
    options = {"shards": shards, "max_tokens": 8 if shards > 1 else None}
    with AttentionClient(urls) as api, decode_loop.on_the_server(model, api, 3, "float64", **options) as attend:
        got, logits = decode_loop.generate(model, prompts, 12, attend)
    assert got == want and all(len(set(tokens)) > 1 for tokens in got)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-9, atol=1e-9)


def test_replicas_are_the_addresses_a_name_resolves_to():
    assert replicas("http://127.0.0.1:8000/prefix") == ["http://127.0.0.1:8000/prefix"]
    assert "http://127.0.0.1:9" in replicas("http://localhost:9")
    assert replicas("https://[::1]/p") == ["https://[::1]:443/p"]
    for bad in ("ftp://x", "http://", "http://no-such-host.invalid:80"):
        with pytest.raises(ValueError):
            replicas(bad)


@pytest.mark.live
def test_live_a_sequence_outgrows_one_replicas_pool(live_server, rng):
    """Two replicas whose pools hold 64 tokens of this session's shape (8 pages of 8 tokens, each
    page a 4 KiB unit): with shards=2 a sequence of 100 tokens goes on to the second when the
    first's pool is full (503), each step the oracle's answer over all 100."""
    small = {"ATTN_SESSION_MEMORY_BYTES": str(8 * 4096), "ATTN_SESSION_PAGE_TOKENS": "8", "ATTN_WARMUP": "0"}
    H, d = 2, 4
    with serving(small) as a, serving(small) as b, AttentionClient([a.url, b.url], retries=0, max_retry_after=0) as api:
        with api.session(heads=H, head_dim=d, shards=2) as s:
            q, K, V = random_tokens(rng, H, H, 40, d, d)
            check(s.attention(q, K, V), whole(q, K, V)[0], "float32", "prefill")
            for step in range(60):
                q, k, v = random_tokens(rng, H, H, 1, d, d)
                K, V = np.concatenate([K, k], 1), np.concatenate([V, v], 1)
                check(s.attention(q, k, v), whole(q, K, V)[0], "float32", f"step {step}")
            lengths = [n for _, _, n in s.segments]
            assert len(lengths) == 2 and sum(lengths) == 100 and lengths[0] < 100
            assert {url for url, _, _ in s.segments} == {a.url, b.url}
