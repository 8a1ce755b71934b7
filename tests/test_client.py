"""The Python client: round trips against the live server, exact splitting of over-limit
requests against a server with small limits, retries (against a local stub), errors, the CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests

from attention_client import AttentionClient, AttentionError, _http, _split
from service import core

from .helpers import ROOT, Hostile, JsonHandler, Q, V, free_port, start_server, stop_server

# Limits 4x (and more) below the requests of the splitting tests.
SMALL_LIMITS = {
    "ATTN_MAX_T": "32",
    "ATTN_MAX_S": "128",
    "ATTN_MAX_SCORE_ELEMENTS": "4096",
    "ATTN_MAX_WEIGHTS_ELEMENTS": "4096",
    "ATTN_MAX_BODY_BYTES": "200000",
    "ATTN_WARMUP": "0",
}


@pytest.fixture(scope="module")
def api(live_server):
    with AttentionClient(live_server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def small_server():
    proc, url = start_server(env=SMALL_LIMITS)
    yield url
    stop_server(proc)


@pytest.fixture
def small_api(small_server):
    with AttentionClient(small_server, timeout=60) as client:
        yield client


@pytest.mark.live
def test_seed_worked_example(api):
    q = k = np.array(Q, dtype=np.float32)
    v = np.array(V, dtype=np.float32)
    out, weights = api.attention(q, k, v, causal=True)
    want_out, want_w = core.attention(q, k, v, causal=True)
    assert out.shape == (3, 2) and weights.shape == (3, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-5)
    e = np.exp(1 / np.sqrt(2))  # row 1 sees keys 0 and 1 with scores 0 and 1/sqrt(d)
    np.testing.assert_allclose(out[1], [1 / (1 + e), 10 * e / (1 + e)], atol=1e-5)


@pytest.mark.live
@pytest.mark.parametrize("encoding", ["b64", "flat", "nested"])
def test_random_batched_case(live_server, rng, encoding):
    q, k, v = (rng.standard_normal((2, 4, 128, 32), dtype=np.float32) for _ in range(3))
    with AttentionClient(live_server, encoding=encoding) as client:
        out, weights = client.attention(q, k, v, causal=True)
    want_out, want_w = core.attention(q, k, v, causal=True)
    assert out.shape == (2, 4, 128, 32) and weights.shape == (2, 4, 128, 128)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-5)


@pytest.mark.live
def test_float64_in_float64_out_and_no_weights(api, rng):
    q, k, v = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 6, 4)), rng.standard_normal((3, 6, 2))
    out, weights = api.attention(q, k, v, key_lengths=np.array([6, 3, 0]), scale=0.3, return_weights=False)
    assert weights is None and out.dtype == np.float64
    np.testing.assert_allclose(out, core.attention(q, k, v, key_lengths=np.array([6, 3, 0]), scale=0.3)[0], rtol=0, atol=1e-12)
    assert np.all(out[2] == 0)  # no allowed key: zeros
    out32, _ = api.attention(q, k, v, dtype="float32")
    assert out32.dtype == np.float32


@pytest.mark.live
def test_mha(api, rng):
    x = rng.standard_normal((2, 10, 8), dtype=np.float32)
    ws = [(rng.standard_normal((8, 8)) / 3).astype(np.float32) for _ in range(4)]
    out, weights = api.mha(x, *ws, heads=2)
    want_out, want_w = core.mha(x, *ws, 2)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-5)


@pytest.mark.live
def test_limits_and_ready(api, live_server):
    assert api.ready()
    assert api.limits()["max_t"] > 0
    with AttentionClient(f"http://127.0.0.1:{free_port()}", retries=0) as dead:
        assert not dead.ready()


@pytest.mark.live
def test_refusal_is_attention_error_with_code(api, rng):
    q = rng.standard_normal((3, 4), dtype=np.float32)
    with pytest.raises(AttentionError) as info:
        api.attention(q, rng.standard_normal((3, 5)), rng.standard_normal((3, 2)))
    err = info.value
    assert (err.status, err.code, err.field) == (422, "shape_mismatch", "k")
    assert err.message.endswith("k has d=5 but q has d=4.")  # the /v2 door says "input k has ..."
    assert err.response is not None and err.response.status_code == 400  # the /v2 door's status for it
    assert "k has d=5" in err.response.json()["error"] and err.response.text == err.response.content.decode()  # read as requests reads one


# --- splitting over the limits -------------------------------------------------------------------


def spy_threads(client: AttentionClient, together: int = 0) -> list[str]:
    """Record the thread of every compute request the client sends. together=n: the first n wait
    for each other before they are sent, so that they are in flight at once (a client that sent
    its blocks one after another would break the barrier and fail the call)."""
    seen, compute = [], client._compute
    barrier = threading.Barrier(together) if together else None

    def recording(path, body, http=None):
        seen.append(threading.current_thread().name)
        if barrier is not None and len(seen) <= together:
            barrier.wait(timeout=60)
        return compute(path, body, http)

    client._compute = recording
    return seen


SPLIT_CASES = {
    # id: (q shape, S, options): every one at least 4x over the small server's score limit
    "leading-axes": ((4, 4, 32, 16), 32, {}),
    "rows-top-left": ((2, 2, 64, 16), 64, {"causal": True}),
    "rows-bottom-right": ((2, 2, 48, 16), 96, {"causal": "bottom_right"}),
    "mask-and-key-lengths": ((2, 2, 64, 16), 80, {"mask": "per-head", "key_lengths": True, "causal": "top_left"}),
    "broadcast-mask-float64": ((4, 64, 8), 64, {"mask": "shared", "dtype": "float64"}),
}


@pytest.mark.live
@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
def test_over_limit_request_is_split_exactly(small_api, small_server, rng, case):
    shape, S, options = SPLIT_CASES[case]
    *lead, T, d = shape
    q = rng.standard_normal(shape, dtype=np.float32)
    k = rng.standard_normal((*lead, S, d), dtype=np.float32)
    v = rng.standard_normal((*lead, S, 8), dtype=np.float32)
    kwargs = {key: val for key, val in options.items() if key in ("causal", "dtype")}
    if options.get("mask") == "per-head":
        kwargs["mask"] = rng.random((*lead, T, S)) > 0.3
    elif options.get("mask") == "shared":
        kwargs["mask"] = rng.random((T, S)) > 0.3
    if options.get("key_lengths"):
        kwargs["key_lengths"] = rng.integers(0, S + 1, size=(lead[0], 1))
    assert np.prod(shape[:-1]) * S >= 4 * 4096  # at least 4x over ATTN_MAX_SCORE_ELEMENTS

    unsplit = requests.post(f"{small_server}/attention", timeout=30, json={"q": q.tolist(), "k": k.tolist(), "v": v.tolist()})
    assert unsplit.status_code == 413  # the server would refuse it whole

    threads = spy_threads(small_api, together=2)  # two blocks in flight at once
    out, weights = small_api.attention(q, k, v, **kwargs)
    core_kwargs = {**kwargs, "key_lengths": kwargs.get("key_lengths")}
    core_kwargs.pop("dtype", None)
    dtype = np.float64 if kwargs.get("dtype") == "float64" else np.float32
    want_out, want_w = core.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), **core_kwargs)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    assert out.shape == want_out.shape and weights.shape == want_w.shape and out.dtype == dtype
    np.testing.assert_allclose(out, want_out, rtol=0, atol=tol)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=tol)
    assert len(threads) >= 4 and len(set(threads[:2])) == 2  # split, and sent concurrently


@pytest.mark.live
def test_mha_batch_is_split(small_api, rng):
    x = rng.standard_normal((8, 32, 16), dtype=np.float32)  # 8 * 4 heads * 32 * 32 = 8x the score limit
    ws = [(rng.standard_normal((16, 16)) / 4).astype(np.float32) for _ in range(4)]
    threads = spy_threads(small_api)
    out, weights = small_api.mha(x, *ws, heads=4)
    want_out, want_w = core.mha(x, *ws, 4)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-6)
    assert len(threads) == 8


@pytest.mark.live
def test_keys_over_max_s_are_split_and_merged(small_api, rng):
    """S over ATTN_MAX_S (413 too_long whole, and for every single row): key ranges merged by lse."""
    q = rng.standard_normal((4, 8), dtype=np.float32)
    k = rng.standard_normal((200, 8), dtype=np.float32)
    out, weights, lse = small_api.attention(q, k, k, return_lse=True)
    want_out, want_w, want_lse = core.attention(q, k, k, return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.live
def test_unsplittable_request_gets_the_servers_refusal(small_api, rng):
    q = rng.standard_normal((4, 60_000), dtype=np.float32)  # one row and one key are over ATTN_MAX_BODY_BYTES
    with pytest.raises(AttentionError) as info:
        small_api.attention(q, q, q)
    assert (info.value.status, info.value.code) == (413, "body_too_large")


@pytest.mark.live
def test_without_splitting_the_server_refuses(small_server, rng):
    q = rng.standard_normal((64, 8), dtype=np.float32)
    with AttentionClient(small_server, split=False) as client, pytest.raises(AttentionError) as info:
        client.attention(q, q, q)
    assert info.value.code == "too_long"


def test_plan_is_even_and_covers_everything():
    def fits(b, t):
        return b * t <= 10

    blocks = _split.plan(7, 4, fits)  # 2 leading indices of 4 rows fit; 7 -> 4 blocks of 2, 2, 2, 1
    assert [(b.b0, b.b1, b.t0, b.t1) for b in blocks] == [(0, 2, 0, 4), (2, 4, 0, 4), (4, 6, 0, 4), (6, 7, 0, 4)]
    blocks = _split.plan(2, 25, fits)  # rows: 25 -> 3 blocks of 9, 9, 7 per leading index
    assert [(b.b0, b.t0, b.t1) for b in blocks] == [(0, 0, 9), (0, 9, 18), (0, 18, 25), (1, 0, 9), (1, 9, 18), (1, 18, 25)]
    assert _split.plan(1, 1, lambda b, t: False) is None


@pytest.mark.parametrize(
    ("n_lead", "n_rows"), [(_split.MAX_BLOCKS + 1, 1), (2, _split.MAX_BLOCKS // 2 + 1)], ids=["by-leading-indices", "by-rows"]
)
def test_plan_gives_up_past_max_blocks(n_lead, n_rows):
    """Limits that fit one row of one leading index: both ways of splitting stop at MAX_BLOCKS
    blocks (None: the request goes whole); one fewer leading index or row, and the plan is made."""

    def fits(b, t):
        return b == 1 and t == 1

    assert _split.plan(n_lead, n_rows, fits) is None
    fewer = (n_lead - 1, n_rows) if n_rows == 1 else (n_lead, n_rows - 1)
    assert len(_split.plan(*fewer, fits)) <= _split.MAX_BLOCKS


# --- retries, against a stub that answers 503 first -------------------------------------------------


class Stub(JsonHandler):
    """POST /attention (native JSON) or /v2/models/attention/infer (the protocol's JSON): `busy`
    503s with Retry-After, each in its door's error shape, then the seed's answer."""

    busy = 0
    retry_after = "2"
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        v2 = self.path.startswith("/v2/")
        if type(self).busy > 0:
            type(self).busy -= 1
            error = {"error": "busy"} if v2 else {"error": {"status": 503, "code": "overloaded", "message": "busy", "field": None}}
            self._send(503, error, {"Retry-After": self.retry_after, "X-Error-Code": "overloaded"})
        elif v2:
            self._send(200, {"model_name": "attention", "outputs": [{"name": "out", "datatype": "FP32", "shape": [1, 1], "data": [4.0]}]})
        else:
            self._send(200, {"out": {"shape": [1, 1], "dtype": "float32", "data": [4.0]}, "cost": {}, "timing_ms": {}})


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Stub.calls, Stub.busy, Stub.retry_after = 0, 0, "2"
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_503_is_retried_after_retry_after(stub, wire):
    Stub.busy = 2
    with AttentionClient(stub, retries=3, split=False, wire=wire) as client:
        sleeps = []
        client._sleep = sleeps.append
        out, weights = client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)), return_weights=False)
    assert out.tolist() == [[4.0]] and weights is None
    assert Stub.calls == 3 and sleeps == [2.0, 2.0]


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_503_after_the_last_retry_is_raised(stub, wire):
    Stub.busy, Stub.retry_after = 10, "0"
    with AttentionClient(stub, retries=2, split=False, wire=wire) as client:
        client._sleep = lambda s: None
        with pytest.raises(AttentionError) as info:
            client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    assert (info.value.status, info.value.code) == (503, "overloaded") and Stub.calls == 3


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_retry_after_is_capped_and_dates_are_read(stub, wire):
    Stub.busy, Stub.retry_after = 1, "Wed, 21 Oct 2015 07:28:00 GMT"  # in the past: retry at once
    with AttentionClient(stub, split=False, max_retry_after=5, wire=wire) as client:
        sleeps = []
        client._sleep = sleeps.append
        client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
        Stub.busy, Stub.retry_after = 1, "3600"
        client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    assert sleeps == [0.0, 5.0]


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_connection_errors_are_retried_with_backoff(wire):
    with AttentionClient(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.1, split=False, wire=wire) as client:
        sleeps = []
        client._sleep = sleeps.append
        with pytest.raises(AttentionError) as info:
            client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    assert info.value.status is None and info.value.code == "connection_error" and info.value.response is None
    assert len(sleeps) == 3
    assert all(0.05 * 2**i <= s <= 0.1 * 2**i for i, s in enumerate(sleeps))  # exponential, with jitter


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_a_retry_after_that_is_not_a_number_of_seconds_backs_off(stub, wire):
    Stub.busy, Stub.retry_after = 1, "nan"  # read as a float: time.sleep(nan) raised ValueError out of the client
    with AttentionClient(stub, split=False, backoff=0.1, wire=wire) as client:
        sleeps = []
        client._sleep = sleeps.append
        client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    assert len(sleeps) == 1 and 0.05 <= sleeps[0] <= 0.1


class Liar(BaseHTTPRequestHandler):
    """Reads the request, then answers `answer`, raw bytes: a status line, headers and a body that
    need not agree."""

    answer = b""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.wfile.write(self.answer)
        self.close_connection = True

    def log_message(self, *args):
        pass


def _ok(body: bytes, length: int | None = None) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n"
    return head.encode() + body


def _v2_binary_answer(head: bytes, data: bytes = b"\0\0\x80\x40") -> bytes:
    """A /v2 binary answer: the JSON head (its length in Inference-Header-Content-Length), then data."""
    return (
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nInference-Header-Content-Length: %d\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(head), len(head) + len(data))
        )
        + head
        + data
    )


SEED_ANSWER = b'{"out":{"shape":[1,1],"dtype":"float32","data":[4.0]}}'
LIES = {
    # Each raised out of the client as MemoryError, ValueError, KeyError or AttributeError, or was
    # returned: {"out": 5} gave out = array(5.0), a 0-d array, for a (1, 1) query.
    "content-length-1e15": (_ok(SEED_ANSWER, 10**15), ["binary", "json"]),
    "content-length-1e30": (_ok(SEED_ANSWER, 10**30), ["binary", "json"]),
    "a-list": (_ok(b"[]"), ["json"]),
    "no-out": (_ok(b"{}"), ["json"]),
    "out-a-number": (_ok(b'{"out":5}'), ["json"]),
    "shape-its-data-lacks": (_ok(b'{"out":{"shape":[9,9],"dtype":"float32","data":[4.0]}}'), ["json"]),
    "dtype-unknown": (_ok(b'{"out":{"shape":[1,1],"dtype":"floaty","data":[4.0]}}'), ["json"]),
    # Attack round three: an out of another shape than the request's (..., T, dv) was returned as
    # is, and broadcast silently into a split request's result.
    "out-of-another-shape": (_ok(b'{"out":{"shape":[2,2],"dtype":"float32","data":[4.0,4.0,4.0,4.0]}}'), ["json"]),
    "out-of-another-shape-v2": (
        _ok(b'{"model_name":"attention","outputs":[{"name":"out","datatype":"FP32","shape":[2,2],"data":[4.0,4.0,4.0,4.0]}]}'),
        ["binary"],
    ),
    # Attack round three: a negative size read all the bytes left (count -1).
    "binary-data-size-2**62": (
        _v2_binary_answer(b'{"outputs":[{"name":"out","datatype":"FP32","shape":[1,1],"parameters":{"binary_data_size":%d}}]}' % 2**62),
        ["binary"],
    ),
    "binary-data-size-negative": (
        _v2_binary_answer(b'{"outputs":[{"name":"out","datatype":"FP32","shape":[1,1],"parameters":{"binary_data_size":-4}}]}'),
        ["binary"],
    ),
    # A size that is not a whole number of items: out took the whole items in it and the weights
    # were read from 2 bytes later, misaligned (returned as the answer).
    "binary-data-size-not-whole-items": (
        _v2_binary_answer(
            b'{"outputs":[{"name":"out","datatype":"FP32","shape":[1,1],"parameters":{"binary_data_size":6}},'
            b'{"name":"weights","datatype":"FP32","shape":[1,1],"parameters":{"binary_data_size":4}}]}',
            b"\0\0\x80\x40\0\0\0\0\x80\x3f",
        ),
        ["binary"],
    ),
    "weights-of-another-shape": (
        _ok(b'{"out":{"shape":[1,1],"dtype":"float32","data":[4.0]},"weights":{"shape":[1,3],"dtype":"float32","data":[1,0,0]}}'),
        ["json"],
    ),
}


@pytest.mark.parametrize(("lie", "wire"), [(lie, wire) for lie, (_, wires) in LIES.items() for wire in wires], ids=lambda x: x)
def test_an_answer_the_client_cannot_use_is_a_bad_response(lie, wire):
    Liar.answer = LIES[lie][0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with AttentionClient(f"http://127.0.0.1:{server.server_address[1]}", retries=0, split=False, wire=wire, timeout=30) as client:
            with pytest.raises(AttentionError) as info:
                client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    finally:
        server.shutdown()
        server.server_close()
    assert info.value.code == "bad_response"


# --- the CLI ----------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attention_client", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.live
def test_cli_attention(live_server, tmp_path, rng):
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 3))
    mask = rng.random((6, 6)) > 0.2
    for name, arr in {"q": q, "k": k, "v": v, "m": mask}.items():
        np.save(tmp_path / f"{name}.npy", arr)
    result = tmp_path / "result.npz"
    proc = run_cli(
        "--url",
        live_server,
        "attention",
        str(tmp_path / "q.npy"),
        str(tmp_path / "k.npy"),
        str(tmp_path / "v.npy"),
        "--mask",
        str(tmp_path / "m.npy"),
        "--causal",
        "-o",
        str(result),
    )
    assert proc.returncode == 0, proc.stderr
    saved = np.load(result)
    want_out, want_w = core.attention(q, k, v, mask, causal="top_left")  # float64 files: float64 compute
    assert saved["out"].dtype == np.float64
    np.testing.assert_allclose(saved["out"], want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(saved["weights"], want_w, rtol=0, atol=1e-12)


@pytest.mark.live
def test_cli_reports_refusals(live_server, tmp_path):
    np.save(tmp_path / "q.npy", np.ones((3, 4)))
    np.save(tmp_path / "k.npy", np.ones((3, 5)))
    proc = run_cli(
        "--url", live_server, "attention", *(str(tmp_path / f) for f in ("q.npy", "k.npy", "k.npy")), "-o", str(tmp_path / "r.npz")
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: 422 shape_mismatch: input k has d=5 but q has d=4."  # the /v2 door's words
    assert not (tmp_path / "r.npz").exists()


@pytest.mark.live
def test_cli_unreadable_file_is_a_usage_error(live_server, tmp_path):
    proc = run_cli("--url", live_server, "attention", *(str(tmp_path / "missing.npy"),) * 3, "-o", str(tmp_path / "r.npz"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.mark.live
def test_cli_limits_and_ready(live_server):
    proc = run_cli("--url", live_server, "limits")
    assert proc.returncode == 0 and json.loads(proc.stdout)["max_t"] > 0
    assert run_cli("--url", live_server, "ready").returncode == 0
    assert run_cli("--url", f"http://127.0.0.1:{free_port()}", "ready").returncode == 1


# --- the attention variants -----------------------------------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize("encoding", ["b64", "flat", "nested"])
def test_variants_as_keyword_arguments(live_server, rng, encoding):
    q = rng.standard_normal((2, 4, 9, 8))
    k, v = rng.standard_normal((2, 2, 11, 8)), rng.standard_normal((2, 2, 11, 3))
    bias, slopes = rng.standard_normal((9, 11)), np.array([0.5, 0.25, 0.125, 0.0625])
    options = {
        "enable_gqa": True,
        "window": (3, 1),
        "bias": bias,
        "alibi_slopes": slopes,
        "average_weights": True,
        "causal": "bottom_right",
    }
    with AttentionClient(live_server, encoding=encoding) as client:
        out, weights = client.attention(q, k, v, **options)
    want_out, want_w = core.attention(q, k, v, **options)
    assert out.dtype == np.float64 and weights.shape == (2, 9, 11)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-12)


@pytest.mark.live
def test_float16_in_and_float16_weights(api, rng):
    q, k, v = (rng.standard_normal((2, 6, 4)).astype(np.float16) for _ in range(3))
    out, weights = api.attention(q, k, v, weights_dtype="float16")
    assert out.dtype == np.float32 and weights.dtype == np.float16  # computed in float32, weights sent in float16
    want_out, want_w = core.attention(*(a.astype(np.float32) for a in (q, k, v)))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-3)


@pytest.mark.live
def test_mha_textbook_listing_and_kv_heads(api, rng):
    x = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], np.float32)
    wq = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], np.float32)
    wk = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], np.float32)
    wv = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], np.float32)
    out, weights = api.mha(x, wq, wk, wv, None, 1, scale=1.0, causal=False)
    np.testing.assert_allclose(out[0], [1.9366, 6.6831, 1.5951], atol=1e-4)
    np.testing.assert_allclose(weights[0, 0], [0.0634, 0.4683, 0.4683], atol=1e-4)
    x = rng.standard_normal((2, 7, 8))
    ws = [rng.standard_normal(shape) / 3 for shape in ((8, 12), (8, 6), (8, 10), (20, 5))]
    out, weights = api.mha(x, *ws, 4, kv_heads=2, window=(2, 0))
    want_out, want_w = core.mha(x, *ws, 4, kv_heads=2, window=(2, 0))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-12)


@pytest.mark.live
def test_windowed_and_biased_requests_split_exactly(small_api, rng):
    """Over the small server's limits: a bias splits by leading indices and rows; a window and
    ALiBi split by leading indices only (their t + S - T moves with rows)."""
    q, k, v = (rng.standard_normal((8, 32, 8), dtype=np.float32) for _ in range(3))  # 8 x 32 x 32 = 2x the score limit
    bias = rng.standard_normal((8, 32, 32)).astype(np.float32)
    slopes = rng.uniform(0, 1, 8).astype(np.float32)
    for options in ({"bias": bias, "causal": True}, {"window": (4, 0), "alibi_slopes": slopes}):
        threads = spy_threads(small_api)
        out, weights = small_api.attention(q, k, v, **options)
        want_out, want_w = core.attention(q, k, v, **options)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-6)
        assert len(threads) >= 2


@pytest.mark.live
def test_gqa_and_averaged_requests_are_split_exactly(small_api, rng):
    """Over the limits, GQA blocks carry each query head's key/value head, and averaged weights are
    averaged once every head is in: what one call gives."""
    q = rng.standard_normal((4, 8, 32, 8), dtype=np.float32)
    kv = rng.standard_normal((4, 2, 32, 8), dtype=np.float32)
    for kwargs in ({"enable_gqa": True}, {"average_weights": True}, {"enable_gqa": True, "average_weights": True}):
        k = kv if kwargs.get("enable_gqa") else q
        threads = spy_threads(small_api)
        out, weights = small_api.attention(q, k, k, **kwargs)
        want_out, want_w = core.attention(q, k, k, **kwargs)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-6)
        assert len(threads) > 1


@pytest.mark.live
def test_cli_variants(live_server, tmp_path, rng):
    arrays = {"q": rng.standard_normal((4, 6, 4)), "k": rng.standard_normal((2, 6, 4)), "v": rng.standard_normal((2, 6, 3))}
    arrays["b"] = rng.standard_normal((6, 6))
    for name, arr in arrays.items():
        np.save(tmp_path / f"{name}.npy", arr)
    result = tmp_path / "result.npz"
    files = [str(tmp_path / f"{n}.npy") for n in "qkv"]
    args = ["--enable-gqa", "--window", "2,0", "--bias", str(tmp_path / "b.npy"), "--average-weights", "--weights-dtype", "float32"]
    proc = run_cli("--url", live_server, "attention", *files, *args, "-o", str(result))
    assert proc.returncode == 0, proc.stderr
    saved = np.load(result)
    want_out, want_w = core.attention(
        arrays["q"], arrays["k"], arrays["v"], enable_gqa=True, window=(2, 0), bias=arrays["b"], average_weights=True
    )
    np.testing.assert_allclose(saved["out"], want_out, rtol=0, atol=1e-12)
    assert saved["weights"].dtype == np.float32 and saved["weights"].shape == (6, 6)
    np.testing.assert_allclose(saved["weights"], want_w, rtol=0, atol=1e-6)
    bad = run_cli("--url", live_server, "attention", *files, "--window", "2", "-o", str(result))
    assert bad.returncode == 2 and "LEFT,RIGHT" in bad.stderr


@pytest.mark.live
def test_cli_lse_key_chunks_and_replicas(live_server, small_server, tmp_path, rng):
    """--url twice (two replicas), --lse, --key-chunks: out and lse of one call, in the result file."""
    arrays = {"q": rng.standard_normal((2, 40, 4)), "k": rng.standard_normal((2, 300, 4)), "v": rng.standard_normal((2, 300, 3))}
    for name, arr in arrays.items():
        np.save(tmp_path / f"{name}.npy", arr)
    result = tmp_path / "result.npz"
    files = [str(tmp_path / f"{n}.npy") for n in "qkv"]
    urls = ["--url", live_server, "--url", small_server]
    proc = run_cli(*urls, "attention", *files, "--causal", "bottom_right", "--no-weights", "--lse", "--key-chunks", "3", "-o", str(result))
    assert proc.returncode == 0, proc.stderr
    saved = np.load(result)
    assert set(saved.files) == {"out", "lse"} and "lse [2, 40]" in proc.stdout
    want_out, _, want_lse = core.attention(*arrays.values(), causal="bottom_right", return_weights=False, return_lse=True)
    np.testing.assert_allclose(saved["out"], want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(saved["lse"], want_lse, rtol=1e-12)


# --- the two wires: binary tensors at /v2 (the default) and JSON at the native door -------------------


def spy_paths(client: AttentionClient) -> list[str]:
    """Record the path of every compute request the client sends (not its GET /limits)."""
    seen, request = [], client._http.request

    def recording(method, path, *args, **kwargs):
        if method == "POST":
            seen.append(path)
        return request(method, path, *args, **kwargs)

    client._http.request = recording
    return seen


WIRE_CASES = {
    # id: (q shape, S, options); float64 inputs are computed (and answered) in float64
    "plain": ((5, 4), 6, {}),
    "causal-no-weights": ((2, 3, 16, 8), 16, {"causal": True, "return_weights": False}),
    "bottom-right-mask-key-lengths": ((2, 3, 7, 8), 11, {"causal": "bottom_right", "mask": True, "key_lengths": True}),
    "int-mask-scale-float64": ((3, 9, 4), 9, {"mask": "int", "scale": 0.5, "dtype": "float64"}),
    "variants": ((2, 4, 9, 8), 11, {"enable_gqa": True, "window": (3, 1), "bias": True, "alibi_slopes": True, "average_weights": True}),
}


@pytest.mark.live
@pytest.mark.parametrize("wire", ["binary", "json"])
@pytest.mark.parametrize("case", list(WIRE_CASES), ids=list(WIRE_CASES))
def test_both_wires_give_the_cores_attention(live_server, rng, wire, case):
    shape, S, options = WIRE_CASES[case]
    *lead, T, d = shape
    dtype = np.float64 if options.get("dtype") == "float64" else np.float32
    kv_lead = [*lead[:-1], lead[-1] // 2] if options.get("enable_gqa") else lead
    q = rng.standard_normal(shape).astype(dtype)
    k, v = rng.standard_normal((*kv_lead, S, d)).astype(dtype), rng.standard_normal((*kv_lead, S, 3)).astype(dtype)
    kwargs = {
        key: val for key, val in options.items() if key in ("causal", "return_weights", "scale", "enable_gqa", "window", "average_weights")
    }
    if options.get("mask") is True:
        kwargs["mask"] = rng.random((T, S)) > 0.3
    elif options.get("mask") == "int":
        kwargs["mask"] = (rng.random((*lead, T, S)) > 0.3).astype(np.int32)  # 0/1 numbers: sent as BOOL on /v2
    if options.get("key_lengths"):
        kwargs["key_lengths"] = rng.integers(0, S + 1, size=lead[:1] + [1])
    if options.get("bias"):
        kwargs["bias"] = rng.standard_normal((T, S)).astype(dtype)
    if options.get("alibi_slopes"):
        kwargs["alibi_slopes"] = np.linspace(0.5, 0.0625, lead[-1]).astype(dtype)
    with AttentionClient(live_server, wire=wire) as client:
        paths = spy_paths(client)
        out, weights = client.attention(q, k, v, **kwargs)
    assert paths == (["/v2/models/attention/infer"] if wire == "binary" else ["/attention"])
    want_out, want_w = core.attention(q, k, v, **{key: val for key, val in kwargs.items() if key != "return_weights"})
    tol = 1e-12 if dtype == np.float64 else 1e-6
    assert out.dtype == dtype and out.shape == want_out.shape
    np.testing.assert_allclose(out, want_out, rtol=0, atol=tol)
    if options.get("return_weights") is False:
        assert weights is None
    else:
        assert weights.dtype == dtype and weights.shape == want_w.shape
        np.testing.assert_allclose(weights, want_w, rtol=0, atol=tol)
    assert out.flags.writeable and out.flags.aligned  # binary: a view of the answer's buffer, placed aligned


@pytest.mark.live
@pytest.mark.parametrize("wire", ["binary", "json"])
@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no-weights"])
def test_both_wires_give_the_cores_mha(live_server, rng, wire, weights):
    x = rng.standard_normal((2, 7, 8), dtype=np.float32)
    ws = [(rng.standard_normal(shape) / 3).astype(np.float32) for shape in ((8, 12), (8, 6), (8, 10), (20, 5))]
    with AttentionClient(live_server, wire=wire) as client:
        paths = spy_paths(client)
        out, w = client.mha(x, *ws, 4, kv_heads=2, window=(2, 0), return_weights=weights)
        out_concat, _ = client.mha(x, *ws[:3], None, 4, kv_heads=2, causal=False, return_weights=weights)
    assert paths == (["/v2/models/mha/infer"] if wire == "binary" else ["/mha"]) * 2
    want_out, want_w = core.mha(x, *ws, 4, kv_heads=2, window=(2, 0))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out_concat, core.mha(x, *ws[:3], None, 4, kv_heads=2, causal=False)[0], rtol=0, atol=1e-6)
    if weights:
        np.testing.assert_allclose(w, want_w, rtol=0, atol=1e-6)
    else:
        assert w is None


@pytest.mark.live
def test_float16_weights_on_the_binary_wire(live_server, rng):
    q, k, v = (rng.standard_normal((2, 6, 4)).astype(np.float16) for _ in range(3))
    with AttentionClient(live_server, wire="binary") as client:
        out, weights = client.attention(q, k, v, weights_dtype="float16")
    assert out.dtype == np.float32 and weights.dtype == np.float16
    np.testing.assert_allclose(weights, core.attention(*(a.astype(np.float32) for a in (q, k, v)))[1], rtol=0, atol=1e-3)


REFUSALS = {
    # id: (call, status, code): each refused by the schema, the limits or the options
    "shape": (lambda api, r: api.attention(r((3, 4)), r((3, 5)), r((3, 2))), 422, "shape_mismatch"),
    "window": (lambda api, r: api.attention(r((3, 4)), r((3, 4)), r((3, 2)), window=(-2, 0)), 422, None),
    "mask-numbers": (lambda api, r: api.attention(r((3, 4)), r((3, 4)), r((3, 2)), mask=np.full((3, 3), 2)), 422, None),
    "heads": (lambda api, r: api.mha(r((5, 8)), r((8, 8)), r((8, 8)), r((8, 8)), r((8, 8)), 3), 422, None),
    "too-long": (lambda api, r: api.attention(r((4, 8)), r((200, 8)), r((200, 8))), 413, "too_long"),
}


@pytest.mark.live
@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_refusals_are_the_same_on_both_wires(small_server, rng, case):
    """The /v2 door answers {"error": message} with the code and field in X-Error-Code and
    X-Error-Field: the client's error has the same status, code and field whichever wire it took
    (the message is each door's wording: the /v2 one names "input k"), from one request."""
    call, status, code = REFUSALS[case]
    errors = {}
    for wire in ("binary", "json"):
        with AttentionClient(small_server, wire=wire, split=False) as client, pytest.raises(AttentionError) as info:
            call(client, lambda shape: rng.standard_normal(shape).astype(np.float32))
        errors[wire] = info.value
    binary, native = errors["binary"], errors["json"]
    assert (binary.status, binary.code, binary.field) == (native.status, native.code, native.field)
    assert binary.status == status and (code is None or binary.code == code)
    assert binary.code not in ("http_error", "bad_response") and native.response.status_code == status
    at_v2 = binary.response.url.endswith("/infer")
    assert binary.response.status_code == (400 if at_v2 and status == 422 else status)  # the /v2 door's status for an invalid request
    if case != "mask-numbers":  # (a mask of numbers other than 0/1 is sent to the native door, which says why)
        assert binary.response.url.split("/")[-3:] == ["models", "attention" if case != "heads" else "mha", "infer"]  # one request
    if case == "shape":
        assert binary.message == "input k has d=5 but q has d=4." and binary.field == "k"
        assert native.message == "k has d=5 but q has d=4."


@pytest.mark.live
def test_cli_json_wire(live_server, tmp_path, rng):
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    for name, arr in {"q": q, "k": k, "v": v}.items():
        np.save(tmp_path / f"{name}.npy", arr)
    result = tmp_path / "result.npz"
    proc = run_cli("--url", live_server, "--wire", "json", "attention", *(str(tmp_path / f"{n}.npy") for n in "qkv"), "-o", str(result))
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(result)["out"], core.attention(q, k, v)[0], rtol=0, atol=1e-12)


def test_wire_and_encoding_choose_the_door():
    assert AttentionClient("http://127.0.0.1:9").wire == "binary"
    assert AttentionClient("http://127.0.0.1:9", encoding="nested").wire == "json"  # an encoding is the JSON door's
    assert AttentionClient("http://127.0.0.1:9", wire="json").encoding == "b64"
    with pytest.raises(ValueError):
        AttentionClient("http://127.0.0.1:9", wire="grpc")


class ClosingStub(Stub):
    """HTTP/1.1 answers that do not say Connection: close, then the connection is closed: what a
    server does to an idle keep-alive connection after its keepalive timeout."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self):
        type(self).connections += 1
        super().setup()

    def do_POST(self):
        super().do_POST()
        self.close_connection = True


@pytest.mark.parametrize("race", [False, True], ids=["seen-closed", "closed-unseen"])
@pytest.mark.parametrize("wire", ["binary", "json"])
def test_a_connection_the_server_closed_is_replaced(monkeypatch, wire, race):
    """A pooled connection the server has closed is replaced before use when the close is seen
    (EOF readable), and else retried once at once on a new one: with retries=0, no call fails."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosingStub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    ClosingStub.calls, ClosingStub.busy, ClosingStub.connections = 0, 0, 0
    if race:  # the server's close lands after the pool looked: the send or the read fails
        monkeypatch.setattr(_http, "_still_open", lambda sock: True)
    try:
        with AttentionClient(f"http://127.0.0.1:{server.server_address[1]}", retries=0, split=False, wire=wire) as client:
            for _ in range(3):
                out, _ = client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)), return_weights=False)
                assert out.tolist() == [[4.0]]
    finally:
        server.shutdown()
        server.server_close()
    assert ClosingStub.calls == ClosingStub.connections == 3  # each call answered once, each on a new connection


