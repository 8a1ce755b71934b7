"""The app's state in two typed objects: Services, what the app holds for its life (one per app,
under one app.extensions key), and RequestContext, what one request holds on its way through the
hooks and the view (one per request, in one flask.g key).

A RequestContext is made in one place, begin(), by the app's first before_request hook
(http.install); every other module reads and writes its fields through context()."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, g

if TYPE_CHECKING:  # annotations only: this module is imported by every other of the web layer
    from schemas import AttentionJob, MhaJob, SessionBatchJob, SessionStepJob
    from service.config import Settings
    from service.cost import CostModel, Work
    from service.sessions import Pool
    from service.shm import Registry
    from service.stats import Row

    from .admission import Gate, Ticket
    from .sending import Send
    from .tracing import Spans, Trace

EXTENSION = "attention"  # app.extensions[EXTENSION]: this app's Services
_G = "attention"  # flask.g.attention: this request's RequestContext


@dataclass
class Services:
    """What the app holds for its life: made by create_app(), read by every hook and view."""

    settings: Settings
    schemas: dict[type, Any]  # the native schemas by class (AttentionRequest, MhaRequest, the sessions')
    kserve_schemas: dict[str, Any]  # the Open Inference Protocol's, by model name
    cost: CostModel
    gate: Gate  # admission: this worker's requests, bytes and compute slots
    pool: Executor | None  # the threads a split computation shares (None: splitting is off)
    sessions: Pool  # every session's keys and values (service.sessions): the server's, or this app's own
    spans: Spans | None = None  # OpenTelemetry, when an exporter is configured (tracing)
    ready: bool = False  # warm-up done (ops.warm_up)
    draining: bool = False  # SIGTERM came (ops.drain)
    openapi: dict | None = None  # the OpenAPI document, built on first use
    stats: Row | None = None  # Triton's statistics: the server's table, this worker's row (triton_ext)
    shm: Registry | None = None  # client shared-memory regions, when ATTN_ALLOW_CLIENT_SHM (triton_ext)

    def readiness(self) -> str:
        """This worker's readiness, the one source for both front doors (/readyz and /v2's ready
        endpoints): "ready", "starting" (warm-up) or "draining" (after SIGTERM)."""
        return "draining" if self.draining else "ready" if self.ready else "starting"


def services(app: Flask | None = None) -> Services:
    """The Services of app (default: the app handling this request)."""
    return (app or current_app).extensions[EXTENSION]


@dataclass(slots=True)
class RequestContext:
    """What one request holds between the hooks and the view that fill and read it."""

    t0: float  # time.perf_counter() when the app saw the request: its clock
    request_id: str  # X-Request-Id, the client's or ours (http.request_id)
    arrived: float  # time.perf_counter() of its first byte (the transport's STARTED_KEY; else t0): X-Deadline-Ms runs from it
    phases: dict[str, float] = field(default_factory=dict)  # phase name -> ms (http.phase)
    # tracing
    trace: Trace | None = None
    span: Any = None  # the OpenTelemetry span, when spans are on; ended once the response is sent
    spans: list[tuple[str, float, float]] | None = None  # (phase, start, ms) for child spans, when on
    trace_clock: tuple[int, float] = (0, 0.0)  # (time.time_ns(), perf_counter()) at the span's start
    # metrics
    metrics_t0: float | None = None  # set by metrics' before hook, taken by its after or teardown hook
    # admission and compute
    deadline_ms: float | None = None  # X-Deadline-Ms
    admission: Ticket | None = None  # the gate's hold on this request, given back once
    job: AttentionJob | MhaJob | SessionStepJob | SessionBatchJob | None = None  # the validated job (its shape for the log and the trace)
    work: Work | None = None  # its work, as the cost model counts it
    busy: int = 1  # requests busy in the server when it was admitted (the count its slowdown is keyed by)
    predicted_ms: float | None = None  # the cost model's prediction, made when it was admitted
    answer_bytes: int = 0  # its answer's predicted bytes on the wire (cost.answer_bytes)
    stop_at: float | None = None  # perf_counter() past which its answer could not be sent by X-Deadline-Ms
    send: Send | None = None  # its answer in the worker's pipe of answers sending (sending.py), until written
    shm_read: int = 0  # bytes its inputs in shared memory came to so far (shared_memory.read_input)
    # an error answer
    error_code: str | None = None
    error_field: str | None = None


def begin(t0: float, request_id: str) -> RequestContext:
    """Make this request's context: the first before_request hook's (http.install) alone."""
    ctx = RequestContext(t0, request_id, t0)
    setattr(g, _G, ctx)
    return ctx


def context() -> RequestContext:
    """This request's context (begin() made it in the app's first before_request hook)."""
    return getattr(g, _G)
