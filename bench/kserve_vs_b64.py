"""The KServe v2 binary tensor extension against the native b64 JSON path, end to end.

    .venv/bin/python bench/kserve_vs_b64.py                  # starts its own server on a free port
    .venv/bin/python bench/kserve_vs_b64.py --url http://127.0.0.1:8000 --runs 20

One request: q, k, v (B, H, T, d) float32, causal, weights returned (B, H, T, T). Both paths run on
the same server, interleaved (b64, binary, b64, ...) so drift from other load hits both alike.
End to end means from numpy arrays in the client to numpy arrays in the client: encoding, HTTP,
the server's whole work, and decoding. Reported: median, min and max over the runs, the bytes on
the wire, and the server's own Server-Timing phases (median), which show where the time goes."""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages

from attention_client.loadtest.transport import parse_server_timing  # noqa: E402
from bench.server import Server  # noqa: E402


def b64_request(session: requests.Session, url: str, q, k, v) -> tuple[np.ndarray, np.ndarray, requests.Response, int]:
    def enc(a):
        return {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode("ascii")}

    def dec(t):
        return np.frombuffer(base64.b64decode(t["b64"]), dtype=t["dtype"]).reshape(t["shape"])

    body = json.dumps({"q": enc(q), "k": enc(k), "v": enc(v), "causal": True, "response_encoding": "b64"}).encode()
    resp = session.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
    resp.raise_for_status()
    doc = resp.json()
    return dec(doc["out"]), dec(doc["weights"]), resp, len(body)


def binary_request(session: requests.Session, url: str, q, k, v) -> tuple[np.ndarray, np.ndarray, requests.Response, int]:
    arrays = {"q": q, "k": k, "v": v}
    header = json.dumps(
        {
            "inputs": [
                {"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
                for n, a in arrays.items()
            ],
            "parameters": {"causal": True, "binary_data_output": True},
        }
    ).encode()
    body = b"".join([header, *(a.tobytes() for a in arrays.values())])
    resp = session.post(
        f"{url}/v2/models/attention/infer", data=body, headers={"Inference-Header-Content-Length": str(len(header))}, timeout=120
    )
    resp.raise_for_status()
    size = int(resp.headers["Inference-Header-Content-Length"])
    head = json.loads(resp.content[:size])
    outputs, offset = {}, size
    for o in head["outputs"]:
        n = o["parameters"]["binary_data_size"]
        outputs[o["name"]] = np.frombuffer(resp.content, dtype="<f4", count=n // 4, offset=offset).reshape(o["shape"])
        offset += n
    return outputs["out"], outputs["weights"], resp, len(body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("-B", type=int, default=1)
    p.add_argument("-H", type=int, default=8)
    p.add_argument("-T", type=int, default=1024)
    p.add_argument("-d", type=int, default=64)
    args = p.parse_args()

    started = None
    if args.url:
        url = args.url
    else:
        started = Server("service", [sys.executable, "-m", "service"])
        started.wait_ready()
        url = f"http://127.0.0.1:{started.port}"
    try:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((args.B, args.H, args.T, args.d), dtype=np.float32) for _ in range(3))
        paths = {"b64 JSON (POST /attention)": b64_request, "KServe binary (POST /v2/.../infer)": binary_request}
        sessions = {name: requests.Session() for name in paths}
        for session in sessions.values():
            session.headers["Accept-Encoding"] = "identity"  # requests asks for gzip by default; the answers are measured uncompressed
        times = {name: [] for name in paths}
        phases = {name: [] for name in paths}
        wire = {}
        results = {}
        for i in range(args.warmup + args.runs):
            for name, fn in paths.items():
                start = time.perf_counter()
                out, weights, resp, sent = fn(sessions[name], url, q, k, v)
                elapsed = (time.perf_counter() - start) * 1000
                if i >= args.warmup:
                    times[name].append(elapsed)
                    phases[name].append(parse_server_timing(resp.headers.get("Server-Timing")))
                wire[name] = (sent, len(resp.content))
                results[name] = (out, weights)
        (o1, w1), (o2, w2) = results.values()
        assert np.array_equal(o1, o2) and np.array_equal(w1, w2), "the two paths disagree"

        load = os.getloadavg()
        print(
            f"q, k, v ({args.B}, {args.H}, {args.T}, {args.d}) float32, causal, weights returned; {args.runs} runs each after {args.warmup} warm-up, interleaved"
        )
        print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"{'path':36} {'median ms':>10} {'min':>8} {'max':>8} {'sent MB':>8} {'recv MB':>8}   server phases (median ms)")
        for name in paths:
            ts = times[name]
            server = {
                key: statistics.median(ph.get(key, 0.0) for ph in phases[name])
                for key in ("decode", "validate", "compute", "encode", "total")
            }
            srv = " ".join(f"{key}={val:.1f}" for key, val in server.items())
            print(
                f"{name:36} {statistics.median(ts):10.1f} {min(ts):8.1f} {max(ts):8.1f} {wire[name][0] / 1e6:8.2f} {wire[name][1] / 1e6:8.2f}   {srv}"
            )
        b64_ms, bin_ms = (statistics.median(times[name]) for name in paths)
        print(f"ratio b64 / binary (median end to end): {b64_ms / bin_ms:.2f}x")
    finally:
        if started is not None:
            started.stop()


if __name__ == "__main__":
    main()
