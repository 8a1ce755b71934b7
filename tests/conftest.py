"""Shared fixtures: an app with small limits, its test client, a seeded rng, and a live_server
that runs the real gunicorn (python -m service) on a free loopback port."""

from __future__ import annotations

import http.client
import io
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

from service.config import Settings
from service.web import create_app

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


READY_IN_A_ROW = 20  # /readyz answers on fresh connections before a server counts as ready


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
    deadline, ready_in_a_row = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
        try:
            # Each worker warms up on its own: one 200 may come from the first one ready while
            # another still says 503. Many in a row, each on a new connection, reach them all.
            if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                ready_in_a_row += 1
                if ready_in_a_row >= READY_IN_A_ROW:
                    return proc, url
                continue
            ready_in_a_row = 0
        except requests.ConnectionError:
            ready_in_a_row = 0
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


# --- shared by the attack suite and the soak test ------------------------------------------------


def numeric_core():
    """The in-process numeric core (attention, mha)."""
    from service import core

    return core


SEED_EXAMPLE = {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": True}


def assert_seed_answered(url: str, session: requests.Session | None = None) -> None:
    """The seed example gets 200 and the in-process core's answer: the server took no harm."""
    r = (session or requests).post(f"{url}/attention", json=SEED_EXAMPLE, timeout=30)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    q, k, v = (np.array(SEED_EXAMPLE[n], dtype=np.float32) for n in ("q", "k", "v"))
    out, weights = numeric_core().attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.array(body["out"]), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(body["weights"]), weights, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="session")
def attack_server():
    """(process, base URL) of a real gunicorn server for the attack suite: default limits, but a
    32 MiB body limit (so that over-limit bodies stay cheap to send) and a 2**24-element output
    limit, both pinned so the cases do not depend on future defaults."""
    proc, url = start_server({"ATTN_MAX_BODY_BYTES": str(32 * 2**20), "ATTN_MAX_OUTPUT_ELEMENTS": str(2**24)})
    yield proc, url
    stop_server(proc)


class _KeepOpen(io.BufferedReader):
    """One buffered reader for several responses on one socket (http.client closes its reader
    after each response; pipelined answers share the buffer)."""

    def close(self) -> None:
        pass


class _OneReader:
    def __init__(self, reader):
        self.reader = reader

    def makefile(self, *args, **kwargs):
        return self.reader


def raw_exchange(
    url: str, data: bytes | list[bytes], *, responses: int = 1, shut_write: bool = False, timeout: float = 30.0
) -> list[tuple[int | None, dict, bytes]]:
    """Send bytes as they are on a fresh connection (a list: one write each); read up to
    `responses` HTTP responses. Each is (status, headers lower-cased, body); status None where the
    server closed the connection instead of answering."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        for part in [data] if isinstance(data, bytes) else data:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        reader = _OneReader(_KeepOpen(socket.SocketIO(sock, "rb")))
        for _ in range(responses):
            resp = http.client.HTTPResponse(reader)
            try:
                resp.begin()
                body = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, http.client.IncompleteRead):
                out.append((None, {}, b""))
                break
            out.append((resp.status, {k.lower(): v for k, v in resp.getheaders()}, body))
    return out
