"""A worker's life: not ready until warmed up, not ready while draining, in-flight requests finish
after SIGTERM, and a killed worker is replaced while the service keeps answering."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import requests

from service.web import create_app, ops

from .conftest import SMALL, start_server, stop_server, wait_for_workers, wait_until
from .test_api import WORKED
from .test_overload import all_ready, body_for


def test_not_ready_until_warmed_up():
    app = create_app(replace(SMALL, warmup=True))
    client = app.test_client()
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json == {"status": "starting"}
    assert client.get("/v2/health/ready").status_code == 503 and client.get("/v2/models/mha/ready").status_code == 503
    assert client.get("/healthz").status_code == 200  # alive all the same
    assert client.post("/attention", json=WORKED).status_code == 200  # and serving, on the default model
    t0 = time.perf_counter()
    ops.warm_up(app)
    assert time.perf_counter() - t0 < 3.0  # bounded
    assert client.get("/readyz").json == {"status": "ready"}
    assert client.get("/limits").json["cost_model"]["calibrated"] is True


def test_start_warm_up_runs_in_the_background():
    app = create_app(replace(SMALL, warmup=True))
    thread = ops.start_warm_up(app)
    assert app.test_client().get("/readyz").status_code == 503
    thread.join(timeout=10)
    assert app.test_client().get("/readyz").status_code == 200
    assert ops.start_warm_up(create_app(SMALL)) is None  # warmup=False: ready at once, nothing to run


def test_draining_is_not_ready(app, client):
    ops.drain(app)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json == {"status": "draining"}
    # one source of readiness: the protocol's front door says the same
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/models/attention/ready").status_code == 503
    assert client.get("/healthz").status_code == 200


def running(url: str) -> bool:
    """a compute request holds a compute slot"""
    text = requests.get(f"{url}/metrics", timeout=5).text
    return any(line.startswith("attention_admission_running_requests ") and float(line.split()[1]) >= 1 for line in text.splitlines())


@pytest.mark.live
def test_sigterm_lets_the_request_in_flight_finish():
    proc, url = start_server()
    try:
        wait_until(lambda: all_ready(url), timeout=30)
        keep = requests.Session()
        assert keep.get(f"{url}/readyz", timeout=5).status_code == 200  # a kept-alive connection
        slow = body_for(2048)  # ~0.3 s of compute and ~0.5 s of encoding 180 MB of weights
        outcome = {}

        def post():
            r = requests.post(f"{url}/attention", data=slow, headers={"Content-Type": "application/json"}, timeout=60)
            outcome.update(status=r.status_code, n=len(r.content))

        client = threading.Thread(target=post)
        client.start()
        wait_until(lambda: running(url), timeout=30, interval=0.02)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        # The worker on the kept-alive connection drains too (kept-alive connections linger 2 s):
        r = keep.get(f"{url}/readyz", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "draining"
        client.join(timeout=40)
        assert outcome.get("status") == 200 and outcome["n"] > 100_000_000
        assert proc.wait(timeout=35) == 0  # a clean exit within graceful_timeout
        print(f"\nin-flight request finished with 200; server exited {time.monotonic() - t0:.2f} s after SIGTERM")
    finally:
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
