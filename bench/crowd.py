"""`python -m bench crowd`: what many clients see, against a server started as `make run` does
(2 workers, the defaults, a free loopback port). Latency is the client's, request sent to answer read.

    python -m bench crowd burst [--n 64 128] [--T 64] [--reps 3] [--triton]
    python -m bench crowd closed [--clients 4 8] [--T 1024] [--seconds 10] [--weights] [--deadline MS ...]
                                 [--set ATTN_MAX_INFLIGHT=1]

burst: n requests at once, each on its own connection (b64, causal, no weights), --reps bursts;
each burst's statuses and time (--triton: the same through tritonclient.http.aio, binary).
closed: --clients clients POST back to back on a keep-alive connection each for --seconds:
statuses, refusals (numbers blanked), p50/p99 of the 200s, and under --deadline (X-Deadline-Ms,
shared out among the clients in turn) the late 200s (past 1.25 x the deadline), the 503s with
Retry-After and the refusals' p50. --set passes a setting to the server."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.common import Server, attention_body, closed_loops, refusal, tensors, triton_inputs

HEADERS = {"Content-Type": "application/json"}


def native_burst(url: str, body: bytes, n: int) -> tuple[Counter, float, Counter]:
    def one(_):
        try:
            r = requests.post(f"{url}/attention", data=body, headers=HEADERS, timeout=120)
        except requests.RequestException as exc:
            return type(exc).__name__, None
        return r.status_code, None if r.status_code == 200 else refusal(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    return Counter(s for s, _ in results), wall, Counter(m for _, m in results if m)


def triton_burst(url: str, T: int, n: int) -> tuple[Counter, float, Counter]:
    import tritonclient.http.aio as aioclient
    from tritonclient.utils import InferenceServerException

    data = dict(zip("qkv", tensors(T), strict=True))

    async def run() -> tuple[list, float]:
        client = aioclient.InferenceServerClient(url.removeprefix("http://"), conn_limit=n)
        try:

            async def one():
                try:
                    await client.infer("attention", triton_inputs(data), parameters={"causal": True, "return_weights": False})
                    return 200, None
                except InferenceServerException as exc:
                    return exc.status() or "error", re.sub(r"[0-9][0-9.e+]*", "#", str(exc.message()))[:160]

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one() for _ in range(n)))
            return results, time.perf_counter() - t0
        finally:
            await client.close()

    results, wall = asyncio.run(run())
    return Counter(str(s) for s, _ in results), wall, Counter(m for _, m in results if m)


def closed(url: str, body: bytes, clients: int, seconds: float, deadlines: list[float]) -> dict:
    """The closed loops' summary, and each deadline's clients' apart when there are several."""
    records = closed_loops(url, body, clients, seconds, deadlines)
    result = {"clients": clients, **summary(records, deadlines[0] if len(deadlines) == 1 else None)}
    if len(deadlines) > 1:
        result["by_deadline"] = {f"{d:g}": summary([r for r in records if r.deadline == d], d) for d in deadlines}
    return result


def summary(records: list[tuple], deadline: float | None) -> dict:
    """Statuses, reasons, p50/p99 of the 200s, the client's time less the server's for the 200s
    (the sending of the answer), and under one deadline the share of late 200s, the 503s with
    Retry-After and the refusals' p50 (client and server)."""
    oks = sorted(ms for _, status, ms, *_ in records if status == 200)
    gaps = [ms - server for _, status, ms, server, *_ in records if status == 200 and server is not None]
    refusals = [r for r in records if r[1] != 200 and r[4] is not None]
    result = {
        "statuses": dict(Counter(str(r[1]) for r in records)),
        "p50_ms": round(statistics.median(oks)) if oks else None,
        "p99_ms": round(oks[min(len(oks) - 1, int(0.99 * len(oks)))]) if oks else None,
        "reasons": dict(Counter(r[4] for r in refusals)),
        "client_minus_built_p50_ms": round(statistics.median(gaps)) if gaps else None,
    }
    if deadline:
        late = sum(1 for ms in oks if ms > 1.25 * deadline)
        result["late_200s"] = f"{late} of {len(oks)} ({100 * late / max(len(oks), 1):.1f}%) later than {1.25 * deadline:g} ms"
        result["503_retry_after"] = dict(Counter("with" if r[5] else "without" for r in refusals if r[1] == 503))
        result["refusal_p50_ms"] = round(statistics.median(r[2] for r in refusals)) if refusals else None
        server = [r[3] for r in refusals if r[3] is not None]
        result["refusal_server_p50_ms"] = round(statistics.median(server)) if server else None
    return result


def learned(url: str) -> dict:
    """What one worker's cost model learned (the respond rate, the slowdown by requests busy)."""
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
                    statuses, wall, reasons = triton_burst(server.url, T, n) if a.triton else native_burst(server.url, body, n)
                    run = dict(door=door, n=n, T=T, rep=rep, statuses=dict(statuses), wall_s=round(wall, 3), reasons=dict(reasons))
                    print(json.dumps(run))
        else:
            T, body = a.T or 1024, attention_body(a.T or 1024, weights=a.weights, causal=False)
            for clients in a.clients:
                result = closed(server.url, body, clients, a.seconds, a.deadline)
                model = learned(server.url)
                print(
                    json.dumps(dict(T=T, weights=a.weights, deadline_ms=a.deadline, settings=settings, **result, one_workers_model=model))
                )


if __name__ == "__main__":
    main()
