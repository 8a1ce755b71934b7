"""gunicorn configuration for the attention service (read by `python -m service`).

Where it listens comes from the service's Settings (HOST, PORT): configuration lives in one place."""
import os

# One BLAS thread per worker, so that workers x threads = 2 never oversubscribes the 2 cores.
# Set before the import below loads numpy (OpenBLAS reads it then); the workers inherit it. An
# OPENBLAS_NUM_THREADS already in the environment wins. Why: see the worker model below.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from service.config import Settings  # noqa: E402  (after the BLAS threads are set)

_settings = Settings.from_env()

bind = f"{_settings.host}:{_settings.port}"
# Worker model, measured by `python -m bench.workers` (b64, T=1024, B=1 H=8 d=64; bench/README.md):
# 2 workers x 1 BLAS thread had the best throughput at concurrency 2 (2.5x to 7x that of 1 x 2
# or 2 x 2) and the best latency at concurrency 1 but once (with weights, 2 x 2 answered alone in
# 94 ms against 202 ms, then took 910 ms against 284 ms at concurrency 2): with two BLAS threads
# per worker, a worker spin-waits for a core that the other worker, or anything else, holds.
# Sync workers: a request is CPU-bound from its first byte to its last, so threads or async
# workers would only queue inside the process (admission control decides who waits).
# Not preloaded: nothing measurable to gain (workers start in ~1 s) and each worker imports fresh.
# Allocator left at glibc's defaults: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ of 1 GiB gave no
# measurable gain (page faults on a fresh 32 MiB of weights cost ~4 ms of ~150) and kept up to
# 200 MiB per idle worker after a T=2048 request.
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
worker_class = "sync"
timeout = 60              # a worker silent this long is killed and replaced
graceful_timeout = 30     # SIGTERM: in-flight requests get this long to finish
keepalive = 5
accesslog = "-"
errorlog = "-"
loglevel = "info"
# gunicorn 27's control socket lives in $HOME/.gunicorn, which the container's user cannot write
# (read-only root filesystem); the service does not use it.
control_socket_disable = True
