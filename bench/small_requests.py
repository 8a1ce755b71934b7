"""Small requests against the server's floor: wrk with 8 connections, alternating GET /healthz and
POST /attention with a T=64 b64 body without weights (B=1, H=8, d=64, causal, float32), on one
or more checkouts and worker counts, side by side in one run. Prints the medians of req/s, their
ratio (attention / healthz) and the non-2xx answers of each.

    python -m bench small_requests                              # this checkout, 2 workers and 1
    python -m bench small_requests --baseline ../main            # and another checkout beside it
    python -m bench small_requests --duration 10 --rounds 3 --workers 2 1
    python -m bench small_requests --floor --workers 2             # and the stack's floor beside it

--floor also serves bench/floor_app.py (this checkout's app with nothing behind /attention but
reading the body and answering a fixed 175 KB): the highest ratio any T=64 b64 request can reach
here with this stack.

Needs wrk (Debian: apt-get install wrk). Each server is `python -m service` as `make run` starts
it (bench/common.py: a free loopback port, ATTN_* settings from a clean shell); WEB_CONCURRENCY
sets its workers, and where the default slots (2 computing + 4 queued per worker) are fewer than
the connections (one worker, 8 connections), ATTN_MAX_QUEUE is raised to fit them, so that the
fixed cost is measured apart from refusals by design. Rounds alternate servers and endpoints, so noise from other work on the
machine falls on all of them alike. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from service import __main__ as service_main

from .common import ROOT, Server, attention_body

LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb")
wrk.body = f:read("*a")
f:close()
"""


def body() -> bytes:
    """A T=64 b64 request without weights: q, k, v of shape (1, 8, 64, 64) float32, causal."""
    return attention_body(64, "b64")


def wrk(url: str, seconds: int, connections: int, script: str | None = None) -> tuple[float, int, int]:
    """(req/s, requests, non-2xx or 3xx answers plus socket errors) of one wrk run."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"] + (["-s", script] if script else []) + [url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    bad += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return rate, total, bad


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another checkout (say a git worktree of main) measured beside this one")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 1], help="worker counts (WEB_CONCURRENCY)")
    p.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument(
        "--floor", action="store_true", help="also serve bench/floor_app.py: /attention reads the body and answers a fixed response"
    )
    args = p.parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed (Debian: apt-get install wrk)")

    tmp = Path(tempfile.mkdtemp(prefix="small-requests-"))
    (tmp / "body.json").write_bytes(body())
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
                key = f"{name} {n}w"
                env = {"WEB_CONCURRENCY": str(n)}
                env = service_main.environment(env) if name == "floor" else env
                if n * (2 + 4) < args.connections:  # the default slots per worker: 2 computing + 4 queued
                    env["ATTN_MAX_QUEUE"] = str(-(-args.connections // n) - 2)  # room for every connection: no 503 by design
                servers[key] = Server(key.replace(" ", "-"), command, env, cwd=tree, inherit_settings=False)
        for server in servers.values():
            server.wait_ready(in_a_row=8)
        runs = {
            key: {
                "healthz": [],
                "attention": [],
                "cpu": {"healthz": [], "attention": []},
                "bad": {"healthz": 0, "attention": 0},
                "n": {"healthz": 0, "attention": 0},
            }
            for key in servers
        }
        for r in range(args.rounds):
            for key, server in servers.items():
                for endpoint, path, lua in (("healthz", "/healthz", None), ("attention", "/attention", str(script))):
                    pids = [server.proc.pid, *server.workers()]
                    cpu0 = cpu_s(pids)
                    rate, total, bad = wrk(server.url + path, args.duration, args.connections, lua)
                    runs[key]["cpu"][endpoint].append((cpu_s(pids) - cpu0) / total * 1000)
                    runs[key][endpoint].append(rate)
                    runs[key]["bad"][endpoint] += bad
                    runs[key]["n"][endpoint] += total
                    print(
                        f"round {r + 1} {key:12s} {endpoint:9s} {rate:8.0f} req/s  {runs[key]['cpu'][endpoint][-1]:.3f} ms CPU/request  non-2xx {bad}",
                        flush=True,
                    )
        load = os.getloadavg()
        print(
            f"\nwrk -t1 -c{args.connections} -d{args.duration}s, {args.rounds} rounds, medians; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
        )
        print(
            "| server | workers | /healthz req/s | T=64 b64 /attention req/s | ratio | server CPU ms per request: /healthz, /attention, beyond | non-2xx /attention (of requests) |"
        )
        print("|---|---|---|---|---|---|---|")
        for key, run in runs.items():
            name, n = key.split()
            h, a = statistics.median(run["healthz"]), statistics.median(run["attention"])
            ch, ca = statistics.median(run["cpu"]["healthz"]), statistics.median(run["cpu"]["attention"])
            cpu = f"{ch:.2f}, {ca:.2f}, {ca - ch:.2f}"
            print(
                f"| {name} | {n[:-1]} | {h:,.0f} | {a:,.0f} | {a / h:.2f} | {cpu} | {run['bad']['attention']} (of {run['n']['attention']:,}) |"
            )
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
