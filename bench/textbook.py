"""`python -m bench textbook` (in `make bench`): this service against the textbook one
(bench/baseline_service.py), side by side in one run, B=1, H=8, d=64, causal, float32:

  compute   in this process, one BLAS thread as in a worker: textbook numpy, this core with and
            without weights, torch's SDPA where torch imports (here or in BENCH_TORCH_PYTHON's)
  service   end to end over loopback, concurrency 1, a requests.Session: request sent, answer
            read, T = 64 .. 4096 (textbook .. 1024), nested and b64, with and without weights;
            this service's phases from Server-Timing, the same attention in-process beside
  memory    a fresh one-worker server's peak RSS over one request (VmHWM) minus its RSS before

Markdown tables of medians and the goals, also written to bench/out/results.md. Bounded by
--budget seconds (cells past it are reported as skipped).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import orjson
import requests
from threadpoolctl import threadpool_info, threadpool_limits

from attention_client.loadtest.transport import parse_server_timing
from bench.baseline_service import textbook_attention
from bench.common import ROOT, D, H, Server, attention_body, publish, reset_peak, status_kb, table, tensors, unb64
from service.core import attention

T_ALL = (64, 128, 256, 512, 1024, 2048, 4096)
T_BASELINE_MAX = 1024
T_TEXTBOOK_MAX = 2048  # in-process textbook numpy: 8 x 4096 x 4096 float64 scores are 1 GiB per temporary
# b64 T=4096 without weights (33.6 MB) is over the default 32 MiB ATTN_MAX_BODY_BYTES: the service
# here allows 64 MiB, and the memory in flight to match. Larger bodies (nested T=4096) are not sent.
BODY_LIMIT = 64 << 20
MAX_WEIGHTS_T = 2048  # the default ATTN_MAX_WEIGHTS_ELEMENTS (2**25) admits 8 x 2048 x 2048 weights
ARGV = {
    "this": [sys.executable, "-m", "service"],
    "textbook": [sys.executable, "-m", "gunicorn", "--bind", "127.0.0.1:{port}", "--workers", "1", "--timeout", "300"]
    + ["--log-level", "warning", "bench.baseline_service:app"],
}
ENV = {"this": {"ATTN_WARMUP": "false", "ATTN_MAX_BODY_BYTES": str(BODY_LIMIT), "ATTN_MAX_INFLIGHT_BYTES": str(2 << 30)}, "textbook": {}}


def post(session: requests.Session, server: Server, body: bytes) -> tuple[float, requests.Response]:
    """ms from the request's first byte sent to the answer's last read, and the answer."""
    start = time.perf_counter()
    resp = session.post(server.url + "/attention", data=body, headers={"Content-Type": "application/json"}, timeout=300)
    resp.content  # noqa: B018 (read whole)
    return (time.perf_counter() - start) * 1000, resp


def raw_bytes(T: int, weights: bool) -> int:
    """q, k, v and out in float32, plus the weights when they are returned."""
    return 4 * H * T * D * 4 + (H * T * T * 4 if weights else 0)


def timed(fn, reps: int, budget_s: float) -> float:
    """The median ms of fn run up to reps times (at least twice, more while within budget_s)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


