"""`python -m bench crowd`: what many clients see, against a server started as `make run` does
(2 workers, the defaults, a free loopback port). Latency is the client's, request sent to answer read.

    python -m bench crowd burst [--n 64 128] [--T 64] [--reps 3] [--triton]
    python -m bench crowd closed [--clients 4 8] [--T 1024] [--seconds 10] [--weights] [--deadline MS ...]
                                 [--set ATTN_MAX_INFLIGHT=1]

burst: n requests at once, each on its own connection (b64, causal, no weights), --reps bursts;
each burst's statuses and time (--triton: the same through tritonclient.http.aio, binary).
closed: --clients clients POST back to back on a keep-alive connection each for --seconds:
common.summary() of the answers, under --deadline (X-Deadline-Ms, shared out among the clients
in turn) each deadline's apart. --set passes a setting to the server."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import Counter

import requests

from bench.common import Server, attention_body, burst, closed_loops, summary, tensors, triton_inputs


def triton_burst(url: str, T: int, n: int) -> list[tuple[int | str, str | None]]:
    """burst() through tritonclient.http.aio, binary tensors."""
    import tritonclient.http.aio as aioclient
    from tritonclient.utils import InferenceServerException

    data = dict(zip("qkv", tensors(T), strict=True))

    async def run() -> list:
        client = aioclient.InferenceServerClient(url.removeprefix("http://"), conn_limit=n)
        try:

            async def one():
                try:
                    await client.infer("attention", triton_inputs(data), parameters={"causal": True, "return_weights": False})
                    return 200, None
                except InferenceServerException as exc:
                    return exc.status() or "error", re.sub(r"[0-9][0-9.e+]*", "#", str(exc.message()))[:160]

            return await asyncio.gather(*(one() for _ in range(n)))
        finally:
            await client.close()

    return asyncio.run(run())


def closed(url: str, body: bytes, clients: int, seconds: float, deadlines: list[float]) -> dict:
    """The closed loops' summary, and each deadline's clients' apart when there are several."""
    records = closed_loops(url, body, clients, seconds, deadlines)
    result = {"clients": clients, **summary(records, deadlines[0] if len(deadlines) == 1 else None), "deadline_ms": deadlines}
    if len(deadlines) > 1:
        result["by_deadline"] = {f"{d:g}": summary([r for r in records if r.deadline == d], d) for d in deadlines}
    return result


def learned(url: str) -> dict:
    """What one worker's cost model learned: its prediction spread, the slowdown by requests busy."""
    model = requests.get(f"{url}/limits", timeout=10).json()["cost_model"]
    return {k: model.get(k) for k in ("prediction_spread", "slowdown_by_busy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["burst", "closed"])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--T", type=int)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--clients", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--weights", action="store_true")
    ap.add_argument("--deadline", type=float, nargs="*", default=[])
    ap.add_argument("--set", action="append", default=[], metavar="VAR=VALUE", help="a setting for the server it starts")
    a = ap.parse_args()
    settings = dict(item.split("=", 1) for item in a.set)
    with Server("crowd", env={"WEB_CONCURRENCY": "2", **settings}, inherit_settings=False) as server:
        server.wait_ready(in_a_row=4)
        if a.mode == "burst":
            T, door = a.T or 64, "tritonclient.http.aio" if a.triton else "native"
            body = attention_body(T)
            for n in a.n:
                for rep in range(a.reps):
                    t0 = time.perf_counter()
                    results = triton_burst(server.url, T, n) if a.triton else burst(server.url, body, n)
                    wall = round(time.perf_counter() - t0, 3)
                    statuses, reasons = Counter(str(s) for s, _ in results), Counter(m for _, m in results if m)
                    print(json.dumps(dict(door=door, n=n, T=T, rep=rep, statuses=statuses, wall_s=wall, reasons=reasons)))
        else:
            T, body = a.T or 1024, attention_body(a.T or 1024, weights=a.weights, causal=False)
            for clients in a.clients:
                result = closed(server.url, body, clients, a.seconds, a.deadline)
                print(json.dumps(dict(T=T, weights=a.weights, settings=settings, **result, one_workers_model=learned(server.url))))


if __name__ == "__main__":
    main()
