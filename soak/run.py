"""Run the soak: start the server (or use --url), drive closed-loop clients for --duration seconds,
sample the workers' memory and file descriptors, then check and summarise.

Checks (exit status 1 if any fails):
  answers    no 5xx but 503/504; every 200 equal to the in-process core; every invalid request
             answered with its exact status and code; no request left without an answer
  memory     each worker's RSS grows less than --max-growth (10%) from the warm-up's high-water
             mark to the end (the median of the samples in the last --window seconds), or less than
             ALLOCATOR_SLACK_MIB: glibc keeps up to its trim threshold (16 MiB, set in
             deploy/gunicorn.conf.py) of freed memory before it gives any back, so a few MiB of
             RSS either way is the allocator, not the service; a leak passes both bounds
  fds        each worker's open file descriptors, idle after the run, at most 4 more than idle
             before it
  workers    the same worker processes from start to end (none died and was replaced)
Memory and fds need the server's arbiter pid: known when the soak starts the server, else --pid.
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.common import Server

from . import resources
from .traffic import Outcome, Traffic

FD_SLACK = 4
ALLOCATOR_SLACK_MIB = 16  # glibc's trim threshold in deploy/gunicorn.conf.py: RSS within it is the allocator's


@dataclass
class Report:
    duration_s: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    failures: list[Outcome] = field(default_factory=list)
    failure_count: int = 0
    trace: list[tuple[float, dict]] = field(default_factory=list)  # (seconds since start, {pid: (rss KiB, fds)})
    idle_before: dict = field(default_factory=dict)
    idle_after: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self, warmup_s: float, window_s: float) -> str:
        lines = [
            f"soak: {self.duration_s:.0f} s, {sum(self.statuses.values())} requests, failures {self.failure_count}",
            "answers by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items(), key=str)),
        ]
        lines.append("requests by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())))
        for pid in sorted(self.idle_before):
            warm = _peak(self.trace, pid, 0, warmup_s, 0)
            end = _median(self.trace, pid, self.duration_s - window_s, self.duration_s + 1, 0)
            lines.append(
                f"worker {pid}: RSS idle before {self.idle_before[pid][0] / 1024:.0f} MiB, warm-up peak "
                f"{_mib(warm)}, at the end {_mib(end)}, idle after {_mib(self.idle_after.get(pid, (None,))[0])}; "
                f"fds idle before {self.idle_before[pid][1]}, idle after {self.idle_after.get(pid, (None, '?'))[1]}"
            )
        if self.trace:
            step = max(1, len(self.trace) // 20)  # about 20 points, the last included
            points = self.trace[::step] + ([self.trace[-1]] if (len(self.trace) - 1) % step else [])
            lines.append(
                "RSS trace (s: MiB per worker): "
                + "; ".join(f"{t:.0f}: " + "/".join(f"{v[0] / 1024:.0f}" for _, v in sorted(s.items())) for t, s in points)
            )
        for f in self.failures[:10]:
            lines.append(f"FAILED {f.kind} {f.status}: {f.detail}")
        lines += self.notes + [f"CHECK FAILED: {p}" for p in self.problems]
        lines.append("soak: OK" if self.ok else "soak: FAILED")
        return "\n".join(lines)


def _mib(kb) -> str:
    return "?" if kb is None else f"{kb / 1024:.0f} MiB"


def _peak(trace, pid, t0, t1, index):
    """The highest sample of [t0, t1]: the working level a worker reached. Single samples dip below
    it whenever the allocator trims, most of all in a worker that sat idle for a while (keep-alive
    connections stay on one worker), so a median of the warm-up's end can start low."""
    values = [s[pid][index] for t, s in trace if t0 <= t <= t1 and pid in s]
    return max(values) if values else None


def _median(trace, pid, t0, t1, index):
    values = [s[pid][index] for t, s in trace if t0 <= t <= t1 and pid in s]
    return statistics.median(values) if values else None


