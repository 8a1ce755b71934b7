"""The attention service: create_app() wires settings, blueprints, error handlers and timing."""
from __future__ import annotations

from flask import Flask

from schemas import AttentionRequest, MhaRequest

from . import api, errors, http, ops
from .config import Settings
from .costmodel import CostModel


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["attention.settings"] = settings
    app.extensions["attention.schemas"] = {cls: cls(settings) for cls in (AttentionRequest, MhaRequest)}
    app.extensions["attention.cost"] = CostModel()
    app.extensions["attention.state"] = {"ready": True}
    http.install(app)
    errors.register(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(ops.bp)
    return app
