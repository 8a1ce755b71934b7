"""The sessions resource through the Flask test client (contract 1.3, "Sessions"): a decode loop
(prefill, steps of 1, a step of 3 then truncate, a fork that diverges, a batched step) equal at
every step to the float64 oracle over the whole sequence, in float32 and float64, with GQA,
windows and ALiBi (hypothesis); `at` conflicts and replays; two keys; a full pool; expiry; the
hostile cases, each a clear 4xx or 503, never a 500, nothing lost. The real server with two
workers: tests/test_sessions_live.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.config import Settings
from service.web import create_app

from . import oracle
from .helpers import b64

_APPS: dict[tuple, object] = {}


def client(**overrides):
    """A test client of an app with these settings (one app per settings: the pool is the app's)."""
    key = tuple(sorted(overrides.items()))
    if key not in _APPS:
        app = create_app(Settings(**{"warmup": False, "session_memory_bytes": 16 * 2**20, **overrides}))
        app.testing = True
        _APPS[key] = app
    return _APPS[key].test_client()


def enc(arr: np.ndarray, dtype: str) -> dict:
    return b64(arr, dtype)


def arr(value) -> np.ndarray:
    from .helpers import tensor

    return tensor(value)


class Loop:
    """A decode loop against the service and the float64 oracle side by side."""

    def __init__(self, c, H, Hkv, d, dv, dtype, options, rng, headers=None):
        self.c, self.H, self.Hkv, self.d, self.dv, self.dtype, self.options, self.rng = c, H, Hkv, d, dv, dtype, options, rng
        self.headers = headers or {}
        r = c.post("/sessions", json={"heads": H, "kv_heads": Hkv, "head_dim": d, "value_dim": dv, "dtype": dtype}, headers=self.headers)
        assert r.status_code == 201, r.get_json()
        self.id = r.get_json()["id"]
        assert r.headers["Location"] == f"/sessions/{self.id}"
        self.k, self.v = np.zeros((Hkv, 0, d)), np.zeros((Hkv, 0, dv))

    def tokens(self, t):
        cast = np.float32 if self.dtype == "float32" else np.float64
        return (self.rng.standard_normal((self.Hkv, t, self.d)).astype(cast), self.rng.standard_normal((self.Hkv, t, self.dv)).astype(cast))

    def step(self, t, append=True, at=True):
        q = self.rng.standard_normal((self.H, t, self.d)).astype(np.float32 if self.dtype == "float32" else np.float64)
        body = {"q": enc(q, self.dtype), "return_lse": True, "return_weights": True, **self.options}
        if append:
            k, v = self.tokens(t)
            body.update(k=enc(k, self.dtype), v=enc(v, self.dtype))
            if at:
                body["at"] = self.k.shape[1]
            self.k, self.v = np.concatenate([self.k, k], 1), np.concatenate([self.v, v], 1)
        r = self.c.post(f"/sessions/{self.id}/attention", json=body, headers=self.headers)
        assert r.status_code == 200, r.get_json()
        got = r.get_json()
        assert got["length"] == self.k.shape[1]
        self.check(q, arr(got["out"]), arr(got["weights"]), arr(got["lse"]), self.k, self.v)
        return got

    def check(self, q, out, weights, lse, k, v):
        kw = {"causal": self.options.get("causal", "bottom_right"), "enable_gqa": True, "return_lse": True}
        if "window" in self.options:
            kw["window"] = tuple(self.options["window"])
        if "alibi_slopes" in self.options:
            kw["alibi_slopes"] = np.array(self.options["alibi_slopes"])
        want_out, want_w, want_lse = oracle.reference(q, k, v, **kw)
        tol = 1e-4 if self.dtype == "float32" else 1e-10
        np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(weights, want_w, rtol=tol, atol=tol)
        seen = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=tol, atol=tol)
        assert (lse[~seen] == np.finfo(np.dtype(self.dtype)).min).all()

    def truncate(self, n):
        r = self.c.post(f"/sessions/{self.id}/truncate", json={"length": n}, headers=self.headers)
        assert r.status_code == 200 and r.get_json() == {"length": n}
        self.k, self.v = self.k[:, :n], self.v[:, :n]

    def fork(self, n):
        r = self.c.post(f"/sessions/{self.id}/fork", json={"length": n}, headers=self.headers)
        assert r.status_code == 201, r.get_json()
        child = object.__new__(Loop)
        child.__dict__.update(self.__dict__)
        child.id, child.k, child.v = r.get_json()["id"], self.k[:, :n], self.v[:, :n]
        assert r.get_json()["length"] == n
        return child


