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
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

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
    it at 88-122 MB over the same load (a study retired from bench/: git log -- bench/rss_soak.py). The threshold is 4 MiB, not 1, and the
    trim threshold 16 MiB, so that a request's blocks under 4 MiB (the core's ~1 MiB scratch)
    reuse heap pages: at 1 MiB with the default trim every request page-faulted its scratch afresh
    (T=1024 without weights: 0 -> 6,500 faults and +30% CPU; with these values 0 faults and the
    default's CPU; git log -- bench/malloc_cost.py). mallopt in the arbiter, before the workers fork (they
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
# Worker model: 2 workers x 1 BLAS thread, chosen by measuring 2x1 against 1x2
# and 2x2 (git log -- bench/workers.py): with two BLAS threads per worker, a worker spin-waits for a core that
# the other worker, or anything else, holds, and latency under concurrency suffers.
# Not preloaded: nothing measurable to gain and each worker imports fresh.
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
# Threaded workers (with the 2 workers x 1 BLAS thread above), so that requests past what the server
# can finish in time reach the app, are predicted, and are queued or refused at once (503 with
# Retry-After, or 504). A sync worker holds one request and the excess waits unseen in the listen
# backlog, where nothing can count, predict or shed it. Each worker computes ATTN_MAX_INFLIGHT at a
# time; a request admitted to wait holds a thread, so the threads (below) hold every request the
# server admits, and 16 more answer /healthz, /readyz and /metrics meanwhile. The comparison with
# sync workers: `python -m tests.test_overload burst` and `... rate` with
# GUNICORN_CMD_ARGS="--worker-class sync --threads 1" (bench/README.md).
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
# (service/admission/census.py): one worker may hold every admitted request (waiting in its queue, or
# computing) while its siblings idle, so its threads fit all of them, and 16 more for the
# operations endpoints and the refusals.
threads = workers * (_settings.max_inflight + _settings.max_queue) + 16
worker_connections = 4096
sendfile = False  # every byte goes through the worker's sendall, which never blocks a thread


# --- server hooks -------------------------------------------------------------------------------


def on_starting(server):
    """Arbiter start: the admission census, the sessions' pool, Triton's statistics table and (when
    allowed) the client shared-memory registry the workers will share (they inherit them when they
    fork), and an empty metrics directory, so a previous run's counts do not come back."""
    from service import sessions, shm, stats
    from service.admission import census

    census.create()
    sessions.create(_settings)
    stats.create()  # Triton's statistics, counted over every worker
    if _settings.allow_client_shm:
        shm.create()  # the client shared-memory regions every worker sees
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
    # The stacks in the message's own text, not an argument: arguments are escaped onto one line
    # (accesslog.ClientBytes), for what they quote of clients.
    worker.log.error(f"worker {worker.pid} timed out after {timeout} s; its threads:\n" + "\n".join(stacks))


def child_exit(server, worker):
    """A worker is gone (exited or killed): its live gauges (in flight, queued) and its admission
    counts stop counting."""
    from prometheus_client import multiprocess

    from service.admission import census

    multiprocess.mark_process_dead(worker.pid)
    if census.shared() is not None:
        census.shared().forget(worker.pid)
