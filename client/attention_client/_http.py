"""The client's HTTP/1.1: keep-alive sockets, pooled, one per request in flight; http.client's
HTTPResponse parses the answer's status line and headers.

Why not urllib3 (or requests on it): measured side by side (`python -m bench client_wire`, its
figures in bench/README.md), the same wire over urllib3 takes longer, with more of the client's
CPU: it writes each body part with its own sendall and copies an answer through its read(). Here a request's head and its body's
parts (the JSON head, then each tensor's buffer as it lies in memory) go in one gathered send
(sendmsg: no copy, no write per part), and the answer's body is read once, straight into one
preallocated buffer that numpy then views (a body of no declared length: in counted pieces, up
to MAX_ANSWER_BYTES). bench/client_wire.py measures the result. One deadline, the timeout after
the request starts, bounds the whole exchange: every send and receive gets the time left.
"""

from __future__ import annotations

import http.client
import io
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import numpy as np

IOV_MAX = 1024  # buffers per sendmsg (Linux's limit)
Buffer = bytes | bytearray | memoryview  # or anything with the buffer protocol (a numpy array)


# The longest answer body read: the service's largest (weights and out at their limits, as nested
# text) is ~1.7 GB. A Content-Length past it is a server's error, and np.empty of it raised
# MemoryError (1e15) or ValueError (1e30) out of the client instead of an AttentionError.
MAX_ANSWER_BYTES = 2**33
# Heads http.client refuses: a line past 64 KiB, a version it does not speak (and the bare
# HTTPException, "got more than 100 headers"). Not a connection failure (BadStatusLine, of which
# RemoteDisconnected is one, can be a keep-alive connection closed under the request: retried).
UNREADABLE_HEAD = (http.client.LineTooLong, http.client.UnknownProtocol)
UNKNOWN_LENGTH_PIECE = 2**20  # a body of no declared length is read in pieces of this, counted


class TransportError(Exception):
    """No answer: kind "connection_error" (refused, reset, closed, DNS, connect timeout; worth a
    retry), "timeout" (connected, but the request was not sent and its whole answer read within
    the timeout) or "bad_response" (an answer that cannot be read, not retried: a head http.client
    refuses, a Content-Length past MAX_ANSWER_BYTES or more than this process can hold, a body of no
    declared length that runs past MAX_ANSWER_BYTES)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Answer:
    """One HTTP response, read whole. body is a writable memoryview (numpy arrays viewing it
    are writable); see Pool.request's align_at."""

    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: memoryview
    url: str