def test_request_head_carries_prefix_host_and_length():
    pool = _http.Pool("https://example.com/api/", timeout=5, max_idle=1, headers={"User-Agent": "t"})
    head = pool._head("POST", "/v2/models/attention/infer", [b"{}", np.zeros(3, np.float32).view(np.uint8)], {"X-A": "1"})
    assert (
        head
        == b"POST /api/v2/models/attention/infer HTTP/1.1\r\nHost: example.com\r\nUser-Agent: t\r\nX-A: 1\r\nContent-Length: 14\r\n\r\n"
    )
    assert (pool._port, _http.Pool("http://[::1]:8080", 5, 1, {})._head("GET", "/readyz", (), {})) == (
        443,
        b"GET /readyz HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n",
    )
    with pytest.raises(ValueError):
        _http.Pool("ftp://example.com", 5, 1, {})


# --- a hostile server: answers that never end, or end too slowly (attack round three) -----------------


def _endless_chunks():
    """A 200 whose chunked body does not end (here: 256 MiB of 1 MiB chunks, then it would)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n" % 2**20 + b" " * 2**20 + b"\r\n"
    for _ in range(256):
        yield chunk
    yield b"0\r\n\r\n"


def _endless_until_close():
    """A 200 with no length, delimited by the close that does not come (here: after 256 MiB)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    for _ in range(256):
        yield b" " * 2**20