class Bench:
    def __init__(self, args):
        self.args, self.t_start = args, time.monotonic()
        self.compute: dict[tuple, float] = {}  # (impl, T) -> median ms
        self.e2e: dict[tuple, dict] = {}  # (service, encoding, weights, T) -> row
        self.memory: list[dict] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t_start)

    def run_compute(self, torch_times: dict) -> None:
        with threadpool_limits(1):
            for T in self.args.sizes:
                q, k, v = tensors(T)
                attention(q, k, v, causal=True, return_weights=T <= MAX_WEIGHTS_T)  # warm
                self.compute["this, no weights", T] = timed(
                    lambda q=q, k=k, v=v: attention(q, k, v, causal=True, return_weights=False), 7, 3
                )
                if T <= MAX_WEIGHTS_T:
                    self.compute["this, weights", T] = timed(lambda q=q, k=k, v=v: attention(q, k, v, causal=True), 7, 3)
                if T <= T_TEXTBOOK_MAX and self.left() > 60:
                    self.compute["textbook numpy", T] = timed(lambda q=q, k=k, v=v: textbook_attention(q, k, v), 5, 4)
                if T in torch_times:
                    self.compute["torch SDPA", T], self.compute["this beside torch", T] = torch_times[T]

    def run_cell(self, server: Server, session, encoding: str, weights: bool, T: int, reps: int, cell_budget: float) -> None:
        """One cell of the service sweep: reps requests (fewer past cell_budget s), each followed
        by the same attention in this process (under the same load)."""
        label = f"{server.name} {encoding} T={T} {'weights' if weights else 'no weights'}"
        if self.left() < 20:
            self.skipped.append(label)
            return
        body = attention_body(T, encoding, weights)
        if len(body) > BODY_LIMIT:  # nested T=4096: ~126 MB of float text
            self.notes.append(f"{label}: not sent, its body of {len(body) / 1e6:.0f} MB is over the {BODY_LIMIT >> 20} MiB allowed here")
            return
        ms, resp = post(session, server, body)  # warm-up (and the check below)
        if resp.status_code != 200:
            self.notes.append(f"{label}: HTTP {resp.status_code}: {resp.content[:200]!r}")
            return
        if server.name == "this" and T <= 1024:
            check(resp.content, encoding, weights, T)
        results = [(ms, resp.headers)] if ms > 2000 else []  # a slow first request is as good a sample as any
        budget, beside, (q, k, v) = min(cell_budget, max(5.0, self.left() - 60)), [], tensors(T)
        start = time.perf_counter()
        while len(results) < reps and (len(results) < 2 or time.perf_counter() - start < budget):
            ms, resp = post(session, server, body)
            results.append((ms, resp.headers))
            if server.name == "this":
                with threadpool_limits(1):
                    beside.append(timed(lambda: attention(q, k, v, causal=True, return_weights=weights), 1, 0))
        phases: dict[str, list[float]] = {}
        for _, hdr in results:
            for name, dur in parse_server_timing(hdr.get("Server-Timing")).items():
                phases.setdefault(name, []).append(dur)
        row = self.e2e[server.name, encoding, weights, T] = {
            "ms": statistics.median(r[0] for r in results),
            "n": len(results),
            "phases": {name: statistics.median(v) for name, v in phases.items()},
            "bytes": len(resp.content),
            "beside": statistics.median(beside) if beside else None,
        }
        print(f"  {label}: {row['ms']:.1f} ms (n={len(results)})", flush=True)

    def run_memory(self, name: str, encoding: str, weights: bool, T: int) -> None:
        """One request on a fresh one-worker server: the worker's peak RSS over it minus its RSS
        after a T=64 warm-up of the same kind (imports, caches)."""
        label = f"memory {name} {encoding} T={T} {'weights' if weights else 'no weights'}"
        if self.left() < 25:
            self.skipped.append(label)
            return
        body, session = attention_body(T, encoding, weights), requests.Session()
        with Server(name, ARGV[name], env={**ENV[name], "WEB_CONCURRENCY": "1"}) as server:
            post(session, server, attention_body(64, encoding, weights))
            (pid,) = server.workers()
            before = reset_peak(pid)
            _, resp = post(session, server, body)
            peak, after = status_kb(pid, "VmHWM") - before, status_kb(pid, "VmRSS")
        if resp.status_code != 200:
            self.notes.append(f"{label}: HTTP {resp.status_code}")
            return
        raw = raw_bytes(T, weights)
        self.memory.append({"service": name, "encoding": encoding, "weights": weights, "T": T, "peak": peak * 1024, "raw": raw})
        self.memory[-1].update(body=len(body), rss_before=before * 1024, rss_after=after * 1024)
        print(f"  {label}: {peak / 1024:.0f} MiB peak for {raw / 2**20:.0f} MiB of tensors", flush=True)


def check(data: bytes, encoding: str, weights: bool, T: int) -> None:
    """The answer is the core's: a benchmark of wrong answers measures nothing."""
    doc = orjson.loads(data)
    got = unb64(doc["out"]) if encoding == "b64" else np.array(doc["out"], np.float32)
    q, k, v = tensors(T)
    np.testing.assert_allclose(got, attention(q, k, v, causal=True, return_weights=False)[0], atol=1e-5)
    assert ("weights" in doc) == weights


