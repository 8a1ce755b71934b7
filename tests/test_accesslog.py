"""The access log (service/web/accesslog.py): one line per request on stdout, written when the
response is sent; its fields for answers of the app and of the worker's event loop; never a body,
an API key or a query string; the plain format; gunicorn's own messages as JSON lines."""

from __future__ import annotations

import dataclasses
import logging
import socket

import numpy as np
import orjson
import pytest
import requests

from service.config import Settings
from service.web import accesslog, create_app

from .helpers import WORKED, b64, post, raw_exchange, serving, wait_until

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def access_lines(text: str) -> list[dict]:
    """The access log's records among a process's output (other lines are skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if doc.get("logger") == "access":
                out.append(doc)
    return out


def only_line(capfd, r) -> dict:
    """The one access line written for r, a test client's response (its line is written once
    its body has been read: when the response is sent)."""
    r.get_data()
    r.close()
    (line,) = access_lines(capfd.readouterr().out)
    return line


def test_a_200_line(client, capfd):
    r = post(client, WORKED, headers={"X-Request-Id": "req-200", "traceparent": TRACEPARENT})
    body = r.get_data()
    line = only_line(capfd, r)
    assert r.status_code == 200
    assert line["request_id"] == "req-200" and line["method"] == "POST" and line["route"] == "/attention"
    assert line["status"] == 200 and "code" not in line and line["pid"] > 0
    assert (line["B"], line["H"], line["T"], line["S"], line["d"]) == (1, 1, 3, 3, 2)
    assert set(line["phases"]) == {"decode", "validate", "compute", "encode"}
    assert line["compute_ms"] == line["phases"]["compute"] and line["predicted_ms"] > 0
    assert line["bytes_in"] == int(r.request.headers["Content-Length"]) and line["bytes_out"] == len(body)
    assert line["duration_ms"] >= sum(line["phases"].values()) - 0.01
    assert line["ts"].endswith("Z") and line["ts"][10] == "T"
    assert line["trace_id"] == TRACEPARENT.split("-")[1]


def test_a_422_line_has_the_code_and_field(client, capfd):
    r = post(client, {"q": [[1.0]], "k": [[1.0, 2.0]], "v": [[1.0]]})
    line = only_line(capfd, r)
    assert r.status_code == 422
    assert (
        (line["status"], line["code"], line["field"])
        == (422, r.json["error"]["code"], r.json["error"]["field"])
        == (422, "shape_mismatch", "k")
    )
    assert "B" not in line  # it never became a job
    assert line["request_id"] == r.headers["X-Request-Id"]


def test_an_unmatched_path_is_logged_under_a_bounded_route(client, capfd):
    r = client.get("/no/such/" + "x" * 1000)
    line = only_line(capfd, r)
    assert r.status_code == 404 and line["route"] == "unmatched" and line["code"] == "not_found"
    assert len(line["path"]) <= accesslog.MAX_PATH + 3


def test_never_a_body_nor_a_query_string(client, capfd):
    r = post(client, {**WORKED, "response_encoding": "MARKER-IN-BODY"}, path="/attention?api_key=MARKER-IN-QUERY")
    r.get_data()
    out = capfd.readouterr().out
    assert r.status_code == 422 and len(access_lines(out)) == 1
    assert "MARKER" not in out


def test_the_join_request_id_and_trace(client, capfd):
    """One request's X-Request-Id is in its log line, and the line's trace and span are those of the
    traceparent the response carries."""
    r = post(client, WORKED, headers={"X-Request-Id": "join-me", "traceparent": TRACEPARENT})
    r.get_data()
    line = only_line(capfd, r)
    _, trace_id, span_id, _ = r.headers["traceparent"].split("-")
    assert (line["request_id"], line["trace_id"], line["span_id"]) == (r.headers["X-Request-Id"], trace_id, span_id)


def test_a_chunked_body_is_counted_as_sent(capfd):
    """A large nested answer streams without a Content-Length: its bytes are counted as sent."""
    app = create_app(Settings(warmup=False))
    rng = np.random.default_rng(0)
    doc = {"q": b64(rng.standard_normal((128, 2))), "k": b64(rng.standard_normal((4, 2))), "v": b64(rng.standard_normal((4, 4096)))}
    r = post(app.test_client(), {**doc, "response_encoding": "nested"})
    body = r.get_data()
    line = only_line(capfd, r)
    assert r.status_code == 200 and "Content-Length" not in r.headers
    assert line["bytes_out"] == len(body) > 2**20


def test_plain_format(settings, capfd):
    app = create_app(dataclasses.replace(settings, log_format="plain"))
    r = post(app.test_client(), {"q": [[1.0]], "k": [[1.0, 2.0]], "v": [[1.0]]}, headers={"X-Request-Id": "plain-1"})
    r.get_data()
    out = capfd.readouterr().out
    assert r.status_code == 422 and not access_lines(out)
    (line,) = out.splitlines()
    assert " 422 POST /attention " in line and "code=shape_mismatch field=k" in line and "id=plain-1" in line


def test_plain_format_shows_no_body_as_a_dash(settings, capfd):
    """A GET has no body: its plain line says in=-, never in=None."""
    app = create_app(dataclasses.replace(settings, log_format="plain"))
    r = app.test_client().get("/healthz")
    r.get_data()
    (line,) = capfd.readouterr().out.splitlines()
    assert r.status_code == 200 and " in=- " in line and "None" not in line


def test_plain_format_escapes_control_characters():
    line = accesslog._plain(
        {"ts": "t", "status": 404, "method": "GET", "route": "unmatched", "path": "/a\nfake line", "duration_ms": 1.0}
        | {"bytes_out": 1, "request_id": "r", "trace_id": "t", "pid": 1}
    )
    assert line.count(b"\n") == 1 and b"\\n" in line


def test_plain_format_escapes_a_field_the_client_named(settings, capfd):
    """An error's field can be a key the client sent: a newline in it must not forge a line."""
    app = create_app(dataclasses.replace(settings, log_format="plain"))
    r = post(app.test_client(), {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]], "x\n2026-12-01T00:00:00Z 200 GET /forged": 1})
    r.get_data()
    out = capfd.readouterr().out
    assert r.status_code == 422
    (line,) = out.splitlines()
    assert "code=unknown_field field=" in line and "\\n" in line


