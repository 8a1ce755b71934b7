"""A gunicorn worker whose threads never wait for a client's request, and wait for its reading only
past the send budget (below): the defence against slow and stalled clients, in pure Python, so
that `make run`, the container, compose and Kubernetes all have it.

gunicorn's gthread worker hands a connection to a thread as soon as its first bytes arrive; the
thread then reads the rest of the request with a blocking socket and no deadline, so 100 uploads
that stall after their first bytes hold 100 threads, and a client that stops reading its response
holds a thread (and, until it is sent, the request's compute slot) for ever. This worker does what
a buffering reverse proxy (nginx: client_header_timeout, client_body_timeout, send_timeout,
proxy_request_buffering, proxy_buffering) does in front of gunicorn, inside the worker's event loop:

- Receive: the event loop reads every request, head and body, without blocking, under deadlines:
  the head within ATTN_HEADER_TIMEOUT_S, the body within ATTN_BODY_TIMEOUT_S plus one second per
  ATTN_BODY_MIN_RATE bytes received (Apache's mod_reqtimeout rule) and ATTN_BODY_TOTAL_TIMEOUT_S
  in all. Past a deadline the client gets 408 `timeout` and the connection closes. Once a head is
  in, what the app refuses from it alone (hooks.check_head: no valid key, an unreadable deadline)
  is answered before a byte of the body is read or 100 Continue sent, and the connection closes.
  A request whose framing cannot be trusted gets 400
  `bad_framing` (a bad Content-Length or chunk, both Content-Length and Transfer-Encoding), an
  unknown transfer coding 501 `not_implemented`, and a client that closes its side before its
  request is complete 400 `incomplete_request` (it can still read the answer); each then closes.
  Only a complete request reaches a thread, already in memory; the thread never reads the socket.
  The body is handed to the app in the buffer it was received into, not copied, under the environ
  key BODY_KEY (a large one is read into a mapping of its own, BODY_BUFFER_AFTER).
  A body over ATTN_MAX_BODY_BYTES gets 413 from here; the bytes of requests being read count
  against ATTN_MAX_INFLIGHT_BYTES (503 overloaded to the upload that goes past it, or past its
  client's share, half; never to a request without a body: see _over_budget).
- Send: a thread writes what the socket takes at once; what a slow reader leaves is held in memory
  and the thread goes on: the response is finished (its compute slot freed) and the event loop
  sends the rest as the client reads. A client that reads nothing for ATTN_SEND_TIMEOUT_S is
  dropped. While more than ATTN_SEND_BUFFER_BYTES are held, new POST requests get 503
  overloaded from here, and a thread still encoding an answer holds at most HELD_PAST_BUDGET of
  it, waiting for its reader beyond that (memory stays bounded by the budget, not by the size of
  the answers being written; a thread waits to send only then).
- Idle: a new connection must send a request head within ATTN_HEADER_TIMEOUT_S; a kept-alive
  one is closed after gunicorn's keepalive seconds. Idle connections cost a file descriptor each
  and no thread; at worker_connections, the one waiting longest for a head gives its place to a
  new one (_make_room), so that connections sending nothing cannot stop the worker accepting.
- Placement: a POST reaching this worker while it holds PLACEMENT_MARGIN more admitted requests
  than its least busy sibling (hooks.margin()) is answered with Connection: close, so that
  keep-alive clients the kernel happened to put on one worker spread over all of them.

These answers, and those to heads gunicorn's parser refuses (handle_error), are made by the app
(hooks.refuse: its error shapes, its counts, its access log): the worker is handed its hooks
before it serves (service.transport). Everything else (WSGI, keep-alive, graceful stop,
max_requests) is gunicorn's. Not for TLS or HTTP/2 (the service serves plain HTTP/1.1 behind an
ingress).

Of gthread it keeps the event loop (run, the poller, accept), the thread pool and the way back from
it (enqueue_req, finish_request), handle_request (the WSGI call, keep-alive, max_requests), and
gunicorn's request parser, which parses the head again in the thread, fed from memory
(BufferedUnreader); a body of known length is then given to its request in memory (MemoryBody).
Those are gunicorn's insides, not its API: gunicorn is pinned exactly (requirements.txt), and
tests/test_worker_io.py, test_slow_clients.py and test_lifecycle.py say when a new version
breaks them."""

from __future__ import annotations

import errno
import ipaddress
import logging
import mmap
import resource
import select
import selectors
import socket
import threading
import time
from collections import deque
from functools import partial
from typing import Any

from gunicorn import http as gunicorn_http
from gunicorn.http.unreader import Unreader
from gunicorn.workers.gthread import ThreadWorker

from service.config import Settings

from . import BODY_KEY, SENT_KEY, STARTED_KEY, Hooks, Refusal, clip, framing

