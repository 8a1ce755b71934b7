"""loadtest on the wire: bodies, Server-Timing, the open loop, connection failure, and a
tiny sweep against the real service (the `live_server` fixture from conftest.py).

Everything here talks to 127.0.0.1 only.
"""

import csv
import http.server
import subprocess
import sys
import threading
import time

import numpy as np
import orjson
import pytest

from attention_client.loadtest.cell import Load, run_cell, summarize
from attention_client.loadtest.cli import main
from attention_client.loadtest.payload import Workload, build_body
from attention_client.loadtest.transport import LIMITS_BYTES, fetch_limits, parse_server_timing

from .helpers import ROOT, Hostile, free_port, serving, tensor


def test_bodies_carry_the_same_tensors_in_both_encodings():
    wl = Workload(batch=2, heads=3, d=8, causal=True, weights=False)
    b64 = orjson.loads(build_body(wl, 16))
    nested = orjson.loads(build_body(Workload(batch=2, heads=3, d=8, causal=True, weights=False, encoding="nested"), 16))
    assert set(b64) == {"q", "k", "v", "causal", "return_weights"}
    assert b64["causal"] is True and b64["return_weights"] is False
    assert b64["q"]["dtype"] == "float32" and b64["q"]["shape"] == [2, 3, 16, 8]
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(tensor(b64[name]), tensor(nested[name]).astype(np.float32))  # nested: float32 in its shortest repr
    assert not np.array_equal(tensor(b64["q"]), tensor(b64["k"]))
    assert build_body(wl, 16) == build_body(wl, 16)  # the same body run to run


def test_server_timing_parsing():
    header = "decode;dur=0.4, validate;dur=0.1, compute;dur=1.25, encode;dur=0.3, total;dur=2.1"
    assert parse_server_timing(header) == {"decode": 0.4, "validate": 0.1, "compute": 1.25, "encode": 0.3, "total": 2.1}
    assert parse_server_timing('cache;desc="hit", db;dur=bad, x;desc=a;dur="3"') == {"x": 3.0}
    assert parse_server_timing(None) == {}


def test_connection_failure_is_one_line_and_exit_status_1(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "attention_client.loadtest",
            "--url",
            url,
            "--T",
            "16",
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"loadtest: cannot connect to {url}: ")
    assert "refused" in last.lower()
    assert not (tmp_path / "out").exists()


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    """Answers every POST after a fixed 40 ms."""

    protocol_version = "HTTP/1.1"
    delay_s = 0.04

    def do_GET(self):
        self._reply(b'{"status":"ok"}')

    seen_auth: list = []

    def do_POST(self):
        self.seen_auth.append(self.headers.get("Authorization"))
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.delay_s)
        self._reply(b'{"out":[]}', timing=f"compute;dur={self.delay_s * 1e3:.1f}")

    def _reply(self, body, timing=None):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if timing:
            self.send_header("Server-Timing", timing)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_open_loop_counts_the_queue_a_closed_loop_hides(slow_server):
    # The server takes at least 40 ms; arrivals are scheduled every 20 ms, one connection. The
    # closed loop politely waits and measures each request from its send: at least 40 ms each, no
    # queue. The open loop measures from the scheduled time: request n cannot be sent before n-1
    # is answered, so it waited at least 20 ms more than n-1 did. That is coordinated omission,
    # and the open loop shows it. (Lower bounds only: a busy machine makes every figure larger.)
    body = b'{"q":[]}'
    closed = run_cell(slow_server, body, Load(1, requests=12))
    opened = run_cell(slow_server, body, Load(1, requests=12, rate=50.0))
    assert [s.status for s in closed.samples] == [s.status for s in opened.samples] == [200] * 12
    closed_ms = [s.latency_s * 1e3 for s in closed.samples]
    opened_ms = [s.latency_s * 1e3 for s in opened.samples]  # in the order sent
    print(f"\nclosed loop {[round(ms) for ms in closed_ms]} ms\nopen loop   {[round(ms) for ms in opened_ms]} ms")
    assert min(closed_ms) >= 40
    assert all(later >= earlier + 20 for earlier, later in zip(opened_ms, opened_ms[1:], strict=False)), opened_ms
    assert opened_ms[-1] >= 40 + 11 * 20  # the last one waited 11 schedule steps behind
    summary = summarize(1, 1, len(body), [closed])
    assert summary.ok == 12 and summary.phases_ms["compute"] == pytest.approx(40.0)


