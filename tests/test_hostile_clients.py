"""Hostile clients, mostly against the real server (gunicorn, service/transport/worker.py): uploads
that hold the worker's byte budget, refusals at the head, a body of exactly the limit, forged log
lines, echoed headers, floods of idle connections and Upgrade; and the laws under them (escaping,
a client's address). docs/reliability.md ("Hostile clients: budgets, heads, logs and connections")
maps each case to its test.

Small settings keep each case quick (a budget of 4 MB, a body limit of 1 MB); waits are bounded
by generous hang guards, and nothing asserts how long anything took."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import socket
from pathlib import Path

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from service.config import Settings
from service.transport.worker import peer_of
from service.web.accesslog import MAX_QUOTED, ClientBytes, printable
from service.web.app import create_app
from service.web.context import services

from . import helpers
from .helpers import HANG, WORKED, connect, post_head, read_to_end, unread_bytes

KEY = "hostile-test-key"
LIMIT = 1_000_000  # ATTN_MAX_BODY_BYTES here
BUDGET = 4 * LIMIT  # ATTN_MAX_INFLIGHT_BYTES here: a client's share is half of it
ENV = {
    "WEB_CONCURRENCY": "1",  # one worker: every connection counts against the same budget
    "ATTN_WARMUP": "0",
    "ATTN_MAX_BODY_BYTES": str(LIMIT),
    "ATTN_MAX_INFLIGHT_BYTES": str(BUDGET),
    "ATTN_BODY_TIMEOUT_S": "3600",  # a stalled upload stays held for the whole test
    "ATTN_HEADER_TIMEOUT_S": "3600",  # ... and so does a connection that sends nothing
    "ATTN_LOG_FORMAT": "plain",  # `make run`'s
}


@contextlib.contextmanager
def serving(**extra: str):
    with helpers.serving({**ENV, **extra}) as srv:
        yield srv


@pytest.fixture(scope="module")
def server():
    with serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server():
    with serving(ATTN_API_KEYS=KEY) as srv:
        yield srv


# --- raw HTTP --------------------------------------------------------------------------------------


def first_answer(s: socket.socket) -> tuple[int, dict, bytes]:
    """The first answer on s (an interim 100 Continue included): status, headers, and as much of
    the body as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {data[:200]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(rest) < n:
        chunk = s.recv(65536)
        assert chunk, "closed mid-answer"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


def all_read(srv: helpers.Server) -> None:
    helpers.wait_until(lambda: unread_bytes(srv.port) == 0, timeout=HANG, interval=0.05, what="the server read what was sent")


def stalled_upload(srv: helpers.Server, source: str, total: int, extra: str = "") -> socket.socket:
    """A connection from source that declares a body of LIMIT bytes, sends its head and body bytes
    up to total bytes in all, and stalls."""
    s = connect(srv, source)
    head = post_head(LIMIT, extra=extra)
    s.sendall(head + b" " * (total - len(head)))
    return s


def get(srv: helpers.Server, path: str, source: str | None = None) -> int:
    if source is None:
        return requests.get(srv.url + path, timeout=HANG).status_code
    s = connect(srv, source)
    with s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return first_answer(s)[0]


def worked_ok(srv: helpers.Server, source: str, key: str | None = None) -> tuple[int, str]:
    """The worked example from source: (status, error code or "")."""
    body = json.dumps(WORKED).encode()
    s = connect(srv, source)
    with s:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        s.sendall(post_head(len(body), extra=auth + "Connection: close\r\n") + body)
        status, headers, _ = first_answer(s)
        return status, headers.get("x-error-code", "")


def log_bytes(srv: helpers.Server) -> bytes:
    return Path(srv.proc.log_path).read_bytes()


# --- 1. probes are answered whatever bodies are held -------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize("keys", ["no-keys", "keys"])
def test_probes_are_answered_while_stalled_uploads_hold_the_whole_budget(keys, server, keyed_server):
    """Stalled uploads from two clients hold exactly the worker's ATTN_MAX_INFLIGHT_BYTES (each its
    share, half): /healthz, /readyz and /metrics are answered 200 every time (they carry no body;
    before, the byte their head added to the budget was refused, 503 every other probe), a body
    from a third client is 503 `overloaded`, logged with its path. With API keys set, the uploads
    carry a valid key (without one, they are refused at the head: test_refused_at_the_head)."""
    srv = keyed_server if keys == "keys" else server
    extra = f"Authorization: Bearer {KEY}\r\n" if keys == "keys" else ""
    held = [stalled_upload(srv, source, LIMIT, extra) for source in ("127.0.0.2", "127.0.0.3") for _ in range(2)]
    try:
        all_read(srv)
        for _ in range(10):
            for path in ("/healthz", "/readyz", "/metrics"):
                assert get(srv, path) == 200
        assert worked_ok(srv, "127.0.0.4", KEY if keys == "keys" else None) == (503, "overloaded")
        lines = [line for line in srv.log_text().splitlines() if " 503 " in line and "code=overloaded" in line]
        assert lines and all(" POST /attention " in line for line in lines)
    finally:
        for s in held:
            s.close()
    helpers.wait_until(lambda: worked_ok(srv, "127.0.0.4", KEY if keys == "keys" else None)[0] == 200, timeout=HANG)


@pytest.mark.live
def test_one_clients_stalled_uploads_take_at_most_half_the_budget(server):
    """One client (127.0.0.2) sends stalled uploads worth the whole budget: those past its share
    (half) are 503 `overloaded`, and another client's request is answered 200 (before, the first
    client held all of it and every other client's body was refused)."""
    held = [stalled_upload(server, "127.0.0.2", LIMIT) for _ in range(4)]
    try:
        all_read(server)

        def answered():
            """two of the uploads are answered (two exactly fill the share; any third passes it)"""
            return [s for s in held if select.select([s], [], [], 0)[0]]

        refused = helpers.wait_until(lambda: len(answered()) >= 2 and answered(), timeout=HANG)
        assert len(refused) == 2
        for s in refused:
            status, headers, _ = first_answer(s)
            assert (status, headers["x-error-code"]) == (503, "overloaded")
        assert worked_ok(server, "127.0.0.3") == (200, "")
    finally:
        for s in held:
            s.close()


@pytest.mark.live
def test_an_upload_is_cut_at_its_total_time_however_steadily_it_comes():
    """A body that trickles in steadily, above ATTN_BODY_MIN_RATE, is cut with 408 at
    ATTN_BODY_TOTAL_TIMEOUT_S (before, it was read for as long as it kept the rate: here an hour)."""
    with serving(ATTN_BODY_TOTAL_TIMEOUT_S="2", ATTN_BODY_MIN_RATE="10") as srv:
        s = connect(srv)
        s.sendall(post_head(LIMIT))
        for _ in range(int(HANG / 0.05)):
            ready, _, _ = select.select([s], [], [], 0.05)
            if ready:
                break
            s.sendall(b" " * 100)  # 2,000 bytes/s: 200 times the rate
        status, headers, body = first_answer(s)
        assert (status, headers["x-error-code"]) == (408, "timeout")
        assert "ATTN_BODY_TOTAL_TIMEOUT_S" in json.loads(body)["error"]["message"]
        s.close()


# --- 2. refused at the head ----------------------------------------------------------------------

HEAD_CASES = {
    # name: (path, extra headers, status, code)
    "no-key": ("/attention", "", 401, "unauthorized"),
    "wrong-key": ("/attention", "Authorization: Bearer nope\r\n", 401, "unauthorized"),
    "no-key-percent-encoded-path": ("/attentio%6E", "", 401, "unauthorized"),
    "no-key-v2": ("/v2/models/attention/infer", "", 401, "unauthorized"),
    "deadline-not-a-number": ("/attention", f"Authorization: Bearer {KEY}\r\nX-Deadline-Ms: soon\r\n", 422, "bad_option"),
    "deadline-zero": ("/mha", f"Authorization: Bearer {KEY}\r\nX-Deadline-Ms: 0\r\n", 422, "bad_option"),
    "body-over-the-limit": ("/attention", f"Authorization: Bearer {KEY}\r\n", 413, "body_too_large"),
}


@pytest.mark.live
@pytest.mark.parametrize("case", HEAD_CASES, ids=list(HEAD_CASES))
def test_refused_at_the_head_before_100_continue(keyed_server, case):
    """A compute request the app would refuse from its head alone is answered as soon as the head
    is in: its first answer is the refusal, not 100 Continue, and not a byte of its body is asked
    for (before, 401 and 422 came after the whole body, which the server invited and read)."""
    path, extra, status, code = HEAD_CASES[case]
    length = LIMIT + 1 if code == "body_too_large" else LIMIT
    s = connect(keyed_server)
    with s:
        s.sendall(post_head(length, path, extra + "Expect: 100-continue\r\n"))
        got, headers, body = first_answer(s)
        assert (got, headers["x-error-code"], headers["connection"]) == (status, code, "close")
        assert json.loads(body)["error"]  # in the door's shape (both have an "error")
        if status == 401:
            assert headers["www-authenticate"].startswith("Bearer")
        if code == "bad_option":
            assert headers["x-error-field"] == "X-Deadline-Ms"
        assert read_to_end(s)[0] == b""  # then closed


@pytest.mark.live
def test_refused_at_the_head_without_expect(keyed_server):
    """Without Expect, a request without a key is refused once its head is in, while its body
    has not come (before, the server waited for the whole body first)."""
    s = connect(keyed_server)
    with s:
        s.sendall(post_head(LIMIT) + b"{")
        got, headers, _ = first_answer(s)
        assert (got, headers["x-error-code"]) == (401, "unauthorized")


@pytest.mark.live
def test_uploads_without_a_key_hold_nothing(keyed_server):
    """With API keys set, twice the budget in stalled uploads without a key: each is 401 at its head
    and holds nothing, so a valid request from the same client is answered 200 (before, they were
    read and held until the body timeout, and the budget refused it)."""
    held = [stalled_upload(keyed_server, "127.0.0.2", LIMIT) for _ in range(8)]
    try:
        for s in held:
            status, headers, _ = first_answer(s)
            assert (status, headers["x-error-code"]) == (401, "unauthorized")
        assert worked_ok(keyed_server, "127.0.0.2", KEY) == (200, "")
    finally:
        for s in held:
            s.close()


@pytest.mark.live
def test_a_valid_head_is_invited_and_answered(keyed_server):
    body = json.dumps(WORKED).encode()
    s = connect(keyed_server)
    with s:
        s.sendall(post_head(len(body), extra=f"Authorization: Bearer {KEY}\r\nX-Deadline-Ms: 10000\r\nExpect: 100-continue\r\n"))
        assert first_answer(s)[0] == 100
        s.sendall(body)
        assert first_answer(s)[0] == 200


# --- 3. the exact limit is inside the limit ------------------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize("extra, status, code", [
    (f"Authorization: Bearer {KEY}\r\nX-Deadline-Ms: 0.001\r\n", 504, "deadline"),
    (f"Authorization: Bearer {KEY}\r\nX-Deadline-Ms: soon\r\n", 422, "bad_option"),
    ("Authorization: Bearer nope\r\n", 401, "unauthorized"),
], ids=["504", "422", "401"])  # fmt: skip
def test_a_body_of_exactly_the_limit_keeps_its_refusal(keyed_server, extra, status, code):
    """limit - 1 and limit bytes get the refusal their head asks for; limit + 1 gets 413 (before,
    exactly the limit got a false 413 from the app's read of the body)."""
    for n, expected in ((LIMIT - 1, (status, code)), (LIMIT, (status, code)), (LIMIT + 1, (413, "body_too_large"))):
        s = connect(keyed_server)
        with s:
            s.sendall(post_head(n, extra=extra + "Connection: close\r\n") + b" " * n)
            got, headers, _ = first_answer(s)
            assert (got, headers["x-error-code"]) == expected, n