def test_log_format_setting(monkeypatch):
    monkeypatch.setenv("ATTN_LOG_FORMAT", "plain")
    assert Settings.from_env().log_format == "plain"
    monkeypatch.setenv("ATTN_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        Settings.from_env()
    monkeypatch.delenv("ATTN_LOG_FORMAT")
    assert Settings.from_env().log_format == "json" and "log_format" not in Settings().limits()


def test_json_formatter_keeps_a_traceback_on_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("service", logging.ERROR, __file__, 1, "failed on %s", ("x",), exc_info=__import__("sys").exc_info())
    text = accesslog.JsonFormatter().format(record)
    doc = orjson.loads(text)
    assert "\n" not in text and doc["msg"] == "failed on x" and doc["level"] == "error" and "ValueError: boom" in doc["exc"]


# --- a real server: gunicorn's lines, the worker's own answers, the API key ----------------------

KEY = "sekrit-key-4f1c9a"


@pytest.fixture(scope="module")
def server():
    with serving({"ATTN_WARMUP": "0", "ATTN_API_KEYS": KEY, "ATTN_HEADER_TIMEOUT_S": "1"}) as srv:
        yield srv


def line_of(server, request_id: str) -> dict:
    def found():
        """the request's access line is in the server's output"""
        return next((d for d in access_lines(server.log_text()) if d["request_id"] == request_id), None)

    return wait_until(found, timeout=30)


@pytest.mark.live
def test_live_200_and_401_never_log_the_key(server):
    r = requests.post(
        f"{server.url}/attention", json=WORKED, headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "live-200"}, timeout=30
    )
    assert r.status_code == 200
    line = line_of(server, "live-200")
    assert line["status"] == 200 and line["T"] == 3 and line["bytes_out"] == len(r.content)
    assert line["trace_id"] == r.headers["traceparent"].split("-")[1] and line["span_id"] == r.headers["traceparent"].split("-")[2]
    r = requests.post(
        f"{server.url}/attention", json=WORKED, headers={"Authorization": "Bearer wrong-key-x", "X-Request-Id": "live-401"}, timeout=30
    )
    assert r.status_code == 401 and line_of(server, "live-401")["code"] == "unauthorized"
    text = server.log_text()
    assert KEY not in text and "wrong-key-x" not in text


