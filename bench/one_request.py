"""`python -m bench.one_request`: one request on both cores (ATTN_SPLIT_THREADS), measured side by
side in one run. B=1, H=8, d=64, causal, float32, b64 on the wire. Medians.

  threshold   in-process, the numeric core on one thread against split on two, T = 64 .. 1024 with
              and without weights: the least work worth splitting (service.cost.split.MIN_FLOPS)
  latency     concurrency 1, end to end through requests (body built with pybase64 and orjson,
              response parsed and decoded to numpy: numpy to numpy), through our AttentionClient
              (its default binary wire, the /v2 door: numpy to numpy with no base64 or JSON of the
              tensors) and on the wire alone (as `make bench`: body built beforehand, response
              read, not parsed), on two servers started as `make run` does, split on (the
              default) and off (ATTN_SPLIT_THREADS=1), alternately,
              beside the same attention in this process on both cores (the core split on two
              threads, and one call with two OpenBLAS threads) and, for T=4096 without weights,
              torch's scaled_dot_product_attention with its default threads
  throughput  concurrency 2 and 4, T=1024 and T=256 with weights, split on against off, in
              alternating rounds: requests per second

Both servers allow 64 MiB bodies (T=4096's b64 body is 32 MiB and 207 bytes) and 2 GiB in flight
per worker (so that 4 clients of T=1024 get no 503: each body is charged 33x for its parse).
Loopback only; loops bounded in count. About 3 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pybase64
import requests
from threadpoolctl import threadpool_limits

from attention_client import AttentionClient
from bench.__main__ import Client, request_body
from bench.server import Server
from schemas.jobs import AttentionJob
from service.core import attention
from service.cost import work_of

H, D = 8, 64
SECTIONS = ("threshold", "latency", "throughput")


def tensors(T: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3)]  # q, k, v


def flops(T: int, weights: bool) -> int:
    q, k, v = tensors(1)
    q, k, v = (np.broadcast_to(a, (1, H, T, D)) for a in (q, k, v))
    return work_of(AttentionJob(q, k, v, None, "top_left", None, None, weights, "b64")).flops


def alternate(fns: dict, reps: int, pause_after: tuple = ()) -> dict:
    """Median ms of each fn, called in turn rep after rep (so all see the same load). After those
    in pause_after (torch, OpenBLAS threads: their threads spin for a while after a call), a pause."""
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
            if name in pause_after:
                time.sleep(0.3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def call(session: requests.Session, url: str, q, k, v, weights: bool):
    """POST /attention numpy to numpy: b64 body, response decoded into arrays."""

    def enc(a):
        return {"shape": list(a.shape), "dtype": "float32", "b64": pybase64.b64encode(a.tobytes()).decode()}

    body = orjson.dumps({"q": enc(q), "k": enc(k), "v": enc(v), "causal": True, "return_weights": weights})
    r = session.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    doc = orjson.loads(r.content)

    def dec(t):
        return np.frombuffer(pybase64.b64decode(t["b64"]), t["dtype"]).reshape(t["shape"])

    return dec(doc["out"]), dec(doc["weights"]) if weights else None


def threshold(reps: int) -> None:
    print("\n### Threshold: in-process, one thread against split on two (service.cost.split.MIN_FLOPS)\n")
    print("| T | weights | MFLOP | one thread ms | split ms | speedup |")
    print("|---:|---|---:|---:|---:|---:|")
    with ThreadPoolExecutor(1) as pool:
        for T in (64, 128, 256, 512, 1024):
            for weights in (False, True):
                one, split = _one_and_split(tensors(T), weights, pool, reps)
                print(
                    f"| {T} | {'yes' if weights else 'no'} | {flops(T, weights) / 1e6:.0f} | {one:.2f} | {split:.2f} | {one / split:.2f}x |",
                    flush=True,
                )


def _one_and_split(qkv, weights: bool, pool, reps: int) -> tuple[float, float]:
    q, k, v = qkv
    kw = {"causal": True, "return_weights": weights}
    m = alternate({1: lambda: attention(q, k, v, **kw), 2: lambda: attention(q, k, v, threads=2, pool=pool, **kw)}, reps)
    return m[1], m[2]


def latency(servers: dict, reps: int) -> None:
    import torch  # in requirements-dev.txt

    print(f"\n### Latency, concurrency 1 (torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print(
        "| T | weights | split on: numpy to numpy | split off: numpy to numpy | split on: wire | split off: wire"
        " | split on: AttentionClient, binary | in-process, split on 2 threads | in-process, 2 OpenBLAS threads | torch SDPA"
        " | on / in-process (best of numpy): numpy to numpy, wire, binary client | on / torch: numpy to numpy, wire, binary client"
        " | off / on: numpy to numpy, wire |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sessions = {name: requests.Session() for name in servers}
    for session in sessions.values():
        session.headers["Accept-Encoding"] = "identity"  # requests asks for gzip by default; the answers are measured uncompressed
    with ThreadPoolExecutor(1) as pool:
        for T, weights in ((1024, True), (4096, False)):
            m = _latency_row(servers, sessions, tensors(T), weights, pool, torch if not weights else None, reps)
            best = min(m["split"], m["blas2"])
            t = m.get("torch")
            torch_ms, on_torch = (
                ("–", "–") if t is None else (f"{t:.1f}", f"{m['on'] / t:.2f}x, {m['on wire'] / t:.2f}x, {m['binary'] / t:.2f}x")
            )
            print(
                f"| {T} | {'yes' if weights else 'no'} | {m['on']:.1f} | {m['off']:.1f} | {m['on wire']:.1f} | {m['off wire']:.1f} | {m['binary']:.1f} | "
                f"{m['split']:.1f} | {m['blas2']:.1f} | {torch_ms} | {m['on'] / best:.2f}x, {m['on wire'] / best:.2f}x, {m['binary'] / best:.2f}x | {on_torch} | "
                f"{m['off'] / m['on']:.2f}x, {m['off wire'] / m['on wire']:.2f}x |",
                flush=True,
            )


def _latency_row(servers: dict, sessions: dict, qkv, weights: bool, pool, torch, reps: int) -> dict:
    """Median ms of each way of computing one request, alternately."""
    q, k, v = qkv
    kw = {"causal": True, "return_weights": weights}

    def blas2():
        with threadpool_limits(2, user_api="blas"):
            attention(q, k, v, **kw)

    fns = {name: (lambda s=sessions[name], url=srv.url: call(s, url, q, k, v, weights)) for name, srv in servers.items()}
    body = request_body(q.shape[-2], "b64", weights)  # the same q, k, v (seed 0)
    for name, srv in servers.items():  # as `make bench` times it: body built beforehand, response read, not parsed
        client = Client(srv.port)
        fns[f"{name} wire"] = lambda client=client: client.post(body)
    ours = AttentionClient(servers["on"].url, timeout=300)  # binary wire, the /v2 door
    fns["binary"] = lambda: ours.attention(q, k, v, **kw)
    fns["split"] = lambda: attention(q, k, v, threads=2, pool=pool, **kw)
    fns["blas2"] = blas2
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        fns["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    for fn in fns.values():  # warm: first touch, pools started
        fn()
    np.testing.assert_allclose(fns["binary"]()[0], fns["split"]()[0], rtol=1e-5, atol=1e-6)  # the client's answer is the core's
    return alternate(fns, reps, pause_after=("blas2", "torch"))


def throughput(servers: dict, rounds: int, per_client: int) -> None:
    print(f"\n### Throughput: requests/s, median of {rounds} alternating rounds\n")
    print("| T | weights | concurrency | split on | split off | on / off |")
    print("|---:|---|---:|---:|---:|---:|")
    for T, n in ((1024, per_client), (256, 5 * per_client)):
        qkv = tensors(T)
        for concurrency in (2, 4):
            rates = {name: [] for name in servers}
            for _ in range(rounds):
                for name, srv in servers.items():
                    rates[name].append(_closed_loop(srv.url, qkv, concurrency, n))
            on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
            print(f"| {T} | yes | {concurrency} | {on:.2f} | {off:.2f} | {on / off:.2f}x |", flush=True)


def _closed_loop(url: str, qkv, concurrency: int, per_client: int) -> float:
    """Requests per second of concurrency clients each sending per_client requests in turn."""
    errors = []

    def client():
        with requests.Session() as s:
            try:
                for _ in range(per_client):
                    call(s, url, *qkv, True)
            except Exception as exc:  # raised below
                errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return concurrency * per_client / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-client", type=int, default=4)
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    with threadpool_limits(1, user_api="blas"):  # as in a worker: the split is the only second core
        print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores; {sys.version.split()[0]}")
        if "threshold" in only:
            threshold(args.reps)
        if only & {"latency", "throughput"}:
            env = {"ATTN_MAX_BODY_BYTES": str(64 * 2**20), "ATTN_MAX_INFLIGHT_BYTES": str(2 * 2**30)}
            servers = {"on": Server("split-on", env=env), "off": Server("split-off", env={**env, "ATTN_SPLIT_THREADS": "1"})}
            try:
                for s in servers.values():
                    s.wait_ready(in_a_row=20)
                if "latency" in only:
                    latency(servers, args.reps)
                if "throughput" in only:
                    throughput(servers, args.rounds, args.per_client)
            finally:
                for s in servers.values():
                    s.stop()
        print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
