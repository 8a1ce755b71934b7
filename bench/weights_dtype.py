"""`python -m bench.weights_dtype`: "weights_dtype": "float16" against float32 weights, end to end.

    .venv/bin/python -m bench.weights_dtype                      # starts its own server on a free port
    .venv/bin/python -m bench.weights_dtype --url http://127.0.0.1:8000 --runs 20

One request: q, k, v (B, H, T, d) float32 in b64, causal, weights returned (B, H, T, T) in b64,
either in the compute dtype (float32) or with "weights_dtype": "float16". Both run on the same
server over one keep-alive connection each, alternating (float32, float16, float32, ...) so drift
from other load hits both alike. Per request: the response's bytes; the time to the response's
headers (the server has read, validated and computed; a b64 body is encoded while it is sent);
the time from the headers to the last byte read (sending the weights: encoding and transfer); the
whole request. Reported: medians over the runs. Loops are bounded by --runs and --budget seconds.
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages

from bench.server import Server  # noqa: E402


def body(q, k, v, weights_dtype: str | None) -> bytes:
    def enc(a):
        return {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode("ascii")}

    doc = {"q": enc(q), "k": enc(k), "v": enc(v), "causal": True}
    if weights_dtype:
        doc["weights_dtype"] = weights_dtype
    return json.dumps(doc).encode()


def timed_post(conn: http.client.HTTPConnection, payload: bytes, read_mb_s: float | None) -> tuple[float, float, bytes]:
    """(ms to the response's headers, ms from them to the last byte, the body). read_mb_s: read
    the body no faster than this (a link slower than loopback: the server's writes wait on it)."""
    start = time.perf_counter()
    conn.request("POST", "/attention", body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    headers_at = time.perf_counter()
    if read_mb_s is None:
        data = resp.read()
    else:
        parts, got = [], 0
        while chunk := resp.read(2**18):
            parts.append(chunk)
            got += len(chunk)
            ahead = got / (read_mb_s * 1e6) - (time.perf_counter() - headers_at)
            if ahead > 0:
                time.sleep(ahead)
        data = b"".join(parts)
    end = time.perf_counter()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {data[:300]!r}")
    return (headers_at - start) * 1000, (end - headers_at) * 1000, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server, http://HOST:PORT (default: start one)")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=240.0, help="seconds at most for the measured runs")
    p.add_argument("-B", type=int, default=1)
    p.add_argument("-H", type=int, default=8)
    p.add_argument("-T", type=int, default=1024)
    p.add_argument("-d", type=int, default=64)
    p.add_argument("--read-mb-s", type=float, help="read responses no faster than this many MB/s (a link slower than loopback)")
    args = p.parse_args()

    started = None
    if args.url:
        host, port = args.url.removeprefix("http://").rstrip("/").split(":")
    else:
        started = Server("service", [sys.executable, "-m", "service"])
        started.wait_ready()
        host, port = "127.0.0.1", started.port
    try:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((args.B, args.H, args.T, args.d), dtype=np.float32) for _ in range(3))
        cases = {"float32 weights": None, "float16 weights": "float16"}
        payloads = {name: body(q, k, v, wd) for name, wd in cases.items()}
        conns = {name: http.client.HTTPConnection(host, int(port), timeout=300) for name in cases}
        rows = {name: [] for name in cases}
        sizes, weights = {}, {}
        start = time.perf_counter()
        for i in range(args.warmup + args.runs):
            for name in cases:
                head_ms, read_ms, data = timed_post(conns[name], payloads[name], args.read_mb_s)
                if i >= args.warmup:
                    rows[name].append((head_ms, read_ms, head_ms + read_ms))
                sizes[name] = len(data)
                if i == 0:
                    w = json.loads(data)["weights"]
                    weights[name] = np.frombuffer(base64.b64decode(w["b64"]), dtype=w["dtype"]).reshape(w["shape"])
            if i >= args.warmup + 1 and time.perf_counter() - start > args.budget:
                break
        w32, w16 = weights["float32 weights"], weights["float16 weights"]
        assert w16.dtype == np.float16 and np.abs(w16.astype(np.float32) - w32).max() < 1e-3, "float16 weights disagree"

        load = os.getloadavg()
        n = len(rows["float32 weights"])
        print(
            f"q, k, v ({args.B}, {args.H}, {args.T}, {args.d}) float32 b64, causal, weights returned in b64; "
            f"{n} runs each after {args.warmup} warm-up, alternating; medians"
            + ("" if args.read_mb_s is None else f"; responses read at most {args.read_mb_s:g} MB/s")
        )
        print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print()
        print("| weights | response MB | to headers ms | headers to last byte ms | end to end ms |")
        print("|---|---:|---:|---:|---:|")
        med = {}
        for name in cases:
            med[name] = [statistics.median(r[j] for r in rows[name]) for j in range(3)]
            print(f"| {name} | {sizes[name] / 1e6:.1f} | {med[name][0]:.1f} | {med[name][1]:.1f} | {med[name][2]:.1f} |")
        a, b = med["float32 weights"], med["float16 weights"]
        print()
        print(
            f"float16 / float32: response bytes {sizes['float16 weights'] / sizes['float32 weights']:.2f}, "
            f"headers to last byte {b[1] / a[1]:.2f}, end to end {b[2] / a[2]:.2f}"
        )
    finally:
        if started is not None:
            started.stop()


if __name__ == "__main__":
    main()