RECV_BYTES = 256 * 1024  # one read from a client in the event loop
# A body of known length is read straight into a buffer of its own (recv_into) once this much of it
# has arrived and at least as much is still to come: appended to the connection's buffer instead,
# each byte is received into a new bytes object and copied once more. The buffer is an anonymous
# mapping, not a bytearray: bytearray(n) writes its n bytes, a mapping's pages are touched only by
# the bytes that arrive, so a client that declares a length and stalls holds what it sent (plus at
# most one huge page), never what it declared; and it is page-aligned, so are the body's tensors.
BODY_BUFFER_AFTER = 2 * 2**20
MAX_HEAD_BYTES = 64 * 1024  # request line and headers (431 past it)
LINGER_S = 2.0  # after an error answer: how long the client may still send before the close
LINGER_BYTES = 1 << 20  # ... and how much of it is read and thrown away
SWEEP_S = 0.25  # how often deadlines are checked (run() wakes at least once a second)
STOP_IDLE_S = 2.0  # a graceful stop closes idle connections after this, as gthread does its kept-alive ones
# Connection placement: a keep-alive connection stays with the worker that accepted it, so clients
# that all landed on one worker queue there while its sibling idles. A POST that arrives while this
# worker holds this many more admitted requests than its least busy sibling is answered with
# Connection: close; the client's next connection goes to whichever worker accepts it first, most
# often the idle one (the busy one's event loop waits for the GIL behind its computing threads).
# 3, not 2: at 2, workers one request either side of an even split keep passing a connection back
# and forth, each pass a close and a reconnect; 3 still evens out connections that all opened on
# one worker.
PLACEMENT_MARGIN = 3
# What one connection may hold for its reader once the worker's send budget (ATTN_SEND_BUFFER_BYTES)
# is spent: about one piece of a streamed answer (a nested block of the wire's chunked encoder).
HELD_PAST_BUDGET = 8 * 2**20
FILE_LIMIT = 65536  # the worker raises its soft open-files limit up to this (one per connection)
QUOTE_CHARS = 128  # what an answer quotes of a client's bytes (a header's value, a request line), at most
Buffer = bytes | bytearray | mmap.mmap | memoryview


def parser_refusal(exc: Exception, limits) -> tuple[int, str, str]:
    """(status, code, message) for a head gunicorn's parser refused with exc (its handle_error's
    statuses), or for a failure past the app (500); limits: gunicorn's config."""
    perr = gunicorn_http.errors
    if isinstance(exc, (perr.InvalidResponseHeader, perr.InvalidResponseHeaderName, perr.ConfigurationProblem)):
        pass  # the application's fault, not the client's: a 500 as below
    elif isinstance(exc, perr.LimitRequestLine):
        return 414, "uri_too_long", f"The request line is longer than {limits.limit_request_line} bytes; send options in the body."
    elif isinstance(exc, perr.LimitRequestHeaders):
        message = (
            f"The request has more than {limits.limit_request_fields} headers or one longer than "
            f"{limits.limit_request_field_size} bytes ({clip(str(exc), QUOTE_CHARS)})."
        )
        return 431, "headers_too_large", message
    elif isinstance(exc, perr.UnsupportedTransferCoding):
        return 501, "not_implemented", f"The server does not decode this transfer coding: {clip(str(exc), QUOTE_CHARS)}."
    elif isinstance(exc, perr.ForbiddenProxyRequest):
        return 403, "forbidden", "The request came through a proxy this server does not trust."
    elif isinstance(exc, perr.ExpectationFailed):
        return 417, "expectation_failed", f"The server cannot meet the Expect header: {clip(str(exc), QUOTE_CHARS)}."
    elif isinstance(exc, perr.ParseException):
        return 400, "bad_request", f"The request line or headers are not valid HTTP/1.1: {clip(str(exc), QUOTE_CHARS)}."
    return 500, "internal", "The server failed on this request; it has been logged."