@pytest.mark.parametrize("answer", [_endless_chunks, _endless_until_close], ids=["chunked", "until-close"])
@pytest.mark.parametrize("wire", ["binary", "json"])
def test_an_answer_without_end_is_cut_at_the_answer_limit(monkeypatch, answer, wire):
    """A body of unknown length (chunked, or up to the close) was read whole by resp.read(): a
    server that never ends one took the client's memory without bound. It is read up to
    MAX_ANSWER_BYTES (here 4 MiB), then refused as a bad response."""
    monkeypatch.setattr(_http, "MAX_ANSWER_BYTES", 4 * 2**20)
    server = Hostile(answer)
    try:
        with AttentionClient(server.url, retries=0, split=False, wire=wire, timeout=30) as client:
            with pytest.raises(AttentionError) as info:
                client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    finally:
        server.close()
    assert info.value.code == "bad_response"
    assert server.sent < 128 * 2**20  # the client stopped reading long before the end


def _trickle(head_bytes_per_step: int):
    """A 200 of a 50-byte body, written a byte every 0.2 s: the head too if head_bytes_per_step is 1."""
    body = b'{"out":{"shape":[1,1],"dtype":"float32","data":[4.0]}}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)

    def answer():
        whole = head + body
        start = 0 if head_bytes_per_step == 1 else len(head)
        if start:
            yield head
        for i in range(start, len(whole)):
            time.sleep(0.2)
            yield whole[i : i + 1]

    return answer


