"""The app's state in two typed objects: Services, what the app holds for its life (one per app,
under one app.extensions key), and RequestContext, what one request holds on its way through the
hooks and the view (one per request, in one flask.g key).

A RequestContext is made in one place, begin(), by the app's first before_request hook
(http.install); every other module reads and writes its fields through context()."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, g

if TYPE_CHECKING:  # annotations only; and only of what sits below this module (no cycle: tests/test_layers.py)
    from flask import Response

    from schemas import AttentionJob, MhaJob, RequestError, SessionBatchJob, SessionStepJob
    from service.admission import Admission, Deadline, Ticket
    from service.config import Settings
    from service.cost import CostModel
    from service.sessions import Pool
    from service.shm import Registry
    from service.stats import Row

    from .spans import Spans, Trace

EXTENSION = "attention"  # app.extensions[EXTENSION]: this app's Services
_G = "attention"  # flask.g.attention: this request's RequestContext


@dataclass
class Services:
    """What the app holds for its life: made by create_app(), read by every hook and view."""

    settings: Settings
    schemas: dict[type, Any]  # the native schemas by class (AttentionRequest, MhaRequest, the sessions')
    kserve_schemas: dict[str, Any]  # the Open Inference Protocol's, by model name
    cost: CostModel
    admission: Admission  # this worker's requests, bytes and compute slots (service.admission)
    pool: Executor | None  # the threads a split computation shares (None: splitting is off)
    sessions: Pool  # every session's keys and values (service.sessions): the server's, or this app's own
    spans: Spans | None = None  # OpenTelemetry, when an exporter is configured (tracing)
    answer_error: Callable[[RequestError], Response] | None = None  # a refusal as its front door answers it (errors.register)
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
    """What one request is: its id, its clock and phases, its deadline, its trace, its admission
    ticket, its job, and the error it was answered with. Each field has one writer (named)."""

    t0: float  # time.perf_counter() when the app saw the request: its clock (http)
    request_id: str  # X-Request-Id, the client's or ours (http)
    arrived: float  # time.perf_counter() of its first byte, the clock X-Deadline-Ms runs on (http)
    phases: dict[str, float] = field(default_factory=dict)  # phase name -> ms (http.phase)
    timeline: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, start, ms) as timed (http.phase)
    deadline: Deadline | None = None  # X-Deadline-Ms (admit)
    ticket: Ticket | None = None  # its hold on admission, and what admission decided for its job (admit)
    trace: Trace | None = None  # its place in a trace, and its span when spans are on (tracing)
    job: AttentionJob | MhaJob | SessionStepJob | SessionBatchJob | None = None  # the validated job (compute)
    shm_read: int = 0  # bytes its inputs in shared memory came to so far (shared_memory.read_input)
    error_code: str | None = None  # the error it was answered with (errors)
    error_field: str | None = None
    counted: bool = False  # in the in-flight gauges until its answer is sent (metrics)


def begin(t0: float, request_id: str, arrived: float) -> RequestContext:
    """Make this request's context: the first before_request hook's (http.install) alone."""
    ctx = RequestContext(t0, request_id, arrived)
    setattr(g, _G, ctx)
    return ctx


def context() -> RequestContext:
    """This request's context (begin() made it in the app's first before_request hook)."""
    return getattr(g, _G)