def soak(
    url: str,
    arbiter: int | None,
    *,
    duration_s: float,
    warmup_s: float,
    clients: int = 4,
    seed: int = 0,
    invalid_share: float = 0.2,
    abandon_share: float = 0.1,
    sample_s: float = 2.0,
    window_s: float = 10.0,
    max_growth: float = 0.10,
    log=print,
) -> Report:
    """Drive the traffic and check; the Report says what happened."""
    report, lock, stop = Report(), threading.Lock(), threading.Event()
    settle_s = 7.0  # longer than gunicorn's keep-alive (5 s): idle connections are closed by then
    if arbiter:
        report.idle_before = resources.sample(arbiter)

    def client(i: int) -> None:
        traffic = Traffic(url, seed * 1000 + i, invalid_share, abandon_share)
        try:
            while not stop.is_set():
                outcome = traffic.one()
                with lock:
                    report.statuses[outcome.status] += 1
                    report.kinds[re.sub(r"-[Tn]\d+$", "", outcome.kind)] += 1
                    if not outcome.ok:
                        report.failure_count += 1
                        if len(report.failures) < 50:
                            report.failures.append(outcome)
        finally:
            traffic.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    next_log = 30.0
    while (elapsed := time.monotonic() - t0) < duration_s:
        if arbiter:
            report.trace.append((elapsed, resources.sample(arbiter)))
        if elapsed >= next_log:
            with lock:
                done = sum(report.statuses.values())
            rss = "/".join(f"{v[0] / 1024:.0f}" for _, v in sorted(report.trace[-1][1].items())) if report.trace else "?"
            log(f"  {elapsed:5.0f} s: {done} requests, {report.failure_count} failed, worker RSS {rss} MiB")
            next_log += 30.0
        time.sleep(sample_s)
    stop.set()
    for t in threads:
        t.join(timeout=130)
    report.duration_s = time.monotonic() - t0
    if arbiter:
        report.trace.append((report.duration_s, resources.sample(arbiter)))
        time.sleep(settle_s)
        report.idle_after = resources.sample(arbiter)
    check(report, warmup_s, window_s, max_growth, arbiter is not None)
    return report


def check(report: Report, warmup_s: float, window_s: float, max_growth: float, measured: bool) -> None:
    """Record in report.problems every check the run fails (see the module docstring)."""
    if report.failure_count:
        report.problems.append(f"{report.failure_count} requests were answered wrongly (see FAILED lines)")
    if not sum(report.statuses.values()):
        report.problems.append("no request was answered")
    if not measured:
        report.notes.append("memory and fds not measured: pass --pid with --url")
        return
    if set(report.idle_after) != set(report.idle_before):
        report.problems.append(f"workers changed: {sorted(report.idle_before)} at the start, {sorted(report.idle_after)} at the end")
    for pid in sorted(set(report.idle_before) & set(report.idle_after)):
        warm = _peak(report.trace, pid, 0, warmup_s, 0)
        end = _median(report.trace, pid, report.duration_s - window_s, report.duration_s + 1, 0)
        if warm and end and end > warm * (1 + max_growth) and end - warm > ALLOCATOR_SLACK_MIB * 1024:
            report.problems.append(
                f"worker {pid} RSS grew {100 * (end / warm - 1):.0f}% after the warm-up "
                f"({warm / 1024:.0f} -> {end / 1024:.0f} MiB), over {100 * max_growth:.0f}% and {ALLOCATOR_SLACK_MIB} MiB"
            )
        before, after = report.idle_before[pid][1], report.idle_after[pid][1]
        if after > before + FD_SLACK:
            report.problems.append(f"worker {pid} holds {after} fds idle after the run against {before} before")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the memory baseline (default: a quarter, at most 60)")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients (default 4)")
    ap.add_argument("--invalid-share", type=float, default=0.2, help="share of invalid requests (default 0.2)")
    ap.add_argument("--abandon-share", type=float, default=0.1, help="share abandoned mid-upload or mid-download (default 0.1)")
    ap.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after the warm-up (default 0.10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="soak a running server instead of starting one (loopback only)")
    ap.add_argument("--pid", type=int, help="with --url: the server's gunicorn arbiter pid, to watch its workers")
    args = ap.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)
    window = min(10.0, warmup / 2)
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        ap.error("--url must be a loopback address")
    server = None
    try:
        if args.url:
            url, arbiter = args.url.rstrip("/"), args.pid
        else:
            server = Server("soak")
            server.wait_ready(timeout=60, in_a_row=8)  # every worker warmed up
            url, arbiter = server.url, server.proc.pid
            print(
                f"soak: server {url} (arbiter {arbiter}, log {server.log.name}), {args.duration:.0f} s, {args.clients} clients, warm-up {warmup:.0f} s"
            )
        report = soak(
            url,
            arbiter,
            duration_s=args.duration,
            warmup_s=warmup,
            clients=args.clients,
            seed=args.seed,
            invalid_share=args.invalid_share,
            abandon_share=args.abandon_share,
            window_s=window,
            max_growth=args.max_growth,
        )
    finally:
        if server is not None:
            server.stop()
    print(report.text(warmup, window))
    return 0 if report.ok else 1