class SendBudget:
    """Bytes of responses held for slow readers, shared by a worker's threads and its event loop.

    A soft limit: a response being written is always held (its request was admitted; admission
    bounds how many there are), but while the limit is passed no new compute request is let in."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self.used >= self.limit

    def charge(self, n: int) -> None:
        with self._lock:
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class ClientSocket(socket.socket):
    """A client connection whose sendall() never blocks: what the kernel does not take at once
    goes to `outbox`, which the event loop sends as the client reads."""

    def __init__(self, *args, budget: SendBudget, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = budget
        self.outbox: deque[memoryview] = deque()
        self.outbox_bytes = 0

    def sendall(self, data, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        timeout = self.gettimeout()
        self.setblocking(False)
        try:
            # What is held goes first, as far as the kernel takes it now: a response written in
            # pieces (a large tensor's text, encoded chunk by chunk) then flows to a client that
            # reads while the thread encodes the rest, rather than waiting for the thread to end.
            if self.outbox:
                self.budget.give(self.send_some())
            if not self.outbox:
                view = view[self.send(view, flags) :]
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            self.settimeout(timeout)
        if view:
            self.queue(view if isinstance(data, bytes) else bytes(view))  # bytes cannot change meanwhile
        if self.budget.full and self.outbox_bytes > HELD_PAST_BUDGET:
            self._wait_for_reader(timeout)

    def _wait_for_reader(self, timeout: float | None) -> None:
        """Once the worker holds its send budget, the thread holds back what it has not encoded
        yet: it sends (waiting for the socket, up to timeout without progress: TimeoutError, the
        client is dropped) until this connection holds HELD_PAST_BUDGET at most. Without it, a
        client that reads nothing has the whole answer held (nested text many times the size of
        its request) until the send timeout. It waits as a thread only (the compute slot went back
        when the response was built), and only while the budget is spent, when the event loop
        lets no new POST in."""
        writable = select.poll()  # poll, not select: a worker's connections may number past FD_SETSIZE
        writable.register(self, select.POLLOUT)
        while self.outbox_bytes > HELD_PAST_BUDGET:
            if not writable.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError(f"the client read nothing for {timeout} s")
            self.setblocking(False)
            try:
                self.budget.give(self.send_some())
            finally:
                self.settimeout(timeout)

    def queue(self, data) -> None:
        """Hold data for the event loop to send, charged to the budget until it is sent or dropped."""
        view = memoryview(data).cast("B")
        self.budget.charge(len(view))
        self.outbox.append(view)
        self.outbox_bytes += len(view)

    def send_some(self) -> int:
        """Event loop, non-blocking socket: send what the kernel takes from the outbox; bytes sent."""
        sent = 0
        while self.outbox:
            head = self.outbox[0]
            try:
                n = self.send(head)
            except (BlockingIOError, InterruptedError):
                break
            sent += n
            if n < len(head):
                self.outbox[0] = head[n:]
                break
            self.outbox.popleft()
        self.outbox_bytes -= sent
        return sent

    def drop_outbox(self) -> int:
        """Forget what was not sent; the budget bytes to give back."""
        n, self.outbox_bytes = self.outbox_bytes, 0
        self.outbox.clear()
        return n


class BufferedUnreader(Unreader):
    """gunicorn's parser reads the request from memory (what the event loop received), never from
    the socket: at the end of the buffer it sees the end of the stream."""

    def __init__(self, segments: list[Buffer]):
        super().__init__()
        self.segments = deque(s for s in segments if len(s))

    def chunk(self, size_hint: int | None = None) -> bytes:
        if not self.segments:
            return b""
        head = self.segments[0]
        n = min(len(head), max(size_hint or 0, 64 * 1024), 1 << 20)
        out = bytes(head[:n])
        if n == len(head):
            self.segments.popleft()
        else:
            self.segments[0] = head[n:]
        return out


class MemoryBody:
    """wsgi.input for a request body of known length that is already in memory: one buffer (the
    event loop's receive buffer, or a large body's own mapping, which nothing else holds), read as
    gunicorn's Body is, once copied into the reader's buffer by readinto(). gunicorn's own Body over
    the unreader copies a body several times on its way to the app (BytesIO buffers at each layer,
    slices of them). `whole` is the buffer itself (None for an empty body): the app gets it, not
    copied, under BODY_KEY, and parses the bytes where the socket put them."""

    failed = False  # gunicorn's parser asks: reading never fails here

    def __init__(self, body: bytearray | mmap.mmap, started: float = 0.0):
        self.whole = body if len(body) else None
        self.body, self.pos = body, 0
        self.started = started  # time.monotonic() of the request's first byte (STARTED_KEY)
        self.when_written: list = []  # callbacks for when the response has been written (SENT_KEY), each called once

    def drop(self) -> None:
        """Forget what was not read: nothing is left for gunicorn's finish_body to read through."""
        self.pos = len(self.body)

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = min(len(out), len(self.body) - self.pos)
        with memoryview(self.body) as view:
            out[:n] = view[self.pos : self.pos + n]
        self.pos += n
        return n

    def read(self, size: int | None = None) -> bytes:
        left = len(self.body) - self.pos
        n = left if size is None or size < 0 else min(size, left)
        with memoryview(self.body) as view:
            out = bytes(view[self.pos : self.pos + n])
        self.pos += n
        return out

    def readline(self, size: int | None = None) -> bytes:
        left = len(self.body) - self.pos
        limit = left if size is None or size < 0 else min(size, left)
        end = self.body.find(b"\n", self.pos, self.pos + limit)
        return self.read(limit if end < 0 else end + 1 - self.pos)

    def readlines(self, size: int | None = None) -> list[bytes]:
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")


