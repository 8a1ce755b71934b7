"""One long attention over 1 and 2 replicas: the client's key split (attention states merged by
lse) against servers of the default limits, beside the same attention in-process.

    python -m bench.replicas                  # T = S = 16384, H = 8, d = 64, causal, no weights (~2 min)
    python -m bench.replicas --t 8192 --reps 1

T = S = 16384 is 4x each server's ATTN_MAX_T and ATTN_MAX_S: the client sends blocks of 4096 query
rows by 4096 keys, all 8 heads (10 of the 16, the rest lie past the causal diagonal), over the
replicas. Each replica is `python -m service.replicas`'s: one worker, one computation at a time,
one thread (a core); the same two serve both cases, calls alternating between the client of the
first alone and the client of both. In-process: service.core.attention on one thread. The error is the largest
|out - exact| against a float64 softmax computed here in blocks of rows (bounded memory). Medians
of --reps runs; the machine may be shared, so the report says how many cores it has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import requests
from threadpoolctl import threadpool_limits

from attention_client import AttentionClient
from service import core, replicas

from .server import free_port


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: int = 1024) -> np.ndarray:
    """Causal (top-left) attention in float64, rows at a time: (H, T, d) -> (H, T, dv)."""
    H, T, d = q.shape
    out = np.empty((H, T, v.shape[-1]))
    for h in range(H):
        kh, vh = k[h].astype(np.float64), v[h].astype(np.float64)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            s = (q[h, t0:t1].astype(np.float64) / np.sqrt(d)) @ kh[:t1].T  # (rows, t1)
            s[np.arange(t1)[None, :] > np.arange(t0, t1)[:, None]] = -np.inf
            e = np.exp(s - s.max(-1, keepdims=True))
            out[h, t0:t1] = (e @ vh[:t1]) / e.sum(-1, keepdims=True)
    return out


def timed(fn, reps: int) -> tuple[float, np.ndarray]:
    """(median seconds, the last result)."""
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def over_replicas(q, k, v, reps: int) -> dict[int, tuple[float, np.ndarray]]:
    """{1: ..., 2: ...}: (median seconds, out) through the client to the first replica alone and to
    both, calls alternating (so that the machine's other load falls on both alike)."""
    port = free_port()
    procs = replicas.start(2, port, quiet=True)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not all(_ready(u) for u in urls):
            if time.monotonic() > deadline:
                raise RuntimeError("replicas not ready within 120 s")
            time.sleep(0.5)
        with AttentionClient(urls[:1], timeout=600) as one, AttentionClient(urls, timeout=600) as two:
            times: dict[int, list[float]] = {1: [], 2: []}
            outs = {}
            for _ in range(reps):
                for n, api in ((1, one), (2, two)):
                    t0 = time.perf_counter()
                    outs[n] = api.attention(q, k, v, causal=True, return_weights=False)[0]
                    times[n].append(time.perf_counter() - t0)
            return {n: (statistics.median(times[n]), outs[n]) for n in times}
    finally:
        replicas.stop(procs)


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/readyz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((args.heads, args.t, args.d), dtype=np.float32) for _ in range(3))
    with threadpool_limits(1):
        local_s, local = timed(lambda: core.attention(q, k, v, causal=True, return_weights=False)[0], args.reps)
    by_replicas = over_replicas(q, k, v, args.reps)
    (one_s, one), (two_s, two) = by_replicas[1], by_replicas[2]
    want = exact(q, k, v)
    print(f"T = S = {args.t}, H = {args.heads}, d = {args.d}, causal, no weights, float32; medians of {args.reps}; {os.cpu_count()} cores")
    print("| where | time | max abs error vs float64 |")
    print("|---|---:|---:|")
    print(f"| in-process numpy (service.core.attention, 1 thread) | {local_s:.2f} s | {np.abs(local - want).max():.2e} |")
    print(f"| 1 replica (client key split) | {one_s:.2f} s | {np.abs(one - want).max():.2e} |")
    print(f"| 2 replicas (client key split) | {two_s:.2f} s ({two_s / one_s:.2f}x of 1) | {np.abs(two - want).max():.2e} |")


if __name__ == "__main__":
    main()
