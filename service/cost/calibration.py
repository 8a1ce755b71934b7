"""Calibration: the shapes the cost model is timed on at start-up, and the clocks it reads."""

from __future__ import annotations

import statistics
import time

from schemas import AttentionJob, MhaJob

# (dtype, shape, kind): attention shapes are (B, H, T, d), S = T (S = 1 for "one key"); mha is (n, d, heads).
CALIBRATION = [
    ("float32", (1, 1, 16, 16), "attention"),  # tiny: almost all c, a block's fixed cost (without it c fitted to ~0)
    ("float32", (1, 8, 1024, 64), "one key"),  # almost all e: q and out's passes, weights v one key wide
    ("float32", (1, 8, 256, 1), "attention"),  # d = 1: q kᵀ one term wide, counted by e too
    ("float32", (1, 8, 64, 64), "attention"),
    ("float32", (1, 8, 256, 64), "attention"),
    ("float32", (1, 8, 128, 64), "causal, no weights"),
    ("float32", (1, 8, 1024, 64), "causal, no weights"),
    ("float32", (1, 8, 512, 16), "attention"),
    ("float32", (1, 8, 512, 128), "attention"),
    ("float32", (256, 512, 8), "mha"),
    ("float32", (1, 4, 1024, 64), "attention"),
    ("float32", (1, 1, 2048, 64), "attention"),
    ("float64", (1, 8, 128, 64), "attention"),
    ("float64", (1, 8, 1024, 64), "one key"),
    ("float64", (1, 8, 512, 64), "attention"),
    ("float64", (1, 2, 1024, 64), "attention"),
]


def probe(rng, dtype: str, shape: tuple, kind: str) -> AttentionJob | MhaJob:
    if kind == "mha":
        n, d, h = shape
        x, wq, wk, wv, wo = (rng.standard_normal(s).astype(dtype) for s in ((n, d), (d, d), (d, d), (d, d), (d, d)))
        return MhaJob(x, wq, wk, wv, wo, heads=h, causal=True, return_weights=True, encoding="b64")
    B, H, T, d = shape
    q = rng.standard_normal(shape).astype(dtype)
    k, v = (rng.standard_normal((B, H, 1 if kind == "one key" else T, d)).astype(dtype) for _ in range(2))
    causal, weights = ("top_left", False) if kind == "causal, no weights" else (False, True)
    return AttentionJob(q, k, v, None, causal=causal, key_lengths=None, scale=None, return_weights=weights, encoding="b64")


def median_ms(run, min_runs: int = 3, min_ms: float = 30.0, max_runs: int = 25, clock=time.perf_counter) -> float:
    """Median time of run() by clock (wall time by default; time.thread_time for this thread's CPU
    time), over at least min_runs calls and min_ms of calls: on a shared machine a quick call is
    often preempted, and one preemption must not become the measurement."""
    times: list[float] = []
    while len(times) < max_runs and (len(times) < min_runs or sum(times) < min_ms):
        times.append(timed(run, clock))
    return statistics.median(times)


def timed(run, clock=time.perf_counter) -> float:
    t0 = clock()
    run()
    return (clock() - t0) * 1000
