"""`python -m bench deadlines [--clients 16] [--seconds 12] [--phases none 1000 none 300] [--checkout DIR]`:
what X-Deadline-Ms costs under overload (contract 1.3, "Deadlines").

Closed-loop clients (threads, `requests`, a keep-alive session each; the next request sent at once
after any answer, refusals included) post H=8, T=S=2048, d=16, causal, b64 bodies to a fresh
`python -m service` (or --checkout's), in alternating phases after a warm-up. Per phase: answers,
on time (read whole within 1.25x the deadline), late 200s, 503s (with Retry-After), 504s, 200s
whose Server-Timing total exceeds the deadline, and on-time answers over the no-deadline mean;
then the server's attention_answers_after_deadline_total and the cost model's spread (/limits)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import requests

from bench.common import ROOT, Answer, Server, b64, closed_loops, table, tensors

WARMUP_S = 4.0
HEADER = "X-Deadline-Ms | answers | on time (<= 1.25x) | on time / no-deadline mean | late 200 | 503 (with Retry-After) | 504 | 200 over deadline (server time)"


def body(H: int = 8, T: int = 2048, d: int = 16) -> bytes:
    q, k, v = (b64(a[0]) for a in tensors(T, h=H, d=d))
    return json.dumps({"q": q, "k": k, "v": v, "causal": True, "return_weights": False}).encode()


def summary(answers: list[Answer], deadline: float | None) -> dict:
    ok = [a for a in answers if a.status == 200]
    bound = math.inf if deadline is None else 1.25 * deadline
    statuses = Counter(a.status for a in answers)
    return {
        "deadline_ms": deadline,
        "answers": len(ok),
        "on_time": sum(1 for a in ok if a.ms <= bound),
        "late_200": sum(1 for a in ok if a.ms > bound),
        "503": statuses.get(503, 0),
        "503_with_retry_after": sum(1 for a in answers if a.status == 503 and a.retry_after),
        "504": statuses.get(504, 0),
        "other": {str(k): v for k, v in statuses.items() if k not in (200, 503, 504)},
        "200_over_deadline_server_time": sum(1 for a in ok if deadline and a.server_ms is not None and a.server_ms > deadline),
        "median_200_ms": round(statistics.median(a.ms for a in ok), 1) if ok else None,
        "refusals": dict(Counter(a.reason for a in answers if a.status != 200).most_common(4)),
    }


def server_late(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("attention_answers_after_deadline_total{"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench deadlines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--phases", nargs="+", default=["none", "1000", "none", "300"], help="deadlines in ms, or none")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout to serve (default: this one)")
    args = parser.parse_args(argv)
    data = body()
    with Server("deadlines", cwd=args.checkout) as server:
        server.wait_ready(in_a_row=4)
        closed_loops(server.url, data, args.clients, WARMUP_S)  # the cost model learns the load; not reported
        rows = []
        for name in args.phases:
            deadline = None if name == "none" else float(name)
            rows.append(summary(closed_loops(server.url, data, args.clients, args.seconds, [deadline] if deadline else []), deadline))
            print(json.dumps(rows[-1]), flush=True)
        base = [r["answers"] for r in rows if r["deadline_ms"] is None]
        mean = sum(base) / len(base) if base else float("nan")
        print(f"\n{args.clients} clients, {args.seconds:g} s a phase, body {len(data) / 1e6:.1f} MB; no-deadline answers: {base}\n")
        cells = [
            (r["deadline_ms"] or "none", r["answers"], r["on_time"], f"{r['on_time'] / mean:.2f}" if mean else "-", r["late_200"])
            + (f"{r['503']} ({r['503_with_retry_after']})", r["504"], r["200_over_deadline_server_time"])
            for r in rows
        ]
        print(table(HEADER, cells))
        limits = requests.get(f"{server.url}/limits", timeout=10).json()
        print(f"\nserver: answers whose last byte left after their deadline: {server_late(server.url):g}")
        print(f"server: prediction spread (one worker's): {json.dumps(limits['cost_model'].get('prediction_spread'))}")


if __name__ == "__main__":
    main()