@pytest.mark.parametrize("status", [401, 422, 503, 504])
def test_in_the_app_a_body_of_exactly_the_limit_keeps_its_refusal(status):
    """The app alone (its hooks, as another worker class or a test client reaches them), with the
    input ended by the server as gunicorn says (wsgi.input_terminated): a refusal that reads the
    body first (422, 503, 504 drain it) keeps its status for a body of exactly the limit, where
    werkzeug's stream refused the read that found its end (413); one byte more is 413 (401 is
    decided first, the body unread)."""
    app = create_app(Settings(warmup=False, max_body_bytes=1000, api_keys=(KEY,), max_inflight=1, max_queue=0))
    headers = {
        401: {},
        422: {"Authorization": f"Bearer {KEY}", "X-Deadline-Ms": "soon"},
        503: {"Authorization": f"Bearer {KEY}"},
        504: {"Authorization": f"Bearer {KEY}", "X-Deadline-Ms": "0.001"},
    }[status]
    held = services(app).admission.enter(0) if status == 503 else None  # the server's one place: the next is 503
    try:
        client = app.test_client()
        for n, expected in ((999, status), (1000, status), (1001, 401 if status == 401 else 413)):
            r = client.post(
                "/attention",
                data=b" " * n,
                content_type="application/json",
                headers=headers,
                environ_overrides={"wsgi.input_terminated": True},
            )
            assert r.status_code == expected, (n, r.get_json())
    finally:
        if held is not None:
            held.release()


