"""The access log: one line per request on stdout, written when the response's last byte is sent;
and gunicorn's own messages (start-up, errors) in the same format.

ATTN_LOG_FORMAT=json (the default: what Kubernetes log collectors expect) writes one JSON object a
line; plain, one line for a person at a terminal (`make run` uses it). A request's fields:

    ts           RFC 3339 UTC, when the line is written (the response sent); the request began
                 duration_ms earlier
    level, logger  "info", "access"
    request_id   X-Request-Id (the client's or ours, as the response says)
    trace_id, span_id  this request's trace and span (service.web.tracing; the response's traceparent)
    method, route, path  route is the URL rule (bounded: "unmatched" for 404/405), path is the path
                 without its query string (cut at 256 characters)
    status, code, field  the HTTP status; the error code and field of an error answer
    duration_ms  from the request reaching the app to its last byte sent
    phases       decode/validate/queue/compute/encode milliseconds (those the request went through)
    B, H, T, S, d  the job's shape, for compute requests that were validated (H: the axis before T,
                 the heads; /mha: its heads)
    predicted_ms, compute_ms  the cost model's prediction and the measured compute
    bytes_in, bytes_out  the request body's Content-Length; the response body's length
    pid          the worker process

Never a body, a header other than X-Request-Id and traceparent, or a query string: an API key or
a secret in a URL never reaches the log. In the plain format what a client chose (method, path, a
field it named) is escaped if it holds a character that is not printable (printable()), and so
are the values gunicorn's messages quote (ClientBytes): no client can forge a line. The worker's event loop answers some requests itself
(408, 413, 431, 400 bad_framing, ...: service/transport/worker.py); worker_answer() logs those in
the same format (service/web/front.py). Cost: one orjson.dumps and one write(2) per request, a few microseconds.
"""

from __future__ import annotations

import logging
import os
import time

import orjson
from flask import Flask, Response, request
from gunicorn import glogging

from service.config import Settings

from . import http, metrics, tracing
from .context import context, services

STDOUT = 1  # the access log's file descriptor; written with one os.write per line (no buffer to flush)
MAX_PATH = 256
MAX_METHOD = 16


_second: tuple[int, str] = (-1, "")  # the last second formatted, and its text (strftime once a second, not once a line)


def rfc3339(t: float) -> str:
    """UTC time t (seconds since the epoch) to the millisecond: 2026-12-01T00:40:12.345Z."""
    global _second
    sec = int(t)
    if sec != _second[0]:
        _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{_second[1]}.{int(t * 1000) % 1000:03d}Z"


def _write(record: dict, fmt: str) -> None:
    line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE) if fmt == "json" else _plain(record)
    view = memoryview(line)
    try:
        while view:  # a pipe takes a line this short at once; the loop is for a signal's short write
            view = view[os.write(STDOUT, view) :]
    except OSError:  # stdout closed (the collector gone): the request must not fail for its log line
        pass


def _plain(r: dict) -> bytes:
    """One line for a terminal: time, status, method, path, duration, then what is known. What a
    client chose (the method, the path, a field it named) is escaped (printable())."""
    path = printable(r.get("path") or r["route"])
    duration = f"{r['duration_ms']:.1f}ms" if r.get("duration_ms") is not None else "-"
    parts = [r["ts"], str(r["status"]), printable(r["method"]), path, duration]
    if "code" in r:
        parts.append(f"code={r['code']}" + (f" field={printable(r['field'])}" if r.get("field") else ""))
    parts += [f"{k}={r[k]}" for k in ("B", "H", "T", "S", "d", "predicted_ms", "compute_ms") if k in r]
    bytes_in = r.get("bytes_in")  # None without a body (a GET)
    parts += [
        f"in={'-' if bytes_in is None else bytes_in}",
        f"out={r['bytes_out']}",
        f"id={printable(r['request_id'])}",
        f"trace={r['trace_id']}",
        f"pid={r['pid']}",
    ]
    return (" ".join(parts) + "\n").encode()


def printable(text: str) -> str:
    """text, or if it holds a character that is not printable, text in double quotes with each such
    character (and each quote and backslash) escaped: CR and LF must not forge a line, nor ESC,
    BEL, DEL or a C1 control drive the terminal that shows it."""
    if text.isprintable():
        return text
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else _escaped(c) for c in text) + '"'


def _escaped(c: str) -> str:
    return "\\" + c if c in '"\\' else c.encode("unicode_escape").decode("ascii")


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n] + "..."


