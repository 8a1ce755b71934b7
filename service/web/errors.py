"""The one place where errors become HTTP: every refusal, from any layer, is a RequestError
(code, message, field), or admission's Refused (code, message, retry-after); STATUS maps its code
to a status, and the front door that served the request (its blueprint, a Door) picks the body's
shape and may remap statuses: the Open Inference Protocol's door answers 400 where the native one
answers 422 (PROTOCOL_STATUS). No traceback ever leaves the process: unexpected exceptions are
logged here and answered with a plain 500."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote

from flask import Blueprint, Flask, Response, request
from werkzeug.exceptions import HTTPException

from schemas import RequestError
from service import wire
from service.admission import Refused

from .context import context, services

log = logging.getLogger("service")

STATUS = {
    "bad_json": 400,
    "bad_request": 400,
    "bad_framing": 400,
    "bad_compression": 400,
    "bad_shared_memory": 400,
    "incomplete_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "session_not_found": 404,
    "method_not_allowed": 405,
    "timeout": 408,
    "length_conflict": 409,
    "too_long": 413,
    "too_large": 413,
    "body_too_large": 413,
    "uri_too_long": 414,
    "unsupported_media_type": 415,
    "headers_too_large": 431,
    "internal": 500,
    "not_implemented": 501,
    "overloaded": 503,
    "deadline": 504,
}  # every other code: 422, the body is JSON but not a valid request. The connection-level codes
# (bad_framing, incomplete_request, timeout, headers_too_large, not_implemented; bad_request and
# uri_too_long for a head gunicorn's parser refuses) are answered by the worker (worker.py), in
# the same shapes.

_HTTP_CODES = {
    400: "bad_json",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}

Shape = Callable[[RequestError, int], dict]

# The Open Inference Protocol documents 400 for a request it cannot serve, and Triton answers 400
# for every invalid or malformed one: at that door, what the native door answers 422 (the body is
# JSON but not a valid request) is 400, its code still in X-Error-Code. Every other status keeps
# its meaning there (404, 413, 415, 503, 504, ...).
PROTOCOL_STATUS = {422: 400}


@dataclass(frozen=True)
class Door:
    """A front door's error answers: the body's shape, and the statuses it answers differently
    from the native door (status -> its own)."""

    shape: Shape
    statuses: dict[int, int] = field(default_factory=dict)


class ApiError(RequestError):
    """A refusal that needs more than a code: headers (Retry-After, Allow, WWW-Authenticate), more
    in its error object (extra: a session's "length"), or, for an HTTP error werkzeug raised that
    no code names, its status. Any other refusal, from any layer, is a plain RequestError."""

    def __init__(
        self,
        code: str,
        message: str,
        field: str | None = None,
        *,
        headers: dict | None = None,
        status: int | None = None,
        extra: dict | None = None,
    ):
        super().__init__(code, message, field)
        self.headers = headers or {}
        self._status = status
        self.extra = extra or {}

    @property
    def status(self) -> int:
        return self._status or status_of(self.code)


def status_of(code: str) -> int:
    return STATUS.get(code, 422)


def body_too_large(limit: int) -> str:
    """The 413 message, the same whether the app or the worker's event loop refuses the body."""
    return f"The request body is larger than the limit of {limit} bytes (ATTN_MAX_BODY_BYTES)."


MAX_FIELD_HEADER = 256  # characters of X-Error-Field: past this it is left out (the body names the field)
_PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # kept as they are in X-Error-Field


def code_headers(err: RequestError) -> dict[str, str]:
    """X-Error-Code (and X-Error-Field) on every error answer, whichever door: the /v2 protocol's
    body is only {"error": message}, and a client of that door still needs the code and field.

    A field can be a key the client sent, so any text: in the header it is percent-encoded (UTF-8,
    RFC 3986) but for printable ASCII other than "%", so that the header is always valid (a key
    such as "\u0100" or one holding CR LF made gunicorn refuse the header: 500) and never splits."""
    headers = {"X-Error-Code": err.code}
    if err.field:
        field = quote(err.field, safe=_PRINTABLE)
        if len(field) <= MAX_FIELD_HEADER:
            headers["X-Error-Field"] = field
    return headers


def native_body(err: RequestError, status: int) -> dict:
    """The native API's shape: {"error": {status, code, message, field}}."""
    return {"error": {"status": status, "code": err.code, "message": err.message, "field": err.field, **getattr(err, "extra", {})}}


NATIVE = Door(native_body)


def _from_http(exc: HTTPException) -> ApiError:
    status = exc.code or 500
    code = _HTTP_CODES.get(status, "http_error")
    if status == 413:
        message = body_too_large(request.max_content_length or 0)  # create_app sets it: a 413 has one
    elif status == 405:
        message = (
            f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(getattr(exc, 'valid_methods', None) or []))}."
        )
    elif status == 404:
        message = f"There is no endpoint at {request.path}; see /openapi.json for the API."
    else:
        message = exc.description or exc.name
    headers = dict(exc.get_headers()) if status == 405 else {}
    return ApiError(code, message, headers={k: v for k, v in headers.items() if k == "Allow"}, status=status)


class Responder:
    """Renders a RequestError as the front door that served the request answers it."""

    def __init__(self, doors: dict[Blueprint, Door]):
        self.doors = {bp.name: door for bp, door in doors.items()}
        self.prefixes = [(bp.url_prefix, door) for bp, door in doors.items() if bp.url_prefix]

    def door(self) -> Door:
        if request.url_rule is not None:
            return self.doors.get(request.blueprint or "", NATIVE)
        # No route matched (404, 405): the door is the blueprint whose prefix the path is under.
        for prefix, door in self.prefixes:
            if request.path == prefix or request.path.startswith(prefix + "/"):
                return door
        return NATIVE

    def respond(self, err: RequestError, headers: dict | None = None, status: int | None = None) -> Response:
        door = self.door()
        status = status or status_of(err.code)
        status = door.statuses.get(status, status)
        ctx = context()
        ctx.error_code = err.code  # counted by metrics as a rejection
        ctx.error_field = err.field  # logged beside it (accesslog)
        resp = Response(wire.dumps(door.shape(err, status)), status=status, mimetype="application/json")
        resp.headers.update(code_headers(err))
        resp.headers.update(headers or {})
        return resp


def register(app: Flask, doors: dict[Blueprint, Door]) -> None:
    """Install the handlers that turn every failure into its door's error answer; doors gives the
    blueprints that answer otherwise than the native door."""
    responder = Responder(doors)
    services(app).answer_error = responder.respond

    @app.errorhandler(RequestError)
    def _request_error(err: RequestError):
        return responder.respond(err)

    @app.errorhandler(ApiError)
    def _api_error(err: ApiError):
        return responder.respond(err, err.headers, err.status)

    @app.errorhandler(Refused)
    def _refused(refusal: Refused):
        """Admission's refusals: 503 overloaded (with Retry-After) or 504 deadline."""
        headers = {"Retry-After": str(refusal.retry_after)} if refusal.retry_after is not None else None
        return responder.respond(RequestError(refusal.code, refusal.message), headers)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        return _api_error(_from_http(exc))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return responder.respond(RequestError("internal", "The server failed on this request; it has been logged."))
