"""HTTP to the service: one timed POST, its Server-Timing phases, and reachability checks.

Every worker thread owns one pooled `requests.Session`; nothing here is shared between
threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import requests
import urllib3

# The phases the server reports in Server-Timing, in the order it runs them.
PHASES = ("decode", "validate", "compute", "encode", "total")
READ_BYTES = 2**20  # an answer's body is read in pieces of at most this, and dropped
DETAIL_BYTES = 2**16  # of a body, kept: an error's detail comes from it
DETAIL_CHARS = 300  # of an error's detail, shown
LIMITS_BYTES = 2**20  # a /limits answer longer than this is not the service's: not read


class ConnectionFailure(Exception):
    """The service cannot be reached at all, so the sweep cannot go on."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot connect to {self.url}: {self.reason}"


@dataclass(frozen=True)
class Reply:
    """One request's outcome. `status` is None when no response came (`error` says why)."""

    status: int | None
    sent_at: float  # time.perf_counter() just before sending
    done_at: float  # time.perf_counter() once the whole body was read
    phases: dict[str, float] = field(default_factory=dict)  # Server-Timing, ms
    error: str | None = None  # "timeout" or "connection" when status is None
    detail: str = ""  # for a non-2xx status: the error code and message of the body


def new_session(api_key: str | None = None) -> requests.Session:
    """A session for one worker thread: keep-alive, JSON content type, no retries."""
    session = requests.Session()
    session.headers["Content-Type"] = "application/json"
    session.headers["Accept-Encoding"] = "identity"  # requests asks for gzip by default: the service's answers, not zlib's, are measured
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return session


def parse_server_timing(header: str | None) -> dict[str, float]:
    """`"decode;dur=0.4, compute;dur=1.2"` -> `{"decode": 0.4, "compute": 1.2}` (ms).

    Entries without a numeric `dur` are skipped; a malformed header gives `{}`.
    """
    phases: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                try:
                    phases[name] = float(value.strip().strip('"'))
                except ValueError:
                    pass
    return phases


def post(session: requests.Session, url: str, body: bytes, timeout: float) -> Reply:
    """POST `body` to `url` and read the whole response within `timeout` of sending it; never
    raises for HTTP or I/O. The body is read and dropped as it comes (its first DETAIL_BYTES kept,
    for an error's detail): a server's endless answer costs no memory and ends at the deadline.
    (`timeout` bounds each socket read as well, so a head that trickles can outlast the deadline:
    run_cell bounds that.)"""
    sent_at = time.perf_counter()
    deadline = sent_at + timeout
    try:
        with session.post(url, data=body, timeout=timeout, stream=True) as response:
            kept = bytearray()
            while piece := response.raw.read1(READ_BYTES):
                if len(kept) < DETAIL_BYTES:
                    kept += piece[: DETAIL_BYTES - len(kept)]
                if time.perf_counter() > deadline:
                    return Reply(None, sent_at, time.perf_counter(), error="timeout")
    except (requests.Timeout, urllib3.exceptions.TimeoutError):  # the latter from reading the body
        return Reply(None, sent_at, time.perf_counter(), error="timeout")
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        return Reply(None, sent_at, time.perf_counter(), error="connection", detail=describe(exc))
    done_at = time.perf_counter()
    phases = parse_server_timing(response.headers.get("Server-Timing"))
    detail = "" if response.ok else _error_detail(response, bytes(kept))
    return Reply(response.status_code, sent_at, done_at, phases, detail=detail)


def check_reachable(base_url: str, timeout: float = 5.0) -> None:
    """Raise ConnectionFailure unless something answers HTTP at `base_url` (any status)."""
    try:
        requests.get(f"{base_url}/healthz", timeout=timeout, stream=True).close()  # the status is enough: its body is not read
    except requests.Timeout:
        raise ConnectionFailure(base_url, f"no answer within {timeout:g} s") from None
    except requests.RequestException as exc:
        raise ConnectionFailure(base_url, describe(exc)) from None


def fetch_limits(base_url: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """GET /limits for the report (version, cost model); None if it is not there."""
    try:
        with requests.get(f"{base_url}/limits", timeout=timeout, stream=True) as response:
            content = response.raw.read(LIMITS_BYTES + 1) if response.ok else b""  # the service's is ~1 KB
        return orjson.loads(content) if len(content) <= LIMITS_BYTES and content else None
    except (requests.RequestException, urllib3.exceptions.HTTPError, orjson.JSONDecodeError):
        return None


def describe(exc: BaseException) -> str:
    """A short reason for a requests exception: the innermost OS error if there is one.

    requests wraps urllib3 wraps the socket error; "Connection refused" is what a person
    needs, not the three layers of reprs around it.
    """
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        err = stack.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.strerror:
            return err.strerror
        for nxt in (getattr(err, "reason", None), err.__cause__, err.__context__, *err.args):
            if isinstance(nxt, BaseException):
                stack.append(nxt)
    return type(exc).__name__


def _error_detail(response: requests.Response, content: bytes) -> str:
    """`"413 too_long: T=8192 is over the maximum 4096"` from the service's error body, in
    printable characters (a server's escape sequences would drive the terminal it is printed
    on) and at most DETAIL_CHARS of them."""
    try:
        error = orjson.loads(content)["error"]
        detail = f"{response.status_code} {error['code']}: {error['message']}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        detail = f"{response.status_code} {response.reason}"
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in detail)
    return shown if len(shown) <= DETAIL_CHARS else shown[: DETAIL_CHARS - 3] + "..."
