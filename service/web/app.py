"""create_app(): wires settings, blueprints (the native API, the Open Inference Protocol, OpenAPI
and docs, the playground page, operations), error handlers, timing, metrics and admission."""

from __future__ import annotations

from flask import Flask

from schemas import AttentionRequest, MhaRequest
from service.config import Settings

from . import accesslog, admission, api, errors, http, kserve, metrics, openapi, ops, parallel, playground, tracing
from .costmodel import CostModel


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask("service")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["attention.settings"] = settings
    app.extensions["attention.schemas"] = {cls: cls(settings) for cls in (AttentionRequest, MhaRequest)}
    app.extensions["attention.kserve.schemas"] = kserve.build_schemas(settings)
    app.extensions["attention.cost"] = CostModel()
    app.extensions["attention.state"] = {"ready": not settings.warmup, "draining": False}  # ops.warm_up() readies it
    http.install(app)
    tracing.install(app)  # after http (its clock), before the rest: every request has a trace
    accesslog.install(app)
    metrics.install(app)  # before admission: its refusals are counted too
    admission.install(app)
    parallel.install(app)
    errors.register(app, shapes={kserve.bp: kserve.error_body})
    app.register_blueprint(api.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(kserve.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(playground.bp)
    return app
