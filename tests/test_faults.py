"""A bug inside the service, as a client and an operator see it: the numeric core made to raise
(tests/faults.py) under each front door, in-process and in the real gunicorn server. The answer is
500 `internal` in the door's shape; nothing of the exception (its message, its type, a traceback,
a file name) leaves the process, in the body or in a header; the traceback is in the server's log;
and the worker keeps serving: the next request is 200, with the right answer."""

from __future__ import annotations

import json
import logging

import pytest
import requests

from service import core

from . import faults
from .helpers import WORKED, assert_seed_answered, serving, wait_until

POISON = {**WORKED, "scale": faults.TRIGGER}  # meets the fault; WORKED itself does not
V2_POISON = {
    "inputs": [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": [x for row in WORKED[n] for x in row]} for n in ("q", "k", "v")],
    "parameters": {"causal": True, "scale": faults.TRIGGER},
}
DOORS = [("/attention", POISON), ("/v2/models/attention/infer", V2_POISON)]
# What must never be in an answer: the exception's message and type, and any trace of the code.
LEAKS = [faults.MESSAGE, "RuntimeError", "Traceback", 'File "', ".py"]


def assert_internal(path: str, status: int, headers: dict, body: bytes) -> None:
    """500 internal in the door's shape, and nothing of the exception in the body or a header."""
    assert status == 500, body[:500]
    doc = json.loads(body)
    if path.startswith("/v2"):
        assert set(doc) == {"error"} and isinstance(doc["error"], str) and doc["error"], doc
    else:
        assert doc == {"error": {"status": 500, "code": "internal", "message": doc["error"]["message"], "field": None}}, doc
    assert headers["X-Error-Code"] == "internal" and "X-Error-Field" not in headers
    text = body.decode() + "".join(f"{k}: {v}\n" for k, v in headers.items())
    for leak in LEAKS:
        assert leak not in text, f"{leak!r} left the server:\n{text[:2000]}"


@pytest.mark.parametrize("path, body", DOORS, ids=["native", "v2"])
def test_a_view_that_raises_is_500_internal_and_logged(client, monkeypatch, caplog, path, body):
    monkeypatch.setattr(core, "attention", faults.raising(core.attention))
    with caplog.at_level(logging.ERROR, logger="service"):
        resp = client.post(path, json=body)
    assert_internal(path, resp.status_code, dict(resp.headers), resp.get_data())
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.name == "service" and record.getMessage() == f"unexpected error on POST {path}"
    assert record.exc_info[0] is RuntimeError and str(record.exc_info[1]) == faults.MESSAGE
    assert "Traceback (most recent call last)" in caplog.text and f"RuntimeError: {faults.MESSAGE}" in caplog.text
    assert client.post("/attention", json=WORKED).status_code == 200


@pytest.mark.live
def test_the_server_answers_a_bug_with_500_logs_it_and_keeps_serving(tmp_path):
    """One compute slot and no queue (ATTN_MAX_INFLIGHT=1, ATTN_MAX_QUEUE=0) on one worker: a
    failed request that kept its slot, or its bytes, would make the next one 503."""
    env = faults.faulty_env(tmp_path / "site", "raise") | {
        "WEB_CONCURRENCY": "1",
        "ATTN_MAX_INFLIGHT": "1",
        "ATTN_MAX_QUEUE": "0",
        "ATTN_LOG_FORMAT": "json",
    }
    with serving(env) as server, requests.Session() as session:
        for _ in range(3):
            for path, body in DOORS:
                resp = session.post(f"{server.url}{path}", json=body, timeout=30)
                assert_internal(path, resp.status_code, dict(resp.headers), resp.content)
                assert_seed_answered(server.url, session)  # the next request: 200 and the core's answer

        def logged() -> list[dict]:
            """the server has logged the six failures"""
            lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
            errors = [doc for doc in lines if doc["logger"] == "service" and doc["level"] == "error"]
            return errors if len(errors) >= 6 else []

        errors = wait_until(logged, timeout=30)
        assert sorted({doc["msg"] for doc in errors}) == [f"unexpected error on POST {path}" for path, _ in sorted(DOORS)]
        for doc in errors:
            trace = doc.get("exc", "")
            assert trace.startswith("Traceback (most recent call last)") and trace.endswith(f"RuntimeError: {faults.MESSAGE}"), doc
