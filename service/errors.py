"""One JSON error shape for every status, and the exception that carries it. No traceback ever
leaves the process: unexpected exceptions are logged here and answered with a plain 500."""

from __future__ import annotations

import logging

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from . import codec
from .attention import ScoreOverflow

log = logging.getLogger("service")

# The Open Inference Protocol answers errors as {"error": "message"}; the native API as below.
KSERVE_PREFIX = "/v2"

_HTTP_CODES = {
    400: "bad_json",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    """A request the service refuses: status, machine-readable code, one actionable sentence,
    and the request field it concerns (None when it is about the request as a whole)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers or {}

    def body(self) -> dict:
        if request.path.startswith(KSERVE_PREFIX):
            return {"error": self.message}
        return {"error": {"status": self.status, "code": self.code, "message": self.message, "field": self.field}}


def invalid(code: str, message: str, field: str | None = None) -> ApiError:
    """A 422: the body is JSON but not a valid request."""
    return ApiError(422, code, message, field)


def _from_http(exc: HTTPException) -> ApiError:
    status = exc.code or 500
    code = _HTTP_CODES.get(status, "http_error")
    if status == 413:
        limit = request.max_content_length
        message = f"The request body is larger than the limit of {limit} bytes (ATTN_MAX_BODY_BYTES)."
    elif status == 405:
        message = f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.valid_methods or []))}."
    elif status == 404:
        message = f"There is no endpoint at {request.path}; see /openapi.json for the API."
    else:
        message = exc.description or exc.name
    headers = dict(exc.get_headers()) if status == 405 else {}
    return ApiError(status, code, message, headers={k: v for k, v in headers.items() if k == "Allow"})


def respond_error(err: ApiError) -> Response:
    g.error_code = err.code  # counted by metrics as a rejection
    resp = Response(codec.dumps(err.body()), status=err.status, mimetype="application/json")
    resp.headers.update(err.headers)
    return resp


def register(app: Flask) -> None:
    """Install the handlers that turn every failure into the one JSON shape."""

    @app.errorhandler(ApiError)
    def _api_error(err: ApiError):
        return respond_error(err)

    @app.errorhandler(ScoreOverflow)
    def _overflow(exc: ScoreOverflow):
        return respond_error(
            invalid(
                "non_finite",
                f'The scores q·kᵀ·scale overflow {exc.dtype}; send "dtype": "float64", smaller values or a smaller scale.',
                "q",
            )
        )

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        return respond_error(_from_http(exc))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return respond_error(ApiError(500, "internal", "The server failed on this request; it has been logged."))
