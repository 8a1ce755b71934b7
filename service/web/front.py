"""The app's side of the transport (service.transport.Hooks): what the event-loop worker needs of the
app, handed to it at start (deploy/gunicorn.conf.py, post_worker_init).

What the app refuses from a request's head alone is refused by the worker as soon as the head is
in, before the body is read or 100 Continue sent (check_head): a compute request, or one under
/sessions, without a valid API key (401, auth.py), or a compute request with an X-Deadline-Ms
that is not a positive number (422, admit.py), in that order, as the app's own hooks would
(they still check, for a request that reaches the app another way).

The worker's own refusals (408, 413, 431, 400 bad_framing, ..., and heads gunicorn's parser refuses)
are in the API's error shapes (the /v2 protocol's under its prefix, else the native), carry the
headers every answer has, are counted in /metrics and logged in one access line as the app's own
answers are. Placement reads admission's shared census."""

from __future__ import annotations

import time
from urllib.parse import unquote, urlsplit

from flask import Flask

from schemas import RequestError
from service import transport, wire

from . import accesslog, admit, auth, errors, http, kserve, metrics
from .context import services


def error_answer(refusal: transport.Refusal, request_id: str | None = None) -> bytes:
    """The bytes of the answer to refusal: its body in the shape of the front door its path is
    under, nosniff, X-Error-Code, the request's X-Request-Id (a fresh one if it has none),
    Server-Timing (total: since its first byte), Retry-After on a 503."""
    status, door = refusal.status, refusal.path.partition("?")[0]
    prefix = kserve.bp.url_prefix
    shape = kserve.error_body if door == prefix or door.startswith(f"{prefix}/") else errors.native_body
    err = RequestError(refusal.code, refusal.message, refusal.field)
    started = refusal.started
    headers = [("Content-Type", "application/json"), http.NOSNIFF, *errors.code_headers(err).items(), *refusal.headers]
    headers.append(("X-Request-Id", request_id or http.request_id("")))
    headers.append(("Server-Timing", f"total;dur={(time.monotonic() - started) * 1000 if started else 0.0:.3f}"))
    if status == 503:
        headers.append(("Retry-After", "1"))
    return transport.answer(status, headers, wire.dumps(shape(err, status)))


class Front:
    """service.transport.Hooks over app (a create_app() app)."""

    def __init__(self, app: Flask):
        self.app, self.admission = app, services(app).admission
        self.log_format = services(app).settings.log_format
        self.keys = services(app).settings.api_keys

    def check_head(self, method: str, path: str, head: bytes) -> transport.Refusal | None:
        route = route_path(path)
        if not auth.guarded(method, route):
            return None
        headers = http.head_headers(head, (b"authorization", b"x-deadline-ms"))
        authorization = headers.get(b"authorization")
        if self.keys and not auth.key_ok(authorization, self.keys):
            err = auth.refusal(authorization)
            return transport.Refusal(err.status, err.code, err.message, headers=tuple(err.headers.items()))
        if method != "POST" or not admit.COMPUTE_PATH.fullmatch(route):
            return None
        try:
            admit.parse_deadline(headers.get(b"x-deadline-ms"))
        except RequestError as err:
            return transport.Refusal(errors.status_of(err.code), err.code, err.message, field=err.field)
        return None

    def refuse(self, refusal: transport.Refusal) -> bytes:
        endpoint = self._endpoint(refusal.path, refusal.method)
        metrics.REQUESTS.labels(endpoint, metrics.method_label(refusal.method), str(refusal.status)).inc()
        metrics.REJECTIONS.labels(endpoint, refusal.code).inc()
        request_id = accesslog.head_request_id(refusal.head)
        answer = error_answer(refusal, request_id)
        sizes = (refusal.received, len(answer))
        r = refusal
        accesslog.worker_answer(self.log_format, r.head, r.method, r.path, endpoint, r.code, r.status, sizes, r.started, request_id)
        return answer

    def margin(self) -> int:
        return self.admission.table.busiest_margin(self.admission.row)

    def _endpoint(self, path: str, method: str) -> str:
        """The route path is served by, as the app labels it (a bounded label): "unmatched" when
        no route has it, as for the app's 404 and 405, or before the head is known."""
        if not path.startswith("/"):
            return "unmatched"
        try:
            rule, _ = self.app.url_map.bind("localhost").match(route_path(path), method=method or "GET", return_rule=True)
        except Exception:  # werkzeug's NotFound, MethodNotAllowed, RequestRedirect
            return "unmatched"
        return rule.rule


def route_path(target: str) -> str:
    """The path a request target (as sent) is routed by, as werkzeug has it (request.path): without
    its query, percent-decoded (UTF-8), one leading slash; the path of an absolute URI."""
    if not target.startswith("/"):
        target = urlsplit(target).path
    path = target.partition("?")[0].partition("#")[0]
    return "/" + unquote(path, errors="replace").lstrip("/")
