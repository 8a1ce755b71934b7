"""The client's HTTP: keep-alive HTTP/1.1 connections of http.client, pooled, one per request in flight.

Why not requests: at T=64 its per-request work (hooks, adapters, cookie jar, header merging) was a
third of the client's end-to-end time, and it reads a body in 10 KiB pieces joined at the end (a
copy of 34 MB at T=1024 with weights). Here a request is sent as its parts (the JSON head, then
each tensor's buffer, never joined) and a response body is read once into one preallocated
bytearray that numpy then views (bench/client_wire.py measures both).
"""

from __future__ import annotations

import http.client
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

Buffer = bytes | bytearray | memoryview  # or anything with the buffer protocol (a numpy array)


class TransportError(Exception):
    """No answer: kind "connection_error" (refused, reset, closed, DNS, connect timeout; worth a
    retry) or "timeout" (connected, but no answer within the timeout)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Answer:
    """One HTTP response, read whole. body is a memoryview of a bytearray (writable, so numpy
    arrays viewing it are writable); see Pool.request's align_at."""

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
        self._factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parts.hostname, parts.port
        self.timeout, self.max_idle, self.headers = timeout, max_idle, dict(headers)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def request(
        self,
        method: str,
        path: str,
        parts: Sequence[Buffer] = (),
        headers: dict[str, str] | None = None,
        align_at: Callable[[http.client.HTTPResponse], int] | None = None,
    ) -> Answer:
        """Send the body's parts in order (the first one with the head, in one send: no Nagle
        wait) and read the whole answer. align_at(response) names a body offset that is placed on
        a 64-byte boundary of the buffer (where the tensors start, so numpy views are aligned).
        A reused connection that the server had closed meanwhile is replaced once, at once
        (attention is idempotent)."""
        conn, reused = self._take()
        try:
            answer, keep = self._exchange(conn, method, path, parts, headers or {}, align_at)
        except TransportError as exc:
            conn.close()
            if not (reused and exc.kind == "connection_error"):
                raise
            conn, reused = self._new(), False
            try:
                answer, keep = self._exchange(conn, method, path, parts, headers or {}, align_at)
            except TransportError:
                conn.close()
                raise
        self._give(conn) if keep else conn.close()
        return answer

    # --- connections ---

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if _still_open(conn):
                    return conn, True
                conn.close()
        return self._new(), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _new(self) -> http.client.HTTPConnection:
        return self._factory(self._host, self._port, timeout=self.timeout)

    # --- one exchange ---

    def _exchange(self, conn, method, path, parts, headers, align_at) -> tuple[Answer, bool]:
        url = self.base_url + path
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:  # refused, unreachable, DNS, connect timeout: all worth a retry
                raise TransportError("connection_error", f"{method} {url}: cannot connect: {exc}") from exc
        try:
            conn.putrequest(method, self.prefix + path, skip_accept_encoding=True)
            for key, value in {**self.headers, **headers}.items():
                conn.putheader(key, value)
            if parts or method in ("POST", "PUT"):
                conn.putheader("Content-Length", str(sum(memoryview(p).nbytes for p in parts)))
            first = bytes(parts[0]) if parts and not isinstance(parts[0], bytes) else (parts[0] if parts else None)
            conn.endheaders(first)  # bytes are sent with the head in one send
            for part in parts[1:]:
                conn.sock.sendall(part)  # buffers, never joined: no copy of the tensors
            resp = conn.getresponse()
            pad = 0 if align_at is None else -align_at(resp) % 64
            body = _read_body(resp, pad)
        except TimeoutError as exc:
            raise TransportError("timeout", f"{method} {url} got no answer within {self.timeout} s.") from exc
        except (OSError, http.client.HTTPException) as exc:  # reset, closed, broken pipe, truncated
            raise TransportError("connection_error", f"{method} {url} failed: {exc!r}") from exc
        answer = Answer(resp.status, resp.reason, resp.headers, body, url)
        return answer, not resp.will_close


def _read_body(resp: http.client.HTTPResponse, pad: int) -> memoryview:
    """The whole body, into one bytearray, starting at buf[pad:]: one recv_into after another
    straight into it when the length is known (no intermediate buffers)."""
    if resp.length is None:  # chunked, or up to the close
        data = resp.read()
        buf = bytearray(pad + len(data))
        buf[pad:] = data
        return memoryview(buf)[pad:]
    buf = bytearray(pad + resp.length)
    view = memoryview(buf)[pad:]
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            raise http.client.IncompleteRead(bytes(0), len(view) - got)
        got += n
    resp.close()
    return view


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection is usable if nothing is readable on it: readable means the
    server closed it (EOF) or sent something unasked."""
    if conn.sock is None:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
