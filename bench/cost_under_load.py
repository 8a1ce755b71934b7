"""`python -m bench.cost_under_load`: how well the cost model's prediction (cost.predicted_ms)
matches the measured compute (Server-Timing's compute) under load, on this checkout against
another (--before DIR, e.g. a checkout of main), side by side in one run.

Each server is `python -m service` as `make run` starts it (2 workers x 2 compute slots), on a
loopback port, with 2 GiB in flight per worker. For T = 256 and 1024 (B=1, H=8, d=64, causal, float32, b64, no weights) and
concurrency 1, 2, 4, then 1 again (after the load: does the model still predict the idle time?),
c client threads each send --requests requests over their own keep-alive connection; every
response gives one ratio measured / predicted, and a cell's figure is their median. The servers
take turns cell by cell (same load on both). Bounded: 2 servers x 2 T x 4 cells x c x --requests
requests; about 2 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

from bench.__main__ import Client, request_body
from bench.server import ROOT, Server

CELLS = (1, 2, 4, 1)  # concurrency; the last 1 comes after the load


def ratios(port: int, body: bytes, concurrency: int, requests: int) -> list[float]:
    """measured / predicted compute of every response, from concurrency clients."""

    def client(_: int) -> list[float]:
        conn, out = Client(port), []
        for _ in range(requests):
            _, status, data, headers = conn.post(body)
            if status != 200:
                raise RuntimeError(f"status {status}: {data[:200]!r}")
            phases = dict(p.strip().split(";dur=") for p in headers["Server-Timing"].split(","))
            out.append(float(phases["compute"]) / orjson.loads(data)["cost"]["predicted_ms"])
        conn.conn.close()
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return [r for rs in pool.map(client, range(concurrency)) for r in rs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout to compare with (e.g. a checkout of main)")
    parser.add_argument("--requests", type=int, default=20, help="requests per client thread and cell")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    checkouts = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    env = {"ATTN_MAX_INFLIGHT_BYTES": str(2**31)}  # 4 clients of T=1024 get no 503: each body is charged 33x for its parse
    servers = {name: Server(name, cwd=path, env=env, inherit_settings=False) for name, path in checkouts.items()}
    try:
        for server in servers.values():
            server.wait_ready(in_a_row=20)
        rows = []
        for T in args.sizes:
            body = request_body(T, "b64", weights=False)
            for name in servers:  # a few requests first: connections made, first touches done
                ratios(servers[name].port, body, 2, 3)
            for i, c in enumerate(CELLS):
                label = f"{c}" + (" (after the load)" if i == len(CELLS) - 1 else "")
                medians = {name: statistics.median(ratios(s.port, body, c, args.requests)) for name, s in servers.items()}
                rows.append((T, label, medians))
                print(f"T={T} concurrency {label}: " + ", ".join(f"{n} {m:.2f}" for n, m in medians.items()), flush=True)
        load = os.getloadavg()
        print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        print(f"{args.requests} requests per client thread and cell; median of measured / predicted compute per response\n")
        names = list(servers)
        print("| T | concurrency | " + " | ".join(names) + " |")
        print("|---:|---|" + "---:|" * len(names))
        for T, label, medians in rows:
            print(f"| {T} | {label} | " + " | ".join(f"{medians[n]:.2f}" for n in names) + " |")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