def _endless_continues():
    """Interim 100 Continue answers, one every 10 ms (for 60 s), and never a final one: http.client
    skips any number of them."""
    for _ in range(6000):
        time.sleep(0.01)
        yield b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize("where", ["head", "body", "endless-100-continue"])
def test_a_trickled_answer_times_out_as_a_whole(where):
    """timeout bounds the whole answer ("seconds per HTTP request"), not each read: a server that
    sends a byte every 0.2 s never let a 1 s per-read timeout fire, and held the client for as long
    as it liked (here ~25 s for a 125-byte answer)."""
    server = Hostile(_endless_continues if where == "endless-100-continue" else _trickle(1 if where == "head" else 0))
    try:
        with AttentionClient(server.url, retries=0, split=False, wire="json", timeout=1) as client:
            with pytest.raises(AttentionError) as info:
                client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    finally:
        server.close()
    assert info.value.code == "timeout"
    assert server.sent < (10_000 if where == "endless-100-continue" else 100)  # the client gave up long before the end


def test_an_mha_answer_of_another_shape_is_a_bad_response():
    """/mha's out must be (..., n, d_out) for x (..., n, d), its weights (..., n, n)."""
    Liar.answer = _ok(b'{"out":{"shape":[3,2],"dtype":"float32","data":[1,2,3,4,5,6]}}')
    server = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with AttentionClient(f"http://127.0.0.1:{server.server_address[1]}", retries=0, split=False, wire="json", timeout=30) as client:
            with pytest.raises(AttentionError) as info:
                client.mha(np.ones((1, 2)), np.eye(2), np.eye(2), np.eye(2), None, 1, return_weights=False)
    finally:
        server.shutdown()
        server.server_close()
    assert info.value.code == "bad_response"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": float("nan")},  # socket.settimeout: ValueError at the first request
        {"timeout": float("inf")},  # OverflowError
        {"timeout": -1},
        {"timeout": 0},
        {"timeout": 1e308},
        {"retries": -1},  # no attempt at all: AssertionError("unreachable")
        {"retries": 1.5},
        {"backoff": float("nan")},  # time.sleep(nan)
        {"backoff": -1.0},
        {"max_retry_after": float("nan")},
        {"max_workers": 0},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_settings_that_cannot_work_are_refused_at_once(kwargs):
    """Attack round three: each was taken, and failed later, at the first request or the first
    retry, with an exception that is not the client's (or an AssertionError)."""
    with pytest.raises(ValueError):
        AttentionClient("http://127.0.0.1:9", **kwargs)


