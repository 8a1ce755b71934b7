"""Slow and stalled clients against the real server (service/transport/worker.py under gunicorn): stalled
and trickling uploads get 408 and are closed, stalled downloads are dropped, and neither, nor a
thousand idle connections, starves anyone else. One worker (22 threads), so that more stalled
connections than threads would starve it if each held a thread; short timeouts keep it quick.

Waits are bounded by generous hang guards; nothing asserts how long anything took."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import select
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from . import helpers
from .helpers import HANG, Server, b64, connect, post_head, read_to_end, unread_bytes

pytestmark = pytest.mark.live

ENV = {
    "WEB_CONCURRENCY": "1",
    "ATTN_WARMUP": "0",
    "ATTN_HEADER_TIMEOUT_S": "2",
    "ATTN_BODY_TIMEOUT_S": "2",
    "ATTN_BODY_MIN_RATE": "1000",
    "ATTN_SEND_TIMEOUT_S": "2",
    "GUNICORN_CMD_ARGS": "--keep-alive 60",  # idle keep-alive connections stay for the 1,000-connection test
}


# --- the server ---------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(**extra: str):
    """`python -m service` (deploy/gunicorn.conf.py, as `make run`) with ENV and extra."""
    with helpers.serving({**ENV, **extra}) as srv:
        yield srv


@pytest.fixture(scope="module")
def server():
    with serving() as srv:
        yield srv


def wait_until(predicate, what: str):
    return helpers.wait_until(predicate, timeout=HANG, interval=0.05, what=what)


def get(srv: Server, path: str) -> int | None:
    try:
        return requests.get(srv.url + path, timeout=HANG).status_code
    except requests.ConnectionError:
        return None


# --- requests and responses on raw sockets ---------------------------------------------------------


def tensor(rng, *shape) -> dict:
    return b64(rng.standard_normal(shape))


def body_of(T: int, weights: bool = False, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return json.dumps(
        {"q": tensor(rng, 1, 2, T, 8), "k": tensor(rng, 1, 2, T, 8), "v": tensor(rng, 1, 2, T, 8), "return_weights": weights}
    ).encode()


def assert_continue(s: socket.socket) -> None:
    """The interim 100 Continue a client that sent Expect: 100-continue waits for, and nothing else."""
    interim = b""
    while b"\r\n\r\n" not in interim:
        interim += s.recv(1)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"


def responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Split the bytes of consecutive HTTP/1.1 responses with Content-Length: (status, headers, body)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data[:200]
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One whole response with Content-Length from a kept-alive connection."""
    data = bytearray()
    while True:
        head, sep, rest = bytes(data).partition(b"\r\n\r\n")
        if sep:
            n = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            if len(rest) >= n:
                [response] = responses(bytes(data))
                return response
        chunk = s.recv(65536)
        assert chunk, "closed before a whole response"
        data += chunk


def valid_request_ok(srv: Server) -> bool:
    """A small valid request on a new connection is answered 200 with the right shape."""
    r = requests.post(srv.url + "/attention", data=body_of(16), headers={"Content-Type": "application/json"}, timeout=HANG)
    return r.status_code == 200 and r.json()["out"]["shape"] == [1, 2, 16, 8]


def assert_error(data: bytes, status: int, code: str) -> None:
    [(got, headers, body)] = responses(data)
    assert got == status, data[:300]
    assert headers["connection"] == "close"
    assert headers["x-error-code"] == code and "x-error-field" not in headers
    doc = json.loads(body)
    assert doc["error"]["status"] == status and doc["error"]["code"] == code and doc["error"]["field"] is None
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


# --- receiving ----------------------------------------------------------------------------------


def test_stalled_upload_gets_408_and_is_closed(server):
    s = connect(server)
    s.sendall(post_head(1_000_000) + b'{"q": [')
    data, _ = read_to_end(s)
    assert_error(data, 408, "timeout")
    assert "ATTN_BODY_TIMEOUT_S" in json.loads(responses(data)[0][2])["error"]["message"]
    assert valid_request_ok(server)


def test_stalled_head_gets_408_and_is_closed(server):
    s = connect(server)
    s.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\nContent-")
    data, _ = read_to_end(s)
    assert_error(data, 408, "timeout")
    assert "ATTN_HEADER_TIMEOUT_S" in json.loads(responses(data)[0][2])["error"]["message"]


def test_stalled_upload_on_v2_gets_its_error_shape(server):
    s = connect(server)
    s.sendall(post_head(1000, "/v2/models/attention/infer") + b"{")
    data, _ = read_to_end(s)
    [(status, _, body)] = responses(data)
    assert status == 408 and isinstance(json.loads(body)["error"], str)


