"""`python -m bench shm [--lengths 64,256,1024] [--runs N] [--url URL]`: a client on the server's
host, numpy to numpy: AttentionClient(url, shared_memory=True) (the tensors in a region registered
once, a JSON head over HTTP, the outputs views of the region) and AttentionClient(url) (the binary
wire) against service.core.attention in this process on one BLAS thread; the server started here
allows client shared memory and computes on one thread too (ATTN_SPLIT_THREADS=1). q, k, v
(1, 8, T, 64), causal, weights returned; the three ways in a new random order every repetition.
Medians (and min), and each over the in-process median; also written to bench/out/shm.md."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attention_client import AttentionClient
from bench.common import publish, served, table
from service import core

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


def report(results: dict[int, dict[str, list[float]]]) -> str:
    rows = []
    for length, times in results.items():
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{med[n]:.2f} (min {min(times[n]):.2f})" for n in ("in-process", "shared memory", "binary wire")]
        rows.append([length, *cells, med["shared memory"] / med["in-process"], med["binary wire"] / med["in-process"]])
    return table("T | in-process ms | shared memory ms | binary wire ms | shared memory / in-process | binary wire / in-process", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024", help="T values, comma-separated")
    parser.add_argument("--runs", type=int, default=None, help="repetitions per T (default: 200, 60, 40 for T = 64, 256, 1024)")
    parser.add_argument("--url", help="a running server that allows client shared memory, ATTN_SPLIT_THREADS=1 (default: start one)")
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    runs = {length: args.runs or RUNS.get(length, 20) for length in lengths}
    load = os.getloadavg()[0]
    with served(args.url, "shm", in_a_row=8, env={"ATTN_ALLOW_CLIENT_SHM": "true", "ATTN_SPLIT_THREADS": "1"}) as url:
        results = measure(url, lengths, runs)
    text = f"`python -m bench shm {' '.join(sys.argv[1:])}`, medians of {', '.join(f'{runs[t]} (T={t})' for t in lengths)}; "
    text += f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n\n{report(results)}\n"
    publish("shm.md", text)


if __name__ == "__main__":
    main()