@pytest.mark.parametrize(
    "args", [["--timeout", "nan"], ["--timeout", "-1"], ["--retries", "-1"], ["--url", "ftp://example.com"]], ids=" ".join
)
def test_cli_settings_that_cannot_work_are_usage_errors(args):
    proc = run_cli(*args, "limits")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")


class CountingLiar(Liar):
    connections = 0

    def setup(self):
        type(self).connections += 1
        super().setup()


def _head_of(header_lines: list[bytes]) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"".join(header_lines) + b"Content-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize(
    "answer",
    [
        _head_of([b"X-Big: " + b"a" * 100_000 + b"\r\n"]),
        _head_of([b"X-Many-%d: 1\r\n" % i for i in range(500)]),
        b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["a-100KB-header", "500-headers", "http-2.0-status-line"],
)
@pytest.mark.parametrize("wire", ["binary", "json"])
def test_an_answer_whose_head_cannot_be_read_is_not_retried(answer, wire):
    """A head http.client refuses (a line past 64 KiB, more than 100 headers, a version it does
    not speak) was a connection_error, retried: the whole request sent again `retries` times to a
    server that answers so each time. It is a bad_response, as an unreadable body is."""
    CountingLiar.answer, CountingLiar.connections = answer, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), CountingLiar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with AttentionClient(f"http://127.0.0.1:{server.server_address[1]}", retries=2, split=False, wire=wire, timeout=30) as client:
            client._sleep = lambda s: None
            with pytest.raises(AttentionError) as info:
                client.attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    finally:
        server.shutdown()
        server.server_close()
    assert info.value.code == "bad_response" and CountingLiar.connections == 1


