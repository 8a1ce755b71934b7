"""The transport: HTTP/1.1 connections in a gunicorn worker's event loop (worker.py), where a request
ends (framing.py), and the one interface between it and the application it serves (this module).

The transport knows bytes, connections and deadlines, never the app: it imports nothing of
service.web nor of Flask (an import-linter contract in pyproject.toml says so). What it needs of
the app it is handed at start, as one object with the methods of `Hooks`:

- `refuse(refusal)`: the answer, as bytes (`answer()` frames them), to a request the worker refuses
  itself (a deadline passed, framing it cannot trust, a body too large, a send budget spent, a head
  gunicorn's parser refuses): the app shapes it as it shapes its own errors for that path,
  counts it and logs it.
- `margin()`: how many more admitted requests this worker holds than its least busy sibling, the
  signal of connection placement.
- `check_head(method, path, head)`: once a request's head has arrived whole, before a byte of its
  body is read or `100 Continue` is sent, what the app refuses from the head alone (a compute
  request without a valid API key, an X-Deadline-Ms it cannot read), or None: the worker answers
  that refusal (refuse()) and closes, so a client without a key holds none of its memory.

Wiring: deploy/gunicorn.conf.py's post_worker_init sets `worker.hooks` (service.web.front.Front over
the loaded app), before the worker serves; a FrontWorker without hooks refuses to start.

The body of a request the worker read into memory reaches the app whole, not copied, under one
environ key, BODY_KEY (absent for a chunked or empty body: read wsgi.input then)."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

BODY_KEY = "transport.body"  # environ: the request body, one bytearray or mmap the app may keep
STARTED_KEY = "transport.started"  # environ: time.monotonic() when the request's first byte arrived (with BODY_KEY)
# environ (with BODY_KEY): call it with a callable to have that called once with True, on the event
# loop, when the response's last byte has been handed to the kernel, or with False if the
# connection is dropped (or the response abandoned) first
SENT_KEY = "transport.when_written"


@dataclass(frozen=True)
class Refusal:
    """A request the worker answers itself, and what it knows of it."""

    status: int
    code: str  # the API's error code (bad_framing, timeout, ...)
    message: str  # for the client
    method: str = ""  # "" before the request line arrived
    path: str = ""  # the request target as sent, query included; "" before the request line arrived
    head: bytes | None = None  # the request line and headers, once they arrived whole
    started: float = 0.0  # time.monotonic() at the request's first byte; 0.0 if none arrived
    received: int = 0  # bytes of the request received
    field: str | None = None  # what the refusal is about, for X-Error-Field (a header's name)
    headers: tuple[tuple[str, str], ...] = ()  # more headers of the answer (WWW-Authenticate on a 401)


class Hooks(Protocol):
    """What the worker needs of the app (see the module docstring)."""

    def refuse(self, refusal: Refusal) -> bytes:
        """The complete answer to send before closing (answer()), counted and logged as the app's."""
        ...

    def margin(self) -> int:
        """Admitted requests this worker holds beyond its least busy sibling (0 when it is alone)."""
        ...

    def check_head(self, method: str, path: str, head: bytes) -> Refusal | None:
        """A refusal decided from the request's head (path: the target as sent; head: the request
        line and headers), of which the worker fills what it knows (method, path, head, times);
        None to read the body."""
        ...


def clip(text: str, limit: int = 64) -> str:
    """text cut to limit characters (and "..."): what an answer or a log line quotes of a
    client's bytes, so that neither grows with them."""
    return text if len(text) <= limit else text[:limit] + "..."


def answer(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """A complete HTTP/1.1 answer after which the connection closes: the status line, headers, the
    body's Content-Length, Connection: close, and the body."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
