"""The event-loop worker's buffers, in-process (service/transport/worker.py): the body handed to the app
without a copy, and a response written in pieces flowing while the thread still writes."""

from __future__ import annotations

import json
import mmap
import socket
from types import SimpleNamespace

import pytest
from gunicorn.http import errors as perr

from service.transport import BODY_KEY, Refusal
from service.transport.worker import ClientSocket, MemoryBody, SendBudget, parser_refusal, with_body
from service.web.front import error_answer


def body_seen_by_app(body: MemoryBody) -> dict:
    """The environ the worker calls the app with, for a request whose wsgi.input is body."""
    seen = {}
    with_body(lambda environ, start_response: seen.update(environ), {"wsgi.input": body}, None)
    return seen


def test_a_body_is_handed_over_whole():
    body = bytearray(b'{"q": [1, 2, 3]}')
    assert body_seen_by_app(MemoryBody(body))[BODY_KEY] is body  # the received buffer itself: no copy


def test_an_empty_body_is_not():
    assert BODY_KEY not in body_seen_by_app(MemoryBody(bytearray()))


@pytest.mark.parametrize("kind", ["bytearray", "mmap"])
def test_wsgi_input_reads_the_body_in_full_by_pieces(kind):
    data = b'{"q": [1, 2, 3]}\n{"k": 1}\nno newline'
    if kind == "mmap":
        body = mmap.mmap(-1, len(data))
        body[:] = data
    else:
        body = bytearray(data)
    reader = MemoryBody(body)
    into = bytearray(2)
    assert reader.readinto(into) == 2
    got = bytes(into) + reader.read(3) + reader.readline() + reader.readline(4) + b"".join(reader.readlines())
    assert got == data and reader.read() == b""


def test_what_the_app_left_unread_is_dropped():
    reader = MemoryBody(bytearray(b"abcdef"))
    reader.read(2)
    reader.drop()
    assert reader.read() == b"" and reader.readinto(bytearray(4)) == 0


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    budget = SendBudget(1 << 40)
    sock = ClientSocket(a.family, a.type, a.proto, fileno=a.detach(), budget=budget)
    yield sock, b, budget
    sock.close()
    b.close()


def drain(peer: socket.socket) -> bytes:
    """What the peer can read now, without waiting."""
    got = bytearray()
    peer.setblocking(False)
    while True:
        try:
            chunk = peer.recv(1 << 20)
        except BlockingIOError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


def test_what_is_held_goes_out_first_when_the_thread_writes_again(pair):
    """A response written in pieces: what the kernel did not take of the first piece is held; when
    the thread writes the next piece, the held bytes go first as far as the client has read, so
    the client gets data while the thread is still encoding (not only when it ends), in order,
    and the budget counts exactly what is still held."""
    sock, peer, budget = pair
    first, second = bytes(range(256)) * 16384, b"the second piece"  # 4 MiB, far past the socket buffers
    sock.sendall(first)
    held = sock.outbox_bytes
    assert 0 < held < len(first) and budget.used == held
    received = drain(peer)  # the client reads what it can
    sock.sendall(second)
    assert sock.outbox_bytes < held + len(second)  # some of the held bytes went before the second piece was held
    assert budget.used == sock.outbox_bytes
    sock.setblocking(False)  # as the event loop has it
    while sock.outbox:  # the event loop's part: the rest, as the client reads
        received += drain(peer)
        budget.give(sock.send_some())
    received += drain(peer)
    assert received == first + second and budget.used == 0


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (perr.InvalidRequestLine("hello there"), 400, "bad_request"),
        (perr.InvalidHeaderName("Bad Name"), 400, "bad_request"),
        (perr.LimitRequestLine(10_000, 4094), 414, "uri_too_long"),
        (perr.LimitRequestHeaders("limit request headers fields"), 431, "headers_too_large"),
        (perr.UnsupportedTransferCoding("gzip"), 501, "not_implemented"),
        (perr.ExpectationFailed("200-ok"), 417, "expectation_failed"),
        (perr.InvalidResponseHeader("X-Bad", "\r\n"), 500, "internal"),  # the app's fault, not the client's
        (ValueError("a bug"), 500, "internal"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_head_gunicorn_refuses_gets_a_status_and_a_code(exc, status, code):
    """handle_error's statuses are gunicorn's; each has a code, and its answer is JSON."""
    limits = SimpleNamespace(limit_request_line=4094, limit_request_fields=100, limit_request_field_size=8190)
    assert parser_refusal(exc, limits)[:2] == (status, code)
    answer = error_answer(Refusal(status, code, parser_refusal(exc, limits)[2], "POST", "/v2/models/attention/infer"))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()) and b"Content-Type: application/json" in head
    assert set(json.loads(body)) == {"error"} and f"X-Error-Code: {code}".encode() in head


def test_the_app_reads_the_body_under_body_key(client):
    """A body the worker hands over under BODY_KEY is the one the app parses, not wsgi.input's."""
    body = bytearray(b'{"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[2.0, 3.0]]}')
    r = client.post("/attention", data=b"x" * len(body), content_type="application/json", environ_overrides={BODY_KEY: body})
    assert r.status_code == 200, r.json
    assert r.json["out"] == [[2.0, 3.0]]