def torch_compute(sizes) -> tuple[dict, str]:
    """torch SDPA medians (ms) per T, one thread, no weights, causal: here or in BENCH_TORCH_PYTHON."""
    script = textwrap.dedent(f"""
        import json, statistics, sys, time
        import torch, torch.nn.functional as F
        torch.set_num_threads(1)
        import importlib.util  # the core alone (numpy only): the service's other imports may be missing here
        spec = importlib.util.spec_from_file_location(
            "attention_core", {str(ROOT / "service" / "core" / "__init__.py")!r}, submodule_search_locations=[{str(ROOT / "service" / "core")!r}]
        )
        core = importlib.util.module_from_spec(spec)
        sys.modules["attention_core"] = core  # for its relative imports
        spec.loader.exec_module(core)
        attention = core.attention  # numpy's OpenBLAS: one thread (OPENBLAS_NUM_THREADS)
        res, ours = {{}}, {{}}
        for T in {list(sizes)}:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, {H}, T, {D}, generator=g) for _ in range(3))
            qn, kn, vn = (t.numpy() for t in (q, k, v))
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            attention(qn, kn, vn, causal=True, return_weights=False)
            ts, us = [], []
            for _ in range(15):  # alternately, so that both see the same load
                t0 = time.perf_counter(); F.scaled_dot_product_attention(q, k, v, is_causal=True); ts.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter(); attention(qn, kn, vn, causal=True, return_weights=False); us.append((time.perf_counter() - t0) * 1000)
                if len(ts) >= 3 and sum(ts) + sum(us) > 4000: break
            res[T], ours[T] = statistics.median(ts), statistics.median(us)
        print(json.dumps({{"version": torch.__version__, "ms": res, "ours": ours}}))
    """)
    python = os.environ.get("BENCH_TORCH_PYTHON", sys.executable)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0:
        return {}, f"no SDPA column: torch failed or is missing in {python} (BENCH_TORCH_PYTHON names another): {run.stderr[-200:]}"
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    return {
        int(t): (ms, doc["ours"][t]) for t, ms in doc["ms"].items()
    }, f"torch {doc['version']} in {python}, timed alternately with this core"


def ratio(a, b, digits: int = 1, unit: str = "x") -> str:
    return f"{a / b:.{digits}f}{unit}" if a and b else "–"


def report(b: Bench, notes: list[str]) -> str:
    c, sizes = b.compute, b.args.sizes
    impls = ["textbook numpy", "this, weights", "this, no weights", "torch SDPA"]
    lines = ["# This service against the textbook one (`python -m bench textbook`)", "", *(f"- {n}" for n in notes), ""]
    lines += ["Compute in-process (ms, one BLAS thread as in a worker):", ""]
    header = ["T", *impls, "textbook / this (weights)", "textbook / this (no weights)", "this (no weights) / torch, timed alternately"]
    rows = [
        [T, *(c.get((i, T), "–") for i in impls), ratio(c.get(("textbook numpy", T)), c.get(("this, weights", T)))]
        + [ratio(c.get(("textbook numpy", T)), c.get(("this, no weights", T)))]
        + [ratio(c.get(("this beside torch", T)), c.get(("torch SDPA", T)), 2, "")]
        for T in sizes
    ]
    lines += [table(header, rows), "", "End to end (ms; phases from this service's Server-Timing):", ""]
    phases = ("decode", "validate", "compute", "encode", "total")
    header = ["encoding", "weights", "T", "textbook", "this", "textbook / this", *phases[:-1], "total (server)"]
    header += ["in-process compute, beside", "this / in-process", "response bytes", "n"]
    rows = []
    for encoding, weights, T in itertools.product(("b64", "nested"), (True, False), sizes):
        this, base = (b.e2e.get((name, encoding, weights, T), {}) for name in ("this", "textbook"))
        if this or base:
            ph, beside = this.get("phases", {}), this.get("beside")
            row = [encoding, "yes" if weights else "no", T, base.get("ms", "–"), this.get("ms", "–"), ratio(base.get("ms"), this.get("ms"))]
            row += [ph.get(p, "–") for p in phases] + [beside or "–", ratio(this.get("ms"), beside, 2, "")]
            rows.append(row + [this.get("bytes", "–"), this.get("n", "–")])
    lines += [table(header, rows), ""]
    if b.memory:
        lines += ["Peak worker memory for one request (a fresh one-worker server, after a T=64 warm-up):", ""]
        header = ["service", "encoding", "weights", "T", "raw tensor bytes (MiB)", "request body (MiB)", "worker RSS before (MiB)"]
        header += ["peak over it (MiB)", "peak / raw", "RSS after (MiB)"]
        rows = [
            [m["service"], m["encoding"], "yes" if m["weights"] else "no", m["T"], *(m[k] / 2**20 for k in ("raw", "body", "rss_before"))]
            + [m["peak"] / 2**20, m["peak"] / m["raw"], m["rss_after"] / 2**20]
            for m in b.memory
        ]
        lines += [table(header, rows), ""]
    verdict = {True: "met", False: "missed", None: "not measured"}
    lines += [table(["figure", "measured", "goal", ""], [(n, v, g, verdict[ok]) for n, v, g, ok in goals(b)]), ""]
    lines += ["Skipped (time budget): " + ", ".join(b.skipped)] if b.skipped else []
    lines += ["Notes: " + "; ".join(b.notes)] if b.notes else []
    return "\n".join(lines) + "\n"


