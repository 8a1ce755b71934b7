"""`python -m bench.compression`: compressed bodies and answers (the figures in README.md's
"Compression").

Starts `python -m service` with one worker (so that its memory is the worker's) and the defaults of
`make run` but ATTN_COMPRESS_MAX_BYTES=0 (every answer compressed when asked, whatever its size),
then:

  1. the gzip bomb: 1 GiB of zeros in about 1 MiB (built piece by piece, never inflated here),
     POSTed --bombs times to /attention; for each, the time from the last byte sent to the
     answer's status line, and the worker's peak resident memory over its resident memory before
     (VmHWM after clear_refs, Linux);
  2. answer sizes: /attention with weights for T in --ts (B=1, H=8, d=64, random float32), as b64
     and as nested JSON, plain and with Accept-Encoding: gzip, and the best of 3 round trips.

Prints markdown tables."""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import socket
import time
import zlib
from pathlib import Path

import numpy as np

from bench.server import Server

BOMB = 2**30


def bomb() -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    return b"".join(packer.compress(zeros) for _ in range(BOMB // len(zeros))) + packer.flush()


def kb(pid: int, key: str) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split(f"{key}:")[1].split()[0])


def send_bomb(port: int, body: bytes, pid: int) -> tuple[int, float, float]:
    """(status, ms from the last byte sent to the status line, the worker's peak RSS growth in MiB)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = kb(pid, "VmRSS")
    head = (
        "POST /attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + body)
        sent = time.perf_counter()
        first = sock.recv(64)
        ms = (time.perf_counter() - sent) * 1000
        while sock.recv(65536):
            pass
    return int(first.split()[1]), ms, (kb(pid, "VmHWM") - before) / 1024


def attention_body(T: int, encoding: str) -> bytes:
    rng = np.random.default_rng(T)
    arrays = {n: rng.standard_normal((1, 8, T, 64)).astype("<f4") for n in ("q", "k", "v")}
    if encoding == "b64":
        tensors = {
            n: {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode()} for n, a in arrays.items()
        }
        return json.dumps({**tensors, "response_encoding": "b64"}).encode()
    return json.dumps({n: a.tolist() for n, a in arrays.items()}).encode()


def answer(port: int, body: bytes, coding: str | None, runs: int = 3) -> tuple[int, float]:
    """(bytes of the answer's body as sent, the best of runs round trips in ms: the answer is
    compressed as it streams, after the encode phase Server-Timing shows)."""
    best = float("inf")
    for _ in range(runs):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        headers = {"Content-Type": "application/json", **({"Accept-Encoding": coding} if coding else {})}
        t0 = time.perf_counter()
        conn.request("POST", "/attention", body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()  # http.client does not decompress: these are the bytes sent (chunking aside)
        best = min(best, (time.perf_counter() - t0) * 1000)
        conn.close()
        assert resp.status == 200 and resp.getheader("Content-Encoding") == coding, (resp.status, data[:200])
    return len(data), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bombs", type=int, default=5)
    parser.add_argument("--ts", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    server = Server("compression", env={"WEB_CONCURRENCY": "1", "ATTN_COMPRESS_MAX_BYTES": "0"}, inherit_settings=False)
    try:
        server.wait_ready()
        [pid] = server.workers()
        body = bomb()
        print(f"\n### The gzip bomb: {BOMB >> 20} MiB of zeros in {len(body) / 2**20:.2f} MiB, ATTN_MAX_BODY_BYTES 32 MiB\n")
        print("| try | status | ms from the last byte sent to the answer | worker peak RSS growth (MiB) |\n|---|---|---|---|")
        for i in range(args.bombs):
            status, ms, mib = send_bomb(server.port, body, pid)
            print(f"| {i + 1} | {status} | {ms:.0f} | {mib:.1f} |")
        print("\n### Answer sizes, /attention with weights (B=1, H=8, d=64, float32), plain and gzip (ATTN_COMPRESS_LEVEL 1)\n")
        print(
            "| T | encoding | plain bytes | gzip bytes | ratio | round trip ms plain | round trip ms gzip |\n|---|---|---|---|---|---|---|"
        )
        for T in args.ts:
            for encoding in ("b64", "nested"):
                body = attention_body(T, encoding)
                plain, plain_ms = answer(server.port, body, None)
                packed, packed_ms = answer(server.port, body, "gzip")
                print(f"| {T} | {encoding} | {plain} | {packed} | {packed / plain:.2f} | {plain_ms:.1f} | {packed_ms:.1f} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
