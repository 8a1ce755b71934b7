"""`python -m bench.admission`: small requests from keep-alive connections against 2 workers, with
wrk: requests per second and non-2xx answers (503 overloaded while the server had free slots).

    python -m bench.admission [--seconds 20] [--reps 3] [--connections 8] [NAME=DIR ...]

Each NAME=DIR serves the checkout DIR (`python -m service` there, with this interpreter, the
defaults of `make run`: 2 workers x (2 computing + 4 queued)); none: this checkout alone. All the
servers start first, then wrk runs against each in turn, --reps times (alternating, so that the
machine's other load falls on all alike). The body: T=64, B=1, H=8, d=64, causal, float32 b64, no
weights (bench/wrk_post.lua). Prints a markdown table: each run's req/s and non-2xx, the medians,
how the connections were spread over the workers 2 s into each run and at its middle (ss), the
load average before each run, the workers' CPU time per request (from /proc: less sensitive to
the machine's other load than req/s). --crowd opens every connection on one worker (the others
are stopped for wrk's first second), the kernel's worst placement, which connection placement
undoes. Needs wrk (apt-get install wrk). 127.0.0.1 only."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.server import ROOT, Server

LUA = Path(__file__).resolve().parent / "wrk_post.lua"


def t64_body() -> bytes:
    rng = np.random.default_rng(0)
    tensor = lambda: {  # noqa: E731
        "shape": [1, 8, 64, 64],
        "dtype": "float32",
        "b64": base64.b64encode(rng.standard_normal((1, 8, 64, 64)).astype("<f4").tobytes()).decode(),
    }
    return json.dumps({"q": tensor(), "k": tensor(), "v": tensor(), "causal": True, "return_weights": False}).encode()


def split(server: Server) -> str:
    """How the server's established client connections are spread over its workers, e.g. "7+1"."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"sport = :{server.port}"], capture_output=True, text=True, timeout=10
    ).stdout
    return "+".join(str(n) for n in sorted((out.count(f"pid={pid},") for pid in server.workers()), reverse=True))


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes pids have used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def wrk(server: Server, body_file: str, connections: int, seconds: int, crowd: bool = False) -> tuple[float, int, str, float]:
    """(requests per second, non-2xx answers, the connections' split 2 s in and at the middle, the
    workers' CPU ms per request) of one run. crowd: every connection opens on one worker (the
    others are stopped, SIGSTOP, for the first second), the worst placement the kernel can make."""
    pids = server.workers()
    cpu0 = cpu_s(pids)
    stopped = pids[1:] if crowd else []
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    proc = subprocess.Popen(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "-s", str(LUA), server.url],
        env={**os.environ, "BODY": body_file},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    time.sleep(1)
    spread = split(server)
    time.sleep(max(0, seconds / 2 - 2))
    spread += ", " + split(server)
    out = proc.communicate(timeout=seconds + 60)[0]
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    return rate, int(bad.group(1)) if bad else 0, spread, 1000 * (cpu_s(pids) - cpu0) / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="*", help="NAME=DIR: a checkout to serve (default: this one)")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--crowd", action="store_true", help="open every connection on one worker (the others stopped meanwhile)")
    args = parser.parse_args()
    pairs = [s.split("=", 1) for s in args.servers] or [("this", str(ROOT))]
    with tempfile.NamedTemporaryFile(suffix=".json") as body:
        body.write(t64_body())
        body.flush()
        servers = [Server(name, cwd=Path(d), inherit_settings=False) for name, d in pairs]
        try:
            for server in servers:
                server.wait_ready(in_a_row=20)
            runs: dict[str, list[tuple[float, int, float, str, float]]] = {s.name: [] for s in servers}
            for rep in range(args.reps):
                for server in servers:
                    load = os.getloadavg()[0]
                    rate, bad, spread, cpu_ms = wrk(server, body.name, args.connections, args.seconds, args.crowd)
                    runs[server.name].append((rate, bad, load, spread, cpu_ms))
                    print(
                        f"rep {rep + 1} {server.name}: {rate:.0f} req/s, {bad} non-2xx, connections {spread}, {cpu_ms:.2f} CPU ms/request (load {load:.1f})",
                        flush=True,
                    )
        finally:
            for server in servers:
                server.stop()
    print(
        "\n| server | req/s per run | median req/s | non-2xx per run | connections per worker | worker CPU ms per request (median) | load average |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        rates = " / ".join(f"{r[0]:.0f}" for r in rows)
        bads = " / ".join(str(r[1]) for r in rows)
        loads = " / ".join(f"{r[2]:.1f}" for r in rows)
        spreads = " / ".join(r[3] for r in rows)
        cpu = statistics.median(r[4] for r in rows)
        print(f"| {name} | {rates} | {statistics.median(r[0] for r in rows):.0f} | {bads} | {spreads} | {cpu:.2f} | {loads} |")


if __name__ == "__main__":
    main()