@pytest.mark.live
def test_live_worker_answers_are_logged(server):
    """413 (a Content-Length over the limit) and 408 (a head that never ends) are answered by the
    worker's event loop, before Flask: logged in the same format."""
    head = b"POST /attention HTTP/1.1\r\nHost: x\r\nX-Request-Id: live-413\r\nContent-Length: 999999999\r\n\r\n"
    ((status, _, _),) = raw_exchange(server.url, head)
    assert status == 413
    line = line_of(server, "live-413")
    assert (line["status"], line["code"], line["route"], line["method"]) == (413, "body_too_large", "/attention", "POST")
    assert line["bytes_in"] == len(head) and line["bytes_out"] > 0

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\nX-Request-Id: never-complete")
        assert sock.recv(4096).startswith(b"HTTP/1.1 408")
    lines = wait_until(lambda: [d for d in access_lines(server.log_text()) if d["status"] == 408], timeout=30, what="a 408 line")
    assert lines[0]["code"] == "timeout" and lines[0]["duration_ms"] >= 500


@pytest.mark.live
def test_live_gunicorn_messages_are_json(server):
    first = server.log_text().splitlines()[0]
    doc = orjson.loads(first)
    assert doc["logger"] == "gunicorn.error" and doc["level"] == "info" and "gunicorn" in doc["msg"].lower()


@pytest.fixture
def service_logger():
    """The "service" logger; it and gunicorn's are restored after a test that lets gunicorn's
    logger configure them."""
    logs = [logging.getLogger(name) for name in ("service", "gunicorn.error", "gunicorn.access")]
    saved = [(list(log.handlers), log.level, log.propagate) for log in logs]
    yield logs[0]
    for log, (handlers, level, propagate) in zip(logs, saved, strict=True):
        log.handlers, log.propagate = handlers, propagate
        log.setLevel(level)


@pytest.mark.parametrize("fmt", ["json", "plain"])
def test_gunicorn_logger(monkeypatch, capfd, service_logger, fmt):
    """gunicorn's messages and the service's own errors (with their traceback) on stderr: one JSON
    line each when the format is json, gunicorn's usual text when plain; no access log of its own."""
    from gunicorn.config import Config

    monkeypatch.setenv("ATTN_LOG_FORMAT", fmt)
    logger = accesslog.GunicornLogger(Config())
    logger.info("Listening at: %s", "http://127.0.0.1:8000")
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        service_logger.exception("unexpected error on %s", "POST /attention")
    logger.access(None, None, {}, None)
    captured = capfd.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    if fmt == "plain":
        assert "[INFO] Listening at: http://127.0.0.1:8000" in lines[0] and "Traceback" in captured.err
        return
    assert len(lines) == 2
    first, second = (orjson.loads(x) for x in lines)
    assert (first["logger"], first["level"], first["msg"]) == ("gunicorn.error", "info", "Listening at: http://127.0.0.1:8000")
    assert (second["logger"], second["level"], second["msg"]) == ("service", "error", "unexpected error on POST /attention")
    assert "RuntimeError: kaput" in second["exc"]
