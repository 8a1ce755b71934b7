"""A small /v2 infer on two checkouts side by side in one run: the Open Inference Protocol's
binary door (T=64: q, k, v of (1, 8, 64, 64) FP32 as binary_data_size inputs, causal, only `out`,
as binary), one server per checkout as `make run` starts them, requests alternating between them
over one keep-alive connection each; per checkout the median latency and the workers' CPU per
request, the decode and validate phases the server reports (Server-Timing: the envelope is read in
decode), and the ratios of this checkout's to the baseline's.

    python -m bench v2_ab ../main                 # 7 rounds of 200 requests each, ~1 min
    python -m bench v2_ab ../main --rounds 9 --requests 300

Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import requests

from attention_client.loadtest.transport import parse_server_timing

from .common import ROOT, Server
from .small_requests import cpu_s


def body() -> tuple[bytes, dict]:
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal((1, 8, 64, 64), dtype=np.float32) for n in "qkv"}
    inputs = [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}} for n, a in arrays.items()
    ]
    outputs = [{"name": "out", "parameters": {"binary_data": True}}]
    header = json.dumps({"inputs": inputs, "outputs": outputs, "parameters": {"causal": True}}).encode()
    return header + b"".join(a.tobytes() for a in arrays.values()), {"Inference-Header-Content-Length": str(len(header))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline", type=Path, help="another checkout (say a git worktree of main)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=200, help="per round and checkout")
    args = p.parse_args()
    data, headers = body()
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    servers = {name: Server(name, cwd=tree, env={"PYTHONPATH": str(tree)}, inherit_settings=False) for name, tree in trees.items()}
    latency: dict[str, list[float]] = {name: [] for name in trees}
    cpu: dict[str, list[float]] = {name: [] for name in trees}
    phases: dict[str, dict[str, list[float]]] = {name: {"decode": [], "validate": []} for name in trees}
    try:
        sessions = {}
        for name, server in servers.items():
            server.wait_ready(in_a_row=4)
            sessions[name] = requests.Session()
            for _ in range(50):  # warm both workers' paths
                sessions[name].post(f"{server.url}/v2/models/attention/infer", data=data, headers=headers, timeout=30).raise_for_status()
        for r in range(args.rounds):
            for name in trees if r % 2 == 0 else reversed(trees):
                server, session, times = servers[name], sessions[name], []
                before = cpu_s(server.workers())
                for _ in range(args.requests):
                    t = time.perf_counter()
                    resp = session.post(f"{server.url}/v2/models/attention/infer", data=data, headers=headers, timeout=30)
                    times.append(time.perf_counter() - t)
                    resp.raise_for_status()
                    timing = parse_server_timing(resp.headers["Server-Timing"])
                    for phase, ms in phases[name].items():
                        ms.append(timing[phase] * 1000)
                cpu[name].append((cpu_s(server.workers()) - before) / args.requests * 1e6)
                latency[name].append(statistics.median(times) * 1e6)
                print(f"round {r + 1} {name:8s} median {latency[name][-1]:.0f} us, worker CPU {cpu[name][-1]:.0f} us/request", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{args.rounds} rounds of {args.requests}, medians; load average {os.getloadavg()[0]:.1f}\n")
    print("| checkout | latency us | worker CPU us/request | decode us | validate us |\n|---|---|---|---|---|")
    med = {
        name: [statistics.median(xs) for xs in (latency[name], cpu[name], phases[name]["decode"], phases[name]["validate"])]
        for name in trees
    }
    for name, row in med.items():
        print(f"| {name} | " + " | ".join(f"{x:.0f}" for x in row) + " |")
    ratios = ", ".join(
        f"{what} {a / b:.3f}" for what, a, b in zip(("latency", "CPU", "decode", "validate"), med["this"], med["baseline"], strict=True)
    )
    print(f"\nthis / baseline: {ratios}")


if __name__ == "__main__":
    main()
