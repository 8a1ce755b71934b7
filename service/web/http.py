"""Request and response plumbing shared by every blueprint: reading a JSON body (media type,
size and strictness checks; a compressed one inflated, compression.py), writing JSON, the
per-phase clock behind Server-Timing and timing_ms, the request id, and the security headers
(nosniff; on HTML pages a Content-Security-Policy and no framing)."""

from __future__ import annotations

import base64
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable

import orjson
from flask import Flask, Response, request
from gunicorn.http.errors import NoMoreData, ParseException

from schemas import RequestError
from service import wire
from service.transport import BODY_KEY, STARTED_KEY

from . import compression
from .context import begin, context

MAX_JSON_DEPTH = 12  # a rank-6 tensor inside a request object is 8 deep; KServe's envelope adds a few


class phase:  # noqa: N801 - used as a function: `with phase("decode"):`
    """Time a block as one phase of this request (milliseconds, accumulated); `with phase(name) as
    timer` gives a timer whose ms is the block's own time once it ends. A class, not a
    @contextmanager: a request times several phases, and the generator's machinery costs more
    than this."""

    __slots__ = ("name", "start", "ms")

    def __init__(self, name: str):
        self.name, self.ms = name, 0.0

    def __enter__(self) -> phase:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ms = (time.perf_counter() - self.start) * 1000
        record(self.name, self.start, self.ms)


def record(name: str, start: float, ms: float) -> None:
    """One phase of this request: ms from start (a perf_counter()), added to its phases (Server-Timing,
    timing_ms) and its timeline (each a child span when spans are on: tracing)."""
    ctx = context()
    ctx.phases[name] = ctx.phases.get(name, 0.0) + ms
    ctx.timeline.append((name, start, ms))


def phases_ms() -> dict[str, float]:
    return {k: round(v, 3) for k, v in context().phases.items()}


def check_media_type(require_json: bool = True) -> None:
    """415 for a body in a Content-Encoding other than identity, gzip or deflate (or in several),
    and, when require_json, for one that is not application/json."""
    compression.request_coding(request.headers.get("Content-Encoding"))
    if require_json and request.mimetype != "application/json":
        got = wire.show(request.mimetype) if request.mimetype else "none"  # cut: a client's header
        raise RequestError("unsupported_media_type", f"The body must be Content-Type: application/json, not {got}.")


def read_body() -> bytes | bytearray | mmap.mmap:
    """The body, inflated if it came compressed; werkzeug refuses it with 413 past
    MAX_CONTENT_LENGTH before reading it all, and compression.inflate() once its inflated bytes
    pass that limit (each step charged to the request's admission ticket as it is produced).

    With a Content-Length, the buffer the worker received it into (environ[service.transport.BODY_KEY]:
    a bytearray, or for a large body an anonymous mapping), or else read in 1 MiB steps into one
    buffer of that size: the body is in memory once (get_data() holds it twice at the end, and
    gunicorn's read of it all at once, twice)."""
    coding = compression.request_coding(request.headers.get("Content-Encoding"))
    try:
        body = _read(request.content_length)
    except (ParseException, NoMoreData) as exc:
        # The HTTP server found the body's framing broken as it read it (a bad chunk, the stream
        # ended early): the client's fault, 400, never the catch-all 500. FrontWorker refuses these
        # before a thread sees them; another worker class finds them only here.
        raise RequestError("bad_framing", f"The request body could not be read: {type(exc).__name__}: {exc}.") from None
    if coding is None:
        return body
    ticket = context().ticket
    limit = request.max_content_length or 0  # create_app sets it (ATTN_MAX_BODY_BYTES)
    return compression.inflate(body, coding, limit, ticket.charge_body if ticket is not None else None)


def _read(length: int | None) -> bytes | bytearray | mmap.mmap:
    if not length:
        return request.get_data(cache=False)
    if (body := request.environ.get(BODY_KEY)) is not None:  # the event-loop worker's buffer (service.transport)
        return body  # not copied: a fresh buffer of the body's size would be written once more
    stream, body = request.stream, bytearray(length)
    view, got = memoryview(body), 0
    while got < length and (n := stream.readinto(view[got : got + 2**20])):  # type: ignore[attr-defined]  # werkzeug's stream has it
        got += n
    view.release()
    if got < length:
        del body[got:]  # the client sent less than it said: the JSON parser will say what is wrong
    return body


def parse_json(body: bytes | bytearray | mmap.mmap) -> dict:
    """Strict JSON object, or 400 bad_json."""
    try:
        doc = wire.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(
            "bad_json", f"The body is not valid strict JSON ({exc}); NaN, Infinity and out-of-range numbers are not JSON."
        ) from None
    if not isinstance(doc, dict):
        raise RequestError("bad_json", f"The body must be a JSON object, not a {type(doc).__name__}.")
    if wire.depth(doc, MAX_JSON_DEPTH + 1) > MAX_JSON_DEPTH:
        raise RequestError("bad_json", f"The body nests deeper than {MAX_JSON_DEPTH} levels, deeper than any tensor may.")
    return doc