def test_hard_bounds_stop_a_cell(slow_server):
    run = run_cell(slow_server, b"{}", Load(2, requests=1000, max_seconds=0.3))
    assert "0.3 s" in run.capped
    # Each worker sends at most one request per 40 ms before the 0.3 s bound: at most 2 x 8.
    assert len(run.samples) <= 16 and run.unsent == 1000 - len(run.samples)
    run = run_cell(slow_server, b"{}", Load(1, duration_s=5.0, max_requests=3))
    assert "3 requests" in run.capped and len(run.samples) == 3


def test_without_matplotlib_the_report_says_so(slow_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    status = main(["--url", slow_server, "--T", "8", "--concurrency", "1", "--requests", "2", "--out", str(tmp_path)])
    assert status == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.csv"]
    report = (tmp_path / "report.md").read_text()
    assert "no latency.png: matplotlib is not installed" in report and ".png)" not in report
    assert "(results.csv, report.md)" in capsys.readouterr().err


def test_api_key_is_sent_and_never_written(slow_server, tmp_path):
    _SlowHandler.seen_auth.clear()
    assert (
        main(["--url", slow_server, "--T", "8", "--concurrency", "1", "--requests", "2", "--api-key", "s3cret-key", "--out", str(tmp_path)])
        == 0
    )
    assert _SlowHandler.seen_auth == ["Bearer s3cret-key"] * 3  # warm-up + 2 timed
    for path in tmp_path.iterdir():
        assert b"s3cret-key" not in path.read_bytes()
    assert "--api-key '***'" in (tmp_path / "report.md").read_text()


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.live
def test_tiny_sweep_against_the_live_service(live_server, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "attention_client.loadtest",
            "--url",
            live_server,
            "--T",
            "16,32",
            "--concurrency",
            "1,2",
            "--requests",
            "3",
            "--rounds",
            "2",
            "--causal",
            "--no-weights",
            "--encoding",
            "b64",
            "--slo-ms",
            "600000",
            "--fit-min-T",
            "16",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[8/8] round 2 T=32 concurrency=2: ok 3/3" in proc.stderr  # progress on stderr

    rows = _read_csv(out / "results.csv")
    assert sorted((int(r["T"]), int(r["concurrency"])) for r in rows) == [(16, 1), (16, 2), (32, 1), (32, 2)]
    for r in rows:
        assert (r["sent"], r["ok"], r["errors"], r["rounds"]) == ("6", "6", "", "2")
        assert len(r["p50_by_round_ms"].split()) == 2
        p50, p90, p99, top = (float(r[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms"))
        assert 0 < p50 <= p90 <= p99 <= top
        assert float(r["throughput_rps"]) > 0
        assert 0 < float(r["server_compute_ms"]) <= float(r["server_total_ms"]) <= top
        assert r["causal"] == "True" and r["weights"] == "False" and r["encoding"] == "b64"

    report = (out / "report.md").read_text()
    for r in rows:  # each measured cell is a row of the table, with its p50
        p50 = float(r["p50_ms"])
        shown = f"{p50:.1f}" if p50 >= 1 else f"{p50:.2f}"
        assert f"| {r['T']} | {r['concurrency']} | 6/6 | 0 | 0 | – | {shown} |" in report
    assert "exponent of p50 (T ≥ 16)" in report and "| 16,32 |" in report
    assert "## Largest T meeting the SLO" in report
    assert "| 1 | 32 | all met |" in report
    assert "![latency percentiles against T](latency.png)" in report

    png = (out / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.live
def test_early_stop_skips_larger_T_once_past_the_slo(live_server, tmp_path, capsys):
    # An SLO of 1 µs: the first cell's p50 is far past 4 x SLO, so T=32 and 64 are never
    # run, in the first round nor in the second.
    status = main(
        [
            "--url",
            live_server,
            "--T",
            "16,32,64",
            "--concurrency",
            "1",
            "--requests",
            "3",
            "--rounds",
            "2",
            "--encoding",
            "nested",
            "--slo-ms",
            "0.001",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    rows = _read_csv(tmp_path / "results.csv")
    assert [(r["T"], r["ok"]) for r in rows] == [("16", "6")]  # nested bodies are served too
    report = (tmp_path / "report.md").read_text()
    assert report.count("stopped after T=16 in round 1") == 1 and "skipped T=32,64" in report
    assert "| 1 | none met |" in report
    assert "skipped T=32,64" in capsys.readouterr().err


@pytest.mark.live
def test_a_refused_T_stops_that_concurrency(live_server, tmp_path):
    # T=8192 is past the service's default limit of 4096: refused with 413 at warm-up,
    # nothing is timed for it, and the larger T is not even built.
    assert (
        main(
            ["--url", live_server, "--T", "16,8192,16384", "--concurrency", "1", "--requests", "2", "--no-weights", "--out", str(tmp_path)]
        )
        == 0
    )
    rows = {r["T"]: r for r in _read_csv(tmp_path / "results.csv")}
    assert sorted(rows, key=int) == ["16", "8192"]
    assert (rows["16"]["ok"], rows["8192"]["ok"], rows["8192"]["errors"]) == ("2", "0", "413:1")
    assert rows["8192"]["note"].startswith("refused: 413 too_long")
    assert "skipped T=16384" in (tmp_path / "report.md").read_text()


def test_bodies_with_a_window_and_grouped_heads():
    wl = Workload(batch=2, heads=4, d=8, causal=True, weights=False, window=(256, 0), kv_heads=2)
    body = orjson.loads(build_body(wl, 16))
    assert body["window"] == [256, 0] and body["enable_gqa"] is True
    assert body["q"]["shape"] == [2, 4, 16, 8] and body["k"]["shape"] == body["v"]["shape"] == [2, 2, 16, 8]
    assert "window [256, 0]" in wl.describe() and "GQA" in wl.describe()


@pytest.mark.parametrize(
    "args, words",
    [(["--window", "256"], "LEFT,RIGHT"), (["--window=-2,0"], ">= -1"), (["--heads", "4", "--kv-heads", "3"], "must divide")],
    ids=["window of one", "window below -1", "kv-heads do not divide"],
)
def test_bad_variant_flags_are_usage_errors(args, words):
    proc = subprocess.run([sys.executable, "-m", "attention_client.loadtest", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr


@pytest.mark.live
def test_window_and_gqa_sweep_against_the_live_service(live_server, tmp_path):
    out = tmp_path / "out"
    args = ["--url", live_server, "--T", "64,128", "--concurrency", "1", "--requests", "3", "--heads", "4", "--d", "16"]
    args += ["--kv-heads", "2", "--window", "16,0", "--no-weights", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "attention_client.loadtest", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = _read_csv(out / "results.csv")
    assert [(r["T"], r["ok"], r["kv_heads"], r["window"]) for r in rows] == [("64", "3", "2", "16,0"), ("128", "3", "2", "16,0")]
    assert "window [16, 0]" in (out / "report.md").read_text()


# --- a server that misbehaves: the tool's time and memory stay bounded (attack round three) ---------


def _slow_endless_body():
    """A 200 whose chunked body goes on (1 MiB every 20 ms, 400 MiB in all): each read of it
    is quick, so a per-read timeout never fires."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n" % 2**20 + b" " * 2**20 + b"\r\n"
    for _ in range(400):
        time.sleep(0.02)
        yield chunk
    yield b"0\r\n\r\n"


def test_an_endless_answer_is_a_timeout_and_is_not_kept():
    """requests read the whole body into memory, as long as each read came within the timeout: a
    body that never ends held the worker and took memory without bound. Now the body is read
    and dropped as it comes (only its head is kept, for an error's detail), by one deadline."""
    server = Hostile(_slow_endless_body)
    try:
        run = run_cell(server.url, b"{}", Load(1, requests=1, timeout_s=1.0, warmup=0))
        sent = server.sent
    finally:
        server.close()
    assert [(s.status, s.error) for s in run.samples] == [(None, "timeout")]
    assert sent < 200 * 2**20  # the worker stopped reading long before the end


def _trickled_head():
    """A head sent a byte every 0.2 s (~14 s for all of it)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    for i in range(len(head)):
        time.sleep(0.2)
        yield head[i : i + 1]


def test_a_cell_ends_at_its_bounds_whatever_the_server_does():
    """A request whose answer's head trickles is past any per-read timeout: the cell waited for it
    however long it took. Now a cell ends by max_seconds + timeout_s (and a grace); a request still
    unanswered then is abandoned and said so."""
    server = Hostile(_trickled_head)
    try:
        run = run_cell(server.url, b"{}", Load(1, requests=1, timeout_s=0.5, max_seconds=0.5, warmup=0))
        sent = server.sent
    finally:
        server.close()
    assert sent < 40 and run.samples == [] and "abandoned" in run.capped


@pytest.mark.parametrize(
    "args, words",
    [
        (["--duration", "nan"], "finite"),
        (["--max-cell-seconds", "nan"], "finite"),  # no time bound: every cell abandoned at once
        (["--timeout", "nan"], "finite"),  # a traceback from socket.settimeout
        (["--timeout", "inf"], "finite"),
        (["--timeout", "1e308"], "at most 86400"),  # OverflowError from settimeout
        (["--max-cell-seconds", "1e308"], "at most 86400"),
        (["--rate", "nan"], "finite"),  # a traceback from the report's plot
        (["--slo-ms", "nan"], "finite"),  # no cell could fail it, silently
        (["--early-stop-factor", "inf"], "finite"),
        (["--T", "16..100000000"], "GiB"),  # the body of T=2**26 alone: 51 GB built in memory
        (["--T", "64", "--batch", "100000", "--heads", "1000"], "GiB"),
        (["--concurrency", "1..100000000"], "past 1024"),  # a session and a thread each, 2**26 of them
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_numbers_that_bound_nothing_are_usage_errors(args, words, capsys):
    """Attack round three: NaN and infinity passed `must be positive` (NaN > 0 is false, so is
    NaN <= 0) and then bounded nothing, or raised a traceback; a T list or workload whose body
    cannot be built was built until memory ran out. Each is now refused at once (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["--url", "http://127.0.0.1:9", *args])
    assert info.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("key", ["key\r\nX-Injected: 1", "key\n", "clé"])
def test_an_api_key_that_cannot_be_sent_is_a_usage_error(key, capsys):
    """requests refuses such a header value at each request: every request of the sweep was
    counted a connection error, with nothing saying why. Now exit 2 at once, the key not repeated."""
    with pytest.raises(SystemExit) as info:
        main(["--url", "http://127.0.0.1:9", "--api-key", key])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--api-key must be printable ASCII" in err and not any(form in err for form in (key, repr(key)[1:-1]))


def test_a_refusal_is_reported_in_printable_words_and_cut():
    """The server's error code and message went into the progress line (the terminal) and the
    report as they came: escape sequences drove the terminal, and a 60 KB message was a 60 KB
    line. Control characters are escaped and the detail cut to DETAIL_CHARS."""
    message = "\x1b]0;pwned\x07" + "m" * 60_000
    body = orjson.dumps({"error": {"status": 413, "code": "too_long\x1b[31m", "message": message, "field": None}})

    def answer():
        yield b"HTTP/1.1 413 Too Large\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    server = Hostile(answer)
    try:
        run = run_cell(server.url, b"{}", Load(1, requests=1, timeout_s=5.0))
    finally:
        server.close()
    assert run.refused.startswith("refused: 413 too_long") and "pwned" in run.refused
    assert not any(c in run.refused for c in "\x1b\x07") and len(run.refused) < 400


@pytest.mark.parametrize("pad", [1000, LIMITS_BYTES], ids=["the service's size", "past the bound"])
def test_limits_are_read_up_to_a_bound(pad):
    """GET /limits (for the report) read a body of any size whole into memory: one past
    LIMITS_BYTES is not the service's (~1 KB) and is not read, nor reported."""
    body = orjson.dumps({"version": "x", "pad": "a" * pad})

    def answer():
        yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    server = Hostile(answer)
    try:
        limits = fetch_limits(server.url)
    finally:
        server.close()
    assert (limits is not None) == (len(body) <= LIMITS_BYTES), limits if limits is None else limits["version"]


@pytest.mark.live
def test_split_sweep_goes_past_one_servers_limits_over_replicas(tmp_path):
    """--url twice (or --split): each request one client call, split past ATTN_MAX_T and ATTN_MAX_S
    (T=128 against 64) and spread over the replicas; every cell answered, the report says so."""
    small = {"ATTN_MAX_T": "64", "ATTN_MAX_S": "64", "ATTN_WARMUP": "0", "WEB_CONCURRENCY": "1"}
    with serving(small) as a, serving(small) as b:
        for urls in ([a.url], [a.url, b.url]):
            out = tmp_path / str(len(urls))
            args = [arg for url in urls for arg in ("--url", url)] + ["--split"] * (len(urls) == 1)
            args += ["--T", "32,128", "--concurrency", "1", "--requests", "2", "--causal", "--no-weights"]
            status = main([*args, "--slo-ms", "600000", "--fit-min-T", "32", "--out", str(out)])
            assert status == 0
            rows = _read_csv(out / "results.csv")
            assert sorted(int(r["T"]) for r in rows) == [32, 128]
            assert all((r["sent"], r["ok"], r["errors"]) == ("2", "2", "") for r in rows)
            report = (out / "report.md").read_text()
            assert f"{len(urls)} replica(s)" in report and "| 1 | 128 | all met |" in report