@st.composite
def loops(draw):
    Hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    options = {"causal": draw(st.sampled_from(["bottom_right", False]))}
    if draw(st.booleans()):
        options["window"] = [draw(st.integers(-1, 6)), draw(st.integers(-1, 3))]
    if draw(st.booleans()):
        options["alibi_slopes"] = [draw(st.floats(0, 1)) for _ in range(Hkv * g)]
    return {
        "H": Hkv * g,
        "Hkv": Hkv,
        "d": draw(st.integers(1, 8)),
        "dv": draw(st.integers(1, 5)),
        "dtype": draw(st.sampled_from(["float32", "float64"])),
        "options": options,
        "page": draw(st.sampled_from([1, 3, 4, 16])),
        "prefill": draw(st.integers(1, 12)),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None)
@given(loops())
def test_a_decode_loop_equals_the_float64_reference_at_every_step(case):
    c = client(session_page_tokens=case["page"])
    rng = np.random.default_rng(case["seed"])
    loop = Loop(c, case["H"], case["Hkv"], case["d"], case["dv"], case["dtype"], case["options"], rng)
    loop.step(case["prefill"])  # prefill: the prompt's tokens and queries at once
    for _ in range(2):
        loop.step(1)
    loop.step(3)  # three draft tokens ...
    loop.truncate(loop.k.shape[1] - 2)  # ... of which two are rejected
    loop.step(1)
    child = loop.fork(max(1, loop.k.shape[1] - 2))  # a fork that diverges from its parent
    child.step(2)
    loop.step(1)
    loop.step(1, append=False)  # a step without new tokens
    # A batched step: both sessions, of different lengths, one new token each.
    q = rng.standard_normal((2, loop.H, 1, loop.d))
    ks, vs = zip(*(s.tokens(1) for s in (loop, child)), strict=True)
    body = {
        "sessions": [loop.id, child.id],
        "q": enc(q, loop.dtype),
        "k": enc(np.stack(ks), loop.dtype),
        "v": enc(np.stack(vs), loop.dtype),
        "at": [loop.k.shape[1], child.k.shape[1]],
        "return_lse": True,
        "return_weights": True,
        **loop.options,
    }
    r = c.post("/sessions/attention", json=body)
    assert r.status_code == 200, r.get_json()
    got = r.get_json()
    cast = np.float32 if loop.dtype == "float32" else np.float64
    for i, s in enumerate((loop, child)):
        s.k, s.v = np.concatenate([s.k, ks[i]], 1), np.concatenate([s.v, vs[i]], 1)
        S = s.k.shape[1]
        assert got["lengths"][i] == S
        weights = arr(got["weights"])[i]
        assert (weights[..., S:] == 0).all()
        s.check(q[i].astype(cast), arr(got["out"])[i], weights[..., :S], arr(got["lse"])[i], s.k, s.v)
    for s in (loop, child):
        assert c.delete(f"/sessions/{s.id}").status_code == 204


def make(c, headers=None, **fields) -> str:
    r = c.post("/sessions", json={"heads": 2, "head_dim": 2, **fields}, headers=headers or {})
    assert r.status_code == 201, r.get_json()
    return r.get_json()["id"]


def append(c, sid, t=1, at=None, headers=None, value=1.0):
    body = {"k": np.full((2, t, 2), value).tolist(), "v": np.full((2, t, 2), value).tolist()}
    if at is not None:
        body["at"] = at
    return c.post(f"/sessions/{sid}/append", json=body, headers=headers or {})


def length(c, sid, headers=None) -> int:
    r = c.get(f"/sessions/{sid}", headers=headers or {})
    assert r.status_code == 200
    return r.get_json()["length"]