def goals(b: Bench) -> list[tuple[str, str, str, bool | None]]:
    """(figure, measured, goal, met: None where not measured)."""

    def row(name: str, value: float | None, goal: float, at_least: bool, unit: str = "x", digits: int = 1):
        bound = f"{'>=' if at_least else '<='} {goal:g}{unit}"
        if value is None:
            return name, "–", bound, None
        return name, f"{value:.{digits}f}{unit}", bound, value >= goal if at_least else value <= goal

    def ms(svc, enc, w, T):
        return b.e2e.get((svc, enc, w, T), {}).get("ms")

    def over(a, c):
        return a / c if a and c else None

    nested = [
        (f"nested JSON, T={T} with weights: textbook / this", ms("textbook", "nested", True, T), ms("this", "nested", True, T))
        for T in (256, 1024)
    ]
    rows = [row(name, over(a, c), 20, True) for name, a, c in nested]
    for w, goal in ((False, 1.5), (True, 3.0)):
        cell = b.e2e.get(("this", "b64", w, 1024), {})
        name = f"b64, T=1024, {'with' if w else 'no'} weights: end to end / in-process compute"
        rows.append(row(name, over(cell.get("ms"), cell.get("beside")), goal, False, "", 2))
    compute = over(b.compute.get(("textbook numpy", 1024)), b.compute.get(("this, weights", 1024)))
    rows.append(row("compute, T=1024, textbook numpy / this (both returning weights)", compute, 3.5, True))
    c = b.compute
    torch = [c["this beside torch", T] / c["torch SDPA", T] for T in b.args.sizes if T >= 256 and ("torch SDPA", T) in c]
    rows.append(row("compute, no weights, causal, T=256..4096: this / torch SDPA (worst T)", max(torch, default=None), 1.5, False, "", 2))
    for w, goal in ((True, 2048), (False, 4096)):
        within = [T for T in b.args.sizes if (ms("this", "b64", w, T) or math.inf) <= 1000]
        name = f"largest T within 1 s (b64, concurrency 1), {'with' if w else 'without'} weights"
        rows.append(row(name, max(within, default=None), goal, True, "", 0))
    mem = max((m["peak"] / m["raw"] for m in b.memory if m["service"] == "this"), default=None)
    rows.append(row("peak worker memory for one request / raw bytes of its tensors (b64, worst measured)", mem, 2, False, "", 2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    parser.add_argument("--max-t", type=int, default=4096, help="largest T (default 4096)")
    parser.add_argument("--reps", type=int, default=7, help="requests per cell at most (default 7)")
    args = parser.parse_args()
    args.sizes = [T for T in T_ALL if T <= args.max_t]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started here on the way out
    b = Bench(args)
    blas = "; ".join(f"{i['internal_api']} {i.get('version')} {i.get('architecture')}" for i in threadpool_info())
    notes = [f"{os.cpu_count()} cores, numpy {np.__version__}, {blas}; load average at start {os.getloadavg()[0]:.2f}"]
    servers = {name: Server(name, ARGV[name], ENV[name]) for name in ARGV}
    try:
        for s in servers.values():
            s.wait_ready()
        print("compute in-process ...", flush=True)
        torch_times, torch_note = torch_compute(args.sizes)
        notes.append(torch_note)
        b.run_compute(torch_times)
        print("this service ...", flush=True)
        session = requests.Session()
        for encoding, weights, T in itertools.product(("b64", "nested"), (False, True), args.sizes):
            if not weights or T <= MAX_WEIGHTS_T:
                slow = encoding == "nested" and T >= 2048
                b.run_cell(servers["this"], session, encoding, weights, T, 3 if slow else args.reps, 8 if slow else 6)
        print("textbook service ...", flush=True)
        session = requests.Session()
        for T in (256, 1024):  # the goal cells first, then the rest of the sweep
            if T in args.sizes:
                b.run_cell(servers["textbook"], session, "nested", True, T, 3, 60)
        for encoding, weights, T in itertools.product(("b64", "nested"), (False, True), args.sizes):
            if T <= T_BASELINE_MAX and ("textbook", encoding, weights, T) not in b.e2e:
                b.run_cell(servers["textbook"], session, encoding, weights, T, 3 if T >= 512 else 5, 30)
    finally:
        for s in servers.values():
            s.stop()
    print("memory ...", flush=True)
    for T, w in ((1024, False), (1024, True), (2048, True), (4096, False)):
        if T in args.sizes:
            b.run_memory("this", "b64", w, T)
    if 1024 in args.sizes:
        b.run_memory("textbook", "b64", True, 1024)
    publish("results.md", report(b, notes))
    print(f"in {time.monotonic() - b.t_start:.0f} s")


if __name__ == "__main__":
    main()
