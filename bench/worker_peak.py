"""Peak RSS of one gunicorn worker over single large requests: what a
worker's lone request can take, against the pod's memory limit (deploy/k8s).

Starts `python -m service` with one worker on a free loopback port, sends one after another a
valid b64 body just under the default 32 MiB limit and the worst hostile 32 MiB bodies of
bench/garbage.py (the worst also with /v2's Inference-Header-Content-Length, which the native
door must not let lower its charge), and prints the worker's RSS before, its peak (VmHWM, reset through
/proc/PID/clear_refs before each) and after. Linux only.

    python -m bench worker_peak
    python -m bench worker_peak --concurrent 16   # 16 hostile 16 MiB bodies at once, 2 workers, with and without the header
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import requests

from attention_client import encode_tensor
from bench.common import Server
from bench.garbage import CATALOGUE

MiB = 2**20


def _kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _post(port: int, body: bytes, headers: dict[str, str]) -> int:
    return requests.post(
        f"http://127.0.0.1:{port}/attention", data=body, headers={"Content-Type": "application/json", **headers}, timeout=120
    ).status_code


def concurrent(n: int) -> None:
    """n hostile 16 MiB bodies (objects of empty b64) at once against 2 workers, without and then
    with Inference-Header-Content-Length: the statuses and the workers' peaks added up."""
    body = CATALOGUE["b64_empty_objects"](16 * MiB)
    server = Server("worker-peak-concurrent", env={"WEB_CONCURRENCY": "2", "ATTN_WARMUP": "0"})
    try:
        server.wait_ready(timeout=60)
        workers, port = server.workers(), server.port
        for name, headers in (
            ("without the header", {}),
            ("with Inference-Header-Content-Length: 0", {"Inference-Header-Content-Length": "0"}),
        ):
            for w in workers:
                with open(f"/proc/{w}/clear_refs", "w") as f:
                    f.write("5")
            with ThreadPoolExecutor(n) as pool:
                statuses = Counter(pool.map(lambda _, h=headers: _post(port, body, h), range(n)))
            peaks = sum(_kib(w, "VmHWM:") for w in workers) / 1024
            print(f"{n} x 16 MiB {name}: {dict(statuses)}; the workers' peaks together {peaks:.0f} MiB", flush=True)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=0, help="send this many hostile bodies at once instead")
    if (n := parser.parse_args().concurrent) > 0:
        concurrent(n)
        return
    server = Server("worker-peak", env={"WEB_CONCURRENCY": "1", "ATTN_WARMUP": "0"})
    try:
        server.wait_ready(timeout=60)
        worker, port = server.workers()[0], server.port
        q = np.random.default_rng(0).standard_normal((8, 4096, 63), np.float32)
        valid = orjson.dumps(
            {"q": encode_tensor(q, "b64"), "k": encode_tensor(q, "b64"), "v": encode_tensor(q, "b64"), "return_weights": False}
        )
        size = 32 * MiB - 64
        binary = {"Inference-Header-Content-Length": "0"}  # /v2's binary split, sent to the native door: charged as JSON all the same
        bodies = [("valid b64 q, k, v (8, 4096, 63)", valid, {})] + [
            (n, CATALOGUE[n](size), {}) for n in ("b64_empty_objects", "rows3_ragged_end", "rows1")
        ]
        bodies.append(("b64_empty_objects with Inference-Header-Content-Length: 0", CATALOGUE["b64_empty_objects"](size), binary))
        print(f"worker idle RSS {_kib(worker, 'VmRSS:') / 1024:.0f} MiB")
        for name, body, headers in bodies:
            before = _kib(worker, "VmRSS:")
            with open(f"/proc/{worker}/clear_refs", "w") as f:
                f.write("5")
            t0 = time.perf_counter()
            status = _post(port, body, headers)
            took = time.perf_counter() - t0
            peak, after = _kib(worker, "VmHWM:"), _kib(worker, "VmRSS:")
            print(
                f"{name}: {len(body) / MiB:.1f} MiB -> {status} in {took:.1f} s; worker RSS before {before / 1024:.0f}, "
                f"peak {peak / 1024:.0f}, after {after / 1024:.0f} MiB",
                flush=True,
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
