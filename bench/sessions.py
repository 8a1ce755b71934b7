"""`python -m bench sessions [--url URL] [--runs 30]`: a decode step through a session against the
same step in-process, against resending the cache, and batched (starts its own server, 2 workers).

A step: t = 1, H = 8, d = 64, float32, its k and v appended and its q attending to all S keys
(POST /sessions/{id}/attention, b64, one keep-alive connection); its time, the client's whole
part. Interleaved, at S = 1024, 4096, 16384: through the project's client and through `requests`
(with its Server-Timing total and bytes), against numpy over the same contiguous arrays and
core.paged_attention over the same keys in pages written a token at a time, in a sessions pool of
shared memory ("paged pool") and in an ordinary array ("paged array"), one BLAS thread. At
S = 4096 a stateless POST /attention resending the cache, and a batched step of 16 sessions
(api.attention_sessions)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import orjson
import requests
from threadpoolctl import threadpool_limits

from attention_client import AttentionClient, _http, _wire
from attention_client.loadtest.transport import parse_server_timing
from bench.common import b64, served, unb64
from service import core, sessions

H, D = 8, 64
PAGE = 256  # the server's ATTN_SESSION_PAGE_TOKENS by default
APPEND_CHUNK = 2048  # tokens a prefill request carries (8 heads x 64 x 4 bytes x 2: 8 MiB raw)
JSON = {"Content-Type": "application/json"}


class Sequence:
    """A session on the server, made and stepped through the client (AttentionClient.session); its
    keys and values here (contiguous, as an in-process loop holds them); with local, also in pages of
    a pool of this process's own (shared memory, as a worker reads them) and in pages of ordinary
    memory (kp, vp, with room for the steps' tokens), both written a token at a time as a pool is."""

    def __init__(self, api: AttentionClient, S: int, rng: np.random.Generator, local: sessions.Pool | None = None, room: int = 0):
        self.session = api.session(H, D)
        self.k = rng.standard_normal((H, S, D)).astype(np.float32)
        self.v = rng.standard_normal((H, S, D)).astype(np.float32)
        for s0 in range(0, S, APPEND_CHUNK):
            self.session.append(self.k[:, s0 : s0 + APPEND_CHUNK], self.v[:, s0 : s0 + APPEND_CHUNK])
        self.local, self.local_id = local, None
        self.kp, self.vp = (np.zeros((-(-(S + room) // PAGE) if local else 0, H, PAGE, D), np.float32) for _ in range(2))
        self.write_pages(0, self.k, self.v)
        if local is not None:
            self.local_id = local.create(sessions.Shape(H, H, D, D, np.dtype(np.float32)), local.max_tokens, sessions.owner_hash(None))
            self.append_locally(self.k, self.v)

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def append_locally(self, k: np.ndarray, v: np.ndarray) -> None:
        assert self.local is not None and self.local_id is not None
        with self.local.session(self.local_id, sessions.owner_hash(None)) as s:
            s.commit(s.append(k, v))

    def write_pages(self, s0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Tokens s0 .. into the ordinary pages (as a pool's append writes them)."""
        end = s0 + k.shape[1]
        for p in range(s0 // PAGE, min(self.kp.shape[0], -(-end // PAGE))):
            a, b = max(s0, p * PAGE), min(end, (p + 1) * PAGE)
            self.kp[p, :, a - p * PAGE : b - p * PAGE] = k[:, a - s0 : b - s0]
            self.vp[p, :, a - p * PAGE : b - p * PAGE] = v[:, a - s0 : b - s0]

    def array_pages(self) -> list:
        """The keys in pages of PAGE tokens of one ordinary array (one run)."""
        n = -(-self.length // PAGE)
        return [(self.kp[:n], self.vp[:n])]

    def local_pages(self) -> list:
        assert self.local is not None and self.local_id is not None
        with self.local.session(self.local_id, sessions.owner_hash(None)) as s:
            return s.pages(self.length)

    def client_step(self, q, k, v) -> tuple[float, np.ndarray]:
        """One decode step through the client (Session.attention): (seconds, out)."""
        t0 = time.perf_counter()
        out = self.session.attention(q, k, v)
        elapsed = time.perf_counter() - t0
        self.took(k, v)
        return elapsed, out

    def requests_step(self, http: requests.Session, url: str, q, k, v) -> tuple[float, np.ndarray, int, float]:
        """The same step through `requests`: (seconds, out, bytes on the wire, the server's own ms:
        Server-Timing's total)."""
        t0 = time.perf_counter()
        body = orjson.dumps({"q": b64(q), "k": b64(k), "v": b64(v), "at": self.length, "response_encoding": "b64"})
        r = http.post(f"{url}/sessions/{self.session.id}/attention", data=body, headers=JSON, timeout=60)
        r.raise_for_status()
        out = unb64(orjson.loads(r.content)["out"])
        elapsed = time.perf_counter() - t0
        self.took(k, v)
        self.session.refresh()  # the client learns the length this step made
        return elapsed, out, len(body) + len(r.content), parse_server_timing(r.headers.get("Server-Timing")).get("total", math.nan)

    def took(self, k, v) -> None:
        """The server took the token: here too."""
        self.write_pages(self.length, k, v)
        self.k, self.v = np.concatenate([self.k, k], 1), np.concatenate([self.v, v], 1)
        if self.local is not None:
            self.append_locally(k, v)


def in_process(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[float, np.ndarray]:
    """The same step in numpy over contiguous arrays: (seconds, out)."""
    t0 = time.perf_counter()
    scores = (q * np.float32(1 / math.sqrt(D))) @ k.transpose(0, 2, 1)  # (H, 1, S)
    scores -= scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    out = (e / e.sum(axis=-1, keepdims=True)) @ v
    return time.perf_counter() - t0, out


def paged(q: np.ndarray, pages: list, S: int) -> float:
    """core.paged_attention over pages (the server's compute, without HTTP): seconds."""
    t0 = time.perf_counter()
    core.paged_attention(q, pages, S)
    return time.perf_counter() - t0


def stateless(client: _http.Pool, q, k, v) -> tuple[float, int]:
    """The same step as POST /attention, resending the cache, through the same transport: (seconds, bytes on the wire)."""
    t0 = time.perf_counter()
    parts = _wire.json_request(
        {"q": q, "k": k, "v": v, "causal": "bottom_right", "return_weights": False, "response_encoding": "b64"}, "b64"
    )
    answer = client.request("POST", "/attention", parts, JSON)
    assert answer.status == 200, bytes(answer.body)[:300]
    _wire.decode_tensor(_wire.loads(answer.body)["out"])
    return time.perf_counter() - t0, sum(len(p) for p in parts) + len(answer.body)


def ms(xs) -> float:
    return statistics.median(xs) * 1000


def run(url: str, runs: int, batch: int) -> None:
    rng = np.random.default_rng(0)
    api, transport, http = AttentionClient(url, timeout=120), _http.Pool(url, 120, 1, {}), requests.Session()
    local = sessions.Pool(2 * (16384 + 2 * runs) * H * D * 4 * 2, PAGE, 16384 + 2 * runs + PAGE, 4, 3600)
    print(f"decode step, t=1, H={H}, d={D}, float32; medians of {runs} interleaved runs; ratio: the client's step over numpy's")
    print(
        f"{'S':>6} {'client ms':>9} {'requests ms':>11} {'server ms':>9} {'numpy ms':>8} {'ratio':>5} "
        f"{'paged pool ms':>13} {'paged array ms':>14} {'bytes/step':>10}"
    )
    single_ms = {}
    for S in (1024, 4096, 16384):
        s = Sequence(api, S, rng, local, room=2 * runs)
        t: dict[str, list[float]] = {name: [] for name in ("client", "requests", "server", "numpy", "pool", "array", "wire")}
        for _ in range(runs):
            q, k, v = (rng.standard_normal((H, 1, D)).astype(np.float32) for _ in range(3))
            elapsed, out = s.client_step(q, k, v)
            t["client"].append(elapsed)
            took, want = in_process(q, s.k, s.v)
            t["numpy"].append(took)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
            t["pool"].append(paged(q, s.local_pages(), s.length))
            t["array"].append(paged(q, s.array_pages(), s.length))
            q, k, v = (rng.standard_normal((H, 1, D)).astype(np.float32) for _ in range(3))
            elapsed, _, nbytes, own = s.requests_step(http, url, q, k, v)
            t["requests"].append(elapsed)
            t["wire"].append(nbytes)
            t["server"].append(own / 1000)
        single_ms[S] = ms(t["client"])
        print(
            f"{S:>6} {single_ms[S]:>9.2f} {ms(t['requests']):>11.2f} {ms(t['server']):>9.2f} {ms(t['numpy']):>8.2f} "
            f"{single_ms[S] / ms(t['numpy']):>5.2f} {ms(t['pool']):>13.2f} {ms(t['array']):>14.2f} {statistics.median(t['wire']):>10.0f}"
        )
        if S == 4096:
            resend, resend_bytes = [], 0
            for _ in range(max(3, runs // 4)):
                q = rng.standard_normal((H, 1, D)).astype(np.float32)
                took, resend_bytes = stateless(transport, q, s.k[:, :S], s.v[:, :S])  # ATTN_MAX_S: 4096
                resend.append(took)
            print(
                f"       stateless POST /attention resending the cache at S=4096: {ms(resend):.1f} ms, {resend_bytes} bytes "
                f"({ms(resend) / single_ms[S]:.0f}x the step's time, {resend_bytes / statistics.median(t['wire']):.0f}x its bytes)"
            )
        s.session.close()
    group = [Sequence(api, 4096, rng) for _ in range(batch)]
    times = []
    for _ in range(max(5, runs // 4)):
        q, k, v = (rng.standard_normal((batch, H, 1, D)).astype(np.float32) for _ in range(3))
        t0 = time.perf_counter()
        api.attention_sessions([s.session for s in group], q, k, v)
        times.append(time.perf_counter() - t0)
        for i, s in enumerate(group):
            s.took(k[i], v[i])
    batch_ms = ms(times)
    tokens_s, steps_s = batch / batch_ms * 1000, 1000 / single_ms[4096]
    print(
        f"batched step of {batch} sessions at S=4096 (api.attention_sessions): {batch_ms:.1f} ms, {tokens_s:.0f} tokens/s "
        f"against one session's {steps_s:.0f} steps/s ({tokens_s / steps_s:.1f}x)"
    )
    for s in group:
        s.session.close()
    api.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one, 2 workers)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    with threadpool_limits(limits=1, user_api="blas"):  # as a worker computes (deploy/gunicorn.conf.py)
        with served(args.url, "sessions", in_a_row=8) as url:
            run(url, args.runs, args.batch)


if __name__ == "__main__":
    main(sys.argv[1:])
