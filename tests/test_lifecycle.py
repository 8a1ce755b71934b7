"""A worker's life: not ready until warmed up, not ready while draining, in-flight requests finish
after SIGTERM, and a killed worker is replaced while the service keeps answering."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import requests

from service import __main__ as service_main
from service.core import attention
from service.web import create_app, ops

from . import faults
from .helpers import WORKED, all_ready, start_server, stop_server, wait_for_workers, wait_until


def test_not_ready_until_warmed_up(settings):
    app = create_app(replace(settings, warmup=True))
    client = app.test_client()
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json == {"status": "starting"}
    assert client.get("/v2/health/ready").status_code == 503 and client.get("/v2/models/mha/ready").status_code == 503
    assert client.get("/healthz").status_code == 200  # alive all the same
    assert client.post("/attention", json=WORKED).status_code == 200  # and serving, on the default model
    ops.warm_up(app)
    assert client.get("/readyz").json == {"status": "ready"}
    assert client.get("/limits").json["cost_model"]["calibrated"] is True


def test_start_warm_up_runs_in_the_background(settings):
    app = create_app(replace(settings, warmup=True))
    thread = ops.start_warm_up(app)
    assert app.test_client().get("/readyz").status_code == 503
    thread.join(timeout=300)  # the calibration's budget is checked between probes: on a busy machine it overruns
    assert not thread.is_alive()
    assert app.test_client().get("/readyz").status_code == 200
    assert ops.start_warm_up(create_app(settings)) is None  # warmup=False: ready at once, nothing to run


def test_draining_is_not_ready(app, client):
    ops.drain(app)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json == {"status": "draining"}
    # one source of readiness: the protocol's front door says the same
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/models/attention/ready").status_code == 503
    assert client.get("/healthz").status_code == 200


@pytest.mark.live
def test_sigterm_lets_the_request_in_flight_finish(tmp_path):
    """A request held in the core on purpose (tests/faults.py) is in flight when SIGTERM comes,
    and stays so until the server says it is draining: then it is let go, answered 200 with the
    right answer, and the server exits cleanly."""
    held = faults.Held(tmp_path)
    proc, url = start_server(faults.faulty_env(tmp_path / "site", "hold", tmp_path))
    try:
        wait_until(lambda: all_ready(url), timeout=30)
        keep = requests.Session()  # a kept-alive connection, held open by polling it
        outcome = {}

        def post():
            r = requests.post(f"{url}/attention", json={**WORKED, "scale": faults.TRIGGER}, timeout=300)
            outcome.update(status=r.status_code, doc=r.json())

        def status() -> str:
            """/readyz's status on the kept-alive connection"""
            return keep.get(f"{url}/readyz", timeout=30).json()["status"]

        assert status() == "ready"
        client = threading.Thread(target=post)
        client.start()
        wait_until(lambda: held.entered() == 1, timeout=120, what="the request reached the core")
        os.kill(proc.pid, signal.SIGTERM)
        # Every worker drains, the one on the kept-alive connection too: it answers "draining" once
        # the signal reaches it (and closes that connection 2 s after it stops, when idle).
        wait_until(lambda: status() == "draining", timeout=60, interval=0.02)
        assert client.is_alive() and proc.poll() is None  # still in flight, the server still up
        held.release()
        client.join(timeout=300)
        assert outcome.get("status") == 200, outcome
        expect_out, expect_w = attention(*(np.array(WORKED[n], np.float32) for n in "qkv"), causal=True, scale=faults.TRIGGER)
        np.testing.assert_allclose(outcome["doc"]["out"], expect_out, rtol=1e-6)
        np.testing.assert_allclose(outcome["doc"]["weights"], expect_w, rtol=1e-6)
        assert proc.wait(timeout=60) == 0  # a clean exit within graceful_timeout
    finally:
        held.release()  # so that a test that failed holding it stops its server at once
        stop_server(proc)


@pytest.mark.live
def test_a_killed_worker_is_replaced(tmp_path):
    metrics_dir = tmp_path / "prom"
    proc, url = start_server({"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    try:
        wait_until(lambda: all_ready(url), timeout=30)
        before = wait_for_workers(proc)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        for _ in range(6):  # the next requests succeed: the other worker serves meanwhile
            assert requests.post(f"{url}/attention", json=WORKED, timeout=10).status_code == 200
        after = wait_for_workers(proc, gone=victim)
        assert after - before  # a new worker
        wait_until(lambda: all_ready(url), timeout=30)
        for _ in range(6):
            assert requests.post(f"{url}/attention", json=WORKED, timeout=10).status_code == 200
        assert not list(metrics_dir.glob(f"gauge_live*_{victim}.db"))  # its live gauges no longer count
        assert proc.poll() is None
    finally:
        stop_server(proc)


@pytest.mark.parametrize(
    ("tunables", "expected"),
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the operator's choice wins
    ],
)
def test_the_server_starts_with_huge_pages_for_large_buffers(tunables, expected):
    """python -m service hands gunicorn (and so every worker) glibc.malloc.hugetlb=1, added to the
    operator's own GLIBC_TUNABLES, unless those name hugetlb themselves."""
    env = {"PATH": "/bin"} | ({} if tunables is None else {"GLIBC_TUNABLES": tunables})
    assert service_main.environment(env) == {**env, "GLIBC_TUNABLES": expected}


def test_a_live_worker_has_the_tunable(attack_server):
    """The running workers (not only the launcher) were started with it: glibc reads it at exec."""
    proc, _ = attack_server
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert children
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert any(v.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.hugetlb=1" in v for v in environ)
