"""The service with nothing behind POST /attention: the stack's floor for a small request.

    python -m gunicorn --config deploy/gunicorn.conf.py "bench.floor_app:create_app()"

The same app as `python -m service` serves (create_app(): hooks, metrics, access log, admission
gauges, the worker and its event loop), except that the /attention view reads the body and answers
a fixed T=64 response (B=1, H=8, d=64, float32 b64: 175 KB) without decoding, validating, admitting,
computing or encoding anything. bench/small_requests.py --floor serves it beside the real one: its
ratio to /healthz is the most any T=64 b64 request can reach on this machine with this stack,
whatever the attention path costs. A benchmark only: never deployed.
"""

from __future__ import annotations

import orjson
import pybase64
from flask import Flask, Response, request

from service.web import create_app as create_service

FIXED = orjson.dumps({"out": {"shape": [1, 8, 64, 64], "dtype": "float32", "b64": pybase64.b64encode(bytes(1 * 8 * 64 * 64 * 4)).decode()}})


def read_and_answer() -> Response:
    """Read the whole body (as the real view does), answer FIXED."""
    request.get_data()
    return Response(FIXED, mimetype="application/json")


def create_app() -> Flask:
    app = create_service()
    app.view_functions["api.attention"] = read_and_answer
    return app
