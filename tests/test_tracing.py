"""Tracing (service/web/tracing.py): W3C traceparent parsed, validated, continued and returned; a
bad one ignored; OpenTelemetry spans (the SDK's in-memory exporter) with their names, parent and
attributes; no OpenTelemetry import at all when no exporter is configured."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import requests
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from service.config import Settings
from service.web import spans as otel
from service.web import tracing

from .helpers import ROOT, WORKED, post, serving, wait_until

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(
    "value, parsed",
    [
        (VALID, (TRACE_ID, PARENT_ID, "01")),
        (f"00-{TRACE_ID}-{PARENT_ID}-00", (TRACE_ID, PARENT_ID, "00")),
        (f" {VALID} ", (TRACE_ID, PARENT_ID, "01")),
        (f"01-{TRACE_ID}-{PARENT_ID}-01-future-field", (TRACE_ID, PARENT_ID, "01")),
        (f"00-{TRACE_ID}-{PARENT_ID}-01-extra", None),
        (f"ff-{TRACE_ID}-{PARENT_ID}-01", None),
        (VALID.upper(), None),
        (f"00-{'0' * 32}-{PARENT_ID}-01", None),
        (f"00-{TRACE_ID}-{'0' * 16}-01", None),
        (f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01", None),
        (f"00-{TRACE_ID}-{PARENT_ID}-1", None),
        (f"00_{TRACE_ID}_{PARENT_ID}_01", None),
        ("", None),
        (None, None),
        ("garbage", None),
    ],
    ids=[
        "valid",
        "not-sampled",
        "spaces",
        "future-version",
        "v00-trailing",
        "version-ff",
        "upper-case",
        "zero-trace",
        "zero-parent",
        "short-trace",
        "short-flags",
        "underscores",
        "empty",
        "absent",
        "garbage",
    ],
)
def test_parse_traceparent(value, parsed):
    assert otel.parse_traceparent(value) == parsed


def test_a_valid_traceparent_is_continued(client):
    r = post(client, WORKED, headers={"traceparent": VALID})
    version, trace_id, span_id, flags = r.headers["traceparent"].split("-")
    assert r.status_code == 200 and (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id != PARENT_ID and len(span_id) == 16 and int(span_id, 16)


@pytest.mark.parametrize("bad", [f"00-{'0' * 32}-{PARENT_ID}-01", "nonsense", "00-" + "z" * 32 + "-" + "1" * 16 + "-01"])
def test_a_bad_traceparent_starts_a_new_trace(client, bad):
    r = post(client, WORKED, headers={"traceparent": bad})
    assert r.status_code == 200
    parsed = otel.parse_traceparent(r.headers["traceparent"])
    assert parsed is not None and parsed[0] != TRACE_ID and parsed[2] == "00"


def test_every_answer_carries_a_traceparent(client):
    for r in (client.get("/healthz"), client.get("/nowhere"), post(client, b"{", path="/attention")):
        assert otel.parse_traceparent(r.headers["traceparent"]) is not None


@pytest.mark.parametrize(
    "env, exporters",
    [
        ({}, ()),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "none"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("otlp_proto_grpc",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ("otlp_proto_http",)),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp_proto_grpc", "console")),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, ()),
    ],
    ids=["unset", "console", "none", "endpoint", "http", "two", "disabled"],
)
def test_exporters_from_the_standard_variables(monkeypatch, env, exporters):
    for name in list(__import__("os").environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env().otel_trace_exporters == exporters


def test_no_opentelemetry_import_without_an_exporter():
    """Off by default, and then free: the SDK (installed here) is never imported."""
    code = (
        "import sys\n"
        "from service.config import Settings\n"
        "from service.web import create_app\n"
        "c = create_app(Settings(warmup=False)).test_client()\n"
        "r = c.post('/attention', json={'q': [[1.0]], 'k': [[1.0]], 'v': [[1.0]]})\n"
        "assert r.status_code == 200 and r.headers['traceparent'], r.status_code\n"
        "print('loaded:', sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded: []" in out.stdout.splitlines(), out.stdout


# --- OpenTelemetry spans, with the SDK's in-memory exporter -------------------------------------


@pytest.fixture
def spans(app):
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(app, provider)
    yield exporter
    provider.shutdown()


def test_one_span_per_request_with_phase_children(client, spans):
    r = post(client, WORKED, headers={"traceparent": VALID, "X-Request-Id": "span-1"})
    r.get_data()
    r.close()
    assert r.status_code == 200
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"POST /attention", "decode", "validate", "compute", "encode"}
    root = finished.pop("POST /attention")
    # The root is the caller's child; the response's traceparent names the root.
    assert root.kind == SpanKind.SERVER and root.parent is not None and root.parent.is_remote
    assert (f"{root.parent.trace_id:032x}", f"{root.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
    assert r.headers["traceparent"] == f"00-{TRACE_ID}-{root.context.span_id:016x}-{root.context.trace_flags:02x}"
    for child in finished.values():
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    a = root.attributes
    assert (a["attention.B"], a["attention.H"], a["attention.T"], a["attention.S"], a["attention.d"]) == (1, 1, 3, 3, 2)
    assert a["http.response.status_code"] == 200 and a["attention.request_id"] == "span-1"
    assert a["attention.predicted_ms"] > 0 and a["attention.compute_ms"] > 0
    assert r.json["cost"]["predicted_ms"] == pytest.approx(a["attention.predicted_ms"], abs=1e-3)


def test_an_error_span_names_its_code(client, spans):
    r = post(client, {"q": [[1.0]], "k": [[1.0, 2.0]], "v": [[1.0]]})
    r.get_data()
    r.close()
    (root,) = [s for s in spans.get_finished_spans() if s.name == "POST /attention"]
    assert root.parent is None  # no traceparent sent: a new trace
    assert root.attributes["error.type"] == "shape_mismatch" and root.attributes["http.response.status_code"] == 422
    assert f"{root.context.trace_id:032x}" == r.headers["traceparent"].split("-")[1]


def test_mha_spans_have_its_heads(client, spans, rng):
    x = rng.standard_normal((4, 8)).tolist()
    w = rng.standard_normal((8, 8)).tolist()
    r = post(client, {"x": x, "wq": w, "wk": w, "wv": w, "heads": 2}, path="/mha")
    r.get_data()
    r.close()
    assert r.status_code == 200, r.json
    (root,) = [s for s in spans.get_finished_spans() if s.name == "POST /mha"]
    assert (root.attributes["attention.H"], root.attributes["attention.T"], root.attributes["attention.d"]) == (2, 4, 4)


@pytest.mark.live
def test_live_spans_from_the_standard_variables():
    """A real server configured only by OTEL_TRACES_EXPORTER exports the request's span (the SDK's
    console exporter, on stdout), under the caller's span; the access line, the response's
    traceparent and the span share the trace and span ids."""
    with serving({"ATTN_WARMUP": "0", "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "50"}) as srv:
        r = requests.post(f"{srv.url}/attention", json=WORKED, headers={"traceparent": VALID, "X-Request-Id": "otel-live"}, timeout=30)
        assert r.status_code == 200
        _, trace_id, span_id, _ = r.headers["traceparent"].split("-")
        assert trace_id == TRACE_ID
        wait_until(lambda: f'"span_id": "0x{span_id}"' in srv.log_text(), timeout=30, what="the request's span exported")
        text = srv.log_text()
        assert '"name": "POST /attention"' in text and f'"parent_id": "0x{PARENT_ID}"' in text
        assert '"attention.request_id": "otel-live"' in text and '"name": "compute"' in text
        (line,) = [orjson.loads(x) for x in text.splitlines() if x.startswith('{"ts"') and '"request_id":"otel-live"' in x]
        assert (line["trace_id"], line["span_id"]) == (trace_id, span_id)


def test_an_exporter_that_is_not_installed_turns_tracing_off(caplog):
    """OTEL_TRACES_EXPORTER naming an exporter whose package is missing: a warning, and no
    provider, so no spans are made."""
    with caplog.at_level("WARNING", logger="service"):
        assert otel._provider(("no_such_exporter",)) is None
    assert "no_such_exporter" in caplog.text