# --- 4, 5. logs that cannot be forged, answers that do not echo --------------------------------

FORGED = "1999-12-31T23:59:59.999Z"  # a line's time no test run has


@pytest.mark.live
@pytest.mark.parametrize(
    "raw",
    [
        f"GET\n{FORGED} /x HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        b"\x1b]0;pwned\x07GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        f"POST /attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\n[{FORGED}] [1] [CRITICAL] \x1b[31mforged\x1b[0m, chunked\r\n\r\n".encode(),
        f"POST /attention HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: x\x1b[31m{'y' * 5000}\r\n\r\n{{}}".encode("latin-1"),
    ],
    ids=["newline-in-method", "osc-title-in-method", "critical-line-in-transfer-encoding", "escape-in-expect"],
)
def test_what_a_client_sends_cannot_forge_a_log_line(server, raw):
    """The request is refused (4xx, 501), and the log gains no line it did not write (none starting
    with the forged timestamp) and no raw control byte: every value a line quotes of the client is
    escaped, in the access log and in gunicorn's own messages, and cut."""
    before = len(log_bytes(server))
    s = connect(server)
    with s:
        s.sendall(raw)
        status = first_answer(s)[0]
    assert 400 <= status < 600
    helpers.wait_until(lambda: f" {status} ".encode() in log_bytes(server)[before:], timeout=HANG, what="the answer's line")
    assert get(server, "/healthz") == 200  # a line after: what came before is whole
    new = log_bytes(server)[before:]
    assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]", new), new[:2000]  # C0, DEL, C1 (UTF-8)
    for line in new.split(b"\n"):
        assert not line.lstrip(b"[").startswith(FORGED.encode()[:10]), line
        assert len(line) < 2000


