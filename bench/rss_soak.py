"""Worker RSS under closed-loop valid traffic: is it flat?

Starts nothing: point it at a running server (`ATTN_WARMUP=0 PORT=8123 python -m service`).
CLIENTS threads send mixed valid /attention requests (T 16..512, b64 and nested, with and
without weights) for SECONDS; every SAMPLE seconds it prints each gunicorn worker's RSS (MB).

    python -m bench.rss_soak --port 8123 --seconds 150 --clients 4 --arbiter PID
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import threading
import time

import numpy as np
import orjson

from attention_client import encode_tensor


def _body(rng: random.Random) -> bytes:
    T = rng.choice([16, 32, 64, 128, 256, 384, 512])
    H, d = rng.choice([1, 4, 8]), 64
    enc = rng.choice(["b64", "nested"])
    q = np.random.default_rng(rng.randrange(2**32)).standard_normal((H, T, d), dtype=np.float32)
    doc = {
        "q": encode_tensor(q, enc),
        "k": encode_tensor(q, enc),
        "v": encode_tensor(q, enc),
        "causal": rng.random() < 0.5,
        "return_weights": rng.random() < 0.5,
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def _client(port: int, stop: float, seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    bodies = [_body(rng) for _ in range(24)]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.monotonic() < stop:
        try:
            conn.request("POST", "/attention", rng.choice(bodies), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            counts[resp.status] = counts.get(resp.status, 0) + 1
        except (OSError, http.client.HTTPException):
            counts["error"] = counts.get("error", 0) + 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _workers(arbiter: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == arbiter:
                        out.append(int(pid))
            except OSError:
                pass
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--arbiter", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sample", type=float, default=10)
    a = ap.parse_args()
    stop = time.monotonic() + a.seconds
    counts: dict = {}
    threads = [threading.Thread(target=_client, args=(a.port, stop, i, counts), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while time.monotonic() < stop:
        pids = _workers(a.arbiter)
        print(
            f"{time.monotonic() - t0:6.0f} s {sum(counts.values()):6d} req  " + "  ".join(f"{p}:{_rss_mb(p):6.1f}" for p in pids),
            flush=True,
        )
        time.sleep(a.sample)
    for t in threads:
        t.join(timeout=70)
    print("final  " + "  ".join(f"{p}:{_rss_mb(p):6.1f}" for p in _workers(a.arbiter)), "answers", counts, flush=True)


if __name__ == "__main__":
    main()