def test_silent_connection_is_closed_without_an_answer(server):
    s = connect(server)
    data, _ = read_to_end(s)
    assert data == b""


def test_trickling_body_is_cut(server):
    """A body arriving far below ATTN_BODY_MIN_RATE (1000 B/s here; this one sends ~40 B/s) is cut
    with 408 before it is complete."""
    length = 100_000
    s = connect(server)
    s.sendall(post_head(length) + b'{"q": [')
    sent, deadline = 0, time.monotonic() + HANG
    while sent < length and time.monotonic() < deadline:
        readable, _, _ = select.select([s], [], [], 0.25)
        if readable:
            break
        try:
            s.sendall(b"0.0, " * 2)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 10
    assert sent < length
    data, _ = read_to_end(s)
    assert_error(data, 408, "timeout")
    assert valid_request_ok(server)


def test_slow_but_steady_body_is_served(server):
    """A body that takes longer than ATTN_BODY_TIMEOUT_S (2 s here) but keeps above the minimum
    rate is served: the deadline moves with the bytes received."""
    body = body_of(64, seed=3)
    pieces = [body[i : i + len(body) // 8 + 1] for i in range(0, len(body), len(body) // 8 + 1)]
    s = connect(server)
    s.sendall(post_head(len(body)))
    for piece in pieces:  # ~3 s in all, each piece far more than 1000 B/s earns per 0.4 s
        s.sendall(piece)
        time.sleep(0.4)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data, _ = read_to_end(s)
    (status, _, out), (second, _, _) = responses(data)
    assert status == 200 and json.loads(out)["out"]["shape"] == [1, 2, 64, 8]
    assert second == 200


def test_bodies_being_read_count_against_the_memory_budget():
    """Past ATTN_MAX_INFLIGHT_BYTES of bodies being read, the upload that goes over gets 503
    overloaded and is closed; the others go on."""
    with serving(ATTN_MAX_INFLIGHT_BYTES="300000") as srv:
        first, second = connect(srv), connect(srv)
        first.sendall(post_head(1_000_000) + b" " * 200_000)
        wait_until(lambda: get(srv, "/healthz") == 200, "first upload read")  # same worker: its bytes are in
        second.sendall(post_head(1_000_000) + b" " * 200_000)
        data, _ = read_to_end(second)
        assert_error(data, 503, "overloaded")
        assert b"Retry-After: 1" in data
        assert valid_request_ok(srv)
        first.close()


def test_body_over_the_limit_is_refused_at_once(server):
    s = connect(server)
    s.sendall(post_head(10**12) + b"{")
    data, _ = read_to_end(s)
    assert_error(data, 413, "body_too_large")


def test_chunked_body_over_the_limit_is_refused(server):
    s = connect(server)
    s.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFF\r\n{")
    data, _ = read_to_end(s)
    assert_error(data, 413, "body_too_large")


def test_chunked_body_is_served(server):
    body = body_of(16, seed=4)
    r = requests.post(
        server.url + "/attention", data=iter([body[:100], body[100:]]), headers={"Content-Type": "application/json"}, timeout=HANG
    )
    assert r.status_code == 200 and r.json()["out"]["shape"] == [1, 2, 16, 8]


@pytest.mark.parametrize("path", ["/attention", "/v2/models/attention/infer"])
@pytest.mark.parametrize("sent", ["head", "body"])
def test_a_half_closed_partial_request_gets_400_and_is_not_computed(server, sent, path):
    """The client shuts its sending side mid-request: it is told why (400 incomplete_request, in
    its front door's shape), and the request, however valid its first bytes, is never computed."""
    body = body_of(16, seed=6)
    data = post_head(len(body) + 100, path) + body if sent == "body" else post_head(100, path)[:-10]
    s = connect(server)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    answer, _ = read_to_end(s)
    if path == "/attention":
        assert_error(answer, 400, "incomplete_request")
    else:
        [(status, _, out)] = responses(answer)
        assert status == 400 and "closed its side" in json.loads(out)["error"]
    assert valid_request_ok(server)


CHUNKED = "Transfer-Encoding: chunked\r\n"
UNFRAMEABLE = {
    "unknown-coding": ("Transfer-Encoding: gzip, chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n", 501, "not_implemented"),
    "chunked-not-last": ("Transfer-Encoding: chunked, gzip\r\n", b"2\r\n{}\r\n0\r\n\r\n", 400, "bad_framing"),
    "length-and-chunked": ("Content-Length: 5\r\n" + CHUNKED, b"2\r\n{}\r\n0\r\n\r\n", 400, "bad_framing"),
    "bad-chunk-size": (CHUNKED, b"zz\r\n{}\r\n0\r\n\r\n", 400, "bad_framing"),
    "missing-chunk-terminator": (CHUNKED, b"2\r\n{}XX0\r\n\r\n", 400, "bad_framing"),
    "length-not-a-number": ("Content-Length: lots\r\n", b"{}", 400, "bad_framing"),
}


@pytest.mark.parametrize("case", UNFRAMEABLE.values(), ids=UNFRAMEABLE.keys())
def test_unframeable_requests_are_refused_before_a_thread(server, case):
    """RFC 9112 section 6: a body whose end cannot be told is 400, a coding the server cannot decode
    501; both from the event loop, in the API's shape, then the connection closes."""
    headers, body, status, code = case
    head = f"POST /attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n".encode()
    s = connect(server)
    s.sendall(head + body)
    data, _ = read_to_end(s)
    assert_error(data, status, code)
    assert valid_request_ok(server)


def _counts(srv: Server) -> dict[str, float]:
    """/metrics' attention_http_requests_total and attention_rejections_total samples (labels sorted,
    as the multiprocess collector writes them)."""
    text = requests.get(srv.url + "/metrics", timeout=HANG).text
    found = re.findall(r"^(attention_(?:http_requests|rejections)_total\{[^}]*\}) (\S+)$", text, re.M)
    return {name: float(value) for name, value in found}


def test_the_workers_own_answers_are_counted(server):
    """408, 413, 431, 501 and 400 from the event loop are in /metrics as the app's answers are, under
    the route's bounded endpoint label ("unmatched" where no route has the path)."""
    before = _counts(server)
    sends = [
        b"POST /attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"POST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        post_head(10**12, "/nowhere/" + "x" * 50),
    ]
    for data in sends:
        s = connect(server)
        s.sendall(data)
        read_to_end(s)
    after = _counts(server)
    grown = {name for name, value in after.items() if value > before.get(name, 0.0)}
    assert {
        'attention_http_requests_total{endpoint="/attention",method="POST",status="501"}',
        'attention_rejections_total{code="not_implemented",endpoint="/attention"}',
        'attention_http_requests_total{endpoint="/v2/models/<name>/infer",method="POST",status="400"}',
        'attention_rejections_total{code="bad_framing",endpoint="/v2/models/<name>/infer"}',
        'attention_http_requests_total{endpoint="unmatched",method="POST",status="413"}',
        'attention_rejections_total{code="body_too_large",endpoint="unmatched"}',
    } <= grown, sorted(grown)


def test_expect_100_continue_is_answered_once(server):
    body = body_of(16, seed=5)
    s = connect(server)
    s.sendall(post_head(len(body), extra="Expect: 100-continue\r\nConnection: close\r\n"))
    assert_continue(s)
    s.sendall(body)
    data, _ = read_to_end(s)
    [(status, _, out)] = responses(data)
    assert status == 200 and json.loads(out)["out"]["shape"] == [1, 2, 16, 8]


def large_body(seed: int) -> bytes:
    """A b64 body of ~8.4 MB: past twice the worker's BODY_BUFFER_AFTER (2 MiB), so that its rest is
    read into a buffer of its own."""
    rng = np.random.default_rng(seed)
    body = json.dumps(
        {"q": tensor(rng, 1, 8, 4096, 16), "k": tensor(rng, 1, 8, 4096, 16), "v": tensor(rng, 1, 8, 4096, 16), "return_weights": False}
    ).encode()
    assert len(body) > 4 * 2**20
    return body


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
def test_a_large_body_in_pieces_is_read_into_its_own_buffer_and_answered(server, expect):
    """A body of known length is appended to the connection's buffer, then, past 2 MiB, read
    straight into a buffer of its own, whatever pieces it arrives in and whatever follows it on
    the connection: the answer is the one of the same body sent at once, and the request
    pipelined behind it is answered too."""
    body = large_body(seed=7)
    whole = requests.post(server.url + "/attention", data=body, headers={"Content-Type": "application/json"}, timeout=HANG)
    s = connect(server)
    s.sendall(post_head(len(body), extra="Expect: 100-continue\r\n" if expect else ""))
    if expect:
        assert_continue(s)
    cuts = [0, 1000, 300_000, 2 * 2**20 - 1, 2 * 2**20 + 1, len(body) // 2, len(body) - 5]
    for a, b in zip(cuts, cuts[1:], strict=False):
        s.sendall(body[a:b])
        time.sleep(0.05)
    s.sendall(body[cuts[-1] :] + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data, _ = read_to_end(s)
    (status, _, out), (second, _, _) = responses(data)
    assert (whole.status_code, status, second) == (200, 200, 200)
    assert json.loads(out)["out"] == whole.json()["out"]


@pytest.mark.parametrize(("uploads", "sent"), [(40, 300_000), (10, 3_000_000)], ids=["appended", "own buffer"])
def test_a_declared_length_costs_no_memory_until_its_bytes_arrive(server, uploads, sent):
    """Uploads each declare a 30 MB body, send part of it (300 KB, or 3 MB: past the point where
    the rest goes to a buffer of the body's length) and stall: the worker holds what they sent (12
    or 30 MB, plus at most a huge page each), not what they declared (1.2 GB or 300 MB)."""
    [pid] = helpers.worker_pids(server.proc)

    def rss_mb() -> float:
        return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    before, socks = rss_mb(), []
    try:
        for _ in range(uploads):
            s = connect(server)
            s.sendall(post_head(30_000_000) + b" " * sent)
            socks.append(s)
        # Wait until the worker has read every byte sent (the kernel holds none unread for it), not
        # for its RSS to grow: an allocator that reuses freed pages need not show any growth.
        wait_until(lambda: get(server, "/healthz") == 200 and unread_bytes(server.port) == 0, "the uploads read")
        grown = rss_mb() - before
        assert grown < 100, f"the worker grew by {grown:.0f} MB for {uploads * sent / 1e6:.0f} MB received"
    finally:
        for s in socks:
            s.close()
    assert valid_request_ok(server)


@pytest.mark.parametrize("sent", [600_000, 3_000_000], ids=["appended", "own buffer"])
def test_a_large_body_cut_short_gets_400_and_the_worker_goes_on(server, sent):
    """A client that declares a large body, sends part of it (before and past the point where its
    rest goes to a buffer of its own) and half-closes: 400 incomplete_request, and the worker
    serves the next request."""
    s = connect(server)
    s.sendall(post_head(8_000_000) + b"[" * sent)
    s.shutdown(socket.SHUT_WR)
    answer, _ = read_to_end(s)
    assert_error(answer, 400, "incomplete_request")
    assert valid_request_ok(server)


def test_pipelined_requests_are_answered_in_order(server):
    body = body_of(16, seed=6)
    s = connect(server)
    s.sendall(
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        + post_head(len(body))
        + body
        + b"GET /limits HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    data, _ = read_to_end(s)
    (s1, _, b1), (s2, _, b2), (s3, _, b3) = responses(data)
    assert (s1, s2, s3) == (200, 200, 200)
    assert json.loads(b1) == {"status": "ok"}
    assert json.loads(b2)["out"]["shape"] == [1, 2, 16, 8]
    assert "max_t" in json.loads(b3)


def test_abrupt_closes_mid_body_leave_the_server_healthy(server):
    for i in range(50):
        s = connect(server)
        s.sendall(post_head(100_000) + b'{"q": [[1.0, 2.0], ' * 10)
        if i % 2:  # half with a reset (SO_LINGER 0), half with a FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    assert get(server, "/healthz") == 200
    assert valid_request_ok(server)
    assert "Traceback" not in server.log_text()


# --- sending ------------------------------------------------------------------------------------


def large_response_request() -> bytes:
    """~11 MB of b64 weights (B=1, H=8, T=S=512), more than the socket buffers hold."""
    rng = np.random.default_rng(7)
    body = json.dumps(
        {"q": tensor(rng, 1, 8, 512, 64), "k": tensor(rng, 1, 8, 512, 64), "v": tensor(rng, 1, 8, 512, 64), "return_weights": True}
    ).encode()
    return post_head(len(body)) + body


def test_stalled_download_is_dropped(server):
    drops = server.log_text().count("of its response")
    s = connect(server, rcvbuf=4096)
    s.sendall(large_response_request())
    head = s.recv(4096)  # the response has begun...
    assert head.startswith(b"HTTP/1.1 200")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1)) if b"Content-Length" in head else None
    # ... and the client reads no more: the server drops it after ATTN_SEND_TIMEOUT_S.
    wait_until(lambda: server.log_text().count("of its response") > drops, "the stalled download dropped")
    data, _ = read_to_end(s)
    received = len(head) + len(data)
    assert length is None or received < length
    assert not data.endswith(b"0\r\n\r\n")  # a chunked response was cut too, not finished
    assert valid_request_ok(server)


def test_past_the_send_buffer_new_posts_get_503_until_slow_readers_go():
    """While more response bytes wait for slow readers than ATTN_SEND_BUFFER_BYTES (1 here), new
    POSTs get 503 overloaded from the worker (health checks still pass); once the stalled client
    is dropped, they are served again."""
    with serving(ATTN_SEND_BUFFER_BYTES="1", ATTN_SEND_TIMEOUT_S="10") as srv:
        s = connect(srv, rcvbuf=4096)
        s.sendall(large_response_request())
        assert s.recv(4096).startswith(b"HTTP/1.1 200")

        def refused():
            """a POST refused (once the response being written has filled the budget)"""
            r = requests.post(srv.url + "/attention", data=body_of(16), headers={"Content-Type": "application/json"}, timeout=HANG)
            return [r] if r.status_code == 503 else None  # (a Response is false when not ok)

        [r] = wait_until(refused, "a POST refused")
        assert r.json()["error"]["code"] == "overloaded" and r.headers["Retry-After"] == "1"
        assert "of its response" not in srv.log_text()  # refused while the slow reader was held
        assert get(srv, "/healthz") == 200
        wait_until(lambda: "of its response" in srv.log_text(), "the stalled download dropped")
        data, _ = read_to_end(s)
        assert not data.endswith(b"0\r\n\r\n")
        assert valid_request_ok(srv)


def test_a_reader_that_stalls_costs_no_more_than_the_send_budget():
    """A 260 KB request whose answer is ~400 MB of nested text, from a client that reads nothing:
    once the worker holds ATTN_SEND_BUFFER_BYTES (16 MB here) for slow readers, the thread waits for
    the reader (its compute slot is already free) instead of encoding the rest into memory, and is
    dropped after ATTN_SEND_TIMEOUT_S. Before, the whole answer was held: 786 MB for 262 KB sent."""
    with serving(ATTN_SEND_BUFFER_BYTES=str(16 * 2**20), ATTN_SEND_TIMEOUT_S="10") as srv:
        [pid] = helpers.worker_pids(srv.proc)

        def rss_mb() -> float:
            return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

        rng = np.random.default_rng(0)
        doc = {n: b64(rng.standard_normal((2, 4096, 1))) for n in ("q", "k", "v")}  # weights (2, 4096, 4096): 134 MB of float32
        body = json.dumps({**doc, "response_encoding": "nested"}).encode()
        before, peak = rss_mb(), 0.0
        s = connect(srv, rcvbuf=4096)
        s.sendall(post_head(len(body)) + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")

        def dropped():
            """the stalled download dropped (its peak memory sampled meanwhile)"""
            nonlocal peak
            peak = max(peak, rss_mb())
            return "of its response" in srv.log_text()

        wait_until(dropped, "the stalled download dropped")
        s.close()
        # The weights array (134 MB), the output, one chunk of text being encoded, the budget: not ~400 MB of text.
        assert peak - before < 300, f"the worker grew by {peak - before:.0f} MB for {len(body) / 1e6:.1f} MB received"
        assert valid_request_ok(srv)


# --- nobody starves -----------------------------------------------------------------------------


def test_stalled_clients_do_not_starve_others(server):
    """100 stalled uploads and 6 stalled downloads on one worker of 22 threads: /healthz and a
    valid request are still answered (with gthread alone, the uploads took every thread)."""
    held = []
    try:
        for _ in range(100):
            s = connect(server)
            s.sendall(post_head(1_000_000) + b'{"q": [')
            held.append(s)
        request = large_response_request()
        for _ in range(6):
            s = connect(server, rcvbuf=4096)
            s.sendall(request)
            held.append(s)
        for _ in range(20):
            assert get(server, "/healthz") == 200
        assert valid_request_ok(server)
    finally:
        for s in held:
            s.close()


def test_a_thousand_idle_keepalive_connections_do_not_starve_others(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"needs 1,200 open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    held = []
    try:
        for _ in range(1000):
            s = connect(server)
            s.sendall(request)
            held.append(s)
        for s in held:  # every one answered, and kept alive
            status, headers, _ = read_response(s)
            assert status == 200 and headers["connection"] == "keep-alive"
        assert get(server, "/healthz") == 200
        assert valid_request_ok(server)
        for s in held[::100]:  # the idle ones are still open and still served
            s.sendall(request)
            status, _, _ = read_response(s)
            assert status == 200
    finally:
        for s in held:
            s.close()
        if soft < 1200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