@pytest.mark.live
def test_an_error_echoes_at_most_a_bounded_prefix_of_a_header(server):
    """Transfer-Encoding: 60,000 bytes of a coding, then chunked: 501 whose message quotes a short
    prefix of it (before, the whole value: a 60,424-byte answer and a log line as long)."""
    before = len(log_bytes(server))
    s = connect(server)
    with s:
        s.sendall(f"POST /attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {'x' * 60_000}, chunked\r\n\r\n".encode())
        status, headers, body = first_answer(s)
    assert (status, headers["x-error-code"]) == (501, "not_implemented")
    assert len(body) < 1000 and "xxxx" in json.loads(body)["error"]["message"]
    helpers.wait_until(lambda: b" 501 " in log_bytes(server)[before:], timeout=HANG, what="the 501's line")
    assert max(len(line) for line in log_bytes(server)[before:].split(b"\n")) < 2000


@pytest.mark.parametrize(
    "path, header, status",
    [
        ("/attention", "Content-Encoding", 415),
        ("/attention", "Content-Type", 415),
        ("/v2/models/attention/infer", "Inference-Header-Content-Length", 400),
    ],
)
def test_an_app_error_quotes_at_most_a_bounded_prefix_of_a_header(path, header, status):
    """A header's value the app's refusal names (a Content-Encoding or Content-Type it does not
    take, a binary header length it cannot read), 8,000 characters long: the message quotes a
    short prefix of it (before, all of it)."""
    app = create_app(Settings(warmup=False))
    headers = {"Content-Type": "application/json", header: "x" * 8000}
    r = app.test_client().post(path, data=json.dumps(WORKED), headers=headers)
    error = r.get_json()["error"]  # /v2's shape: {"error": message}
    message = error if isinstance(error, str) else error["message"]
    assert r.status_code == status and "xxxx" in message and len(r.get_data()) < 1000


