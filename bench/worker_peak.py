"""`python -m bench worker_peak`: one gunicorn worker's peak RSS over lone 32 MiB requests, a valid
b64 body and the worst hostile bodies of bench/garbage.py, against the pod's memory limit
(deploy/k8s): RSS before, peak (VmHWM, reset through /proc/PID/clear_refs) and after. Linux only."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import orjson
import requests

from bench.common import Server, b64, status_kb
from bench.garbage import CATALOGUE

MiB = 2**20


def main() -> None:
    q = np.random.default_rng(0).standard_normal((8, 4096, 63), np.float32)
    bodies = [("valid b64 q, k, v (8, 4096, 63)", orjson.dumps({"q": b64(q), "k": b64(q), "v": b64(q), "return_weights": False}))]
    bodies += [(n, CATALOGUE[n](32 * MiB - 64)) for n in ("b64_empty_objects", "rows3_ragged_end", "rows1")]
    with Server("worker-peak", env={"WEB_CONCURRENCY": "1", "ATTN_WARMUP": "0"}) as server:
        (worker,) = server.workers()
        print(f"worker idle RSS {status_kb(worker, 'VmRSS') / 1024:.0f} MiB")
        for name, body in bodies:
            before = status_kb(worker, "VmRSS")
            Path(f"/proc/{worker}/clear_refs").write_text("5")
            t0 = time.perf_counter()
            status = requests.post(
                server.url + "/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120
            ).status_code
            took, peak, after = time.perf_counter() - t0, status_kb(worker, "VmHWM"), status_kb(worker, "VmRSS")
            print(
                f"{name}: {len(body) / MiB:.1f} MiB -> {status} in {took:.1f} s; worker RSS before {before / 1024:.0f}, "
                f"peak {peak / 1024:.0f}, after {after / 1024:.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
