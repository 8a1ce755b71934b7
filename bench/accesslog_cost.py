"""What the access log and the trace context cost a request (microseconds).

Two measures, side by side in one run:

- the line alone: building a /attention 200's record, one orjson.dumps and one write(2) to
  /dev/null (json and plain), and tracing.start() for a request with and without a traceparent;
- a whole request through the Flask test client (GET /healthz and the worked example's POST /attention,
  stdout sent to /dev/null), with the access log and trace context installed and without them,
  alternating blocks, in CPU time; the difference of the medians is the cost per request.

    python -m bench.accesslog_cost [--requests 200] [--blocks 30]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import timeit

from service.config import Settings
from service.web import accesslog, tracing
from service.web import app as app_module

RECORD = {
    "ts": "2026-12-01T00:40:12.345Z",
    "level": "info",
    "logger": "access",
    "request_id": "6cdaaf58c4ae46de8b70d6edb34661d5",
    "trace_id": "77e26ccb519b500b0c3b7caa6b08f0a7",
    "span_id": "03e507cb7f09e3fb",
    "method": "POST",
    "route": "/attention",
    "path": "/attention",
    "status": 200,
    "phases": {"decode": 0.147, "validate": 0.312, "compute": 0.244, "encode": 0.096},
    "B": 8,
    "H": 8,
    "T": 1024,
    "S": 1024,
    "d": 64,
    "predicted_ms": 20.1,
    "compute_ms": 19.4,
    "bytes_in": 8_400_000,
    "duration_ms": 31.303,
    "bytes_out": 2_800_000,
    "pid": 31679,
}
WORKED = {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": True}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@contextlib.contextmanager
def stdout_to_devnull():
    """fd 1 to /dev/null (the access log writes there), restored after."""
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def per_call_us(fn, number: int = 20000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def make_client(observed: bool):
    """A test client of the app, with or without the access log and trace context installed."""
    saved = tracing.install, accesslog.install
    if not observed:
        tracing.install = accesslog.install = lambda app: None  # create_app calls them through the modules
    try:
        app = app_module.create_app(Settings(warmup=False))
    finally:
        tracing.install, accesslog.install = saved
    return app.test_client()


def request_us(client, kind: str, n: int) -> float:
    """CPU time per request over n requests (the whole exchange, body read), microseconds: CPU
    time, not wall time, so that other work on a shared machine does not count."""
    start = time.process_time()
    for _ in range(n):
        if kind == "healthz":
            r = client.get("/healthz")
        else:
            r = client.post("/attention", json=WORKED)
        r.get_data()
        r.close()
    return (time.process_time() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="requests per block")
    ap.add_argument("--blocks", type=int, default=30, help="alternating blocks per app")
    args = ap.parse_args()

    with stdout_to_devnull():
        line = {fmt: per_call_us(lambda f=fmt: accesslog._write(dict(RECORD), f)) for fmt in ("json", "plain")}
        start_new = per_call_us(lambda: tracing.start(None))
        start_cont = per_call_us(lambda: tracing.start(TRACEPARENT))
        clients = {True: make_client(True), False: make_client(False)}
        results = {(kind, obs): [] for kind in ("healthz", "attention") for obs in (True, False)}
        for kind in ("healthz", "attention"):
            for c in clients.values():
                request_us(c, kind, 50)  # warm
            for i in range(args.blocks):
                for obs in (True, False) if i % 2 else (False, True):
                    results[kind, obs].append(request_us(clients[obs], kind, args.requests))

    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"one line, built dict -> dumps -> write(2) to /dev/null: json {line['json']:.2f} us, plain {line['plain']:.2f} us")
    print(f"tracing.start(): new trace {start_new:.2f} us, continuing a traceparent {start_cont:.2f} us")
    print("| request (Flask test client), CPU | with log + trace, us | without, us | difference, us |")
    print("|---|---|---|---|")
    for kind in ("healthz", "attention"):
        on, off = statistics.median(results[kind, True]), statistics.median(results[kind, False])
        print(f"| {kind} | {on:.1f} | {off:.1f} | {on - off:+.1f} |")


if __name__ == "__main__":
    main()
