"""Large requests on the wire: where a big b64 request's time goes besides its compute, this
checkout against another side by side in one run, and what a fresh buffer costs this machine.

    python -m bench.large_requests --baseline "$TMPDIR/main-base"   # ~15-60 s; markdown tables
    python -m bench.large_requests --reps 9                          # this checkout alone

Part 1, in-process: the time to fill a fresh 32 MiB buffer with 4 KiB pages (glibc's default for
a mapped block) and with transparent huge pages (numpy's own arrays, which madvise them; and what
`python -m service` gives every malloc'd block of 4 MiB or more with glibc.malloc.hugetlb=1),
against refilling one already faulted in.

Part 2: each checkout's server started as `make run` starts it (`python -m service`, 2 workers;
bodies up to 64 MiB allowed, as bench.one_request), one keep-alive connection each, requests
alternating between them: b64 T=1024 with weights (8.4 MB in, 47.5 MB out) and T=4096 without
(33.5 MB in, 11.2 MB out), B=1, H=8, d=64, causal. The body is built beforehand and the answer read,
not parsed (as `make bench` times the wire). Medians of the end-to-end time and of each phase of
the server's Server-Timing header (decode includes handing the body to the app). Loopback only;
loops bounded in count.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.__main__ import Client, request_body
from bench.server import ROOT, Server

MIB = 2**20
CASES = ((1024, True), (4096, False))
PHASES = ("decode", "validate", "compute", "encode", "total")

FILL = """
import statistics, time, numpy as np
n = 32 * 2**20
def ms(f, reps=7):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)
reused = np.empty(n, np.uint8); reused.fill(0)
print(ms(lambda: bytearray(n)), ms(lambda: np.empty(n, np.uint8).fill(1)), ms(lambda: reused.fill(1)))
"""


def fresh_buffers() -> None:
    """Part 1: fill times of a fresh 32 MiB buffer, each way, in a fresh interpreter (glibc reads
    its tunables at start)."""
    print("### A fresh 32 MiB buffer, filled (in-process, medians of 7)\n")
    print("| allocator | bytearray(n) (malloc'd, zeroed) | numpy array (huge pages) | one already faulted in |")
    print("|---|---:|---:|---:|")
    for name, tunables in (("glibc's default (4 KiB pages)", ""), ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=1")):
        env = {**os.environ, "GLIBC_TUNABLES": tunables, "MALLOC_MMAP_THRESHOLD_": str(4 * MIB)}
        out = subprocess.run([sys.executable, "-c", FILL], env=env, capture_output=True, text=True, check=True).stdout.split()
        print(f"| {name} | {float(out[0]):.1f} ms | {float(out[1]):.1f} ms | {float(out[2]):.1f} ms |")


def timing(header: str) -> dict[str, float]:
    """Server-Timing "decode;dur=4.1, ..." as {phase: ms}."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+);dur=([\d.]+)", header or "")}


def on_the_wire(trees: list[tuple[str, Path]], reps: int) -> None:
    """Part 2: the servers side by side, requests alternating."""
    env = {"ATTN_MAX_BODY_BYTES": str(64 * MIB), "ATTN_MAX_INFLIGHT_BYTES": str(2 * 2**30)}
    servers = {name: Server(f"large-{name}", env=env, cwd=tree, inherit_settings=False) for name, tree in trees}
    try:
        for server in servers.values():
            server.wait_ready(in_a_row=20)
        print("\n### End to end and by phase (ms, medians)\n")
        print("| T | weights | server | end to end | " + " | ".join(PHASES) + " | after total (sending, the client's read) |")
        print("|---:|---|---|---:|" + "---:|" * len(PHASES) + "---:|")
        for T, weights in CASES:
            body = request_body(T, "b64", weights)
            clients = {name: Client(s.port) for name, s in servers.items()}
            runs = {name: [] for name in servers}
            for rep in range(reps + 2):  # the first two warm up
                for name, client in clients.items():
                    ms, status, _, headers = client.post(body)
                    if status != 200:
                        raise RuntimeError(f"{name}: {status}")
                    if rep >= 2:
                        runs[name].append((ms, timing(headers.get("Server-Timing"))))
            for name, rows in runs.items():
                end = statistics.median(r[0] for r in rows)
                phases = {p: statistics.median(r[1].get(p, 0.0) for r in rows) for p in PHASES}
                after = statistics.median(r[0] - r[1].get("total", 0.0) for r in rows)
                cells = " | ".join(f"{phases[p]:.1f}" for p in PHASES)
                print(f"| {T} | {'yes' if weights else 'no'} | {name} | {end:.1f} | {cells} | {after:.1f} |", flush=True)
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another checkout (say a git worktree of main) measured beside this one")
    p.add_argument("--reps", type=int, default=9, help="timed requests per case and server")
    args = p.parse_args(argv)
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    t0 = time.monotonic()
    fresh_buffers()
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    on_the_wire(trees, args.reps)
    print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