class Conn:
    """A client connection and where it is: reading a request, in a thread, writing, closing. sock,
    client and server are what gthread's handle_request reads of a connection."""

    READING, IN_THREAD, WRITING, CLOSING = "reading", "in_thread", "writing", "closing"

    def __init__(self, sock: ClientSocket, client, server):
        self.sock, self.client, self.server = sock, client, server
        self.peer = peer_of(client)  # the client whose share of the bytes being read this connection's count against
        self.parser: Any = None  # gunicorn's parser of the request in a thread
        # Where a request is read: set by FrontWorker._start_request, before each request.
        self.state = self.READING
        self.buf = bytearray()
        self.body: mmap.mmap | None = None  # a large body's own buffer (BODY_BUFFER_AFTER); buf then holds the head
        self.body_got = 0  # bytes of it received
        self.scanner: framing.RequestScanner  # set by _start_request, before each request
        self.body_started = 0.0
        self.deadline = 0.0
        self.keep = False  # after the response: keep-alive (True) or close
        self.registered = False
        self.lingered = 0
        self.pending = b""  # bytes received after the request in a thread (pipelined)
        self.dropped = False  # the thread gave up on a client that did not read
        self.started = 0.0  # monotonic time of the request's first byte (an early answer's duration)
        self.head: bytes | None = None  # the request head handed to a thread, while it is there
        self.known_body: bytearray | mmap.mmap | None = None  # ... and its body, if of known length
        self.when_written: list = []  # the app's callbacks for when this response has been written (SENT_KEY)


def peer_of(client) -> str:
    """The client a connection's request bytes are counted against, for the fair share of the
    worker's budget: its IP address, an IPv6 one's /64 (what one host is usually given); "" for a
    unix socket."""
    if not isinstance(client, tuple) or not client:
        return ""
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return str(client[0])
    if address.version == 4:
        return str(address)
    if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d, an IPv4 client on a dual-stack socket
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/64", strict=False))


def _call_written(conn: Conn, written: bool) -> None:
    """Call conn's when-written callbacks (SENT_KEY) once each, with written."""
    callbacks, conn.when_written = conn.when_written, []
    for callback in callbacks:
        try:
            callback(written)
        except Exception:  # the app's: never the event loop's end
            logging.getLogger("gunicorn.error").exception("a when-written callback failed")


def with_body(app, environ: dict, start_response):
    """Call the WSGI app with the body, read into memory as one buffer, under BODY_KEY."""
    body = environ.get("wsgi.input")
    if type(body) is MemoryBody and body.whole is not None:
        environ[BODY_KEY] = body.whole
        environ[STARTED_KEY] = body.started
        environ[SENT_KEY] = body.when_written.append
    return app(environ, start_response)


