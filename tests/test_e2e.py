"""End to end: the real gunicorn server (python -m service) on a free loopback port."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from service.core import attention

from .helpers import WORKED, WORKED_OUT, WORKED_WEIGHTS, b64, server_blas, tensor

pytestmark = pytest.mark.live


def test_worked_example(live_server):
    r = requests.post(f"{live_server}/attention", json=WORKED, timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json"
    np.testing.assert_allclose(r.json()["weights"], WORKED_WEIGHTS, atol=0.01)
    np.testing.assert_allclose(r.json()["out"], WORKED_OUT, atol=0.01)
    assert "total;dur=" in r.headers["Server-Timing"] and r.headers["X-Request-Id"]


def test_b64_batched_matches_core(live_server, rng):
    q, k, v = (rng.standard_normal((2, 4, 64, 16)).astype(np.float32) for _ in range(3))
    r = requests.post(f"{live_server}/attention", json={"q": b64(q), "k": b64(k), "v": b64(v), "causal": True}, timeout=30)
    assert r.status_code == 200
    out = tensor(r.json()["out"])
    assert out.dtype == np.float32
    expect, _ = attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, expect, atol=1e-6)


def test_malformed_requests_leave_the_server_serving(live_server):
    bad = [b"{", b'{"q": [[NaN]]}', b"[" * 100000, b'{"q": "x", "k": 1, "v": null}']
    for body in bad:
        r = requests.post(f"{live_server}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=10)
        assert 400 <= r.status_code < 500
        assert "Traceback" not in r.text and r.json()["error"]["code"]
    assert requests.post(f"{live_server}/attention", json=WORKED, timeout=10).status_code == 200


def test_errors_and_ops_endpoints_are_json(live_server):
    assert requests.get(f"{live_server}/healthz", timeout=5).json() == {"status": "ok"}
    assert requests.get(f"{live_server}/readyz", timeout=5).status_code == 200
    limits = requests.get(f"{live_server}/limits", timeout=5).json()
    assert limits["max_t"] >= 2048
    r = requests.get(f"{live_server}/missing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_large_nested_response_streams_chunked(live_server, rng):
    """Weights past one block are written while they are sent (chunked, no Content-Length) and
    arrive whole and exact."""
    q, k, v = (rng.standard_normal((1, 8, 200, 16)).astype(np.float32) for _ in range(3))
    body = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "causal": True}
    r = requests.post(f"{live_server}/attention", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in r.headers
    with server_blas():  # the server's BLAS threads: the same bits
        out, weights = attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.array(r.json()["weights"], dtype=np.float32), weights)
    np.testing.assert_array_equal(np.array(r.json()["out"], dtype=np.float32), out)
