"""Overload on the real server: a burst far past what 2 workers admit is answered with 200s and
immediate 503s (Retry-After), never a hung connection, and /healthz answers throughout.

Also a measuring tool, against a fresh server started with the given environment variables (for
instance GUNICORN_CMD_ARGS="--worker-class sync" to compare worker models):
    python -m tests.test_overload burst [N=48] [T=1024] [ENV=VALUE ...]     the burst, summarised
    python -m tests.test_overload rate [T=256,1024] [C=1,2,4] [S=5] [W=0] [...]  closed loop: req/s, memory
Requests are B=1, H=8, d=64, float32 b64, with weights returned unless W=0."""

from __future__ import annotations

import base64
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from .conftest import start_server, stop_server, wait_for_workers, wait_until


def body_for(T: int, weights: bool = True, seed: int = 0) -> bytes:
    """B=1, H=8, d=64 float32 q, k, v in b64; with weights, 8.4 MB up and 47 MB down at T=1024."""
    rng = np.random.default_rng(seed)
    enc = lambda a: {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode()}
    doc = {name: enc(rng.standard_normal((1, 8, T, 64)).astype(np.float32)) for name in ("q", "k", "v")}
    return json.dumps({**doc, "return_weights": weights}).encode()


def all_ready(url: str) -> bool:
    """every worker answers /readyz with 200 (warm-up done)"""
    return all(requests.get(f"{url}/readyz", timeout=5).status_code == 200 for _ in range(8))


def burst(url: str, body: bytes, n: int, pids: set[int] = frozenset()) -> dict:
    """n concurrent POSTs of body, each on its own connection, while /healthz is polled every
    50 ms; the workers' peak resident memory sampled meanwhile."""
    stop, health, rss = threading.Event(), [], {}

    def poll():
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = requests.get(f"{url}/healthz", timeout=10).status_code
            except requests.RequestException as exc:
                status = type(exc).__name__
            health.append((status, (time.perf_counter() - t0) * 1000))
            for pid in pids:
                try:
                    kb = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))
                    rss[pid] = max(rss.get(pid, 0), kb // 1024)
                except (OSError, StopIteration):
                    pass
            time.sleep(0.05)

    def one(_):
        t0 = time.perf_counter()
        try:
            r = requests.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            return r.status_code, r.headers.get("Retry-After"), code, time.perf_counter() - t0
        except requests.RequestException as exc:
            return type(exc).__name__, None, None, time.perf_counter() - t0

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    statuses = {}
    for status, *_ in results:
        statuses[status] = statuses.get(status, 0) + 1
    spread = lambda xs: [round(min(xs), 2), round(statistics.median(xs), 2), round(max(xs), 2)] if xs else None
    return {
        "statuses": statuses,
        "results": results,
        "wall_s": round(wall, 2),
        "ok_s": spread([dt for s, _, _, dt in results if s == 200]),
        "refused_s": spread([dt for s, _, _, dt in results if s == 503]),
        "healthz": health,
        "healthz_max_ms": round(max(ms for _, ms in health), 1) if health else None,
        "worker_rss_peak_mb": rss,
    }


def summary(result: dict) -> str:
    keep = ("statuses", "wall_s", "ok_s", "refused_s", "healthz_max_ms", "worker_rss_peak_mb")
    return json.dumps(
        {
            **{k: result[k] for k in keep},
            "healthz_polls": len(result["healthz"]),
            "healthz_failed": sum(1 for status, _ in result["healthz"] if status != 200),
        }
    )


@pytest.mark.live
def test_a_burst_of_48_T1024_gets_only_200s_and_503s():
    proc, url = start_server({"WEB_CONCURRENCY": "2"})
    try:
        wait_until(lambda: all_ready(url), timeout=30)
        result = burst(url, body_for(1024), 48, wait_for_workers(proc))
        print("\n" + summary(result))
        assert set(result["statuses"]) <= {200, 503}, result["statuses"]
        assert result["statuses"].get(200, 0) >= 2 and result["statuses"].get(503, 0) >= 1
        for status, retry_after, code, _ in result["results"]:
            if status == 503:
                assert code == "overloaded" and int(retry_after) >= 1
        assert len(result["healthz"]) >= 5 and all(status == 200 for status, _ in result["healthz"])
        assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
        r = requests.post(f"{url}/attention", data=body_for(256), headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 200  # and it serves as before
    finally:
        stop_server(proc)


def closed_loop(url: str, body: bytes, clients: int, seconds: float, pids: set[int] = frozenset()) -> dict:
    """clients each POST body back to back on one connection for seconds: requests per second,
    latency, and the workers' resident memory (now and peak, VmHWM) afterwards."""
    latencies, statuses, stop = [], {}, time.monotonic() + seconds

    def loop():
        with requests.Session() as session:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                r = session.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)

    t0 = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.monotonic() - t0
    latencies.sort()
    memory = {}
    for pid in pids:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        memory[pid] = {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}
    return {
        "clients": clients,
        "statuses": statuses,
        "ok_per_s": round(len(latencies) / wall, 2),
        "p50_ms": round(1000 * statistics.median(latencies)) if latencies else None,
        "p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))]) if latencies else None,
        "worker_mb": memory,
    }


if __name__ == "__main__":
    # python -m tests.test_overload burst [N=48] [T=1024] [ENV=VALUE ...]
    # python -m tests.test_overload rate [T=256,1024,2048] [C=1,2,4] [S=5] [W=1|0] [ENV=VALUE ...]
    mode, args = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    opts = {k: args.pop(k) for k in ("N", "T", "C", "S", "W") if k in args}
    proc, url = start_server(args)
    try:
        wait_until(lambda: all_ready(url), timeout=30)
        pids = wait_for_workers(proc, int(args.get("WEB_CONCURRENCY", 2)))
        if mode == "burst":
            n, T = int(opts.get("N", 48)), int(opts.get("T", 1024))
            print(json.dumps({"env": args, "N": n, "T": T}), summary(burst(url, body_for(T), n, pids)))
        else:
            for T in map(int, opts.get("T", "256,1024,2048").split(",")):
                for clients in map(int, opts.get("C", "1,2,4").split(",")):
                    body = body_for(T, weights=opts.get("W", "1") == "1")
                    print(
                        json.dumps(
                            {
                                "env": args,
                                "T": T,
                                "weights": opts.get("W", "1") == "1",
                                **closed_loop(url, body, clients, float(opts.get("S", 5)), pids),
                            }
                        )
                    )
    finally:
        stop_server(proc)
