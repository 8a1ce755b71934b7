"""A client on the server's host: a round trip through shared memory against the same computation
in this process, and against the binary wire.

    .venv/bin/python -m bench shm                         # starts `python -m service` with ATTN_ALLOW_CLIENT_SHM=true
    .venv/bin/python -m bench shm --lengths 1024 --runs 30

One request: q, k, v (1, 8, T, 64) float32, causal, weights returned (at T=1024 the weights are
32 MiB). Three ways, taken in a new random order within every repetition so that drift from other
load on the machine hits them alike:

- in-process: service.core.attention in this process, on one BLAS thread as a worker computes
  (the server runs with ATTN_SPLIT_THREADS=1, so that it computes on one thread too: a lone large
  request would otherwise be split over both cores, or not, by the load of the moment);
- shared memory: AttentionClient(url, shared_memory=True): the tensors in a region registered
  once, only a JSON head over HTTP, the outputs views of the region;
- binary wire: AttentionClient(url) (the default): raw bytes both ways over loopback.

Reported: each way's median (and min) in ms and its median over the in-process median. The table
goes to bench/out/shm.md and is printed."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attention_client import AttentionClient
from bench.common import OUT as OUT_DIR
from bench.common import Server
from service import core

OUT = OUT_DIR / "shm.md"
B, H, D = 1, 8, 64
RUNS = {64: 200, 256: 60, 1024: 40}


def measure(url: str, lengths: list[int], runs: dict[int, int]) -> dict[int, dict[str, list[float]]]:
    shm_client = AttentionClient(url, shared_memory=True, split=False, retries=0, timeout=120)
    wire_client = AttentionClient(url, split=False, retries=0, timeout=120)
    ways = {
        "in-process": lambda q, k, v: core.attention(q, k, v, causal=True),
        "shared memory": lambda q, k, v: shm_client.attention(q, k, v, causal=True),
        "binary wire": lambda q, k, v: wire_client.attention(q, k, v, causal=True),
    }
    results: dict[int, dict[str, list[float]]] = {}
    order = random.Random(0)
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            for length in lengths:
                rng = np.random.default_rng(length)
                q, k, v = (rng.standard_normal((B, H, length, D), dtype=np.float32) for _ in range(3))
                expected = ways["in-process"](q, k, v)
                for name in ("shared memory", "binary wire"):  # warm: the region registered, connections open
                    got = ways[name](q, k, v)
                    np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-5)
                    del got
                times: dict[str, list[float]] = {name: [] for name in ways}
                for _ in range(runs.get(length, 20)):
                    names = list(ways)
                    order.shuffle(names)
                    for name in names:
                        start = time.perf_counter()
                        result = ways[name](q, k, v)
                        times[name].append((time.perf_counter() - start) * 1000)
                        del result  # a shared-memory result frees its region only once dropped
                results[length] = times
                print(f"T={length}: " + ", ".join(f"{n} {statistics.median(t):.2f} ms" for n, t in times.items()), file=sys.stderr)
    finally:
        shm_client.close()
        wire_client.close()
    return results


def table(results: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        "| T | in-process ms | shared memory ms | binary wire ms | shared memory / in-process | binary wire / in-process |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for length, times in results.items():
        med = {name: statistics.median(t) for name, t in times.items()}
        low = {name: min(t) for name, t in times.items()}
        base = med["in-process"]
        cells = [f"{med[n]:.2f} (min {low[n]:.2f})" for n in ("in-process", "shared memory", "binary wire")]
        lines.append(f"| {length} | {' | '.join(cells)} | {med['shared memory'] / base:.2f} | {med['binary wire'] / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024", help="T values, comma-separated")
    parser.add_argument("--runs", type=int, default=None, help="repetitions per T (default: 200, 60, 40 for T = 64, 256, 1024)")
    parser.add_argument(
        "--url", default=None, help="a running server that allows client shared memory, ATTN_SPLIT_THREADS=1 (default: start one)"
    )
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    runs = {length: args.runs or RUNS.get(length, 20) for length in lengths}

    load_start = os.getloadavg()
    server = None
    if args.url is None:
        server = Server("shm", env={"ATTN_ALLOW_CLIENT_SHM": "true", "ATTN_SPLIT_THREADS": "1"})  # the same computation
        server.wait_ready(in_a_row=8)
    try:
        results = measure(args.url or server.url, lengths, runs)  # type: ignore[union-attr]  # one of the two is set
    finally:
        if server is not None:
            server.stop()
    load = " ".join(f"{x:.2f}" for x in load_start), " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python -m bench shm", *sys.argv[1:]])
    report = "\n".join(
        [
            "# Shared memory against the same computation in-process (`python -m bench shm`)",
            "",
            f"`{command}`: q, k, v ({B}, {H}, T, {D}) float32, causal, weights returned; medians of "
            + ", ".join(f"{runs[t]} (T={t})" for t in lengths)
            + " repetitions, the three ways in a new random order each time.",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()};"
            f" {datetime.datetime.now():%Y-%m-%d %H:%M}, load average at start {load[0]}, at end {load[1]}.",
            "",
            table(results),
            "",
        ]
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