class Pool:
    """Connections to one base URL (http or https, with an optional path prefix), reused LIFO;
    at most max_idle are kept between requests. Thread-safe: each request takes its own."""

    def __init__(self, base_url: str, timeout: float, max_idle: int, headers: dict[str, str]):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be http://host[:port][/prefix] or https://..., not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.prefix = parts.path.rstrip("/")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._host, self._port = parts.hostname, parts.port or (443 if self._tls else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = host if parts.port is None else f"{host}:{parts.port}"
        for name, value in headers.items():  # the head is written here, not by http.client, which would refuse these
            if not (name.isascii() and name.isprintable() and value.isascii() and value.isprintable()) or ":" in name:
                raise ValueError(
                    f"header {name!r} would break the request head: its name and value must be printable ASCII (no CR, LF or control)"
                )
        self.timeout, self.max_idle, self.headers = timeout, max_idle, dict(headers)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def request(
        self,
        method: str,
        path: str,
        parts: Sequence[Buffer] = (),
        headers: dict[str, str] | None = None,
        align_at: Callable[[http.client.HTTPResponse], int] | None = None,
    ) -> Answer:
        """Send the request (its head and the body's parts in one gathered send, no copy of the
        parts) and read the whole answer. align_at(response) names a body offset that is placed
        on a 64-byte boundary of the buffer (where the tensors start, so numpy views are
        aligned). A reused connection that the server had closed meanwhile is replaced once, at
        once (attention is idempotent)."""
        head = self._head(method, path, parts, headers or {})
        sock, reused = self._take()
        try:
            answer, keep = self._exchange(sock, head, parts, method, path, align_at)
        except TransportError as exc:
            sock.close()
            if not (reused and exc.kind == "connection_error"):
                raise
            sock = self._connect()
            try:
                answer, keep = self._exchange(sock, head, parts, method, path, align_at)
            except TransportError:
                sock.close()
                raise
        self._give(sock) if keep else sock.close()
        return answer

    # --- connections ---

    def _take(self) -> tuple[socket.socket, bool]:
        with self._lock:
            while self._idle:
                sock = self._idle.pop()
                if _still_open(sock):
                    return sock, True
                sock.close()
        return self._connect(), False

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the last segment of a request goes at once
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as exc:  # refused, unreachable, DNS, connect timeout: all worth a retry
            raise TransportError("connection_error", f"cannot connect to {self.base_url}: {exc}") from exc
        return sock

    # --- one exchange ---

    def _head(self, method: str, path: str, parts: Sequence[Buffer], headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
        lines += [f"{key}: {value}" for key, value in {**self.headers, **headers}.items()]
        if parts or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {sum(memoryview(p).nbytes for p in parts)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _exchange(self, sock, head, parts, method, path, align_at) -> tuple[Answer, bool]:
        """One request and its whole answer within self.timeout: the socket's timeout bounds each
        send and receive; the deadline, the exchange (a server that trickles a byte per second
        never let a per-receive timeout fire)."""
        url, deadline = self.base_url + path, time.monotonic() + self.timeout
        try:
            if hasattr(sock, "sendmsg") and not isinstance(sock, ssl.SSLSocket):
                _send_gathered(sock, [head, *parts], deadline)
            else:  # TLS sockets (and Windows') have no sendmsg
                for part in [head, *parts]:
                    sock.sendall(part)
            resp = http.client.HTTPResponse(cast(socket.socket, _ByDeadline(sock, deadline)), method=method)  # it only calls makefile()
            try:
                resp.begin()
                pad = 0 if align_at is None else -align_at(resp) % 64
                body = _read_body(resp, pad)
            except BaseException:
                resp.close()  # its file holds the socket open (sock.close() waits for it) while the error is alive
                raise
        except TimeoutError as exc:
            raise TransportError("timeout", f"{method} {url} got no whole answer within {self.timeout} s.") from exc
        except (OSError, http.client.HTTPException) as exc:  # reset, closed, broken pipe, truncated
            if isinstance(exc, UNREADABLE_HEAD) or type(exc) is http.client.HTTPException:  # answered, unreadably: no retry helps
                raise TransportError("bad_response", f"{method} {url} got an answer whose head cannot be read: {exc!r}") from exc
            raise TransportError("connection_error", f"{method} {url} failed: {exc!r}") from exc
        finally:
            sock.settimeout(self.timeout)  # for its next request, if it is kept
        return Answer(resp.status, resp.reason, resp.headers, body, url), not resp.will_close


class _ByDeadline:
    """The socket as http.client.HTTPResponse reads it (makefile), each receive given the time
    left before the deadline as its timeout: past the deadline, TimeoutError."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._sock.fileno()

    def readinto(self, buf) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer did not end within the timeout")
        self._sock.settimeout(left)
        return self._sock.recv_into(buf)


def _send_gathered(sock: socket.socket, parts: Sequence[Buffer], deadline: float) -> None:
    """sendall of the parts in order, gathered: one sendmsg (writev) for all of them while the
    socket takes them, so the server reads the request in as few pieces as the kernel allows; by
    the deadline (a server reading a byte at a time would otherwise hold the client)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not taken within the timeout")
        sock.settimeout(left)
        sent = sock.sendmsg(views[:IOV_MAX])
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def _read_body(resp: http.client.HTTPResponse, pad: int) -> memoryview:
    """The whole body, into one writable buffer, starting at buf[pad:]: one recv_into after
    another straight into it when the length is known (no intermediate buffers)."""
    if resp.length is None:  # chunked, or up to the close: read in pieces, up to MAX_ANSWER_BYTES
        pieces, total = [], 0  # (resp.read() read a body that never ends without bound)
        while piece := resp.read(UNKNOWN_LENGTH_PIECE):
            total += len(piece)
            if total > MAX_ANSWER_BYTES:
                raise TransportError("bad_response", f"the answer's body (of no declared length) runs past {MAX_ANSWER_BYTES} bytes")
            pieces.append(piece)
        buf = bytearray(pad + total)
        buf[pad:] = b"".join(pieces)
        return memoryview(buf)[pad:]
    if resp.length > MAX_ANSWER_BYTES:
        raise TransportError("bad_response", f"the answer declares Content-Length: {resp.length}, past {MAX_ANSWER_BYTES}")
    try:
        arr = np.empty(pad + resp.length, dtype=np.uint8)  # not zeroed first, unlike bytearray(n): the socket fills it
    except MemoryError:
        raise TransportError("bad_response", f"no memory for an answer of Content-Length: {resp.length}") from None
    view = arr.data[pad:]
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            raise http.client.IncompleteRead(bytes(0), len(view) - got)
        got += n
    resp.close()
    return view


def _still_open(sock: socket.socket) -> bool:
    """An idle keep-alive connection is usable if nothing is readable on it: readable means the
    server closed it (EOF) or sent something unasked."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
