"""The numeric core's speed in-process: main's core (before) against this tree's (after) against
torch's scaled_dot_product_attention, B=1, H=8, d=64, S=T, causal (and at T=4096 also not),
float32 (float64 if asked), each implementation once per repetition in a random order, medians.

    python -m bench.core_speed          # ~60-90 s; prints a markdown table
    python -m bench.core_speed small    # T <= 256 only (the reference path), ~20 s
    python -m bench.core_speed small float64    # the same in float64
    python -m bench.core_speed mha      # mha() at n=64, d_model=512, 8 heads, ~5 s

The core runs as in a worker: one BLAS thread (OPENBLAS_NUM_THREADS=1) and the worker's allocator
settings (bench/garbage.py's WORKER_MALLOC_ENV; without them every call maps and faults its
arrays afresh, ~100 us of a T=64 request), threads=1, or threads=2 over a pool of one (the split
of one large request). torch uses its default threads (it ignores ours: no weights), told to
sleep between calls (OMP_WAIT_POLICY=PASSIVE): by default its OpenMP threads spin after each call,
on the two cores the next numpy call needs, and slowed whatever ran after torch (T=64 ~1.7x, T=2048
~1.3x, at random). "before" is main's service/core (`git archive`), imported as a package of
its own; `before=REF` takes it from another commit (say the one a change starts from):

    python -m bench.core_speed small before=6de42b9
"""

from __future__ import annotations

from bench.garbage import rerun_with_core_bench_env

rerun_with_core_bench_env("bench.core_speed")

import importlib.util  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from service import core as after  # noqa: E402

# (T, weights, causal, repetitions): each repetition runs every implementation once, in a random order
CASES = [
    (64, False, True, 400),
    (64, True, True, 400),
    (128, False, True, 200),
    (128, True, True, 200),
    (256, False, True, 60),
    (256, True, True, 60),
    (1024, False, True, 20),
    (1024, True, True, 20),
    (2048, False, True, 12),
    (4096, False, True, 10),
    (4096, False, False, 6),
]


BEFORE = next((a.partition("=")[2] for a in sys.argv[1:] if a.startswith("before=")), "main")  # the ref "before" is


def load_before():
    """The core at main (or before=REF) as a package of its own, core_before."""
    root = Path(tempfile.mkdtemp(prefix="core-speed-"))
    archive = subprocess.run(["git", "archive", BEFORE, "service/core"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    init = root / "service" / "core" / "__init__.py"
    spec = importlib.util.spec_from_file_location("core_before", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["core_before"] = module  # for its relative imports
    spec.loader.exec_module(module)
    return module


def torch_sdpa():
    """A function (q, k, v) -> out through torch's SDPA, or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None

    def run(q, k, v, causal):
        with torch.no_grad():
            return F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=causal).numpy()

    return run


def mha_small(before, reps: int = 400) -> None:
    """mha() at the GPT block's small size (n=64, d_model=512, 8 heads, causal, wo), main's core
    against this tree's, alternating in a random order, medians."""
    rng, order = np.random.default_rng(0), np.random.default_rng(1)
    x = rng.standard_normal((64, 512), dtype=np.float32)
    wq, wk, wv, wo = ((rng.standard_normal((512, 512)) / np.sqrt(512)).astype(np.float32) for _ in range(4))
    print(f"load average {os.getloadavg()[0]:.2f}; numpy {np.__version__}; float32; medians")
    print(f"| mha n=64 d=512 h=8 | before ({BEFORE}) | after | after / before |")
    print("|---|---|---|---|")
    for weights in (False, True):
        runs = {
            name: partial(core.mha, x, wq, wk, wv, wo, 8, return_weights=weights) for name, core in (("before", before), ("after", after))
        }
        times = {name: [] for name in runs}
        for _ in range(reps):
            for name in order.permutation(list(runs)):
                t = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t)
        b, a = (float(np.median(times[name])) for name in ("before", "after"))
        print(f"| weights {'yes' if weights else 'no'} | {b * 1e6:,.0f} us | {a * 1e6:,.0f} us | {a / b:.2f}x |")


def main() -> None:
    if "mha" in sys.argv[1:]:
        mha_small(load_before())
        return
    before, sdpa = load_before(), torch_sdpa()
    pool = ThreadPoolExecutor(1)
    rng, order = np.random.default_rng(0), np.random.default_rng(1)
    rows = []
    cases = [c for c in CASES if c[0] <= 256] if "small" in sys.argv[1:] else CASES
    dtype = np.float64 if "float64" in sys.argv[1:] else np.float32
    for T, weights, causal, reps in cases:
        q, k, v = (rng.standard_normal((1, 8, T, 64), dtype=dtype) for _ in range(3))
        runs = {
            (name, threads): partial(core.attention, q, k, v, causal=causal, return_weights=weights, threads=threads, pool=pool)
            for threads in (1, 2)
            for name, core in (("before", before), ("after", after))
        }
        if sdpa is not None and not weights:
            runs[("torch", 0)] = partial(sdpa, q, k, v, causal)
        times = {key: [] for key in runs}
        for f in runs.values():
            f()  # warm up
        keys = list(runs)
        for _ in range(reps):
            # in a random order each time: a call ran ~3-4% slower right after another
            # implementation's (T=1024 with weights, 40 repetitions; T=64 right after torch's),
            # so a fixed order favoured whichever ran first
            for i in order.permutation(len(keys)):
                key, f = keys[i], runs[keys[i]]
                t = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t)
        med = {key: float(np.median(ts)) for key, ts in times.items()}
        for threads in (1, 2):
            torch_t = med.get(("torch", 0))
            b, a = med[("before", threads)], med[("after", threads)]
            rows.append((T, weights, causal, threads, b, a, torch_t))
    unit = lambda s: f"{s * 1e6:,.0f} us" if s < 2e-3 else f"{s * 1e3:,.1f} ms"  # noqa: E731
    print(f"load average {os.getloadavg()[0]:.2f}; numpy {np.__version__}; {dtype.__name__}; medians")
    print(f"| T | weights | causal | threads | before ({BEFORE}) | after | after / before | torch SDPA | after / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    for T, weights, causal, threads, b, a, t in rows:
        torch_cols = f"{unit(t)} | {a / t:.2f}x" if t else "- | -"
        print(f"| {T} | {yes(weights)} | {yes(causal)} | {threads} | {unit(b)} | {unit(a)} | {a / b:.2f}x | {torch_cols} |")
    pool.shutdown()


if __name__ == "__main__":
    main()
