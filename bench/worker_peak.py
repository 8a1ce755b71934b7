"""`python -m bench worker_peak`: one gunicorn worker's peak RSS over lone 32 MiB requests, a valid
b64 body and the worst hostile bodies of bench/garbage.py (the worst also with /v2's
Inference-Header-Content-Length, which the native door must not let lower its charge), against the
pod's memory limit (deploy/k8s): RSS before, peak (VmHWM, reset through /proc/PID/clear_refs) and
after. `--concurrent 16`: 16 hostile 16 MiB bodies at once, 2 workers, with and without the header.
Linux only."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import requests

from bench.common import Server, b64, reset_peak, status_kb
from bench.garbage import CATALOGUE

MiB = 2**20
BINARY = {"Inference-Header-Content-Length": "0"}  # /v2's binary split, sent to the native door: charged as JSON all the same


def post(server: Server, body: bytes, headers: dict[str, str]) -> int:
    headers = {"Content-Type": "application/json", **headers}
    return requests.post(server.url + "/attention", data=body, headers=headers, timeout=120).status_code


def concurrent(n: int) -> None:
    """n hostile 16 MiB bodies (objects of empty b64) at once against 2 workers, without and then
    with the header: the statuses and the workers' peaks added up."""
    body = CATALOGUE["b64_empty_objects"](16 * MiB)
    with Server("worker-peak-concurrent", env={"WEB_CONCURRENCY": "2", "ATTN_WARMUP": "0"}) as server:
        workers = server.workers()
        for name, headers in (("without the header", {}), ("with Inference-Header-Content-Length: 0", BINARY)):
            for w in workers:
                reset_peak(w)
            with ThreadPoolExecutor(n) as pool:
                statuses = Counter(pool.map(lambda _, h=headers: post(server, body, h), range(n)))
            peaks = sum(status_kb(w, "VmHWM") for w in workers) / 1024
            print(f"{n} x 16 MiB {name}: {dict(statuses)}; the workers' peaks together {peaks:.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=0, help="send this many hostile bodies at once instead")
    if (n := parser.parse_args().concurrent) > 0:
        concurrent(n)
        return
    q = np.random.default_rng(0).standard_normal((8, 4096, 63), np.float32)
    bodies = [("valid b64 q, k, v (8, 4096, 63)", orjson.dumps({"q": b64(q), "k": b64(q), "v": b64(q), "return_weights": False}), {})]
    bodies += [(n, CATALOGUE[n](32 * MiB - 64), {}) for n in ("b64_empty_objects", "rows3_ragged_end", "rows1")]
    bodies.append(("b64_empty_objects with Inference-Header-Content-Length: 0", CATALOGUE["b64_empty_objects"](32 * MiB - 64), BINARY))
    with Server("worker-peak", env={"WEB_CONCURRENCY": "1", "ATTN_WARMUP": "0"}) as server:
        (worker,) = server.workers()
        print(f"worker idle RSS {status_kb(worker, 'VmRSS') / 1024:.0f} MiB")
        for name, body, headers in bodies:
            before = reset_peak(worker)
            t0 = time.perf_counter()
            status = post(server, body, headers)
            took, peak, after = time.perf_counter() - t0, status_kb(worker, "VmHWM"), status_kb(worker, "VmRSS")
            print(
                f"{name}: {len(body) / MiB:.1f} MiB -> {status} in {took:.1f} s; worker RSS before {before / 1024:.0f}, "
                f"peak {peak / 1024:.0f}, after {after / 1024:.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
