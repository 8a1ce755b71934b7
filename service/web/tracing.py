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

import logging
import random
import re
import time
from dataclasses import dataclass

from flask import Flask, Response, request

from service.config import Settings

from . import metrics
from .context import RequestContext, context, services

log = logging.getLogger("service")

# version-traceid-parentid-flags, lower-case hex; a later version may append "-..." fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(slots=True)
class Trace:
    """This request's place in a trace (ids as lower-case hex)."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits: this request's span
    parent_id: str | None  # the caller's span, when it sent a valid traceparent
    flags: str  # 2 hex digits; "01": sampled (recorded) upstream or here

    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid W3C traceparent header, else None.

    Valid: version 00 exactly (55 characters) or a later version (not ff) with anything after a
    "-"; lower-case hex; neither id all zeros (W3C Trace Context, section 3.2)."""
    if not value or len(value) > 512:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None) or trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id, flags


def new_id(bits: int) -> str:
    """A random non-zero id of bits/4 hex digits (random is reseeded in each forked worker)."""
    while not (n := random.getrandbits(bits)):
        pass
    return f"{n:0{bits // 4}x}"


def start(traceparent: str | None) -> Trace:
    """The caller's trace continued by a new span, or a new trace if it sent none valid. Flags are
    the caller's (we do not change its sampling decision); a new trace says 00, as nothing records it."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return Trace(new_id(128), new_id(64), None, "00")
    trace_id, parent_id, flags = parsed
    return Trace(trace_id, new_id(64), parent_id, flags)


def job_fields(job) -> dict[str, int]:
    """B, H, T, S, d of a job (schemas.jobs): B the attention's leading axes (heads included), H the
    heads (/mha's count; /attention's axis before T, 1 if q has none), d the query/key width."""
    heads = getattr(job, "heads", None)
    if heads is None:
        shape = job.q.shape
        heads = shape[-3] if len(shape) >= 3 else 1
    return {"B": job.B, "H": int(heads), "T": int(job.T), "S": int(job.S), "d": int(job.head_widths[0])}


class Spans:
    """The OpenTelemetry side: made only when tracing is on (it imports the API)."""

    def __init__(self, tracer):
        from opentelemetry import trace as api

        self.api, self.tracer = api, tracer

    def start(self, trace: Trace, name: str):
        """Start this request's SERVER span under the caller's span; trace takes the span's ids."""
        api, context = self.api, None
        if trace.parent_id is not None:
            caller = api.SpanContext(int(trace.trace_id, 16), int(trace.parent_id, 16), True, api.TraceFlags(int(trace.flags, 16)))
            context = api.set_span_in_context(api.NonRecordingSpan(caller))
        span = self.tracer.start_span(name, context=context, kind=api.SpanKind.SERVER, start_time=time.time_ns())
        sc = span.get_span_context()
        trace.trace_id, trace.span_id, trace.flags = f"{sc.trace_id:032x}", f"{sc.span_id:016x}", f"{sc.trace_flags:02x}"
        return span

    def finish(self, span, resp: Response, ctx: RequestContext) -> None:
        """Attributes, a child span per timed phase, and the span's end once the body is sent."""
        status = resp.status_code
        attributes = {"http.response.status_code": status, "attention.request_id": ctx.request_id}
        if (code := ctx.error_code) is not None:
            attributes["error.type"] = code
        if (job := ctx.job) is not None:
            attributes.update({f"attention.{k}": v for k, v in job_fields(job).items()})
        if (predicted := ctx.predicted_ms) is not None:
            attributes["attention.predicted_ms"] = predicted
        if (compute := ctx.phases.get("compute")) is not None:
            attributes["attention.compute_ms"] = compute
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(self.api.Status(self.api.StatusCode.ERROR, code))
        wall0, perf0 = ctx.trace_clock
        parent = self.api.set_span_in_context(span)
        spans, ctx.spans = ctx.spans or [], None
        for name, began, ms in spans:
            t = wall0 + int((began - perf0) * 1e9)
            self.tracer.start_span(name, context=parent, start_time=t).end(end_time=t + int(ms * 1e6))
        metrics.when_sent(resp, span.end)


def use_provider(app: Flask, provider) -> None:
    """Trace this app's requests with an OpenTelemetry TracerProvider (tests pass one with an
    in-memory exporter). An app's own, from the OTEL_* variables, is spans_for()'s."""
    services(app).spans = Spans(provider.get_tracer("service.web"))


def _provider(exporters: tuple[str, ...]):
    """A TracerProvider exporting to the named exporters in batches, or None without the SDK or
    any of the exporters. The SDK reads the rest of its configuration (sampler, endpoint, headers,
    service name: "attention" unless OTEL_SERVICE_NAME says) itself."""
    try:
        from importlib.metadata import entry_points

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* variables configure tracing but opentelemetry-sdk is not installed: no spans are exported")
        return None
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "attention"}))
    provider, exporting = TracerProvider(resource=resource), False
    for name in exporters:
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            log.warning("no OpenTelemetry span exporter named %r is installed (pip install opentelemetry-exporter-otlp)", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(next(iter(found)).load()()))
        exporting = True
    return provider if exporting else None  # spans nobody receives are not made


def spans_for(settings: Settings) -> Spans | None:
    """Spans to trace an app's requests with, when the OTEL_* variables configure an exporter
    (and the SDK and the exporter are installed); else None."""
    if settings.otel_trace_exporters and (provider := _provider(settings.otel_trace_exporters)) is not None:
        return Spans(provider.get_tracer("service.web"))
    return None


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
            ctx.trace_clock = (time.time_ns(), time.perf_counter())
            ctx.span = spans.start(trace, name)
            ctx.spans = []  # http.phase() appends (name, start, ms) to it

    @app.after_request
    def _propagate(resp: Response):
        ctx = context()
        if ctx.trace is not None:
            resp.headers["traceparent"] = ctx.trace.traceparent()
            spans = services(app).spans
            if (span := ctx.span) is not None and spans is not None:
                ctx.span = None
                spans.finish(span, resp, ctx)
        return resp
