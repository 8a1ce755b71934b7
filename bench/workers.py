"""`python -m bench.workers`: the worker model, measured. Runs this service as
workers x BLAS threads = 2x1, 1x2 and 2x2 and sends b64 T=1024 requests (with and without
weights) at concurrency 1 and 2; prints median latency and requests per second. The choice in
deploy/gunicorn.conf.py rests on this table. Loopback only, bounded counts."""

from __future__ import annotations

import statistics
import sys
import threading
import time

from bench.__main__ import Client, request_body
from bench.server import Server

MODELS = [(2, 1), (1, 2), (2, 2)]  # (workers, BLAS threads per worker)


def run(port: int, body: bytes, concurrency: int, per_client: int) -> tuple[float, float]:
    times: list[float] = []
    lock = threading.Lock()

    def worker():
        client = Client(port)
        for _ in range(per_client):
            ms, status, _, _ = client.post(body)
            assert status == 200
            with lock:
                times.append(ms)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return statistics.median(times), len(times) / wall


def main() -> None:
    bodies = {w: request_body(1024, "b64", w) for w in (False, True)}
    print("| workers x BLAS threads | weights | c=1 median ms | c=2 median ms | c=2 requests/s |")
    print("|---|---|---:|---:|---:|")
    for workers, threads in MODELS:
        env = {"WEB_CONCURRENCY": str(workers), "OPENBLAS_NUM_THREADS": str(threads), "ATTN_WARMUP": "false"}
        server = Server("this", [sys.executable, "-m", "service"], env)
        try:
            server.wait_ready()
            for w, body in bodies.items():
                run(server.port, body, 2, 2)  # warm every worker
                c1, _ = run(server.port, body, 1, 8)
                c2, rps = run(server.port, body, 2, 8)
                print(f"| {workers} x {threads} | {'yes' if w else 'no'} | {c1:.1f} | {c2:.1f} | {rps:.1f} |", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