class FrontWorker(ThreadWorker):
    """gthread, with the reading and the slow writing moved from the threads to the event loop."""

    hooks: Hooks  # the app's side, set before run() (post_worker_init; service.transport)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = Settings.from_env()
        self.budget = SendBudget(self.settings.send_buffer_bytes)
        self.conns: dict[Conn, None] = {}
        self.stopping_at: float | None = None
        self.next_sweep = 0.0
        self.received = 0  # bytes of requests being read, in all connections' buffers
        self.by_peer: dict[str, int] = {}  # ... of them, each client's (Conn.peer; only those holding some)
        # A client may hold at most this of them: half the budget, or one body of the largest size.
        self.peer_share = max(self.settings.max_inflight_bytes // 2, self.settings.max_body_bytes)
        # Connections waiting for a request head (new, kept-alive, or part of a head in), longest first:
        # at worker_connections, the first gives its place to a new connection (accept).
        self.heads: dict[Conn, None] = {}

    def init_process(self):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = FILE_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FILE_LIMIT)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        super().init_process()

    def run(self):
        """gthread's loop, once the app's hooks are in place; the app is called with the body under
        BODY_KEY."""
        if getattr(self, "hooks", None) is None:
            raise RuntimeError("FrontWorker has no hooks: set worker.hooks in post_worker_init (service.transport)")
        self.wsgi = partial(with_body, self.wsgi)
        super().run()

    # -- connections in and out -------------------------------------------------------------------

    def accept(self, listener):
        try:
            raw, addr = listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: stop accepting until a connection closes (run() re-enables).
                self.log.warning("cannot accept a connection: %s", e)
                self.worker_connections = max(1, self.nr_conns)
                return
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        sock = ClientSocket(raw.family, raw.type, raw.proto, fileno=raw.detach(), budget=self.budget)
        self.nr_conns += 1
        conn = Conn(sock, addr, listener.getsockname())
        self.conns[conn] = None
        self._start_request(conn, b"", new=True)
        if self.nr_conns >= self.worker_connections:
            self._make_room(conn)

    def _make_room(self, new: Conn) -> None:
        """All worker_connections are open: close the one that has waited longest for a request head
        (silent, or a head begun and not finished), so that the worker goes on accepting. Without it,
        connections that send nothing (or a head's first bytes) hold every place until the header
        timeout, and a health probe waits in the listen backlog meanwhile; as nginx closes kept-alive
        connections when its worker_connections run out, a connection that has sent no whole request
        gives its place. A busy connection (a body being read, a request in a thread, an answer
        being written) is never closed for room."""
        oldest = next(iter(self.heads), None)
        if oldest is None or oldest is new:
            return
        self.log.debug("%s closed for room: %s connections open, its request head not in", oldest.client, self.nr_conns)
        self._close(oldest)

    def _watch(self, conn: Conn, events: int, callback) -> None:
        if conn.registered:
            self.poller.modify(conn.sock, events, partial(callback, conn))
        else:
            self.poller.register(conn.sock, events, partial(callback, conn))
            conn.registered = True

    def _unwatch(self, conn: Conn) -> None:
        if conn.registered:
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.registered = False

    def _close(self, conn: Conn) -> None:
        if conn not in self.conns:
            return
        del self.conns[conn]
        _call_written(conn, False)  # dropped: its response was never all written
        self._release_buf(conn)
        self._unwatch(conn)
        self.budget.give(conn.sock.drop_outbox())
        self.nr_conns -= 1
        try:
            conn.sock.close()
        except OSError:
            pass
        if self.worker_connections < self.cfg.worker_connections:  # after EMFILE: accept again
            self.worker_connections = self.cfg.worker_connections

    # -- receiving --------------------------------------------------------------------------------

    def _count(self, conn: Conn, n: int) -> None:
        """n more bytes (or fewer, n < 0) of conn's request held."""
        self.received += n
        held = self.by_peer.get(conn.peer, 0) + n
        if held:
            self.by_peer[conn.peer] = held
        else:
            self.by_peer.pop(conn.peer, None)

    def _release_buf(self, conn: Conn) -> None:
        self._count(conn, -(len(conn.buf) + conn.body_got))
        conn.buf, conn.body, conn.body_got = bytearray(), None, 0
        self.heads.pop(conn, None)  # it no longer waits for a head: it has one, or is answered or closed

    def _start_request(self, conn: Conn, pending: bytes, new: bool = False) -> None:
        """Wait for (the rest of) the next request; pending is what already arrived of it."""
        now = time.monotonic()
        conn.state = Conn.READING
        conn.buf = bytearray(pending)
        conn.started = now
        self._count(conn, len(pending))
        self.heads[conn] = None
        conn.scanner = framing.RequestScanner(MAX_HEAD_BYTES, self.settings.max_body_bytes)
        conn.sock.setblocking(False)
        # A new connection has the header timeout to send its head; a kept-alive one, the keepalive.
        idle = self.settings.header_timeout_s if new or pending else self.cfg.keepalive
        conn.deadline = now + idle
        self._watch(conn, selectors.EVENT_READ, self._on_readable)
        if pending:
            self._advance(conn)

    def _on_readable(self, conn: Conn, _fileobj) -> None:
        if conn.body is not None:
            self._on_body_readable(conn, conn.body)
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._closed_early(conn)
            return
        if not conn.buf:
            conn.started = time.monotonic()
            conn.deadline = conn.started + self.settings.header_timeout_s
        # Appended as it comes, never a bytearray of the Content-Length a client declares: that
        # would be as many bytes of memory at once (bytearray(n) zeroes them), held by a client
        # that sends a head and stalls (a few hundred KB each, declaring their limit, would hold
        # as many limits).
        # A large body moves to a mapping of its length (_body_buffer, past BODY_BUFFER_AFTER),
        # whose pages only arriving bytes touch. What a connection holds is what it sent, counted here.
        conn.buf += data
        self._received(conn, len(data))

    def _on_body_readable(self, conn: Conn, body: mmap.mmap) -> None:
        """The rest of a large body, straight into its own buffer (never past its end: what follows
        it, pipelined, is read as the next request)."""
        try:
            with memoryview(body) as view:
                n = conn.sock.recv_into(view[conn.body_got :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not n:
            self._closed_early(conn)
            return
        conn.body_got += n
        self._received(conn, n)

    def _closed_early(self, conn: Conn) -> None:
        """The client closed, or half-closed, its side before a complete request: where part of one
        arrived it is never computed, and the client is told why; else the connection just closes."""
        if not conn.buf:
            self._close(conn)
            return
        what = "head" if conn.scanner.head_end is None else "body"
        self._answer(
            conn, 400, "incomplete_request", f"The client closed its side of the connection before the request {what} was complete."
        )

    def _received(self, conn: Conn, n: int) -> None:
        """n more bytes of conn's request have arrived: count them, then act on them."""
        self._count(conn, n)
        self._advance(conn)

    def _over_budget(self, conn: Conn) -> str | None:
        """Why the worker holds too many request bytes for one more of a body (the message of the
        503), or None. Bodies being read count against the worker's memory budget like admitted
        ones: a client must send the bytes to hold them, and the body that goes past it is
        refused. A request without a body never is (a probe is answered whatever bodies are held:
        heads are bounded each by MAX_HEAD_BYTES and the header timeout, and in number by
        worker_connections), and one client (Conn.peer) holds at most peer_share, so that its
        stalled uploads leave room for others'."""
        budget = self.settings.max_inflight_bytes
        if self.received > budget:
            return f"The server is reading more request bytes than it admits (ATTN_MAX_INFLIGHT_BYTES={budget}); retry shortly."
        if self.by_peer.get(conn.peer, 0) > self.peer_share:
            return (
                f"This client's uploads being read hold more than its share of the server's bytes ({self.peer_share} of "
                f"ATTN_MAX_INFLIGHT_BYTES={budget}); retry once they are sent."
            )
        return None

    def _advance(self, conn: Conn) -> None:
        """Act on what the scanner says of the bytes received so far."""
        scanner = conn.scanner
        head_known = scanner.head_end is not None
        if conn.body is not None:  # buf is the head; the body is in its own buffer
            done = conn.body_got == len(conn.body)
            verdict = framing.Verdict(framing.COMPLETE, len(conn.buf)) if done else framing.Verdict(framing.NEED_MORE)
        else:
            verdict = scanner.scan(conn.buf)
        if verdict.kind == framing.MALFORMED:  # never guessed at, never handed to a thread
            self._answer(conn, 400, "bad_framing", f"Where the request ends cannot be told: {verdict.reason} (RFC 9112 section 6).")
            return
        if verdict.kind == framing.NOT_IMPLEMENTED:
            self._answer(conn, 501, "not_implemented", f"The server does not decode {verdict.reason} (RFC 9112 section 6.1).")
            return
        if verdict.kind == framing.HEAD_TOO_LARGE:
            self._answer(conn, 431, "headers_too_large", f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes.")
            return
        if verdict.kind == framing.BODY_TOO_LARGE:
            limit = self.settings.max_body_bytes  # the app's own 413 says the same (errors.body_too_large)
            self._answer(conn, 413, "body_too_large", f"The request body is larger than the limit of {limit} bytes (ATTN_MAX_BODY_BYTES).")
            return
        if not head_known and scanner.head_end is not None:  # the head has just arrived whole
            self.heads.pop(conn, None)
            # What the app refuses from the head (no valid key, a deadline it cannot read) is
            # refused before a byte of the body is read, and before 100 Continue invites it.
            refusal = self.hooks.check_head(scanner.method, scanner.path, bytes(conn.buf[: scanner.head_end]))
            if refusal is not None:
                self._answer(conn, refusal.status, refusal.code, refusal.message, refusal.field, refusal.headers)
                return
        if scanner.head_end is not None and scanner.body_length != 0 and (why := self._over_budget(conn)):
            self._answer(conn, 503, "overloaded", why)
            return
        if verdict.kind == framing.NEED_MORE:
            if not head_known and conn.scanner.head_end is not None:
                conn.body_started = time.monotonic()
                if conn.scanner.expects_continue:  # the client waits for this before its body
                    self._send_now(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
            if (head_end := conn.scanner.head_end) is not None:
                received = conn.scanner.body_received(len(conn.buf)) + conn.body_got
                length = conn.scanner.body_length
                if conn.body is None and length is not None and BODY_BUFFER_AFTER <= received <= length - BODY_BUFFER_AFTER:
                    self._body_buffer(conn, head_end, length)
                settings = self.settings
                by_rate = settings.body_timeout_s + received / settings.body_min_rate
                conn.deadline = conn.body_started + min(by_rate, settings.body_total_timeout_s)
        elif verdict.kind == framing.COMPLETE:
            if self.budget.full and conn.scanner.method == "POST":
                limit = self.settings.send_buffer_bytes
                self._answer(
                    conn,
                    503,
                    "overloaded",
                    f"The server holds more response bytes that clients have not read than it allows (ATTN_SEND_BUFFER_BYTES={limit}); retry shortly.",
                )
                return
            self._dispatch(conn, verdict.end)

    @staticmethod
    def _body_buffer(conn: Conn, head_end: int, length: int) -> None:
        """Move the body received so far (from head_end in buf) into a buffer of the body's length
        (BODY_BUFFER_AFTER), where the rest will be read; buf keeps the head."""
        body = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)  # anonymous: pages are touched as bytes arrive
        if hasattr(mmap, "MADV_HUGEPAGE"):
            body.madvise(mmap.MADV_HUGEPAGE)  # faulted in 2 MiB pages, as malloc's blocks (service/__main__.py)
        with memoryview(conn.buf) as view:
            got = len(view) - head_end
            body[:got] = view[head_end:]
        del conn.buf[head_end:]
        conn.body, conn.body_got = body, got

    def _send_now(self, conn: Conn, data: bytes) -> None:
        """A few bytes, sent at once (non-blocking socket): the socket buffer has room for them."""
        try:
            conn.sock.send(data)
        except OSError:
            pass

    def _dispatch(self, conn: Conn, end: int) -> None:
        """Hand the request to a thread: its head and body (buf[:end], or buf the head and
        conn.body the body, read into its own buffer); what follows end in buf is the next request's."""
        self._unwatch(conn)
        scanner, buf = conn.scanner, conn.buf
        head_end = end if scanner.head_end is None else scanner.head_end
        conn.pending = bytes(buf[end:])
        # gunicorn's parser reads the head alone (a buffer running into the body would have up to
        # 64 KB of it copied through the parser's buffers and back); a body of known length
        # (framed by the scanner) is the received buffer itself, handed to the app as MemoryBody,
        # and only a chunked one is decoded by gunicorn's reader, from memory.
        head = bytes(buf[:head_end])
        conn.head = head  # kept while in the thread: the request id of an answer handle_error makes
        if scanner.expect_line is not None and scanner.head_end is not None:
            # The 100 Continue has been sent: hide the Expect header so gunicorn does not send another.
            start, stop = scanner.expect_line
            head = head[:start] + head[stop:]
        body: bytearray | mmap.mmap | None = conn.body  # a large body's own buffer, or None: the body follows the head in buf
        self._release_buf(conn)
        if body is None:
            del buf[end:]  # what follows the request (pipelined), copied to pending above
            del buf[:head_end]  # in place: a bytearray drops its first bytes by moving its start, no copy
            body = buf
        chunked = scanner.body_length is None
        conn.known_body = None if chunked else body
        conn.parser = gunicorn_http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader = BufferedUnreader([head, body] if chunked else [head])
        conn.state = Conn.IN_THREAD
        self.enqueue_req(conn)

    def _answer(self, conn: Conn, status: int, code: str, message: str, field: str | None = None, headers: tuple = ()) -> None:
        """Answer with an error from here (the app shapes, counts and logs it), and close."""
        scanner = conn.scanner
        self.log.info("%s %s: %s (%s)", conn.client, status, code, message)
        head = bytes(conn.buf[: scanner.head_end]) if scanner.head_end is not None else None
        received = len(conn.buf) + conn.body_got
        refusal = Refusal(status, code, message, scanner.method, scanner.path, head, conn.started, received, field, headers)
        answer = self.hooks.refuse(refusal)
        self._release_buf(conn)
        conn.keep = False
        conn.sock.queue(answer)
        self._write(conn)

    # -- in a thread ------------------------------------------------------------------------------

    def handle(self, conn: Conn):
        """One complete request, already in memory. Runs in a thread; returns keep-alive or not."""
        req = None
        try:
            conn.sock.settimeout(self.settings.send_timeout_s)
            req = next(conn.parser)
            if not req:
                return False
            if req.method == "POST" and self._crowded():
                req.force_close()  # this answer says Connection: close: the client's next connection may land elsewhere
            if conn.known_body is not None:
                req.body = MemoryBody(conn.known_body, conn.started)
            keep = self.handle_request(req, conn)
            if isinstance(req.body, MemoryBody):
                conn.when_written, req.body.when_written = req.body.when_written, []  # the event loop's, once the rest is written
                req.body.drop()  # what the app left unread is in memory: not read through 8 KB at a time by finish_body
            return bool(keep and conn.parser.finish_body())
        except TimeoutError:
            conn.dropped = True  # part of a response is lost: nothing more may be sent on it
            self.log.info("%s read nothing of its response for %s s: dropped", conn.client, self.settings.send_timeout_s)
        except (gunicorn_http.errors.NoMoreData, StopIteration):
            pass
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                self.log.exception("Socket error processing request.")
        except Exception as e:
            self.handle_error(req, conn.sock, conn.client, e, conn)
        finally:
            if req is not None and isinstance(req.body, MemoryBody):  # a response abandoned before the event loop got it
                for callback in req.body.when_written:
                    callback(False)
                req.body.when_written = []
        return False

    def handle_error(self, req, client, addr, exc, conn: Conn | None = None):
        """The answer to a head gunicorn's parser refuses (a bad request line or header, a line or
        headers over its limits), or to a failure past the app, with gunicorn's statuses but in
        the API's shape: gunicorn's own is an HTML page, and every refusal here is JSON with a
        code (a client of either door parses it as such). conn: the connection, whose scanner and
        head give the path, method and request id where gunicorn's parser got no request."""
        status, code, message = parser_refusal(exc, self.cfg)
        if status >= 500:
            self.log.exception("Error handling request %s", getattr(req, "uri", "(no URI read)"))
        else:
            self.log.warning("Invalid request from ip=%s: %s", (addr or ("",))[0], exc)
        req = req or getattr(exc, "req", None)
        scanner = getattr(conn, "scanner", None)
        path = getattr(req, "path", None) or getattr(scanner, "path", None) or ""
        method = getattr(req, "method", None) or getattr(scanner, "method", None) or ""
        head, started = getattr(conn, "head", None), getattr(conn, "started", 0.0)
        answer = self.hooks.refuse(Refusal(status, code, message, method, path, head, started, len(head or b"")))
        try:
            client.sendall(answer)
        except OSError:
            self.log.debug("Failed to send error message.")

    def _crowded(self) -> bool:
        """This worker holds PLACEMENT_MARGIN or more admitted requests than its least busy sibling
        (never when it is alone)."""
        return self.hooks.margin() >= PLACEMENT_MARGIN

    # -- sending ----------------------------------------------------------------------------------

    def finish_request(self, conn: Conn, fs) -> None:
        """Back on the event loop after the thread: send what the client has not taken yet, then
        wait for the next request or close."""
        try:
            keep = bool(fs.result()) if not fs.cancelled() else False
        except Exception:
            keep = False
        if conn.sock.fileno() < 0 or conn.dropped:  # closed in the thread, or its client dropped
            self._close(conn)
            return
        conn.keep = keep
        conn.parser = None  # it holds the request's buffer (up to ATTN_MAX_BODY_BYTES): not while idle
        conn.head = conn.known_body = None
        conn.sock.setblocking(False)
        self._write(conn)

    def _write(self, conn: Conn) -> None:
        conn.state = Conn.WRITING
        conn.deadline = time.monotonic() + self.settings.send_timeout_s
        if conn.sock.outbox:
            self._watch(conn, selectors.EVENT_WRITE, self._on_writable)
            self._on_writable(conn, None)
        else:
            self._after_response(conn)

    def _on_writable(self, conn: Conn, _fileobj) -> None:
        try:
            sent = conn.sock.send_some()
        except OSError:
            self._close(conn)
            return
        self.budget.give(sent)
        if sent:
            conn.deadline = time.monotonic() + self.settings.send_timeout_s
        if not conn.sock.outbox:
            self._after_response(conn)

    def _after_response(self, conn: Conn) -> None:
        _call_written(conn, True)
        if conn.keep:
            self._start_request(conn, conn.pending)
            return
        # Close as RFC 9112 section 9.6 asks: FIN first, then read what the client still sends for
        # a little while, so that it gets the answer rather than a reset.
        conn.state = Conn.CLOSING
        conn.deadline = time.monotonic() + LINGER_S
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._watch(conn, selectors.EVENT_READ, self._on_closing)

    def _on_closing(self, conn: Conn, _fileobj) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        conn.lingered += len(data)
        if not data or conn.lingered > LINGER_BYTES:
            self._close(conn)

    # -- deadlines (run() calls murder_pending once a second, and after every batch of events) ----

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        if now < self.next_sweep:  # deadlines are kept to the second: no need to look at every event
            return
        self.next_sweep = now + SWEEP_S
        if not self.alive and self.stopping_at is None:
            self.stopping_at = now
        for conn in [c for c in self.conns if c.state != Conn.IN_THREAD]:
            idle = conn.state == Conn.READING and not conn.buf
            if idle and self.stopping_at is not None:
                conn.deadline = min(conn.deadline, self.stopping_at + STOP_IDLE_S)
            if now < conn.deadline:
                continue
            if conn.state == Conn.READING and conn.buf:
                what = "request head" if conn.scanner.head_end is None else "request body"
                limit = (
                    f"{self.settings.header_timeout_s} s (ATTN_HEADER_TIMEOUT_S)"
                    if conn.scanner.head_end is None
                    else f"{self.settings.body_timeout_s} s plus 1 s per {self.settings.body_min_rate} bytes (ATTN_BODY_TIMEOUT_S, "
                    f"ATTN_BODY_MIN_RATE), and {self.settings.body_total_timeout_s} s in all (ATTN_BODY_TOTAL_TIMEOUT_S)"
                )
                self._unwatch(conn)
                self._answer(conn, 408, "timeout", f"The {what} did not arrive in time: the limit is {limit}.")
            else:
                if conn.state == Conn.WRITING:
                    self.log.info("%s read nothing of its response for %s s: dropped", conn.client, self.settings.send_timeout_s)
                self._close(conn)
