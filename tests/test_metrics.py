"""GET /metrics: names and units, what each request adds, and (on the real server) that every
gunicorn worker's counts reach one scrape."""

from __future__ import annotations

import glob
import os
import threading

import pytest
import requests
from flask import Response
from prometheus_client import REGISTRY
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from service.web.http import when_sent
from service.web.metrics import METHODS, method_label, t_bucket

from .helpers import WORKED, b64, start_server, stop_server, wait_for_workers, wait_until


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_follow_prometheus_conventions(client):
    client.post("/attention", json=WORKED)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    ours = {name: f for name, f in families(r.get_data(as_text=True)).items() if name.startswith("attention_")}
    assert {
        "attention_http_requests",
        "attention_http_request_duration_seconds",
        "attention_phase_duration_seconds",
        "attention_compute_duration_seconds",
        "attention_rejections",
        "attention_requests_in_flight",
    } <= set(ours)
    for name, family in ours.items():
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        if family.type == "histogram" and "duration" in name:
            assert name.endswith("_seconds"), name


def test_a_request_is_counted_with_its_phases_and_T_bucket(client, rng):
    labels = {"endpoint": "/attention", "method": "POST", "status": "200"}
    before = {
        "requests": value("attention_http_requests_total", **labels),
        "latency": value("attention_http_request_duration_seconds_count", **labels),
        "by_T": value("attention_compute_duration_seconds_count", endpoint="/attention", t_bucket="64"),
        **{
            p: value("attention_phase_duration_seconds_count", endpoint="/attention", phase=p)
            for p in ("decode", "validate", "compute", "encode")
        },
    }
    q = rng.standard_normal((2, 40, 8))
    assert client.post("/attention", json={"q": b64(q), "k": b64(q), "v": b64(q)}).status_code == 200
    after = {
        "requests": value("attention_http_requests_total", **labels),
        "latency": value("attention_http_request_duration_seconds_count", **labels),
        "by_T": value("attention_compute_duration_seconds_count", endpoint="/attention", t_bucket="64"),
        **{
            p: value("attention_phase_duration_seconds_count", endpoint="/attention", phase=p)
            for p in ("decode", "validate", "compute", "encode")
        },
    }
    assert {k: after[k] - before[k] for k in before} == {k: 1.0 for k in before}
    assert value("attention_requests_in_flight") == 0  # back to zero once answered


@pytest.mark.parametrize("body, code", [(b"{oops", "bad_json"), (b'{"q": [[1]]}', "missing_field")], ids=["bad_json", "missing_field"])
def test_errors_are_counted_as_rejections_by_code(client, body, code):
    before = value("attention_rejections_total", endpoint="/attention", code=code)
    r = client.post("/attention", data=body, content_type="application/json")
    assert r.json["error"]["code"] == code
    assert value("attention_rejections_total", endpoint="/attention", code=code) == before + 1


def test_unknown_paths_share_one_label(client):
    before = value("attention_http_requests_total", endpoint="unmatched", method="GET", status="404")
    client.get("/no/such/path/123")
    client.get("/another-one")
    assert value("attention_http_requests_total", endpoint="unmatched", method="GET", status="404") == before + 2


def test_made_up_methods_share_one_label(client):
    """gunicorn accepts any token as a method: a label per token would grow without bound."""
    labels = dict(endpoint="unmatched", status="405")  # a 405 matched no rule
    before = value("attention_http_requests_total", method="other", **labels)
    for method in ("XM0001", "XM0002", "BREW"):
        assert client.open("/healthz", method=method).status_code == 405
    assert value("attention_http_requests_total", method="other", **labels) == before + 3
    assert value("attention_http_requests_total", method="XM0001", **labels) == 0.0
    assert {method_label(m) for m in METHODS} == METHODS and method_label("get") == "other"


@pytest.mark.parametrize("T, bucket", [(1, "64"), (64, "64"), (65, "128"), (1024, "1024"), (1025, "2048"), (4096, "4096")])
def test_t_bucket(T, bucket):
    assert t_bucket(T) == bucket


def per_worker_counts(directory: str, endpoint: str = "/attention") -> dict[int, float]:
    """Requests counted by each worker, read from its own multiprocess file."""
    counts = {}
    for path in glob.glob(os.path.join(directory, "counter_*.db")):
        pid = int(path.rsplit("_", 1)[1].split(".")[0])
        counts[pid] = sum(
            s.value
            for m in MultiProcessCollector.merge([path])
            for s in m.samples
            if s.name == "attention_http_requests_total" and s.labels["endpoint"] == endpoint
        )
    return counts


@pytest.mark.live
def test_metrics_merge_every_worker(tmp_path):
    """Two workers both serve; one scrape shows the sum of both, stale files are cleared at start."""
    directory = tmp_path / "prom"
    directory.mkdir()
    (directory / "counter_999999.db").write_bytes(b"stale")  # a previous run's file: must go at start
    proc, url = start_server({"PROMETHEUS_MULTIPROC_DIR": str(directory)})
    try:
        assert not (directory / "counter_999999.db").exists()
        pids = wait_for_workers(proc)  # both forked (the first may answer before the second exists)

        def both_workers_served():
            """both workers have counted requests"""
            threads = [
                threading.Thread(target=requests.post, args=(f"{url}/attention",), kwargs={"json": WORKED, "timeout": 10}) for _ in range(8)
            ]
            [t.start() for t in threads]
            [t.join() for t in threads]
            counts = per_worker_counts(str(directory))
            return counts if all(counts.get(pid, 0) > 0 for pid in pids) else None

        counts = wait_until(both_workers_served, timeout=30, interval=0)
        scraped = families(requests.get(f"{url}/metrics", timeout=5).text)
        total = sum(
            s.value
            for s in scraped["attention_http_requests"].samples
            if s.name == "attention_http_requests_total" and s.labels["endpoint"] == "/attention"
        )
        assert total == sum(counts[pid] for pid in pids) > 0
        phases = [
            s for s in scraped["attention_phase_duration_seconds"].samples if s.name.endswith("_count") and s.labels["phase"] == "compute"
        ]
        by_T = [s for s in scraped["attention_compute_duration_seconds"].samples if s.name.endswith("_count")]
        assert sum(s.value for s in phases) == sum(s.value for s in by_T) == total
        print(f"\nper-worker /attention counts {counts}, scraped total {total}")
    finally:
        stop_server(proc)


@pytest.mark.parametrize("ending", ["sent", "closed"])
def test_when_sent_runs_every_callback_once_in_order_through_one_wrapper(ending):
    """The hooks' callbacks share one body wrapper; a callback that raises does not stop the ones
    after it, and its error still surfaces."""
    resp, calls = Response([b"a", b"b"]), []

    def failing():
        calls.append("first")
        raise RuntimeError("first failed")

    when_sent(resp, failing)
    body = resp.response
    when_sent(resp, lambda: calls.append("second"))
    when_sent(resp, lambda: calls.append("third"))
    assert resp.response is body  # wrapped once
    with pytest.raises(RuntimeError, match="first failed"):
        if ending == "sent":
            assert b"".join(resp.response) == b"ab"
        else:
            resp.close()
    assert calls == ["first", "second", "third"]
    resp.close()  # the other ending, later: nothing runs twice
    assert calls == ["first", "second", "third"]