def install(app: Flask) -> None:
    """Write each request's line once its response is sent (metrics.when_sent)."""
    fmt = services(app).settings.log_format

    @app.after_request
    def _log(resp: Response):
        req, ctx = request._get_current_object(), context()  # type: ignore[attr-defined]  # the request once through its proxy (each access costs a lookup)
        t0, trace, rule, method = ctx.t0, ctx.trace, req.url_rule, req.method
        record = {
            "ts": None,  # when sent: below
            "level": "info",
            "logger": "access",
            "request_id": ctx.request_id,
            "trace_id": trace.trace_id if trace else None,
            "span_id": trace.span_id if trace else None,
            "method": _clip(method, MAX_METHOD),
            "route": rule.rule if rule is not None else "unmatched",
            "path": _clip(req.path, MAX_PATH),
            "status": resp.status_code,
        }
        if (code := ctx.error_code) is not None:
            record["code"] = code
            if (field := ctx.error_field) is not None:
                record["field"] = field
        phases = ctx.phases
        if phases:
            record["phases"] = {k: round(v, 3) for k, v in phases.items()}
        if (job := ctx.job) is not None:
            record.update(tracing.job_fields(job))
        if (ticket := ctx.ticket) is not None and ticket.work is not None:
            record["predicted_ms"] = round(ticket.predicted_ms, 3)
        if phases and "compute" in phases:
            record["compute_ms"] = round(phases["compute"], 3)
        record["bytes_in"] = req.content_length
        nbytes = 0 if method == "HEAD" else resp.content_length
        if nbytes is None:  # a chunked body (large nested tensors): counted as it is sent
            counted = [0]

            def count(body):
                for chunk in body:
                    counted[0] += len(chunk)
                    yield chunk

            resp.response = count(resp.response)

        def sent():
            record["ts"] = rfc3339(time.time())
            record["duration_ms"] = round((time.perf_counter() - t0) * 1000, 3)
            record["bytes_out"] = counted[0] if nbytes is None else nbytes
            record["pid"] = os.getpid()
            _write(record, fmt)

        metrics.when_sent(resp, sent)
        return resp


def head_request_id(head: bytes | None) -> str:
    """The request id of a request the worker answers itself: its X-Request-Id if the head
    arrived whole and the id is acceptable (http.request_id), else a fresh one."""
    headers = http.head_headers(head, (b"x-request-id",)) if head else {}
    return http.request_id(headers.get(b"x-request-id", ""))


def worker_answer(
    fmt: str,
    head: bytes | None,
    method: str,
    path: str,
    route: str,
    code: str,
    status: int,
    sizes: tuple[int, int],
    started: float,
    request_id: str,
) -> None:
    """The line of a request the worker answered itself (worker.py). head is the request's head
    if it arrived whole (its traceparent is read from it); sizes are (bytes received, bytes of the
    answer); started is time.monotonic() at its first byte; request_id the one the answer carries
    (head_request_id)."""
    headers = http.head_headers(head, (b"traceparent",)) if head else {}
    trace = tracing.start(headers.get(b"traceparent"))
    record = {
        "ts": rfc3339(time.time()),
        "level": "info",
        "logger": "access",
        "request_id": request_id,
        "trace_id": trace.trace_id,
        "span_id": trace.span_id,
        "method": _clip(method, MAX_METHOD) or "-",
        "route": route,
        "path": _clip(path.partition("?")[0], MAX_PATH),
        "status": status,
        "code": code,
        "duration_ms": round((time.monotonic() - started) * 1000, 3) if started else None,
        "bytes_in": sizes[0],
        "bytes_out": sizes[1],
        "pid": os.getpid(),
    }
    _write(record, fmt)


# --- gunicorn's own messages ---------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """A log record as one JSON line: ts, level, logger, pid, msg (and exc, a traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": rfc3339(record.created), "level": record.levelname.lower(), "logger": record.name, "pid": record.process}
        doc["msg"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


MAX_QUOTED = 512  # characters of a client's value a message quotes


class ClientBytes(logging.Filter):
    """Escapes (printable()) and cuts (MAX_QUOTED) the values a message quotes: its arguments, where
    gunicorn and the worker put what a client sent (a request line, a header's value, a parser's
    error), so that a CR LF there cannot forge a line nor an ESC reach the terminal. The message's
    own text, and a traceback, are the program's and stay as written."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_quoted(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _quoted(v) for k, v in record.args.items()}
        if not isinstance(record.msg, str):
            record.msg = _quoted(record.msg)
        return True


def _quoted(value):
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("latin-1")
    elif isinstance(value, BaseException):
        value = str(value)
    if not isinstance(value, str):
        return value  # a number, a tuple of them (an address), ...: not a client's text
    return printable(_clip(value, MAX_QUOTED))


class GunicornLogger(glogging.Logger):
    """gunicorn's logger (deploy/gunicorn.conf.py: logger_class): its error log (start-up, worker
    life, errors; stderr) as JSON lines when ATTN_LOG_FORMAT=json, and the service's own logger
    ("service": unexpected errors, calibration) on the same handler, what they quote of a client
    escaped and cut (ClientBytes). No access log: ours is."""

    def setup(self, cfg) -> None:
        super().setup(cfg)
        json_lines = Settings.from_env().log_format == "json"
        for handler in self.error_log.handlers:
            handler.addFilter(ClientBytes())
            if json_lines:
                handler.setFormatter(JsonFormatter())
        service = logging.getLogger("service")
        service.handlers = list(self.error_log.handlers)
        service.setLevel(self.error_log.level)
        service.propagate = False

    def access(self, resp, req, environ, request_time) -> None:
        pass
