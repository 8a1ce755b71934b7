"""How close a numpy core can come to torch at T=4096: the matmuls alone against torch's whole SDPA.

    python -m bench.matmul_floor            # ~30 s; prints a markdown table

B=1, H=8, T=S=4096, d=64, causal, float32, on 2 threads as a large request alone on the server
(service/cost/split.py's split). Three things, each once per repetition in a random order, medians:

- matmuls only: exactly the two matmuls of every causal block the core computes (q_blk kᵀ and
  scores v over the keys up to the block's last row; 128-row blocks, the core's at this size),
  on two threads taking blocks from one queue, with nothing else: no scale, no max, no exp, no
  sum, no division, no mask. No numpy attention can take less than this;
- this core: service.core.kernels.attention, threads=2;
- torch: torch.nn.functional.scaled_dot_product_attention, its default threads (2 here).

If "matmuls only" is about torch's time, issue 11's "T=4096 without weights at most 1.2x torch,
end to end" leaves the softmax and the whole wire (decode, transfer, encode) 0.2x torch's time,
while exp alone over the ~67M scores of a causal T=4096 request takes about that on these cores.
The core runs as in a worker (bench/core_speed.py's environment: one BLAS thread per calling
thread, the worker's allocator settings). Needs torch (requirements-bench or `pip install torch`).
"""

from __future__ import annotations

from bench.garbage import rerun_with_core_bench_env

rerun_with_core_bench_env("bench.matmul_floor")  # as bench.core_speed runs the core

import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402

from service.core import kernels  # noqa: E402

T, H, D, ROWS, REPS = 4096, 8, 64, 128, 9


def main() -> None:
    import torch

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, T, D), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    pool = ThreadPoolExecutor(1)
    out = np.empty((H, T, D), np.float32)
    blocks = [(h, t0) for h in range(H) for t0 in range(0, T, ROWS)]

    def matmuls_only() -> None:
        queue, lock = iter(blocks), threading.Lock()

        def work() -> None:
            scores = np.empty((ROWS, T), np.float32)
            while True:
                with lock:
                    block = next(queue, None)
                if block is None:
                    return
                h, t0 = block
                end = t0 + ROWS  # the keys up to the block's last row (causal)
                np.matmul(q[0, h, t0:end], k[0, h, :end].T, out=scores[:, :end])
                np.matmul(scores[:, :end], v[0, h, :end], out=out[h, t0:end])

        other = pool.submit(work)
        work()
        other.result()

    runs = {
        "matmuls only": matmuls_only,
        "this core": lambda: kernels.attention(q, k, v, causal=True, return_weights=False, threads=2, pool=pool),
        "torch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True),
    }
    times = {name: [] for name in runs}
    for _ in range(REPS):
        for name in random.sample(list(runs), len(runs)):
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) * 1000)
    torch_ms = statistics.median(times["torch SDPA"])
    load = os.getloadavg()
    print(f"B=1, H={H}, T=S={T}, d={D}, causal, float32, 2 threads; {REPS} repetitions, medians; load average {load[0]:.2f}\n")
    print("| | ms | / torch |")
    print("|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.1f} | {statistics.median(ms) / torch_ms:.2f}x |")


if __name__ == "__main__":
    main()
