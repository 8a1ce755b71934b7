"""`python -m bench.variants`: what the attention variants cost in the numeric core, side by side in one run.

In this process, one BLAS thread as in a worker, B=1, H=8, d=64, float32, no weights (the weights
of T=8192 would be 2 GiB), medians of interleaved runs:

  window   T=8192 under window (256, 0) (each row sees 257 keys) against T=512 causal (each row
           sees 256.5 keys on average) and T=8192 causal: a window makes the cost linear in T, so
           its time per query row should be that of T=512 causal (goal: within 2x), while T=8192
           causal is ~16x more per row
  gqa      8 query heads on 2 key/value heads (enable_gqa) against plain 8-head attention, causal,
           T=1024 and 4096, with and without weights at 1024 (goal: GQA no slower)

Loops are bounded in count and time (--budget seconds per comparison). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.core import attention, plan  # noqa: E402

H, D = 8, 64


def interleaved(cases: dict, reps: int, budget_s: float) -> dict[str, list[float]]:
    """Run each case once per round, rounds until reps or the budget (at least 2 rounds): ms lists."""
    times = {name: [] for name in cases}
    start = time.perf_counter()
    for i in range(reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
        if i >= 1 and time.perf_counter() - start > budget_s:
            break
    return times


def tensors(rng, heads: int, T: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal((1, heads, T, D)).astype(dtype)


def window_rows(rng, reps: int, budget: float) -> list[str]:
    q8k, k8k, v8k = (tensors(rng, H, 8192) for _ in range(3))
    q512, k512, v512 = (tensors(rng, H, 512) for _ in range(3))
    cases = {
        "T=512 causal": lambda: attention(q512, k512, v512, causal=True, return_weights=False),
        "T=8192 window (256, 0)": lambda: attention(q8k, k8k, v8k, window=(256, 0), return_weights=False),
        "T=8192 causal": lambda: attention(q8k, k8k, v8k, causal=True, return_weights=False),
    }
    rows_of = {"T=512 causal": 512, "T=8192 window (256, 0)": 8192, "T=8192 causal": 8192}
    scores_of = {
        "T=512 causal": plan(H, 512, 512, D, causal=True, return_weights=False).scores,
        "T=8192 window (256, 0)": plan(H, 8192, 8192, D, window=(256, 0), return_weights=False).scores,
        "T=8192 causal": plan(H, 8192, 8192, D, causal=True, return_weights=False).scores,
    }
    times = interleaved(cases, reps, budget)
    base = statistics.median(times["T=512 causal"]) / 512
    lines = ["| case | median ms | n | scores computed | µs per query row | per row vs T=512 causal |", "|---|---|---|---|---|---|"]
    for name, ms in times.items():
        med = statistics.median(ms)
        per_row = med / rows_of[name]
        lines.append(f"| {name} | {med:.1f} | {len(ms)} | {scores_of[name]:,} | {per_row * 1000:.2f} | {per_row / base:.2f}x |")
    return lines


def gqa_rows(rng, reps: int, budget: float) -> list[str]:
    lines = ["| T | weights | plain 8 heads ms | GQA 8q/2kv ms | n | GQA / plain |", "|---|---|---|---|---|---|"]
    for T, weights in ((1024, False), (1024, True), (4096, False)):
        q, k, v = (tensors(rng, H, T) for _ in range(3))
        k2, v2 = np.ascontiguousarray(k[:, :2]), np.ascontiguousarray(v[:, :2])
        cases = {
            "plain": functools.partial(attention, q, k, v, causal=True, return_weights=weights),
            "gqa": functools.partial(attention, q, k2, v2, causal=True, enable_gqa=True, return_weights=weights),
        }
        times = interleaved(cases, reps, budget)
        plain, gqa = statistics.median(times["plain"]), statistics.median(times["gqa"])
        lines.append(f"| {T} | {'yes' if weights else 'no'} | {plain:.1f} | {gqa:.1f} | {len(times['gqa'])} | {gqa / plain:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="rounds per comparison, at most")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per comparison before stopping early")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(
        f"B=1, H={H}, d={D}, float32, one BLAS thread, no weights unless said; load average at start: "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
    )
    with threadpool_limits(1):
        attention(*(tensors(rng, H, 64) for _ in range(3)), window=(8, 0))  # warm-up
        print("\n".join(window_rows(rng, args.reps, args.budget)))
        print()
        print("\n".join(gqa_rows(rng, args.reps, args.budget)))


if __name__ == "__main__":
    main()
