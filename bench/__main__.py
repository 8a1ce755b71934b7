"""`python -m bench NAME [ARGS]`: one named scenario; `python -m bench` (`make bench`): the headline
set, each with its defaults; `python -m bench -h`: the scenarios. Each scenario prints the
markdown tables bench/README.md shows, beside the command that produced them."""

from __future__ import annotations

import importlib
import sys

SCENARIOS = {  # name: what it measures
    "textbook": "this service against a textbook Flask + marshmallow + numpy one, compute and end to end, and peak memory (~10 min)",
    "compression": "which answers pay for compressing; requests' default Accept-Encoding against identity; the gzip bomb (~2 min)",
    "client_wire": "the Python client against tritonclient, urllib3, requests, numpy to numpy (~2 min)",
    "small_requests": "the fixed cost per request: T=64 b64 req/s over /healthz req/s, wrk, 8 connections (~2 min; needs wrk)",
    "small_profile": "where a small request's CPU goes, stage by stage, in-process (~30 s; the table needs py-spy)",
    "sessions": "a decode step through a session against the same step in-process, resending the cache, and batched (~15 s)",
    "crowd": "what many clients see: bursts, closed loops, with deadlines if asked (~1-3 min a run)",
    "deadlines": "what X-Deadline-Ms costs under overload: 16 closed-loop clients, phases with and without a deadline (~1 min)",
    "worker_peak": "a worker's peak RSS over single large requests (~1 min)",
    "garbage": "the work before a hostile body is refused, per MB (~1 min)",
    "peers": "KServe, MLServer, LitServe, Ray Serve and BentoML serving the same model (`make bench-peers`, ~5 min)",
    "perf_analyzer": "Triton's perf_analyzer against this service, binary tensors and shared memory (`make bench-perf-analyzer`, ~5 min)",
    "shm": "a client on the server's host: shared memory and the binary wire against the same computation in-process (~1 min)",
    "dashboard": "docs/dashboard.png: the Grafana dashboard drawn from a real Prometheus over a run with load (~2 min)",
}
HEADLINE = ("textbook", "compression", "client_wire", "small_requests")  # `make bench`


def run(name: str, args: list[str]) -> None:
    module = importlib.import_module(f"bench.{name}" if name != "peers" else "bench.peers.__main__")
    sys.argv = [f"python -m bench {name}", *args]  # each scenario parses sys.argv[1:] itself
    module.main()


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__ + "\n")
        width = max(map(len, SCENARIOS))
        for name, about in SCENARIOS.items():
            print(f"  {name:<{width}}  {about}")
        print(f"\nheadline set: {' '.join(HEADLINE)}")
        return
    if not argv:
        for name in HEADLINE:
            print(f"\n## python -m bench {name}\n", flush=True)
            run(name, [])
        return
    if argv[0] not in SCENARIOS:
        sys.exit(f"unknown scenario {argv[0]!r}; one of: {', '.join(SCENARIOS)}")
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
