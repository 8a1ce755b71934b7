"""A decode step through a session against the same step in-process, and against resending the cache.

    .venv/bin/python -m bench sessions                      # starts its own server (2 workers) on a free port
    .venv/bin/python -m bench sessions --url http://127.0.0.1:8000 --runs 40

A decode step: t = 1 new token, H = 8 heads, d = 64, float32, its k and v appended and its q
attending to all S keys (POST /sessions/{id}/attention, b64, one keep-alive connection, as a decode
loop keeps one). Measured, interleaved (step, in-process, step, ...), medians:
- at S = 1024, 4096, 16384: the step through `requests` against the same step in-process (numpy:
  q kᵀ, softmax, weights v over the same contiguous arrays, on one BLAS thread as a worker has),
  and the step over the pool's pages in-process (core.paged_attention, what the server runs);
- at S = 4096: a stateless POST /attention resending the whole cache (q, k, v in b64) for the same
  step; the bytes on the wire of each (request body and answer);
- a batched step of 16 sessions at S = 4096 (POST /sessions/attention): tokens per second against
  one session's steps per second."""

from __future__ import annotations

import argparse
import base64
import math
import statistics
import sys
import time

import numpy as np
import orjson
import requests
from threadpoolctl import threadpool_limits

from bench.common import Server
from service import core

H, D = 8, 64
APPEND_CHUNK = 2048  # tokens a prefill request carries (8 heads x 64 x 4 bytes x 2: 8 MiB raw)


