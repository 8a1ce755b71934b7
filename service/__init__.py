"""The attention service: create_app() wires settings, blueprints (the native API, the Open
Inference Protocol, OpenAPI and docs, operations), error handlers, timing, metrics and admission."""

from __future__ import annotations

from flask import Flask

from schemas import AttentionRequest, MhaRequest

from . import admission, api, errors, http, kserve, metrics, openapi, ops
from .config import Settings
from .costmodel import CostModel


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["attention.settings"] = settings
    app.extensions["attention.schemas"] = {cls: cls(settings) for cls in (AttentionRequest, MhaRequest)}
    app.extensions["attention.cost"] = CostModel()
    app.extensions["attention.state"] = {"ready": not settings.warmup, "draining": False}  # ops.warm_up() readies it
    http.install(app)
    metrics.install(app)  # before admission: its refusals are counted too
    admission.install(app)
    errors.register(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(kserve.bp)
    app.register_blueprint(openapi.bp)
    return app
