"""create_app(): wires settings, blueprints (the native API, the Open Inference Protocol, OpenAPI
and docs, the playground page, operations), error handlers, timing, metrics and admission."""

from __future__ import annotations

from typing import IO

from flask import Flask, Request, Response
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.utils import cached_property
from werkzeug.wsgi import get_input_stream

from schemas import AttentionRequest, MhaRequest
from service import sessions as session_pool
from service import wire
from service.config import Settings
from service.cost import CostModel

from . import (
    accesslog,
    admit,
    api,
    auth,
    compression,
    compute,
    errors,
    http,
    kserve,
    metrics,
    openapi,
    ops,
    playground,
    sessions,
    spans,
    tracing,
)
from .context import EXTENSION, Services, services
from .triton_ext import install as install_triton  # importing it adds Triton's extensions' routes to kserve.bp


class ServiceRequest(Request):
    """Flask's request, but a body of exactly MAX_CONTENT_LENGTH bytes is within the limit."""

    @cached_property
    def stream(self) -> IO[bytes]:
        """werkzeug's stream, but bounded one byte past the limit: werkzeug's, when the server ends
        the input itself (wsgi.input_terminated, as gunicorn does), refuses (413) the read that finds
        the end of a body of exactly the limit, so that a refusal that reads the body first (a 401,
        422, 503 or 504 draining it) became a false 413. A Content-Length over the limit is 413
        before any read, as werkzeug does; a body without one is 413 at its limit's next byte."""
        if self.shallow:
            raise RuntimeError("a shallow request does not read its body")
        limit = self.max_content_length
        if limit is None:
            return get_input_stream(self.environ)
        if self.content_length is not None and self.content_length > limit:
            raise RequestEntityTooLarge()
        return get_input_stream(self.environ, max_content_length=limit + 1)


class ServiceFlask(Flask):
    """Flask, but its automatic answer to OPTIONS is JSON like every other answer (Flask's is an
    empty text/html page), a body of exactly the limit is inside it (ServiceRequest), and Upgrade is
    ignored (create_url_adapter)."""

    request_class = ServiceRequest

    def make_default_options_response(self) -> Response:
        """200, the Allow header, and {"allow": [the same methods]}."""
        resp = super().make_default_options_response()
        resp.set_data(wire.dumps({"allow": sorted(resp.allow)}))
        resp.mimetype = "application/json"
        return resp

    def create_url_adapter(self, request):
        """Flask's, but a request asking to upgrade to WebSocket is routed as the HTTP request it
        also is. The service speaks HTTP/1.1 only and ignores Upgrade, as RFC 9110 section 7.8
        lets a server that keeps to its protocol (nginx does, where no WebSocket is proxied): the
        request is answered as if Upgrade were absent, never switched. werkzeug's router would
        look for a WebSocket route and refuse (400, its WebsocketMismatch) a request every other
        client gets answered."""
        adapter = super().create_url_adapter(request)
        if adapter is not None and adapter.websocket:
            adapter.websocket, adapter.url_scheme = False, request.scheme if request is not None else "http"
        return adapter


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = ServiceFlask("service")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes

    def predict(work, busy, threads):  # the app's cost model, whichever it holds now (tests swap it)
        return services(app).cost.predict(work, busy, threads)

    app.extensions[EXTENSION] = Services(
        settings=settings,
        schemas={cls: cls(settings) for cls in (AttentionRequest, MhaRequest, *sessions.SCHEMAS)},
        kserve_schemas=kserve.build_schemas(settings),
        cost=CostModel(),
        admission=admit.make(settings, predict),
        pool=compute.make_pool(settings),
        sessions=session_pool.shared() or session_pool.pool_for(settings),  # the arbiter's, shared by the workers
        spans=spans.spans_for(settings),
        ready=not settings.warmup,  # else ops.warm_up() readies it
    )
    install_triton(app)  # the statistics table's row, the shared-memory registry
    http.install(app)  # first: it makes each request's context
    tracing.install(app)  # after http (its clock), before the rest: every request has a trace
    accesslog.install(app)
    metrics.install(app)  # before auth and admission: their refusals are counted too
    auth.install(app)
    admit.install(app, charges={kserve.bp: kserve.body_charge})  # the /v2 door parses only its JSON header as JSON
    compression.install(
        app, settings.compress_level, settings.compress_min_bytes, settings.compress_max_bytes, settings.compress_answers
    )  # last: its hook runs first (compression.install)
    errors.register(app, doors={kserve.bp: errors.Door(kserve.error_body, errors.PROTOCOL_STATUS)})
    app.register_blueprint(api.bp)
    app.register_blueprint(sessions.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(kserve.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(playground.bp)
    return app
