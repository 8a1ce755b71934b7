"""Prometheus metrics: what is counted, and GET /metrics.

Under gunicorn every worker is a process, so prometheus_client runs in multiprocess mode: each
worker writes its values to files in PROMETHEUS_MULTIPROC_DIR and /metrics merges them all.
That variable must be set before prometheus_client is first imported (deploy/gunicorn.conf.py
sets it when unset; this module creates the directory if it is missing); without it (tests, a
single process) the ordinary in-process registry is used.

Label values are bounded: endpoint is the route's rule ("unmatched" for 404/405), method is one
of METHODS or "other" (the HTTP server accepts any token as a method), status is a code the app
emits, T is bucketed to a power of two, phase is one of the code's phase names, code is one of
the contract's error codes, pid (worker memory, read when scraped) one of the live workers.
"""

from __future__ import annotations

import math
import os
import time

from flask import Blueprint, Flask, Response, request

from service.cost import Work
from service.transport import SENT_KEY

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # named but perhaps not made (an emptyDir at /tmp)
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

from prometheus_client import (  # noqa: E402  (after the directory exists)
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402

from .context import context, services  # noqa: E402
from .http import when_sent  # noqa: E402

# prometheus_client chose its mode by this variable when first imported (above, or earlier in the
# same process: the variable is set before either, deploy/gunicorn.conf.py). The library has no
# public accessor for the mode it chose; it documents the variable as the switch, so it is read here.
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)