class TinyLimits(Stub):
    """A server whose /limits say one query row per request (ATTN_MAX_T=1 is a valid setting, and
    a hostile server may say anything); every POST is refused 413."""

    posts = 0

    def do_GET(self):
        limits = {"max_t": 1, "max_s": 4096, "max_score_elements": 2**27, "max_weights_elements": 2**25, "max_body_bytes": 2**25}
        self._send(200, limits)

    def do_POST(self):
        type(self).posts += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(413, {"error": {"status": 413, "code": "too_long", "message": "T is over 1", "field": "q"}})


@pytest.mark.parametrize("wire", ["binary", "json"])
def test_limits_that_would_split_a_call_into_thousands_of_requests_are_not_followed(wire):
    """A call is split into at most _split.MAX_BLOCKS requests: T=5000 rows against max_t=1 were
    5,000 requests (and a million rows a million), each refused or not. Past the bound the request
    is sent whole, once, and the server says why it refuses it."""
    TinyLimits.posts = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), TinyLimits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with AttentionClient(f"http://127.0.0.1:{server.server_address[1]}", retries=0, wire=wire, timeout=30) as client:
            with pytest.raises(AttentionError) as info:
                client.attention(np.ones((5000, 1)), np.ones((4, 1)), np.ones((4, 1)), return_weights=False)
    finally:
        server.shutdown()
        server.server_close()
    assert (info.value.status, TinyLimits.posts) == (413, 1)


