"""The service with nothing behind POST /attention, the stack's floor for a small request
(`python -m bench small_requests --floor`): the app `python -m service` serves, every hook and the
worker, whose /attention view reads the body and answers a fixed T=64 b64 answer (175 KB) without
decoding, validating, admitting, computing or encoding. A benchmark only: never deployed."""

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
