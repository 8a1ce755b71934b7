"""Trace context (W3C `traceparent`) and OpenTelemetry spans: the request's place in a trace and
its span, as plain objects (tracing.py installs the hooks that make them). Imports nothing of the
web layer.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from service.config import Settings

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
    span: Any = None  # the OpenTelemetry span, when spans are on; ended once the answer is sent
    clock: tuple[int, float] = field(default=(0, 0.0))  # (time.time_ns(), perf_counter()) at the span's start

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

    def finish(self, trace: Trace, status: int, attributes: dict, timeline: list[tuple[str, float, float]]) -> None:
        """Attributes, the status, and a child span per timed phase (timeline: (name, start
        perf_counter(), ms)); the caller ends the span once the body is sent."""
        span, code = trace.span, attributes.get("error.type")
        span.set_attributes(attributes)
        if status >= 500:
            span.set_status(self.api.Status(self.api.StatusCode.ERROR, code))
        wall0, perf0 = trace.clock
        parent = self.api.set_span_in_context(span)
        for name, began, ms in timeline:
            t = wall0 + int((began - perf0) * 1e9)
            self.tracer.start_span(name, context=parent, start_time=t).end(end_time=t + int(ms * 1e6))


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