@pytest.mark.parametrize("api_key", ["key\r\nX-Injected: yes", "key\nX-Injected: yes", "key\x00", "clé"])
def test_an_api_key_that_would_break_the_request_head_is_refused(api_key):
    """The client writes its request head itself: a key holding CR LF (from an environment variable
    or a file with a trailing line) added a header of the key's choosing to every request
    (http.client refuses such a value; this head did not). Now ValueError when the client is made."""
    with pytest.raises(ValueError, match="api_key") as info:  # the argument's name, not the header it goes into
        AttentionClient("http://127.0.0.1:9", api_key=api_key)
    assert not any(form in str(info.value) for form in (api_key, repr(api_key)[1:-1]))  # a secret: not repeated, as is or escaped


def test_cli_does_not_write_a_servers_control_characters_to_the_terminal(tmp_path):
    """The CLI printed the server's error code and message as they came: a server could write
    terminal escape sequences (here: set the window title, colour the text) to the user's terminal.
    Control characters are shown escaped."""
    body = b'{"error":{"status":422,"code":"bad\\u001b[31m","message":"\\u001b]0;pwned\\u0007 and\\r\\nmore","field":null}}'
    Liar.answer = b"HTTP/1.1 422 Unprocessable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    server = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in "qkv":
        np.save(tmp_path / f"{name}.npy", np.ones((1, 1), np.float32))
    try:
        files = [str(tmp_path / f"{n}.npy") for n in "qkv"]
        proc = run_cli(
            "--url",
            f"http://127.0.0.1:{server.server_address[1]}",
            "--wire",
            "json",
            "--retries",
            "0",
            "attention",
            *files,
            "-o",
            str(tmp_path / "r.npz"),
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 1 and "pwned" in proc.stderr
    assert not any(c in proc.stderr for c in "\x1b\x07\r") and proc.stderr.count("\n") == 1


def test_the_hostile_server_ends_when_its_client_closes_early():
    """tests.helpers.Hostile, which these tests share: a client that closes before its head ends
    (a refused setting, a timeout while sending) ended a read loop that then spun on recv's b""
    for ever, a thread burning a core for the rest of the run."""
    server = Hostile(lambda: iter([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]))
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\n")  # half a head, then the close
    server.thread.join(timeout=30)  # it ends of itself: the timeout only stops a hang
    alive = server.thread.is_alive()
    server.close()
    assert not alive and server.sent == 0