def test_at_makes_an_append_exactly_once():
    c = client()
    sid = make(c)
    assert append(c, sid, 3, at=0).get_json() == {"length": 3}
    replay = append(c, sid, 3, at=0)  # the retry of an append that was applied
    assert replay.status_code == 409
    err = replay.get_json()["error"]
    assert err["code"] == "length_conflict" and err["length"] == 3 and err["field"] == "at"
    assert length(c, sid) == 3
    step = c.post(f"/sessions/{sid}/attention", json={"q": [[[1, 0]], [[0, 1]]], "k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2, "at": 0})
    assert step.status_code == 409 and step.get_json()["error"]["length"] == 3  # nor computed
    assert length(c, sid) == 3
    assert append(c, sid, 1).get_json() == {"length": 4}  # without at: appended whatever the length


def test_a_step_that_fails_appends_nothing():
    c = client()
    sid = make(c, dtype="float32")
    append(c, sid, 2, at=0)
    huge = np.full((2, 1, 2), 3e19).tolist()  # scores past float32: 422 non_finite after the tokens were written
    r = c.post(f"/sessions/{sid}/attention", json={"q": huge, "k": huge, "v": [[[1, 1]]] * 2})
    assert r.status_code == 422 and r.get_json()["error"]["code"] == "non_finite"
    assert '"dtype"' not in r.get_json()["error"]["message"]  # a step has no dtype to send: the session's is its own
    assert length(c, sid) == 2
    r = append(c, sid, 1, value=1e300)  # past the session's float32
    assert r.status_code == 422 and r.get_json()["error"]["code"] == "non_finite"
    assert '"dtype"' not in r.get_json()["error"]["message"]


def test_sessions_are_per_key():
    c = client(api_keys=("alice-key", "bob-key"))
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    sid = make(c, alice)
    append(c, sid, 2, headers=alice)
    for method, path, body in (
        ("get", f"/sessions/{sid}", None),
        ("post", f"/sessions/{sid}/append", {"k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2}),
        ("post", f"/sessions/{sid}/attention", {"q": [[[1, 1]]] * 2}),
        ("post", f"/sessions/{sid}/fork", {}),
        ("post", f"/sessions/{sid}/truncate", {"length": 0}),
        ("delete", f"/sessions/{sid}", None),
        ("post", "/sessions/attention", {"sessions": [sid], "q": [[[[1, 1]]] * 2]}),
    ):
        r = getattr(c, method)(path, json=body, headers=bob)
        assert r.status_code == 404 and r.get_json()["error"]["code"] == "session_not_found", (path, r.get_json())
        assert getattr(c, method)(path, json=body).status_code == 401  # no key at all
    assert length(c, sid, alice) == 2  # nothing bob did reached it


def test_a_full_pool_is_503_with_retry_after_and_evicts_nothing():
    c = client(session_memory_bytes=2 * 4096, session_page_tokens=16)  # two pages of (2 heads, 16 tokens, 2+2) float32... one unit each
    a = make(c)
    assert append(c, a, 32, at=0).status_code == 200  # both pages
    b = make(c)
    r = append(c, b, 1, at=0)
    assert r.status_code == 503 and r.get_json()["error"]["code"] == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1
    assert length(c, a) == 32 and length(c, b) == 0
    step = c.post(f"/sessions/{b}/attention", json={"q": [[[1, 1]]] * 2, "k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2})
    assert step.status_code == 503 and length(c, b) == 0
    assert c.delete(f"/sessions/{a}").status_code == 204
    assert append(c, b, 1, at=0).status_code == 200  # room again


def test_a_session_whose_page_is_larger_than_the_pool_is_refused_at_once():
    """A page that cannot fit in the whole pool could never hold a token: 413 when the session is
    made, not a 503 "retry later" on every append for ever."""
    c = client(session_memory_bytes=2**20, session_page_tokens=256)  # a page of (8 heads, 256 tokens, 64 + 64) float64: 4 MiB
    r = c.post("/sessions", json={"heads": 8, "head_dim": 64, "dtype": "float64"})
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "too_large", r.get_json()
    assert "ATTN_SESSION_MEMORY_BYTES" in r.get_json()["error"]["message"]
    q = np.ones((16, 1, 64))  # sent as FP32: 2 MiB a page
    r = sequence(c, "big", q, q, q, sequence_start=True)  # /v2's sequence start makes one too
    assert r.status_code == 413 and r.headers["X-Error-Code"] == "too_large", r.get_json()
    assert c.get("/limits").get_json()["sessions"]["sessions"] == 0  # nothing made
    assert c.post("/sessions", json={"heads": 1, "head_dim": 64}).status_code == 201  # a page of 128 KiB fits


def test_a_flood_of_creates_is_503_past_the_table_and_loses_nothing():
    c = client(session_max_count=8)
    ids = []
    codes = set()
    for _ in range(20):
        r = c.post("/sessions", json={"heads": 1, "head_dim": 1})
        codes.add(r.status_code)
        if r.status_code == 201:
            ids.append(r.get_json()["id"])
        else:
            assert r.status_code == 503 and "Retry-After" in r.headers
    assert codes == {201, 503} and len(ids) == 8
    assert all(c.get(f"/sessions/{sid}").status_code == 200 for sid in ids)
    for sid in ids:
        c.delete(f"/sessions/{sid}")


def test_idle_sessions_expire():
    c = client(session_idle_s=1)
    sid = make(c)
    append(c, sid, 2)
    deadline = time.monotonic() + 20
    while c.get(f"/sessions/{sid}").status_code == 200:  # each look is a use: wait without looking
        assert time.monotonic() < deadline
        time.sleep(1.2)
    r = c.get(f"/sessions/{sid}")
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "session_not_found"
    assert c.get("/limits").get_json()["sessions"]["expired"] >= 1
    metrics = c.get("/metrics").get_data(as_text=True)
    assert "attention_session_expiries_total" in metrics


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("get", "/sessions/nope", None, 404, "session_not_found"),
        ("get", "/sessions/" + "0" * 38, None, 404, "session_not_found"),
        ("get", "/sessions/" + "f" * 38, None, 404, "session_not_found"),
        ("post", "/sessions/nope/attention", {"q": [[[1, 1]]] * 2}, 404, "session_not_found"),
        ("post", "/sessions", {"heads": 3, "kv_heads": 2, "head_dim": 2}, 422, "bad_option"),
        ("post", "/sessions", {"heads": 2}, 422, "missing_field"),
        ("post", "/sessions", {"heads": 2, "head_dim": 2, "max_tokens": 10**12}, 413, "too_long"),
        ("post", "/sessions", {"heads": 2, "head_dim": 2, "casual": True}, 422, "unknown_field"),
        ("post", "/sessions", {"heads": 2, "head_dim": 2, "dtype": "float16"}, 422, "bad_option"),
        ("post", "/sessions", {"heads": True, "head_dim": 2}, 422, "bad_type"),
    ],
)
def test_hostile_requests_are_clear_refusals(method, path, body, status, code):
    r = getattr(client(), method)(path, json=body)
    assert r.status_code == status and r.get_json()["error"]["code"] == code, r.get_json()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow warnings: a hostile value leaves the log alone
def test_hostile_bodies_on_a_session():
    c = client()
    sid = make(c, max_tokens=8)
    append(c, sid, 2, at=0)
    cases = [
        ("append", {"k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2, "at": 2**62}, 409, "length_conflict"),
        ("append", {"k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2, "at": -1}, 422, "bad_option"),
        ("append", {"k": [[[1, 1, 1]]] * 2, "v": [[[1, 1]]] * 2}, 422, "shape_mismatch"),
        ("append", {"k": [[[1, 1]]] * 3, "v": [[[1, 1]]] * 3}, 422, "shape_mismatch"),
        ("append", {"k": [[[1, 1]]] * 2, "v": [[[1, 1], [1, 1]]] * 2}, 422, "shape_mismatch"),
        ("append", {"k": [[[1, 1]] * 7] * 2, "v": [[[1, 1]] * 7] * 2}, 413, "too_long"),
        ("append", {"k": [[[1, 1]]] * 2}, 422, "missing_field"),
        ("attention", {"q": [[[1, 1]]] * 3}, 422, "shape_mismatch"),
        ("attention", {"q": [[[1, 1]]] * 2, "k": [[[1, 1]]] * 2}, 422, "missing_field"),
        ("attention", {"q": [[[1, 1]]] * 2, "dtype": "float64"}, 422, "unknown_field"),
        ("attention", {"q": [[[1, 1]]] * 2, "alibi_slopes": [1, 2, 3]}, 422, "shape_mismatch"),
        ("attention", {"q": [[[1, 1]]] * 2, "window": [-2, 0]}, 422, "bad_option"),
        ("attention", {"q": [[[1, 1]]] * 2, "scale": 1e300}, 422, "non_finite"),
        ("attention", {"q": [[[1, 1]]] * 2, "window": [2**70, 0]}, 422, "bad_type"),
        ("append", {"k": {"shape": [2, 2**40, 2], "dtype": "float32", "data": "AAAA"}, "v": [[[1, 1]]] * 2}, 422, "bad_shape"),
        ("append", {"k": [[]] * 2, "v": [[]] * 2}, 422, "bad_shape"),
        ("append", {"k": [[[1e300, 1]]] * 2, "v": [[[1, 1]]] * 2}, 422, "non_finite"),  # past the session's float32
        ("truncate", {"length": 2**63}, 409, "length_conflict"),
        ("fork", {"length": -1}, 422, "bad_option"),
        ("fork", {"length": True}, 422, "bad_type"),
        ("truncate", {"length": 3}, 409, "length_conflict"),
        ("truncate", {}, 422, "missing_field"),
        ("fork", {"length": 99}, 409, "length_conflict"),
    ]
    for action, body, status, code in cases:
        r = c.post(f"/sessions/{sid}/{action}", json=body)
        assert r.status_code == status and r.get_json()["error"]["code"] == code, (action, body, r.get_json())
        assert length(c, sid) == 2  # nothing lost, nothing half-applied
    batch = [
        ({"sessions": [sid, sid], "q": [[[[1, 1]]] * 2] * 2}, 422, "bad_option"),
        ({"sessions": [sid], "q": [[[[1, 1]]] * 2] * 2}, 422, "shape_mismatch"),
        ({"sessions": [sid, "nope"], "q": [[[[1, 1]]] * 2] * 2}, 404, "session_not_found"),
        ({"sessions": [], "q": [[[[1, 1]]] * 2]}, 422, "bad_type"),
        ({"sessions": [sid], "q": [[[[1, 1]]] * 2], "at": [2]}, 422, "bad_option"),
        ({"sessions": [f"{i:06x}" + "0" * 32 for i in range(10_000)], "q": b64(np.zeros((10_000, 2, 1, 2)))}, 404, "session_not_found"),
    ]
    for body, status, code in batch:
        r = c.post("/sessions/attention", json=body)
        assert r.status_code == status and r.get_json()["error"]["code"] == code, (body, r.get_json())
    assert length(c, sid) == 2


def answered(send, timeout: float = 30.0):
    """send()'s answer, or a failure if it has none in timeout seconds (a request that hangs)."""
    got: list = []
    worker = threading.Thread(target=lambda: got.append(send()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert got, f"no answer in {timeout} s"
    return got[0]


def test_a_session_has_one_id_and_no_other_spelling():
    c = client()
    sid = make(c)
    for other in (sid.upper(), "0x" + sid[2:], "\u0660" * 6 + sid[6:], sid[:6] + sid[6:].upper(), "+" + sid[1:]):
        r = c.get(f"/sessions/{other}")
        assert r.status_code == 404 and r.get_json()["error"]["code"] == "session_not_found", other
    assert length(c, sid) == 0


def test_a_batch_naming_one_slot_twice_is_refused_and_holds_nothing():
    """Two ids of one slot (another spelling of a live id, or a made-up token after its slot) would
    have the request wait on a lock it holds itself, for ever, and the session with it."""
    c = client()
    sid = make(c)
    for other in (sid.upper(), sid[:6] + "f" * 32, sid[:6] + "0" * 32):
        for ids in ([sid, other], [other, sid]):
            r = answered(lambda ids=ids: c.post("/sessions/attention", json={"sessions": ids, "q": [[[[1, 1]]] * 2] * 2}))
            assert r.status_code == 404 and r.get_json()["error"]["code"] == "session_not_found", (ids, r.get_json())
    assert answered(lambda: append(c, sid, 1, at=0)).status_code == 200  # not held by any of them
    assert length(c, sid) == 1


def test_a_batch_of_sessions_of_different_shapes_is_refused():
    c = client()
    a, b = make(c), make(c, value_dim=3)
    r = c.post("/sessions/attention", json={"sessions": [a, b], "q": [[[[1, 1]]] * 2] * 2})
    assert r.status_code == 422 and r.get_json()["error"]["field"] == "sessions", r.get_json()
    assert "value_dim=3" in r.get_json()["error"]["message"]


def test_a_batch_with_one_conflict_changes_no_session():
    c = client()
    a, b = make(c), make(c)
    append(c, a, 1, at=0)
    body = {
        "sessions": [a, b],
        "q": [[[[1, 1]]] * 2] * 2,
        "k": [[[[1, 1]]] * 2] * 2,
        "v": [[[[1, 1]]] * 2] * 2,
        "at": [1, 5],
    }
    r = c.post("/sessions/attention", json=body)
    assert r.status_code == 409 and r.get_json()["error"]["length"] == 0
    assert (length(c, a), length(c, b)) == (1, 0)
    body["at"] = [1, 0]
    r = c.post("/sessions/attention", json=body)
    assert r.status_code == 200 and r.get_json()["lengths"] == [2, 1]


def test_appends_racing_on_one_session_are_serialised_and_none_is_lost():
    c = client()
    sid = make(c)
    results: list[int] = []

    def racer(i):
        own = client()
        for _ in range(10):
            while True:  # the client's loop with at: read the length, append at it, retry on 409
                L = length(own, sid)
                r = append(own, sid, 1, at=L, value=float(i))
                if r.status_code == 200:
                    results.append(r.get_json()["length"])
                    break
                assert r.status_code == 409

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(1, 41)) and length(c, sid) == 40  # each append once, none lost


def test_appends_truncates_forks_steps_and_deletes_racing_lose_no_page():
    """Many threads on one session and its forks, every operation at once: each answer is a success
    or a clear refusal, and once every session is deleted the pool holds nothing (no page leaked,
    none freed twice)."""
    c = client(session_page_tokens=2, session_max_count=64)
    sid = make(c)
    append(c, sid, 3)
    tokens = {"k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2}
    codes: list[int] = []
    made: list[str] = []

    def racer(i):
        own = client(session_page_tokens=2, session_max_count=64)
        for j in range(12):
            op = (i + j) % 6
            if op == 0:
                r = own.post(f"/sessions/{sid}/append", json=tokens)
            elif op == 1:
                r = own.post(f"/sessions/{sid}/truncate", json={"length": 1})
            elif op == 2:
                r = own.post(f"/sessions/{sid}/fork", json={})
                if r.status_code == 201:
                    made.append(r.get_json()["id"])
            elif op == 3:
                r = own.post(f"/sessions/{sid}/attention", json={"q": [[[1, 1]]] * 2, **tokens})
            elif op == 4 and (forks := list(made)):
                r = own.post(f"/sessions/{forks[0]}/append", json=tokens)  # a fork's copy on write
            else:
                try:
                    r = own.delete(f"/sessions/{made.pop()}")
                except IndexError:  # none left: another thread took the last
                    r = own.get(f"/sessions/{sid}")
            codes.append(r.status_code)
            r.close()

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(codes) <= {200, 201, 204, 404}, sorted(set(codes))  # 404: a fork another thread deleted first
    for other in [sid, *made]:
        assert c.delete(f"/sessions/{other}").status_code == 204
    pool = c.get("/limits").get_json()["sessions"]
    assert (pool["sessions"], pool["pages"], pool["used_bytes"]) == (0, 0, 0), pool


def a_step_held_computing(monkeypatch, c, sid: str):
    """A step on sid (2 heads, d=2), started on a thread and held in its computation, so holding
    the session, until release() is called: (the thread, the list its answer goes to, release).
    Steps made after it compute at once."""
    import service.web.sessions as web_sessions

    computing, go_on = threading.Event(), threading.Event()
    run = web_sessions.run

    def held_run(job):
        computing.set()
        assert go_on.wait(60)
        return run(job)

    monkeypatch.setattr(web_sessions, "run", held_run)
    answers: list = []
    stepper = threading.Thread(target=lambda: answers.append(c.post(f"/sessions/{sid}/attention", json={"q": [[[1, 1]]] * 2})))
    stepper.start()
    assert computing.wait(60)
    monkeypatch.setattr(web_sessions, "run", run)
    return stepper, answers, go_on.set


def test_a_delete_during_a_step_waits_for_it_and_frees_everything(monkeypatch):
    c = client(session_page_tokens=2)
    sid = make(c)
    append(c, sid, 3)
    stepper, step, release = a_step_held_computing(monkeypatch, c, sid)
    deleted: list = []
    deleter = threading.Thread(target=lambda: deleted.append(client(session_page_tokens=2).delete(f"/sessions/{sid}")))
    deleter.start()
    deleter.join(0.5)
    assert not deleted  # the step holds the session
    release()
    stepper.join(60)
    deleter.join(60)
    assert step[0].status_code == 200 and step[0].get_json()["length"] == 3
    assert deleted[0].status_code == 204
    assert c.get(f"/sessions/{sid}").status_code == 404
    pool = c.get("/limits").get_json()["sessions"]
    assert (pool["sessions"], pool["pages"]) == (0, 0), pool


def test_a_step_waiting_for_a_busy_session_keeps_its_deadline(monkeypatch):
    """Waiting for another request's hold on a session is part of a step's X-Deadline-Ms (contract
    1.3, "Deadlines"): past it, 504 deadline and nothing appended; a step without a deadline waits
    and is answered once the hold ends."""
    c = client()
    sid = make(c)
    append(c, sid, 3, at=0)
    holder, first, release = a_step_held_computing(monkeypatch, c, sid)
    step = {"q": [[[1, 0]], [[0, 1]]], "k": [[[1, 1]]] * 2, "v": [[[1, 1]]] * 2, "at": 3}
    late = client().post(f"/sessions/{sid}/attention", json=step, headers={"X-Deadline-Ms": "200"})
    assert late.status_code == 504, late.get_json()
    assert late.get_json()["error"]["code"] == "deadline" and "held the session" in late.get_json()["error"]["message"]
    waiting: list = []
    waiter = threading.Thread(target=lambda: waiting.append(client().post(f"/sessions/{sid}/attention", json=step)))
    waiter.start()
    waiter.join(0.5)
    assert not waiting  # no deadline: it waits for the hold
    release()
    holder.join(60)
    waiter.join(60)
    assert first[0].status_code == 200 and first[0].get_json()["length"] == 3
    assert waiting[0].status_code == 200 and waiting[0].get_json()["length"] == 4  # the late step appended nothing: at=3 held
    assert length(c, sid) == 4


def test_limits_and_openapi_show_sessions():
    c = client()
    pool = c.get("/limits").get_json()["sessions"]
    assert {"memory_bytes", "used_bytes", "page_tokens", "sessions", "pages"} <= pool.keys()
    paths = c.get("/openapi.json").get_json()["paths"]
    for path in ("/sessions", "/sessions/{sid}", "/sessions/{sid}/append", "/sessions/{sid}/attention", "/sessions/attention"):
        assert path in paths, sorted(paths)


def sequence(c, seq_id, q, k, v, headers=None, **parameters):
    inputs = [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.reshape(-1).tolist()} for n, a in (("q", q), ("k", k), ("v", v))
    ]
    body = {"inputs": inputs, "parameters": {**({"sequence_id": seq_id} if seq_id is not None else {}), **parameters}}
    return c.post("/v2/models/attention_sequence/infer", json=body, headers=headers or {})


def test_v2_sequences_refuse_clearly():
    c = client(api_keys=("alice-key", "bob-key"))
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    q, k, v = np.ones((2, 1, 2)), np.ones((1, 1, 2)), np.ones((1, 1, 2))
    r = sequence(c, 7, q, k, v, alice)
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "session_not_found"  # never started
    assert sequence(c, 7, q, k, np.array([[[1.0, 2.0]]]), alice, sequence_start=True).status_code == 200
    assert sequence(c, 7, q, k, v, bob).status_code == 404  # another key's sequence of the same id does not exist for bob
    r = sequence(c, 7, np.ones((3, 1, 2)), k, v, alice)
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "shape_mismatch"  # the protocol's 400
    r = sequence(c, None, q, k, v, alice, sequence_start=True)
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "missing_field"
    r = sequence(c, 0, q, k, v, alice, sequence_start=True)
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "bad_type"
    r = sequence(c, 7, q, k, np.array([[[3.0, 4.0]]]), alice, sequence_end=True)
    assert r.status_code == 200
    out = tensor_of(r.get_json(), "out")
    np.testing.assert_allclose(out, [[[2.0, 3.0]]] * 2)  # two equal keys, their values' mean: the refused requests appended nothing
    assert sequence(c, 7, q, k, v, alice).status_code == 404  # ended


def test_v2_sequence_starts_racing_leave_one_sequence_and_a_bad_start_ends_none():
    """Starts of one sequence id at once: however they interleave, one session holds the sequence
    afterwards (none is left behind to hold memory, or to be found after the sequence ended)."""
    c = client(session_max_count=64)
    q = np.ones((2, 1, 2))
    sessions_live = lambda: c.get("/limits").get_json()["sessions"]["sessions"]  # noqa: E731
    before = sessions_live()
    gate = threading.Barrier(8)
    codes: list[int] = []

    def starter():
        own = client(session_max_count=64)
        gate.wait(30)
        for _ in range(4):
            r = sequence(own, "raced", q, q, q, sequence_start=True)
            codes.append(r.status_code)
            r.close()

    threads = [threading.Thread(target=starter) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(codes) <= {200, 404}, codes  # 404: a start whose sequence the next start ended before it stepped
    assert sessions_live() == before + 1
    bad = sequence(c, "raced", np.ones((3, 1, 2)), np.ones((2, 1, 2)), np.ones((2, 1, 2)), sequence_start=True)
    assert bad.status_code == 400 and bad.headers["X-Error-Code"] == "shape_mismatch"
    assert sequence(c, "raced", q, q, q).status_code == 200  # the bad start ended nothing
    assert sequence(c, "raced", q, q, q, sequence_end=True).status_code == 200
    assert sessions_live() == before
    assert sequence(c, "raced", q, q, q).status_code == 404  # ended: nothing of it is found


def test_v2_sequence_envelope_is_read_by_its_models_schema():
    """attention_sequence's infer request is read by the envelope schema built from its row of the
    model table (schemas/kserve.py), as every model's: its inputs, outputs and parameters and no
    others, binary inputs included; its parameters checked by the native fields."""
    c = client()
    q, k, v = np.ones((2, 1, 2)), np.ones((1, 1, 2)), np.ones((1, 1, 2))
    r = sequence(c, 9, q, k, v, sequence_start=True, average_weights=True)
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "unknown_field"
    assert r.get_json()["error"].startswith("parameter 'average_weights' is not a parameter of model attention_sequence; its")
    assert "sequence_id, sequence_start, sequence_end" in r.get_json()["error"]
    r = sequence(c, 9, q, k, v, sequence_start="yes")
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "bad_type" and "parameter sequence_start" in r.get_json()["error"]
    inputs = [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.reshape(-1).tolist()} for n, a in (("q", q), ("k", k), ("v", v))
    ]
    start = {"sequence_id": "s", "sequence_start": True}
    for body, field in (
        ({"inputs": inputs, "outputs": [{"name": "weights"}], "parameters": start}, "outputs"),  # no weights output
        ({"inputs": [*inputs, {**inputs[0], "name": "mask"}], "parameters": start}, "mask"),  # no mask input
    ):
        r = c.post("/v2/models/attention_sequence/infer", json=body)
        assert r.status_code == 400 and r.headers["X-Error-Code"] == "unknown_field", r.get_json()
        assert r.headers["X-Error-Field"] == field
    # q's bytes after the JSON header (the binary tensor data extension), lse asked for as an output
    header = {
        "inputs": [{"name": "q", "datatype": "FP32", "shape": [2, 1, 2], "parameters": {"binary_data_size": 16}}, *inputs[1:]],
        "outputs": [{"name": "out"}, {"name": "lse"}],
        "parameters": {**start, "sequence_end": True},
    }
    head = json.dumps(header).encode()
    r = c.post(
        "/v2/models/attention_sequence/infer",
        data=head + q.astype("<f4").tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.get_json()
    assert [o["name"] for o in r.get_json()["outputs"]] == ["out", "lse"]
    np.testing.assert_allclose(tensor_of(r.get_json(), "out"), np.ones((2, 1, 2)))


def tensor_of(doc: dict, name: str) -> np.ndarray:
    (entry,) = [o for o in doc["outputs"] if o["name"] == name]
    return np.array(entry["data"]).reshape(entry["shape"])
