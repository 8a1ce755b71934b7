"""create_app(): wires settings, blueprints (the native API, the Open Inference Protocol, OpenAPI
and docs, the playground page, operations), error handlers, timing, metrics and admission."""

from __future__ import annotations

from flask import Flask, Response

from schemas import AttentionRequest, MhaRequest
from service import wire
from service.config import Settings
from service.cost import CostModel

from . import accesslog, admission, api, auth, compression, errors, http, kserve, metrics, openapi, ops, parallel, playground, tracing
from .context import EXTENSION, Services
from .triton_ext import install as install_triton  # importing it adds Triton's extensions' routes to kserve.bp


class ServiceFlask(Flask):
    """Flask, but its automatic answer to OPTIONS is JSON like every other answer (Flask's is an
    empty text/html page)."""

    def make_default_options_response(self) -> Response:
        """200, the Allow header, and {"allow": [the same methods]}."""
        resp = super().make_default_options_response()
        resp.set_data(wire.dumps({"allow": sorted(resp.allow)}))
        resp.mimetype = "application/json"
        return resp


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = ServiceFlask("service")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    gate = admission.make_gate(settings)
    app.extensions[EXTENSION] = Services(
        settings=settings,
        schemas={cls: cls(settings) for cls in (AttentionRequest, MhaRequest)},
        kserve_schemas=kserve.build_schemas(settings),
        cost=CostModel(),
        gate=gate,
        pool=parallel.make_pool(settings),
        spans=tracing.spans_for(settings),
        ready=not settings.warmup,  # else ops.warm_up() readies it
    )
    install_triton(app)  # the statistics table's row, the shared-memory registry
    http.install(app)  # first: it makes each request's context
    tracing.install(app)  # after http (its clock), before the rest: every request has a trace
    accesslog.install(app)
    metrics.install(app)  # before auth and admission: their refusals are counted too
    auth.install(app)
    admission.install(app)
    compression.install(
        app, settings.compress_level, settings.compress_min_bytes, settings.compress_max_bytes
    )  # last: its hook runs first (compression.install)
    errors.register(app, doors={kserve.bp: errors.Door(kserve.error_body, errors.PROTOCOL_STATUS)})
    app.register_blueprint(api.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(kserve.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(playground.bp)
    return app
