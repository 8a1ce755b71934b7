"""`python -m bench client_wire [--url URL] [--runs 400,20]`: the Python client against tritonclient,
urllib3 and `requests`, end to end numpy to numpy, on the same server (started here by default).

One request: q, k, v (1, 8, T, 64) float32, causal, weights returned, T=64 and 1024. Five paths,
each its own keep-alive connection (new every --reconnect repetitions, so that which worker serves
which path changes), taken in a new seeded random order every repetition (a rotation would fix
each path's predecessor): AttentionClient binary (/v2) and json (b64); the client's binary wire
over urllib3 at its best; tritonclient.http binary; `requests` with stdlib json and base64 at
POST /attention, as a user writes by hand. Medians (and min) in ms, the ratio to tritonclient's,
and this process's CPU per request (the client's own work)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import requests
import tritonclient.http as triton
import urllib3

from attention_client import AttentionClient, _wire
from bench.common import served, table, triton_inputs

Path = tuple[Callable, Callable]  # (call(q, k, v) -> (out, weights), close())


def client_path(url: str, wire: str) -> Path:
    api = AttentionClient(url, wire=wire, retries=0, split=False, timeout=120)
    return (lambda q, k, v: api.attention(q, k, v, causal=True)), api.close


def triton_path(url: str) -> Path:
    client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=120, connection_timeout=120)
    outputs = [triton.InferRequestedOutput("out", binary_data=True), triton.InferRequestedOutput("weights", binary_data=True)]

    def call(q, k, v):
        result = client.infer("attention", triton_inputs({"q": q, "k": k, "v": v}), outputs=outputs, parameters={"causal": True})
        return result.as_numpy("out"), result.as_numpy("weights")

    return call, client.close


def requests_path(url: str) -> Path:
    session = requests.Session()  # as it comes: Accept-Encoding gzip, deflate (the server answers identity)

    def enc(a):
        return {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode("ascii")}

    def dec(t):
        return np.frombuffer(base64.b64decode(t["b64"]), dtype=t["dtype"]).reshape(t["shape"])

    def call(q, k, v):
        body = json.dumps({"q": enc(q), "k": enc(k), "v": enc(v), "causal": True, "response_encoding": "b64"}).encode()
        resp = session.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
        resp.raise_for_status()
        doc = resp.json()
        return dec(doc["out"]), dec(doc["weights"])

    return call, session.close


def urllib3_binary_path(url: str) -> Path:
    """The client's binary wire over urllib3 (what requests rests on) at its best: the parts
    handed as they are (urllib3 writes each with its own sendall), the answer read with readinto
    into one preallocated buffer (urllib3 copies through its read()): what the client's own
    transport is measured against (docs/architecture.md)."""
    pool = urllib3.connection_from_url(url, maxsize=1, retries=urllib3.Retry(total=1, read=0, status=0, redirect=0), timeout=120)

    def call(q, k, v):
        parts = [memoryview(p).cast("B") for p in _wire.v2_request({"q": q, "k": k, "v": v}, {"causal": True}, ["out", "weights"])]
        headers = {_wire.HEAD_LENGTH: str(len(parts[0])), "Content-Length": str(sum(len(p) for p in parts))}
        resp = pool.urlopen("POST", "/v2/models/attention/infer", body=parts, headers=headers, preload_content=False, decode_content=False)
        assert resp.status == 200, resp.status
        body, got = np.empty(resp.length_remaining, np.uint8), 0
        while got < len(body):
            got += resp.readinto(body.data[got:])
        resp.release_conn()
        outputs = _wire.v2_outputs(body.data, int(resp.headers[_wire.HEAD_LENGTH]))
        return outputs["out"], outputs["weights"]

    return call, pool.close


PATHS = {
    "AttentionClient binary (default)": lambda url: client_path(url, "binary"),
    "same binary wire over urllib3": urllib3_binary_path,
    "AttentionClient json (b64)": lambda url: client_path(url, "json"),
    "tritonclient.http binary": triton_path,
    "requests + json b64 /attention": requests_path,
}
REFERENCE = "tritonclient.http binary"


def measure(url: str, T: int, runs: int, warmup: int, reconnect: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """ms per request of each path, end to end and of this process's CPU, alternating; checks
    that all paths give the same arrays. Every `reconnect` repetitions each path reconnects (and
    makes one unmeasured call): which of the server's workers holds which path's connection
    changes, so no path keeps the worker that also serves the heaviest one for the whole run."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, T, 64), dtype=np.float32) for _ in range(3))
    names = list(PATHS)
    paths: dict[str, Path] = {}
    times = {name: [] for name in names}
    cpus = {name: [] for name in names}  # this process's CPU time: the client's own work
    results = {}
    order = random.Random(T)
    for i in range(warmup + runs):
        order.shuffle(names)  # not a rotation: that would keep each path's predecessor (its garbage, its server-side after-work) fixed
        if i % reconnect == 0:
            for name in names:
                if name in paths:
                    paths[name][1]()
                paths[name] = PATHS[name](url)
                paths[name][0](q, k, v)  # connects
        calls = {name: path[0] for name, path in paths.items()}
        for name in names:
            start, cpu = time.perf_counter(), time.process_time()
            out, weights = calls[name](q, k, v)
            elapsed, cpu = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
            if i >= warmup:
                times[name].append(elapsed)
                cpus[name].append(cpu)
            results[name] = (out, weights)
    for _, close in paths.values():
        close()
    want_out, want_w = results[REFERENCE]
    for name, (out, weights) in results.items():
        # Equal to float32 rounding: tritonclient's tensors start unaligned in the server's buffer
        # (its JSON head is not padded), which changes the last bit of a few results.
        assert out.dtype == weights.dtype == np.float32, f"{name}: {out.dtype}, {weights.dtype}"
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-5, err_msg=name)
    return times, cpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start `python -m service` on a free port)")
    p.add_argument("-T", default="64,1024", help="sequence lengths, comma-separated (default %(default)s)")
    p.add_argument("--runs", default="400,20", help="repetitions per T, comma-separated (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reconnect", type=int, default=20, help="new connections every this many repetitions (default %(default)s)")
    args = p.parse_args()
    lengths = [int(t) for t in args.T.split(",")]
    runs = [int(n) for n in args.runs.split(",")]
    runs += runs[-1:] * (len(lengths) - len(runs))

    with served(args.url) as url:
        print(f"q, k, v (1, 8, T, 64) float32, causal, weights returned; load average {os.getloadavg()[0]:.2f} at the start\n")
        rows = []
        for T, n in zip(lengths, runs, strict=True):
            times, cpus = measure(url, T, n, args.warmup, args.reconnect)
            ref = statistics.median(times[REFERENCE])
            for name, ts in times.items():
                rows.append([T, name, statistics.median(ts), min(ts), f"{statistics.median(ts) / ref:.2f}x", statistics.median(cpus[name])])
        print(table(["T", "path", "median ms", "min ms", "/ tritonclient", "client CPU ms (median)"], rows))
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
