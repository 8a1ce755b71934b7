"""gunicorn configuration for the attention service (read by `python -m service`).

Where it listens comes from the service's Settings (HOST, PORT): configuration lives in one place."""
import os

from service.config import Settings

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
# gunicorn 27's control socket lives in $HOME/.gunicorn, which the container's user cannot write
# (read-only root filesystem); the service does not use it.
control_socket_disable = True
