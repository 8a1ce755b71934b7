"""gunicorn configuration for the attention service (read by `python -m service`).

Where it listens comes from the service's Settings (HOST, PORT): configuration lives in one place.
The server hooks at the end give every worker its share of the metrics, a warm-up before it is
ready, and a graceful drain on SIGTERM."""

import atexit
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback

# One BLAS thread per worker, so that workers x threads = 2 never oversubscribes the 2 cores.
# Set before the import below loads numpy (OpenBLAS reads it then); the workers inherit it. An
# OPENBLAS_NUM_THREADS already in the environment wins. Why: see the worker model below.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# prometheus_client chooses multiprocess mode when it is first imported, which happens as soon
# as the web layer is (the next imports): the directory must be named before that. Unset: a fresh
# private directory, removed when the process that made it (the arbiter) exits. Set (e.g.
# /tmp/prometheus under Kubernetes): service.web.metrics creates it if missing, on_starting empties it.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _own_metrics_dir = tempfile.mkdtemp(prefix="attention-metrics-")
    atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(_own_metrics_dir, ignore_errors=True))  # noqa: B008 (the pid now: only the maker removes it)


def _tune_malloc() -> None:
    """Keep worker RSS flat: buffers of 4 MiB and more always mmapped (and unmapped when freed),
    two arenas, and up to 16 MiB of free heap top kept for reuse.

    glibc serves a malloc of 128 KiB or more with mmap, but each free of such a block raises that
    threshold to its size (up to 32 MiB): after the first requests, every score block, weights
    buffer and decoded tensor under 32 MiB comes from the heap of an arena, and the gthread
    worker's threads each get an arena (up to 8 per core). Freed, those blocks stay in the
    arenas, fragmented: under 4 clients of mixed valid requests a worker went 41 -> 288 MB in
    150 s and kept rising, while tracemalloc saw the Python and numpy heap flat (+0.02 MB over 400
    requests: no leak, no cache). A fixed threshold (which also stops it moving) and 2 arenas kept
    it at 88-122 MB over the same load (bench/rss_soak.py). The threshold is 4 MiB, not 1, and the
    trim threshold 16 MiB, so that a request's blocks under 4 MiB (the core's ~1 MiB scratch)
    reuse heap pages: at 1 MiB with the default trim every request page-faulted its scratch afresh
    (T=1024 without weights: 0 -> 6,500 faults and +30% CPU; with these values 0 faults and the
    default's CPU; bench/malloc_cost.py). mallopt in the arbiter, before the workers fork (they
    inherit it), so that every way of running the service (make run, the container, compose,
    Kubernetes) gets it; MALLOC_* in the environment win."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): its allocator has none of these knobs
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # <malloc.h>
    for env, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, 4 << 20),
        ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, 16 << 20),
        ("MALLOC_ARENA_MAX", M_ARENA_MAX, 2),
    ):
        if env not in os.environ:
            libc.mallopt(param, value)


_tune_malloc()  # before the imports below allocate: the arbiter's settings are the workers'

import service.web  # noqa: E402, F401  (after the BLAS threads and the metrics directory; the workers fork with it loaded)
from service.config import Settings, warnings, web_concurrency  # noqa: E402

_settings = Settings.from_env()

# An IPv6 literal (HOST=:: or ::1) in brackets: gunicorn reads "host:port" at the last colon, and
# "::1:8000" stopped it at start ("'' is not a valid port number").
_host = f"[{_settings.host}]" if ":" in _settings.host and not _settings.host.startswith("[") else _settings.host
bind = f"{_host}:{_settings.port}"
# Worker model, measured by `python -m bench.workers` (b64, T=1024, B=1 H=8 d=64; bench/README.md):
# 2 workers x 1 BLAS thread had the best throughput at concurrency 2 (2.5x to 7x that of 1 x 2
# or 2 x 2) and the best latency at concurrency 1 but once (with weights, 2 x 2 answered alone in
# 94 ms against 202 ms, then took 910 ms against 284 ms at concurrency 2): with two BLAS threads
# per worker, a worker spin-waits for a core that the other worker, or anything else, holds.
# Not preloaded: nothing measurable to gain (workers start in ~1 s) and each worker imports fresh.
# Allocator: see _tune_malloc above (fixed mmap and trim thresholds, two arenas).
workers = web_concurrency()  # WEB_CONCURRENCY, 2 by default
timeout = 60  # a worker silent this long is killed and replaced
graceful_timeout = 30  # SIGTERM: in-flight requests get this long to finish
keepalive = 5
# Logs: the service writes its own access log, one line per request on stdout (JSON, or plain with
# ATTN_LOG_FORMAT=plain: service/web/accesslog.py), with the request id, trace, phases and shape that
# gunicorn's line lacks; gunicorn's is off. Its error log (start-up, workers, errors) goes to stderr,
# as JSON lines too when the format is json (the logger class).
accesslog = None
errorlog = "-"
loglevel = "info"
logger_class = "service.web.accesslog.GunicornLogger"
# gunicorn 27's control socket lives in $HOME/.gunicorn, which the container's user cannot write
# (read-only root filesystem); the service does not use it.
control_socket_disable = True

# --- worker class: chosen for admission control -------------------------------------------------
# Threaded workers (with the 2 workers x 1 BLAS thread above), so that requests past a worker's
# bounds reach the app and are refused with 503 at once. A sync worker holds one request and the
# excess waits unseen in the listen backlog, where nothing can count or shed it. The server admits
# (ATTN_MAX_INFLIGHT + ATTN_MAX_QUEUE) x workers requests, in any worker (service/web/census.py);
# each worker computes ATTN_MAX_INFLIGHT at a time; the 16 other threads refuse the
# excess (the event loop below has read it) and answer /healthz, /readyz and /metrics meanwhile
# (a request waiting for a thread is unseen too).
# Measured here, 2 workers on the 2 shared cores, with `python -m tests.test_overload burst` (48
# concurrent T=1024 requests, B=1 H=8 d=64, b64, weights) and `... rate` (closed loop), sync run
# with GUNICORN_CMD_ARGS="--worker-class sync --threads 1" (threads > 1 turn sync into gthread):
#   burst, sync:        48 x 200, the last after 6.9 s; /healthz waited up to 3.6 s behind them
#                       (16-21 s and 9.6-11.7 s at load average 5-7, before the fast path).
#   burst, gthread 22:  12 x 200 + 36 x 503 overloaded with Retry-After, every answer within 2.4 s,
#                       the 503s in 0.22-0.38 s (the upload); /healthz at most 0.26 s. At load
#                       average 5-7: 0.5-0.8 s, against 1.1-1.5 s with 10 threads.
#   closed loop, T=1024: 2 clients 7.5 req/s sync, 8.4 gthread; 4 clients 6.8 and 7.9.
#                T=256:  2 clients 115 and 105; 4 clients 110 and 120 (noise, either way).
#   ATTN_MAX_INFLIGHT=1 measured the same as the default 2 (T=1024, 2 clients: 8.5 req/s); 2 is
#   kept so that one worker can use both cores when the connections happen to land on it.
#
# --- slow and stalled clients: gthread, its reading and slow writing moved to the event loop ----
# service/transport/worker.py's FrontWorker is gthread (everything above holds) except that a thread gets a
# request only once the event loop has read all of it, under deadlines (408 past them), and hands
# a response a client does not read to the event loop instead of waiting (dropped after
# ATTN_SEND_TIMEOUT_S; past ATTN_SEND_BUFFER_BYTES held, new POSTs get 503). gthread alone gives
# a thread to a connection at its first byte, and the thread then waits on the socket without a
# deadline: 100 stalled uploads took every thread.
# Idle connections cost a file descriptor and no thread; worker_connections bounds them per worker
# (the worker raises its soft open-files limit to fit). docs/operations.md: "Slow and stalled clients".
worker_class = "service.transport.worker.FrontWorker"
# Admission queues by predicted wait, under a server-wide safety cap of requests held
# (service/web/census.py): one worker may hold every admitted request (waiting in its queue, or
# computing) while its siblings idle, so its threads fit all of them, and 16 more for the
# operations endpoints and the refusals.
threads = workers * (_settings.max_inflight + _settings.max_queue) + 16
worker_connections = 4096
sendfile = False  # every byte goes through the worker's sendall, which never blocks a thread


# --- server hooks -------------------------------------------------------------------------------


def on_starting(server):
    """Arbiter start: the admission census the workers will share (they inherit it when they fork),
    and an empty metrics directory, so a previous run's counts do not come back."""
    from service.web import census

    census.create()
    for said in warnings(_settings):
        server.log.warning("configuration: %s", said)
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    for name in os.listdir(directory):
        if name.endswith(".db"):
            os.remove(os.path.join(directory, name))


