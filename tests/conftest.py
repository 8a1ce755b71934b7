"""Shared fixtures: an app with small limits, its test client, a seeded rng, and a live_server
that runs the real gunicorn (python -m service) on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from hypothesis import settings as hypothesis_settings

from service import create_app
from service.config import Settings

ROOT = Path(__file__).resolve().parent.parent

# Property tests explore freely on a developer's machine and replay a fixed set in CI.
hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")

SMALL = Settings(max_t=64, max_s=64, max_score_elements=20_000, max_weights_elements=10_000, max_body_bytes=200_000, max_d=64, warmup=False)


@pytest.fixture
def settings() -> Settings:
    return SMALL


@pytest.fixture
def app(settings):
    app = create_app(settings)
    app.testing = True
    return app


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env: dict | None = None, timeout: float = 60.0):
    """Start `python -m service` on a free loopback port; returns (process, base_url) once ready."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # each server its own
    full_env = {**inherited, "HOST": "127.0.0.1", "PORT": str(port), **(env or {})}
    log = tempfile.NamedTemporaryFile(prefix="attention-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_path = log.name  # read by tests that inspect the server's log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
        try:
            if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"server not ready within {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=35)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def live_server():
    """Base URL of the real gunicorn server, shared by the session's end-to-end tests."""
    proc, url = start_server()
    yield url
    stop_server(proc)


def worker_pids(proc: subprocess.Popen) -> set[int]:
    """The gunicorn arbiter's children: its workers (Linux /proc)."""
    return {int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()}


def wait_for_workers(proc: subprocess.Popen, n: int = 2, gone: int | None = None) -> set[int]:
    """Wait until the arbiter has n workers (and none is the pid gone); their pids."""

    def workers():
        pids = worker_pids(proc)
        return pids if len(pids) == n and gone not in pids else None

    return wait_until(workers, timeout=30)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1):
    """Poll predicate() until it returns a true value (returned), or fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not true within {timeout} s: {predicate.__doc__ or predicate}")
