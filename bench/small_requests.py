"""`python -m bench small_requests`: the fixed cost of a small request. wrk (1 thread, 8 connections)
against GET /healthz and POST /attention with a T=64 b64 body without weights (530 KB in, 175 KB
out), servers and endpoints alternating in rounds, medians of req/s, their ratio (attention /
healthz), each server's CPU per request (/proc) and its non-2xx answers; then the latency of a
T=64 request sent alone through `requests`, as `make bench-peers` sends it.

    python -m bench small_requests --workers 2 --duration 5 --rounds 3 --floor
    python -m bench small_requests --baseline ../main            # another checkout beside this one

--floor also serves bench/floor_app.py, whose /attention only reads the body and answers a fixed
175 KB: the highest ratio a T=64 b64 request can reach with this stack. Each server is
`python -m service` as `make run` starts it; where a worker's default slots (2 computing + 4
queued) are fewer than the connections, ATTN_MAX_QUEUE is raised to fit them (no 503 by design).
Needs wrk (Debian: apt-get install wrk)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from service import __main__ as service_main

from .common import ROOT, D, H, NativeClient, Server, attention_body, cpu_seconds, table

LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb")
wrk.body = f:read("*a")
f:close()
"""
HEADER = (
    "server | workers | /healthz req/s | T=64 b64 /attention req/s | ratio | server CPU ms per request: /healthz, /attention, beyond "
    "| non-2xx /attention (of requests) | one at a time, ms"
)


def one_at_a_time(servers: dict, reps: int) -> dict[str, float]:
    """Median ms of a T=64 request sent alone by `make bench-peers`'s client (NativeClient: the
    body encoded and the answer decoded each time), the servers in turns."""
    rng = np.random.default_rng(0)
    qkv = {name: rng.standard_normal((1, H, 64, D)).astype(np.float32) for name in "qkv"}
    clients = {key: NativeClient(server.port) for key, server in servers.items()}
    times: dict = defaultdict(list)
    for i in range(reps + 10):  # the first 10 rounds warm up
        for key in servers if i % 2 else reversed(servers):
            t0 = time.perf_counter()
            clients[key].infer(qkv, weights=False)
            if i >= 10:
                times[key].append((time.perf_counter() - t0) * 1000)
    for client in clients.values():
        client.close()
    return {key: statistics.median(t) for key, t in times.items()}


def wrk(url: str, seconds: int, connections: int, script: str | None = None) -> tuple[float, int, int]:
    """(req/s, requests, non-2xx or 3xx answers plus socket errors) of one wrk run."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"] + (["-s", script] if script else []) + [url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    bad += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return rate, total, bad


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another checkout (say a git worktree of main) measured beside this one")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 1], help="worker counts (WEB_CONCURRENCY)")
    p.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--latency-reps", type=int, default=200, help="requests to each server sent one at a time (after 10 to warm up)")
    p.add_argument(
        "--floor", action="store_true", help="also serve bench/floor_app.py: /attention reads the body and answers a fixed response"
    )
    args = p.parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed (Debian: apt-get install wrk)")

    tmp = Path(tempfile.mkdtemp(prefix="small-requests-"))
    (tmp / "body.json").write_bytes(attention_body(64))
    script = tmp / "post.lua"
    script.write_text(LUA.format(body=tmp / "body.json"))

    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    trees += [("floor", ROOT)] if args.floor else []
    servers = {}
    try:
        for name, tree in trees:
            command = [sys.executable, "-m", "service"]
            if name == "floor":  # as `python -m service` runs gunicorn (its config, its environment), another app
                command = [sys.executable, "-m", "gunicorn", "--config", str(service_main.CONF), "bench.floor_app:create_app()"]
            for n in args.workers:
                key = f"{name} {n}"
                env = {"WEB_CONCURRENCY": str(n)}
                env = service_main.environment(env) if name == "floor" else env
                if n * (2 + 4) < args.connections:  # the default slots per worker: 2 computing + 4 queued
                    env["ATTN_MAX_QUEUE"] = str(-(-args.connections // n) - 2)  # room for every connection: no 503 by design
                servers[key] = Server(key.replace(" ", "-"), command, env, cwd=tree, inherit_settings=False)
        for server in servers.values():
            server.wait_ready(in_a_row=8)
        rate: dict = defaultdict(list)  # (server, endpoint) -> req/s per round
        cpu: dict = defaultdict(list)  # (server, endpoint) -> CPU ms per request per round
        bad: dict = defaultdict(int)  # (server, endpoint) -> failed requests, and (..., "n") all of them
        for r in range(args.rounds):
            for key, server in servers.items():
                for endpoint, lua in (("/healthz", None), ("/attention", str(script))):
                    pids = [server.proc.pid, *server.workers()]
                    cpu0 = cpu_seconds(pids)
                    per_s, total, failed = wrk(server.url + endpoint, args.duration, args.connections, lua)
                    cpu[key, endpoint].append((cpu_seconds(pids) - cpu0) / total * 1000)
                    rate[key, endpoint].append(per_s)
                    bad[key, endpoint], bad[key, "n"] = bad[key, endpoint] + failed, bad[key, "n"] + total * (endpoint == "/attention")
                    print(
                        f"round {r + 1} {key:12s} {endpoint:10s} {per_s:8.0f} req/s  {cpu[key, endpoint][-1]:.3f} ms CPU/request  non-2xx {failed}",
                        flush=True,
                    )
        latency = one_at_a_time(servers, args.latency_reps)
        load = os.getloadavg()[0]
        print(f"\nwrk -t1 -c{args.connections} -d{args.duration}s, {args.rounds} rounds, medians; load average {load:.2f}\n")
        rows = []
        for key in servers:
            h, a = statistics.median(rate[key, "/healthz"]), statistics.median(rate[key, "/attention"])
            ch, ca = statistics.median(cpu[key, "/healthz"]), statistics.median(cpu[key, "/attention"])
            failed = f"{bad[key, '/attention']} (of {bad[key, 'n']:,})"
            rows.append([*key.split(), f"{h:,.0f}", f"{a:,.0f}", a / h, f"{ch:.2f}, {ca:.2f}, {ca - ch:.2f}", failed, latency[key]])
        print(table(HEADER, rows))
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
