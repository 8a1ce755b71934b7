"""gunicorn configuration for the attention service (read by `python -m service`).

Where it listens comes from the service's Settings (HOST, PORT): configuration lives in one place."""
import os

# One BLAS thread per worker: two sync workers on two cores, each computing on its own core.
# Set before the import below loads numpy (and OpenBLAS reads it); the workers inherit it.
# Measured (bench/README.md): 2 workers x 1 thread; see the worker model below.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from service.config import Settings  # noqa: E402  (after the BLAS threads are set)

_settings = Settings.from_env()

bind = f"{_settings.host}:{_settings.port}"
# Two cores: two worker processes, each computing on one core.
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
worker_class = "sync"
timeout = 60              # a worker silent this long is killed and replaced
graceful_timeout = 30     # SIGTERM: in-flight requests get this long to finish
keepalive = 5
accesslog = "-"
errorlog = "-"
loglevel = "info"
