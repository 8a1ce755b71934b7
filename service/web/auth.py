"""Authentication: with ATTN_API_KEYS set, the compute endpoints, the shared-memory register and
unregister (which let a request read and write memory) and the sessions resource (every method: a
session is visible to the key that made it only) need `Authorization: Bearer <key>`
(401 unauthorized otherwise). Checked before anything else looks at the request, in constant time
over every key, so that the time taken does not tell which key came close."""

from __future__ import annotations

import hmac
import re

from flask import Flask, request

from .context import services
from .errors import ApiError

GUARDED_POST = re.compile(r"/(attention|mha)|/v2/models/[^/]+(/versions/[^/]+)?/infer|/v2/(system|cuda)sharedmemory(/region/[^/]+)?/\w+")
SESSIONS_PATH = re.compile(r"/sessions(/.*)?")  # every method: a session is its key's alone


def guarded(method: str, path: str) -> bool:
    """Whether a request needs a key (when keys are set): a compute POST (or a shared-memory
    register or unregister), or any request under /sessions."""
    return (method == "POST" and GUARDED_POST.fullmatch(path) is not None) or SESSIONS_PATH.fullmatch(path) is not None


def key_ok(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header value carries one of keys as a Bearer token."""
    scheme, _, given = (authorization or "").partition(" ")
    given_b = given.strip().encode()
    ok = False
    for key in keys:  # compare with every key: the time taken does not tell which one came close
        ok |= hmac.compare_digest(given_b, key.encode())
    return scheme.lower() == "bearer" and bool(given_b) and ok


def refusal(authorization: str | None) -> ApiError:
    """The 401 for a request without a valid key."""
    given = bool((authorization or "").partition(" ")[2].strip())
    return ApiError(
        "unauthorized",
        "This endpoint needs an API key: send the header Authorization: Bearer <key>.",
        headers={"WWW-Authenticate": 'Bearer realm="attention"' + (', error="invalid_token"' if given else "")},
    )


def install(app: Flask) -> None:
    """The before_request hook that refuses a compute request without a valid key."""
    keys = services(app).settings.api_keys
    if not keys:
        return

    @app.before_request
    def _authenticate():
        if guarded(request.method, request.path):
            header = request.headers.get("Authorization")
            if not key_ok(header, keys):
                raise refusal(header)