def post_worker_init(worker):
    """In each worker, before it serves: the transport's hooks into the app (its own refusals in the
    API's shapes, counted and logged; the placement signal: service.transport), the warm-up in the
    background (/readyz says 503 until it is done, /healthz answers meanwhile), and readiness 503
    from SIGTERM on."""
    from service.transport.worker import FrontWorker
    from service.web import front, ops

    app = worker.wsgi
    if isinstance(worker, FrontWorker):  # worker_class, unless GUNICORN_CMD_ARGS chose another
        worker.hooks = front.Front(app)
    ops.start_warm_up(app)
    stop = signal.getsignal(signal.SIGTERM)

    def drain(signum, frame):
        ops.drain(app)
        stop(signum, frame)  # the worker stops accepting; requests in flight finish

    signal.signal(signal.SIGTERM, drain)
    signal.siginterrupt(signal.SIGTERM, False)


def worker_int(worker):
    """SIGINT or SIGQUIT: the worker quits without draining."""
    worker.log.info("worker %s interrupted; quitting without draining", worker.pid)


def worker_abort(worker):
    """SIGABRT: the arbiter's timeout fired. Log where every thread was, to find what hung."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = [
        f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)) for ident, frame in sys._current_frames().items()
    ]
    worker.log.error("worker %s timed out after %s s; its threads:\n%s", worker.pid, timeout, "\n".join(stacks))


def child_exit(server, worker):
    """A worker is gone (exited or killed): its live gauges (in flight, queued) and its admission
    counts stop counting."""
    from prometheus_client import multiprocess

    from service.web import census

    multiprocess.mark_process_dead(worker.pid)
    if census.shared() is not None:
        census.shared().forget(worker.pid)