REQUESTS = Counter(
    "attention_http_requests_total", "HTTP requests answered, by endpoint, method and status.", ["endpoint", "method", "status"]
)
LATENCY = Histogram(
    "attention_http_request_duration_seconds",
    "Time from the request reaching the app to its response's last byte, by endpoint, method and status.",
    ["endpoint", "method", "status"],
    buckets=LATENCY_BUCKETS,
)
PHASES = Histogram(
    "attention_phase_duration_seconds",
    "Time per request phase (queue, decode, validate, compute, encode), by endpoint.",
    ["endpoint", "phase"],
    buckets=LATENCY_BUCKETS,
)
COMPUTE = Histogram(
    "attention_compute_duration_seconds",
    "Compute time by endpoint and sequence length T rounded up to a power of two (at least 64).",
    ["endpoint", "t_bucket"],
    buckets=LATENCY_BUCKETS,
)
PREDICTION = Histogram(
    "attention_cost_prediction_ratio",
    "Measured compute time over the cost model's prediction, per computed request.",
    ["endpoint"],
    buckets=RATIO_BUCKETS,
)
REJECTIONS = Counter(
    "attention_rejections_total",
    "Requests answered with an error body, by endpoint and error code (the contract's codes).",
    ["endpoint", "code"],
)
IN_FLIGHT = Gauge("attention_requests_in_flight", "Requests being handled now, summed over live workers.", multiprocess_mode="livesum")
IN_FLIGHT_MAX = Gauge(
    "attention_requests_in_flight_worker_max", "Requests being handled now by the busiest live worker.", multiprocess_mode="livemax"
)
QUEUED = Gauge(
    "attention_admission_queued_requests",
    "Admitted compute requests waiting for a compute slot, summed over live workers.",
    multiprocess_mode="livesum",
)
RUNNING = Gauge(
    "attention_admission_running_requests",
    "Admitted compute requests holding a compute slot, summed over live workers.",
    multiprocess_mode="livesum",
)
BYTES = Gauge(
    "attention_admission_inflight_bytes",
    "Request and estimated working bytes held by admitted requests, summed over live workers.",
    multiprocess_mode="livesum",
)
READY = Gauge(
    "attention_workers_ready",
    "Live workers that are ready (warm-up done, not draining): a drop is a worker lost or going.",
    multiprocess_mode="livesum",
)
ANSWER_SEND = Histogram(
    "attention_answer_send_seconds",
    "Time from a computed answer's start (its head about to be written) to its last byte handed to the kernel, by endpoint: what X-Deadline-Ms does not cover.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
LATE_ANSWERS = Counter(
    "attention_answers_after_deadline_total",
    "Answers started within their X-Deadline-Ms whose last byte left after it (the client's reading, the network), by endpoint.",
    ["endpoint"],
)
SPLITS = Counter(
    "attention_split_computations_total",
    "Computations split across threads: a large request alone on the server, on several cores (ATTN_SPLIT_THREADS).",
)

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def metrics():
    """Prometheus text exposition of every live and past worker's metrics."""
    if MULTIPROCESS:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(WORKER_MEMORY)
    else:
        registry = REGISTRY
    pool = CollectorRegistry()  # read from the shared pool at scrape time: the same figures from any worker
    pool.register(SessionPool(services().sessions))
    return Response(generate_latest(registry) + generate_latest(pool), content_type=CONTENT_TYPE_LATEST)


class SessionPool:
    """The sessions' pool (service.sessions), read when scraped: live sessions, pages, bytes in use
    and in all, and the sessions expired since the server started."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        stats = self.pool.stats()
        for name, key, text in (
            ("attention_sessions", "sessions", "Live sessions."),
            ("attention_session_pages", "pages", "Pages of the sessions' pool in use (a page shared by forks counts once)."),
            ("attention_session_bytes", "used_bytes", "Bytes of the sessions' pool in use."),
            ("attention_session_memory_bytes", "memory_bytes", "Bytes of the sessions' pool (ATTN_SESSION_MEMORY_BYTES)."),
        ):
            family = GaugeMetricFamily(name, text)
            family.add_metric([], stats[key])
            yield family
        expired = CounterMetricFamily("attention_session_expiries", "Sessions expired, idle past ATTN_SESSION_IDLE_S.")
        expired.add_metric([], stats["expired"])
        yield expired


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # /proc/PID/statm counts pages


class WorkerMemory:
    """attention_worker_resident_memory_bytes{pid}: each live worker's RSS, read from /proc when
    scraped. Multiprocess mode merges no process_* metrics (each worker's would be its own), so the
    scraping worker reads its siblings': the children of its parent, gunicorn's arbiter. In one
    process (no gunicorn), that process alone. Nothing on a system without /proc."""

    def collect(self):
        family = GaugeMetricFamily(
            "attention_worker_resident_memory_bytes", "Resident memory of each live worker, read from /proc at scrape time.", labels=["pid"]
        )
        pids = [os.getpid()]
        if MULTIPROCESS:
            try:
                ppid = os.getppid()
                with open(f"/proc/{ppid}/task/{ppid}/children") as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                pass
        for pid in pids:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    family.add_metric([str(pid)], int(f.read().split()[1]) * PAGE_BYTES)
            except (OSError, IndexError, ValueError):  # gone meanwhile, or no /proc
                pass
        yield family


WORKER_MEMORY = WorkerMemory()
if not MULTIPROCESS:
    REGISTRY.register(WORKER_MEMORY)


def t_bucket(T: int) -> str:
    """T rounded up to a power of two, at least 64: a bounded label."""
    return str(max(64, 1 << max(0, math.ceil(math.log2(max(T, 1))))))


_children: dict[tuple, object] = {}


def child(metric, *labels: str):
    """metric.labels(*labels), looked up once per label set: .labels() takes a lock and checks and
    converts its values on every call (label values are bounded, so the cache is too)."""
    key = (metric, labels)
    found = _children.get(key)
    if found is None:
        found = _children.setdefault(key, metric.labels(*labels))
    return found


def observe_compute(work: Work, ms: float, predicted_ms: float) -> None:
    """One computed job: its compute time by T, and how it compares with the prediction."""
    endpoint = _endpoint()
    child(COMPUTE, endpoint, t_bucket(work.T)).observe(ms / 1000)
    if predicted_ms > 0:
        child(PREDICTION, endpoint).observe(ms / predicted_ms)


def method_label(method: str) -> str:
    """The method as a label value: a standard one as is, any other token "other" (each made-up
    method would otherwise be a new time series, and a new file in multiprocess mode)."""
    return method if method in METHODS else "other"


def _endpoint() -> str:
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


_GAUGES = {"queued": QUEUED, "running": RUNNING, "bytes": BYTES}


def admission_count(what: str, change: float) -> None:
    """Admission's metrics callback (service.admission.Admission's count)."""
    if what == "splits":
        SPLITS.inc(change)
    else:
        _GAUGES[what].inc(change)


def install(app: Flask) -> None:
    """Count every request: register before the admission hooks so rejections are counted too."""
    app.register_blueprint(bp)
    READY.set(1 if services(app).ready else 0)  # ops.warm_up() and drain() change it

    @app.before_request
    def _start():
        context().counted = True
        IN_FLIGHT.inc()
        IN_FLIGHT_MAX.inc()

    @app.after_request
    def _observe(resp: Response):
        ctx = context()
        if not ctx.counted:
            return resp
        ctx.counted = False
        endpoint, method, status = _endpoint(), method_label(request.method), str(resp.status_code)
        child(REQUESTS, endpoint, method, status).inc()
        latency, t0 = child(LATENCY, endpoint, method, status), ctx.t0

        def sent():
            latency.observe(time.perf_counter() - t0)
            IN_FLIGHT.dec()
            IN_FLIGHT_MAX.dec()

        when_sent(resp, sent)
        if ctx.job is not None and resp.status_code < 400:  # a computed answer
            _time_the_send(resp, endpoint, ctx.deadline.at if ctx.deadline is not None else math.inf)
        for name, ms in ctx.phases.items():
            child(PHASES, endpoint, name).observe(ms / 1000)
        if ctx.error_code is not None:  # an error answer (not, say, /readyz's 503)
            child(REJECTIONS, endpoint, ctx.error_code).inc()
        return resp

    @app.teardown_request
    def _finish(exc):
        ctx = context()
        if ctx.counted:  # no response was made
            ctx.counted = False
            IN_FLIGHT.dec()
            IN_FLIGHT_MAX.dec()


def _time_the_send(resp: Response, endpoint: str, deadline_at: float) -> None:
    """The answer's way to its client, from now (its start) to its last byte handed to the kernel:
    the event loop's moment (SENT_KEY) where the worker has one, since a slow reader's rest is
    written there after the thread is done; else when the body has been iterated."""
    start = time.perf_counter()

    def sent(written: bool = True) -> None:
        if written:
            end = time.perf_counter()
            child(ANSWER_SEND, endpoint).observe(end - start)
            if end > deadline_at:
                child(LATE_ANSWERS, endpoint).inc()

    when_written = request.environ.get(SENT_KEY)
    if when_written is not None:
        when_written(sent)
    else:
        when_sent(resp, sent)
