"""A server started for a measurement (the bench and the soak): a command, `python -m service` by
default, on a free loopback port, its output in a log file, its gunicorn workers read from /proc."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop proc: SIGTERM, up to grace_s for it to exit, then SIGKILL; nothing if it has exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """A gunicorn master started here on a free loopback port; its workers are its children.
    argv may name the port as "{port}"; HOST and PORT are set in its environment, and
    PROMETHEUS_MULTIPROC_DIR is not inherited (each server keeps its own metrics); nor are ATTN_*
    settings if inherit_settings is false (the defaults, as `make run` in a clean shell). cwd is
    the checkout it serves."""

    def __init__(self, name: str, argv: list[str] | None = None, env: dict | None = None, cwd: Path = ROOT, inherit_settings: bool = True):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        inherited = {
            k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and (inherit_settings or not k.startswith("ATTN_"))
        }
        full_env = {**inherited, "HOST": "127.0.0.1", "PORT": str(self.port), **(env or {})}
        argv = [a.replace("{port}", str(self.port)) for a in (argv or [sys.executable, "-m", "service"])]
        self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 90, in_a_row: int = 1, path: str = "/readyz") -> None:
        """Wait until path (GET) answers 200 in_a_row times running, each on a new connection (each
        worker warms up on its own: many in a row reach them all). The timeout only stops a hang;
        either failure says so with the tail of the server's log."""
        deadline, ok = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready; its log ends:\n{self.log_tail()}"
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", path)
                ok = ok + 1 if conn.getresponse().status == 200 else 0
                conn.close()
            except OSError:
                ok = 0
            if ok >= in_a_row:
                return
            if not ok:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s ({self.url}{path}); its log ends:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def workers(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def stop(self) -> None:
        """SIGTERM, and time for gunicorn's 30 s graceful shutdown; then SIGKILL. The log file goes too."""
        terminate(self.proc, 35)
        Path(self.log.name).unlink(missing_ok=True)
