"""`python -m bench.slow_clients`: the service under slow and stalled clients (the figures in
README.md's "Slow and stalled clients").

Against a running server (`--url`, e.g. `make run`'s http://127.0.0.1:8000), or, without --url,
against `python -m service` started here on a free loopback port with the defaults of `make run`
(`--cwd DIR` serves another checkout, e.g. an older commit, with this interpreter):

  1. opens --downloads stalled downloads: sends a complete valid request for a large response
     (T=--download-t with weights, b64: ~45 MB at 1024) from a socket with a 4 KiB receive buffer,
     never read;
  2. opens --uploads stalled uploads: headers with Content-Length: 1000000 and `{"q": [`, then
     nothing;
  3. optionally (--idle N) opens N connections that send nothing;
  4. while they are all held open: polls GET /healthz --polls times, one new connection each as a
     probe does (each with a --probe-timeout; a timeout counts at that value), then sends
     --valid valid T=256 requests (B=1, H=8, d=64, b64, no weights) one after the other.

Prints the /healthz latencies (p50, p99, max, failures) and the T=256 statuses and times, as
markdown. Every address is 127.0.0.1; loops are bounded in count and in time (--budget)."""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import resource
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from bench.server import ROOT, Server


def tensor(rng, *shape) -> dict:
    a = rng.standard_normal(shape).astype("<f4")
    return {"shape": list(shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def attention_body(rng, T: int, weights: bool) -> bytes:
    return json.dumps(
        {"q": tensor(rng, 1, 8, T, 64), "k": tensor(rng, 1, 8, T, 64), "v": tensor(rng, 1, 8, T, 64), "return_weights": weights}
    ).encode()


def request_bytes(path: str, body: bytes, length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode() + body


def probe(url: str, path: str, timeout: float, body: bytes | None = None) -> tuple[int | None, float]:
    """(status or None on failure, seconds) of one request on a new connection."""
    u = urlparse(url)
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request("POST" if body is not None else "GET", path, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            return resp.status, time.perf_counter() - t0
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return None, time.perf_counter() - t0


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    u = urlparse(url)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect((u.hostname, u.port))
    return s


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server; default: start python -m service here")
    ap.add_argument("--cwd", type=Path, default=ROOT, help="the checkout to serve when starting one (default: this one)")
    ap.add_argument("--uploads", type=int, default=200)
    ap.add_argument("--downloads", type=int, default=20)
    ap.add_argument("--idle", type=int, default=0)
    ap.add_argument("--download-t", type=int, default=1024, help="T of the downloads' requests (with weights)")
    ap.add_argument("--set", action="append", default=[], metavar="ATTN_X=V", help="a setting for the server started here")
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--valid", type=int, default=5)
    ap.add_argument("--probe-timeout", type=float, default=2.0)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the polls and valid requests together")
    args = ap.parse_args(argv)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.uploads + args.downloads + args.idle + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))

    server = None
    if args.url:
        url = args.url
    else:  # make run's defaults but --set
        settings = dict(kv.split("=", 1) for kv in args.set)
        server = Server("slow-clients", env=settings, cwd=args.cwd, inherit_settings=False)
        server.wait_ready(timeout=90)
        url = server.url
    rng = np.random.default_rng(0)
    held: list[socket.socket] = []
    try:
        valid = attention_body(rng, 256, weights=False)
        assert probe(url, "/attention", 30, valid)[0] == 200, "a valid T=256 request fails before the test"
        big = request_bytes("/attention", attention_body(rng, args.download_t, weights=True))
        stalled_upload = request_bytes("/attention", b'{"q": [', length=1_000_000)
        downloads_sent = 0
        for _ in range(args.downloads):  # first, while the server still reads requests
            s = connect(url, rcvbuf=4096)
            s.settimeout(30)
            try:
                s.sendall(big)
                downloads_sent += 1
            except OSError:
                pass  # the server stopped reading it
            held.append(s)
        for _ in range(args.uploads):
            s = connect(url)
            s.sendall(stalled_upload)
            held.append(s)
        for _ in range(args.idle):
            held.append(connect(url))
        time.sleep(2.0)  # the downloads' requests are computed, their responses stall

        deadline = time.monotonic() + args.budget
        times, failures = [], 0
        for _ in range(args.polls):
            if time.monotonic() > deadline:
                break
            status, took = probe(url, "/healthz", args.probe_timeout)
            times.append(took)
            failures += status != 200
        statuses, valid_times, downloads = [], [], {}
        for i in range(args.valid):
            if i and time.monotonic() > deadline:  # at least one, whatever the polls took
                break
            status, took = probe(url, "/attention", 30, valid)
            statuses.append(status)
            valid_times.append(took)
        downloads = {}  # what the stalled downloads were answered (200 responses left unread, or 503s)
        for s in held[: args.downloads]:
            s.settimeout(1.0)
            try:
                line = s.recv(64).split(b"\r\n", 1)[0].decode("latin-1")
            except OSError:
                line = "no answer yet"
            downloads[line] = downloads.get(line, 0) + 1
    finally:
        for s in held:
            s.close()
        if server is not None:
            server.stop()

    ms = [t * 1000 for t in times]
    print(
        f"held open: {args.uploads} stalled uploads, {args.downloads} stalled downloads (T={args.download_t} with weights), {args.idle} idle connections; settings {args.set or 'defaults'}"
    )
    print(f"stalled downloads: {downloads_sent} of {args.downloads} requests sent whole; their answers: {downloads}")
    print()
    print(f"| /healthz polls | p50 ms | p99 ms | max ms | failed (timeout {args.probe_timeout:.0f} s or error) |")
    print("|---|---|---|---|---|")
    print(f"| {len(ms)} | {percentile(ms, 50):.1f} | {percentile(ms, 99):.1f} | {max(ms, default=float('nan')):.1f} | {failures} |")
    print()
    print("| valid T=256 requests (B=1 H=8 d=64 b64) | statuses | ms each |")
    print("|---|---|---|")
    print(f"| {len(statuses)} | {', '.join(str(s) for s in statuses)} | {', '.join(f'{t * 1000:.0f}' for t in valid_times)} |")


if __name__ == "__main__":
    main()