# --- 6. idle floods, Upgrade ----------------------------------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nX-Slow: "], ids=["nothing", "part-of-a-head"])
def test_a_flood_of_idle_connections_does_not_stop_probes(sent):
    """Four times worker_connections connections that send nothing (or the start of a head, and
    stall) against a header timeout of an hour: /healthz is still answered, each time (before, the
    worker stopped accepting at worker_connections and a probe waited in the listen backlog until
    the header timeout). The connections waiting longest for a head give their places."""
    with serving(GUNICORN_CMD_ARGS="--worker-connections 50") as srv:
        held = []
        try:
            for _ in range(200):
                s = connect(srv)
                if sent:
                    s.sendall(sent)
                held.append(s)
            for _ in range(10):
                assert get(srv, "/healthz") == 200
            assert worked_ok(srv, "127.0.0.1") == (200, "")
        finally:
            for s in held:
                s.close()


@pytest.mark.live
@pytest.mark.parametrize(
    "method, path, headers, body",
    [
        ("GET", "/healthz", {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}, None),
        ("POST", "/attention", {"Connection": "Upgrade", "Upgrade": "websocket"}, WORKED),
        (
            "GET",
            "/healthz",
            {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"},
            None,
        ),
    ],
    ids=["websocket-get", "websocket-post", "h2c"],
)
def test_upgrade_is_ignored_and_the_request_answered(server, method, path, headers, body):
    """The service speaks HTTP/1.1 only: Upgrade is ignored (RFC 9110 section 7.8), the request
    answered as sent, never 101 (before, a WebSocket upgrade on any route was 400 `bad_json`)."""
    r = requests.request(method, server.url + path, headers=headers, json=body, timeout=HANG)
    assert r.status_code == 200, r.text
    assert "upgrade" not in r.headers.get("Connection", "").lower()


# --- the laws under them ------------------------------------------------------------------------


@given(st.text())
def test_a_plain_log_value_is_one_printable_line_whatever_it_holds(text):
    """printable(): what a client sent, in a plain log line, holds no character a terminal acts on
    (so no line break), and is the text itself when it held none."""
    out = printable(text)
    assert out.isprintable()
    assert out == text if text.isprintable() else out.startswith('"') and out.endswith('"')


@given(st.lists(st.one_of(st.text(), st.binary(), st.integers()), max_size=4))
def test_a_message_quoting_a_client_is_one_printable_line(args):
    """ClientBytes: a message's arguments (what gunicorn quotes of a client) come out printable and
    cut, whatever they hold; the message's own text stays as written."""
    record = logging.LogRecord("gunicorn.error", logging.WARNING, __file__, 1, "quoted:" + " %s" * len(args), tuple(args), None)
    assert ClientBytes().filter(record)
    message = record.getMessage()
    assert message.startswith("quoted:") and message.isprintable()
    quoted = 10 * (MAX_QUOTED + 3) + 2  # each character at most "\\U0001xxxx", in quotes
    assert len(message) <= len("quoted:") + sum(1 + (len(str(a)) if isinstance(a, int) else quoted) for a in args)


def test_a_client_is_its_address_or_its_ipv6_64():
    """Conn.peer, the fair share's key: an IPv4 address (mapped into IPv6 or not), an IPv6 /64."""
    assert peer_of(("127.0.0.2", 5)) == peer_of(("::ffff:127.0.0.2", 5, 0, 0)) == "127.0.0.2"
    assert peer_of(("2001:db8::1", 5, 0, 0)) == peer_of(("2001:db8::ffff:1", 6, 0, 0)) != peer_of(("2001:db8:0:1::1", 5, 0, 0))
    assert peer_of("") == ""  # a unix socket's peer
