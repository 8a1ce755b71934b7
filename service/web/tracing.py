"""Trace context for every request (W3C `traceparent`), and OpenTelemetry spans when an exporter
is configured.

Every request has a trace id and a span id of its own: the caller's trace if it sent a valid
`traceparent` (its span becomes our parent), else a new trace. The response carries
`traceparent: 00-<trace id>-<our span id>-<flags>` and the access log line both ids
(service.web.accesslog), so a caller's trace leads to the request's log line and back. A
malformed `traceparent` is ignored, as the standard asks (a new trace starts), never an error.

OpenTelemetry is an optional extra (`pip install opentelemetry-sdk opentelemetry-exporter-otlp`),
off unless the standard variables name an exporter (OTEL_TRACES_EXPORTER, or an
OTEL_EXPORTER_OTLP_ENDPOINT: Settings.otel_trace_exporters). On, a request is one SERVER span,
"POST /attention", child of the caller's span, with a child span per phase http.phase() timed
(decode, validate, queue, compute, encode) and the job's shape, prediction and status as
attributes; it ends when the response's last byte is sent. Off, the SDK is never imported and a
request costs a header parse and two random numbers.
"""

from __future__ import annotations

import time

from flask import Flask, Response, request

from . import metrics
from .context import context, services
from .http import when_sent
from .spans import Spans, job_fields, start


def use_provider(app: Flask, provider) -> None:
    """Trace this app's requests with an OpenTelemetry TracerProvider (tests pass one with an
    in-memory exporter). An app's own, from the OTEL_* variables, is spans_for()'s."""
    services(app).spans = Spans(provider.get_tracer("service.web"))


def install(app: Flask) -> None:
    """Continue or start a trace per request and answer with its traceparent; spans if configured
    (Services.spans: spans_for(), or use_provider())."""

    @app.before_request
    def _start():
        ctx = context()
        trace = ctx.trace = start(request.headers.get("traceparent"))
        spans = services(app).spans
        if spans is not None:
            rule, method = request.url_rule, metrics.method_label(request.method)  # a bounded span name
            name = method if rule is None else f"{method} {rule.rule}"
            trace.clock = (time.time_ns(), time.perf_counter())
            trace.span = spans.start(trace, name)

    @app.after_request
    def _propagate(resp: Response):
        ctx = context()
        if ctx.trace is not None:
            resp.headers["traceparent"] = ctx.trace.traceparent()
            spans, span = services(app).spans, ctx.trace.span
            if span is not None and spans is not None:
                spans.finish(ctx.trace, resp.status_code, _attributes(resp.status_code), ctx.timeline)
                ctx.trace.span = None  # ended once, when the body is sent
                when_sent(resp, span.end)
        return resp


def _attributes(status: int) -> dict:
    """The span's attributes: the status, the request id, the error, the job's shape, its
    predicted and measured compute."""
    ctx = context()
    attributes: dict = {"http.response.status_code": status, "attention.request_id": ctx.request_id}
    if (code := ctx.error_code) is not None:
        attributes["error.type"] = code
    if (job := ctx.job) is not None:
        attributes.update({f"attention.{k}": v for k, v in job_fields(job).items()})
    if (ticket := ctx.ticket) is not None and ticket.work is not None:
        attributes["attention.predicted_ms"] = ticket.predicted_ms
    if (compute := ctx.phases.get("compute")) is not None:
        attributes["attention.compute_ms"] = compute
    return attributes