def enc(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, np.float32)
    return {"shape": list(a.shape), "dtype": "float32", "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def dec(t: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(t["b64"]), dtype=t["dtype"]).reshape(t["shape"])


class Session:
    """A session on the server and its keys and values here (contiguous, as an in-process loop holds them)."""

    def __init__(self, http: requests.Session, url: str, S: int, rng: np.random.Generator):
        self.http, self.url = http, url
        r = http.post(f"{url}/sessions", json={"heads": H, "head_dim": D}, timeout=60)
        r.raise_for_status()
        self.id = r.json()["id"]
        self.k = rng.standard_normal((H, S, D)).astype(np.float32)
        self.v = rng.standard_normal((H, S, D)).astype(np.float32)
        for s0 in range(0, S, APPEND_CHUNK):
            body = {"k": enc(self.k[:, s0 : s0 + APPEND_CHUNK]), "v": enc(self.v[:, s0 : s0 + APPEND_CHUNK]), "at": s0}
            post(http, f"{url}/sessions/{self.id}/append", body).raise_for_status()

    def step(self, q, k, v) -> tuple[float, np.ndarray, int, float]:
        """One decode step: (seconds, out, bytes on the wire, the server's own ms: Server-Timing's total)."""
        body = orjson.dumps({"q": enc(q), "k": enc(k), "v": enc(v), "at": self.k.shape[1], "response_encoding": "b64"})
        t0 = time.perf_counter()
        r = self.http.post(f"{self.url}/sessions/{self.id}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=60)
        r.raise_for_status()
        out = dec(r.json()["out"])
        elapsed = time.perf_counter() - t0
        self.k, self.v = np.concatenate([self.k, k], 1), np.concatenate([self.v, v], 1)
        return elapsed, out, len(body) + len(r.content), server_ms(r)


def server_ms(r: requests.Response) -> float:
    """Server-Timing's total: the server's own time for the request, in ms."""
    for part in r.headers.get("Server-Timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "total":
            return float(dur)
    return math.nan


def post(http: requests.Session, url: str, body: dict) -> requests.Response:
    return http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}, timeout=120)


def in_process(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[float, np.ndarray]:
    """The same step in numpy over contiguous arrays: (seconds, out)."""
    t0 = time.perf_counter()
    scores = (q * np.float32(1 / math.sqrt(D))) @ k.transpose(0, 2, 1)  # (H, 1, S)
    scores -= scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    out = (e / e.sum(axis=-1, keepdims=True)) @ v
    return time.perf_counter() - t0, out


def paged_in_process(q: np.ndarray, k: np.ndarray, v: np.ndarray, page: int = 256) -> float:
    """core.paged_attention over the same keys in pages of page tokens, one run of them as a pool
    hands consecutive pages (the server's compute, without HTTP)."""
    S = k.shape[1]
    n = -(-S // page)
    kp, vp = np.zeros((n, H, page, D), np.float32), np.zeros((n, H, page, D), np.float32)
    for i in range(n):
        m = min(page, S - i * page)
        kp[i, :, :m], vp[i, :, :m] = k[:, i * page : i * page + m], v[:, i * page : i * page + m]
    t0 = time.perf_counter()
    core.paged_attention(q, [(kp, vp)], S)
    return time.perf_counter() - t0


def stateless(http: requests.Session, url: str, q, k, v) -> tuple[float, int]:
    """The same step as POST /attention, resending the cache: (seconds, bytes on the wire)."""
    body = orjson.dumps(
        {"q": enc(q), "k": enc(k), "v": enc(v), "causal": "bottom_right", "return_weights": False, "response_encoding": "b64"}
    )
    t0 = time.perf_counter()
    r = http.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
    r.raise_for_status()
    dec(r.json()["out"])
    return time.perf_counter() - t0, len(body) + len(r.content)


def run(url: str, runs: int, batch: int) -> None:
    rng = np.random.default_rng(0)
    http = requests.Session()
    print(f"decode step, t=1, H={H}, d={D}, float32; medians of {runs} interleaved runs")
    print(f"{'S':>6} {'step ms':>8} {'server ms':>10} {'numpy ms':>9} {'ratio':>6} {'paged ms':>9} {'bytes/step':>11}")
    single_ms = {}
    for S in (1024, 4096, 16384):
        s = Session(http, url, S, rng)
        steps, numpy_ms, paged_ms, wire, server = [], [], [], [], []
        for _ in range(runs):
            q, k, v = (rng.standard_normal((H, 1, D)).astype(np.float32) for _ in range(3))
            elapsed, out, nbytes, own = s.step(q, k, v)
            steps.append(elapsed)
            server.append(own)
            wire.append(nbytes)
            took, want = in_process(q, s.k, s.v)
            numpy_ms.append(took)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
            paged_ms.append(paged_in_process(q, s.k, s.v))
        step, numpy_med = statistics.median(steps) * 1000, statistics.median(numpy_ms) * 1000
        single_ms[S] = step
        print(
            f"{S:>6} {step:>8.2f} {statistics.median(server):>10.2f} {numpy_med:>9.2f} {step / numpy_med:>6.2f} {statistics.median(paged_ms) * 1000:>9.2f} {statistics.median(wire):>11.0f}"
        )
        if S == 4096:
            resend, resend_bytes = [], 0
            for _ in range(max(3, runs // 4)):
                q = rng.standard_normal((H, 1, D)).astype(np.float32)
                took, resend_bytes = stateless(http, url, q, s.k[:, :S], s.v[:, :S])  # ATTN_MAX_S: 4096
                resend.append(took)
            resend_ms = statistics.median(resend) * 1000
            print(
                f"       stateless POST /attention resending the cache at S=4096: {resend_ms:.1f} ms, {resend_bytes} bytes "
                f"({resend_ms / step:.0f}x the step's time, {resend_bytes / statistics.median(wire):.0f}x its bytes)"
            )
        http.delete(f"{url}/sessions/{s.id}", timeout=60)
    sessions = [Session(http, url, 4096, rng) for _ in range(batch)]
    times, timing = [], []
    for _ in range(max(5, runs // 4)):
        q, k, v = (rng.standard_normal((batch, H, 1, D)).astype(np.float32) for _ in range(3))
        body = {"sessions": [s.id for s in sessions], "q": enc(q), "k": enc(k), "v": enc(v), "response_encoding": "b64"}
        body["at"] = [s.k.shape[1] for s in sessions]
        t0 = time.perf_counter()
        r = post(http, f"{url}/sessions/attention", body)
        r.raise_for_status()
        times.append(time.perf_counter() - t0)
        timing.append(r.headers.get("Server-Timing", ""))
        for i, s in enumerate(sessions):
            s.k, s.v = np.concatenate([s.k, k[i]], 1), np.concatenate([s.v, v[i]], 1)
    batch_ms = statistics.median(times) * 1000
    tokens_s, steps_s = batch / batch_ms * 1000, 1000 / single_ms[4096]
    print(
        f"batched step of {batch} sessions at S=4096: {batch_ms:.1f} ms, {tokens_s:.0f} tokens/s against one session's "
        f"{steps_s:.0f} steps/s ({tokens_s / steps_s:.1f}x); the server's phases (one of them): {timing[len(timing) // 2]}"
    )
    for s in sessions:
        http.delete(f"{url}/sessions/{s.id}", timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one, 2 workers)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    with threadpool_limits(limits=1, user_api="blas"):  # as a worker computes (deploy/gunicorn.conf.py)
        if args.url:
            run(args.url, args.runs, args.batch)
            return
        server = Server("sessions")
        try:
            server.wait_ready(in_a_row=8)
            run(server.url, args.runs, args.batch)
        finally:
            server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
