"""`python -m bench deadlines [--clients 16] [--seconds 12] [--phases none 1000 none 300]`:
what X-Deadline-Ms costs under overload (contract 1.3, "Deadlines").

Closed-loop clients (threads, `requests`, a keep-alive session each; the next request sent at once
after any answer, refusals included) post H=8, T=S=2048, d=16, causal, b64 bodies to a fresh
`python -m service`, in alternating phases after a warm-up. Per phase common.summary() of the
answers, and on-time answers over the no-deadline mean; then the server's
attention_answers_after_deadline_total and the cost model's spread (/limits)."""

from __future__ import annotations

import argparse
import json

import requests

from bench.common import Server, attention_body, closed_loops, summary, table

WARMUP_S = 4.0
HEADER = "X-Deadline-Ms | answers | on time (<= 1.25x) | on time / no-deadline mean | late 200 | 503 (with Retry-After) | 504 | 200 over deadline (server time)"


def server_late(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("attention_answers_after_deadline_total{"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench deadlines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--phases", nargs="+", default=["none", "1000", "none", "300"], help="deadlines in ms, or none")
    args = parser.parse_args(argv)
    data = attention_body(2048, h=8, d=16)
    with Server("deadlines") as server:
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
            + (
                f"{r['statuses'].get('503', 0)} ({r['503_with_retry_after']})",
                r["statuses"].get("504", 0),
                r["200_over_deadline_server_time"],
            )
            for r in rows
        ]
        print(table(HEADER, cells))
        limits = requests.get(f"{server.url}/limits", timeout=10).json()
        print(f"\nserver: answers whose last byte left after their deadline: {server_late(server.url):g}")
        print(f"server: prediction spread (one worker's): {json.dumps(limits['cost_model'].get('prediction_spread'))}")


if __name__ == "__main__":
    main()
