"""gunicorn configuration for the attention service (read by `python -m service`).

Where it listens comes from the service's Settings (HOST, PORT): configuration lives in one place.
The server hooks at the end give every worker its share of the metrics."""
import os
import shutil
import tempfile

# prometheus_client chooses multiprocess mode when it is first imported, which happens as soon
# as the service is (the next import): the directory must be named before that. Unset: a fresh
# private directory, removed on exit. Set (e.g. /tmp/prometheus under Kubernetes): service.metrics
# creates it if missing, and on_starting empties it.
_own_metrics_dir = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _own_metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="attention-metrics-")

from service.config import Settings  # noqa: E402  (after the metrics directory, see above)

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


# --- server hooks -------------------------------------------------------------------------------

def on_starting(server):
    """Arbiter start: empty the metrics directory, so a previous run's counts do not come back."""
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    for name in os.listdir(directory):
        if name.endswith(".db"):
            os.remove(os.path.join(directory, name))


def child_exit(server, worker):
    """A worker is gone (exited or killed): its live gauges (in flight, queued) stop counting."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if _own_metrics_dir:
        shutil.rmtree(_own_metrics_dir, ignore_errors=True)
