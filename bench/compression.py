"""`python -m bench compression`: which answers are worth compressing, and what `requests`' default
`Accept-Encoding: gzip, deflate` costs a client.

1. Each kind of answer compressed here at level 1 (zlib): ratio, speeds, and the link speed below
   which compressing pays (the bytes saved take longer to send than (de)compressing them).
2. POST /attention (b64 T=64, 256, nested T=64, no weights, `resp.json()`) with `requests`'
   defaults and with `Accept-Encoding: identity` against the default server, and with the
   defaults against ATTN_COMPRESS_ANSWERS=accepted; alternating, medians of --reps; on the
   loopback and with each exchange's bytes at a gigabit (125 MB/s) added.
3. The gzip bomb, 1 GiB of zeros in about 1 MiB, raw bytes --bombs times: the time from the last
   byte sent to the status line, and the worker's peak RSS growth (VmHWM after clear_refs).
"""

from __future__ import annotations

import argparse
import functools
import socket
import time
import zlib
from statistics import median

import numpy as np
import orjson
import pybase64
import requests

from bench.common import GIGABIT, Server, alternate, attention_body, reset_peak, status_kb, table

BOMB = 2**30
HEADER = "request | defaults ms | identity ms | accepted ms | defaults / identity | accepted / identity | gigabit: defaults / identity | gigabit: accepted / identity | answer bytes identity/gzip"


def kinds(url: str) -> dict[str, bytes]:
    """Answers of each kind, as the server writes them: a (8, T, 64) float32 tensor in b64, binary
    (/v2) and nested text; the OpenAPI document, from the server at url."""
    rng = np.random.default_rng(0)
    found = {}
    for T in (64, 256):
        a = rng.standard_normal((8, T, 64)).astype("<f4")
        found[f"b64 T={T}"] = pybase64.b64encode(a.tobytes())
        found[f"binary T={T}"] = a.tobytes()
        found[f"nested T={T}"] = orjson.dumps(a.tolist())
    found["/openapi.json"] = requests.get(url + "/openapi.json").content
    return found


def pays(url: str, runs: int = 10) -> str:
    rows = []
    for name, data in kinds(url).items():
        t0 = time.perf_counter()
        for _ in range(runs):
            packed = zlib.compress(data, 1)
        pack_s = (time.perf_counter() - t0) / runs
        t0 = time.perf_counter()
        for _ in range(runs):
            zlib.decompress(packed)
        unpack_s = (time.perf_counter() - t0) / runs
        r = len(packed) / len(data)
        saved_s_per_byte_at_1 = 1 - r  # bytes saved per byte of answer; pays while saved / link > pack + unpack
        link = saved_s_per_byte_at_1 * len(data) / (pack_s + unpack_s)
        rows.append((name, len(data), r, len(data) / pack_s / 1e6, len(data) / unpack_s / 1e6, link * 8 / 1e6))
    return table("answer | bytes | gzip ratio | compress MB/s | decompress MB/s | pays below (Mbit/s)", rows)


def clients(base_url: str, accepted_url: str, body: bytes):
    """(calls, bytes): a timed call for each side (requests' defaults, identity, requests' defaults
    against the server at accepted_url) and each side's bytes on the wire: the request's, and the
    answer's as sent (read undecoded). The defaults and identity share one session, so one
    keep-alive connection and so one worker: on two, the workers' own difference (up to 15-20%
    between runs) was read as the header's."""
    base = requests.Session()
    json, identity = {"Content-Type": "application/json"}, {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    sides = ((base, base_url, json), (base, base_url, identity), (requests.Session(), accepted_url, json))

    def call(session: requests.Session, url: str, headers: dict) -> None:
        resp = session.post(url + "/attention", data=body, headers=headers)
        resp.raise_for_status()
        resp.json()

    def wire(session: requests.Session, url: str, headers: dict) -> int:
        with session.post(url + "/attention", data=body, headers=headers, stream=True) as resp:
            return len(body) + len(resp.raw.read(decode_content=False))

    return [functools.partial(call, *side) for side in sides], [wire(*side) for side in sides]


def defaults_against_identity(server: Server, accepted: Server, reps: int) -> str:
    rows = []
    for encoding, T in (("b64", 64), ("b64", 256), ("nested", 64)):
        calls, wire = clients(server.url, accepted.url, attention_body(T, encoding))
        ms = alternate(calls, reps)
        loop = [median(m) for m in ms]
        gig = [median(m) + wire[i] / GIGABIT * 1000 for i, m in enumerate(ms)]
        answer = [w - len(attention_body(T, encoding)) for w in wire]
        ratios = [loop[0] / loop[1], loop[2] / loop[1], gig[0] / gig[1], gig[2] / gig[1]]
        rows.append([f"{encoding} T={T}", *loop, *ratios, f"{answer[1]} / {answer[2]}"])
    return table(HEADER, rows)


def bomb() -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    return b"".join(packer.compress(zeros) for _ in range(BOMB // len(zeros))) + packer.flush()


def send_bomb(port: int, body: bytes, pid: int) -> tuple[int, float, float]:
    """(status, ms from the last byte sent to the status line, the worker's peak RSS growth in MiB)."""
    before = reset_peak(pid)
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
    return int(first.split()[1]), ms, (status_kb(pid, "VmHWM") - before) / 1024


def bombs(n: int) -> str:
    body, rows = bomb(), []
    with Server("bomb", env={"WEB_CONCURRENCY": "1"}, inherit_settings=False) as server:
        [pid] = server.workers()
        for i in range(n):
            rows.append((i + 1, *send_bomb(server.port, body, pid)))
    head = f"{BOMB >> 20} MiB of zeros in {len(body) / 2**20:.2f} MiB, ATTN_MAX_BODY_BYTES 32 MiB\n\n"
    return head + table("try | status | ms from the last byte sent to the answer | worker peak RSS growth (MiB)", rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench compression", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--bombs", type=int, default=3)
    args = parser.parse_args(argv)
    with (
        Server("compression", inherit_settings=False) as server,
        Server("accepted", env={"ATTN_COMPRESS_ANSWERS": "accepted"}, inherit_settings=False) as accepted,
    ):
        print("\n### Which answers pay for compressing (zlib level 1, this process)\n")
        print(pays(server.url))
        print(f"\n### requests' defaults against identity, POST /attention, medians of {args.reps} alternating\n")
        print(defaults_against_identity(server, accepted, args.reps))
    if args.bombs:
        print("\n### The gzip bomb\n")
        print(bombs(args.bombs))


if __name__ == "__main__":
    main()