def read_json() -> dict:
    """The request's JSON object: 415, 413 or 400 if it is not one. Timed as the decode phase."""
    check_media_type()
    with phase("decode"):
        return parse_json(read_body())


def json_response(body, status: int = 200) -> Response:
    """The body is written once: b64 tensors and large nested arrays are encoded chunk by chunk as
    they are sent."""
    data, length = wire.dump_chunks(body)
    resp = Response(data, status=status, mimetype="application/json")
    if length is not None:  # b64 streams with a known length; a large nested array goes chunked
        resp.headers["Content-Length"] = str(length)
    return resp


def when_sent(resp: Response, done: Callable[[], None]) -> None:
    """Call done() once resp's body has been sent: after its last chunk, or when the server closes
    the response (a client gone, a HEAD request). A response with b64 or large nested tensors
    streams (they are encoded as they are sent); any other body is built, and held in memory
    until it has been written, so it ends the same way.

    Several hooks ask this of one response (admission, metrics, the access log, tracing): the
    first call wraps the body once, later ones join its list, and the callbacks run in the order
    they were given, each even if one before it raised. One generator between the body and the
    server, not one per hook."""
    callbacks = resp.__dict__.get("_when_sent")
    if callbacks is not None:
        callbacks.append(done)
        return
    callbacks = resp.__dict__["_when_sent"] = [done]
    once = threading.Lock()

    def finish():
        if once.acquire(blocking=False):
            _call_all(callbacks)

    def chunks(body):
        try:
            yield from body
        finally:
            finish()

    resp.response = chunks(resp.response)
    resp.call_on_close(finish)


def _call_all(callbacks: list[Callable[[], None]]) -> None:
    """Call each in turn; the first exception, if any, is raised once all have run."""
    error = None
    for done in callbacks:
        try:
            done()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others ran
            error = error or exc
    if error is not None:
        raise error


MAX_REQUEST_ID = 128


def head_headers(head: bytes, names: tuple[bytes, ...]) -> dict[bytes, str]:
    """The named headers (lower-case names) of a request head the worker read (service.transport),
    decoded as latin-1, a repeated one's values joined by commas (as gunicorn's environ has them)."""
    found: dict[bytes, str] = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and (key := name.strip().lower()) in names:
            text = value.strip(b" \t").decode("latin-1")
            found[key] = f"{found[key]},{text}" if key in found else text
    return found


def request_id(sent: str) -> str:
    """The client's X-Request-Id if it is 1..128 printable ASCII characters (it is echoed in a
    header and written to logs), else a fresh one."""
    if 0 < len(sent) <= MAX_REQUEST_ID and sent.isascii() and sent.isprintable():
        return sent
    return os.urandom(16).hex()  # what uuid4().hex is made of, less the UUID object and its version bits


def html_policy(*inline_scripts: str) -> str:
    """The Content-Security-Policy of an HTML page: everything from the service itself, no plugins,
    no framing (clickjacking), and of inline scripts only those given (allowed by their hash).
    Inline styles are allowed: Swagger UI and the landing page use them, and they run no code."""
    hashes = "".join(f" 'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in inline_scripts)
    return (
        f"default-src 'self'; script-src 'self'{hashes}; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    )


HTML_POLICY = html_policy()  # a page with an inline script sets its own (openapi.docs)
NOSNIFF = ("X-Content-Type-Options", "nosniff")  # on every answer, the app's and the worker's own


def install(app: Flask) -> None:
    """The request's context (its clock and request id: installed first, so every other hook
    finds it), the Server-Timing / X-Request-Id headers, and the security headers: nosniff on
    every answer (a JSON error that names what the client sent is never read as HTML), and on
    HTML pages a Content-Security-Policy and no framing."""

    @app.before_request
    def _start():
        t0, started = time.perf_counter(), request.environ.get(STARTED_KEY)
        # The event loop read the body before the app saw the request (its first byte at STARTED_KEY, on the monotonic clock).
        arrived = t0 if started is None else t0 - max(time.monotonic() - started, 0.0)
        begin(t0, request_id(request.headers.get("X-Request-Id", "")), arrived)

    @app.after_request
    def _headers(resp: Response):
        ctx = context()
        total = (time.perf_counter() - ctx.t0) * 1000
        parts = [f"{k};dur={v:.3f}" for k, v in ctx.phases.items()] + [f"total;dur={total:.3f}"]
        resp.headers["Server-Timing"] = ", ".join(parts)
        resp.headers["X-Request-Id"] = ctx.request_id
        resp.headers[NOSNIFF[0]] = NOSNIFF[1]
        if resp.mimetype == "text/html":
            resp.headers.setdefault("Content-Security-Policy", HTML_POLICY)
            resp.headers["X-Frame-Options"] = "DENY"  # frame-ancestors for browsers without CSP 2
        return resp
