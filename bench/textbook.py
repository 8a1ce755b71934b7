"""`python -m bench textbook` (in `make bench`): this service against the textbook one, side by side, in one run.

Starts the textbook baseline (bench/baseline_service.py) and this service (`python -m service`,
deploy/gunicorn.conf.py) on free loopback ports, and measures, with B=1, H=8, d=64, causal, float32:

  compute   the attention in this process, one BLAS thread as in a worker: textbook numpy, this
            core with and without weights, and torch's scaled_dot_product_attention where torch
            is installed (here, or in BENCH_TORCH_PYTHON's interpreter)
  service   end to end over loopback, concurrency 1: request sent, whole response read (bodies
            are built beforehand; nothing is parsed after), for T = 64 .. 4096 (baseline .. 1024),
            nested and b64, with and without weights; this service's phases from Server-Timing
  memory    a worker's peak RSS over one request (VmHWM, reset through /proc/PID/clear_refs)
            minus its RSS before it, against the raw bytes of the request's tensors (q, k, v, out,
            weights)

Prints markdown tables of medians and the goals, and writes them to bench/out/results.md.
Loops are bounded in count and time (--budget seconds, default 540); cells past the budget are
reported as skipped. Every address is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import orjson
import pybase64
import requests
from threadpoolctl import threadpool_info, threadpool_limits

from attention_client.loadtest.transport import parse_server_timing
from bench.baseline_service import textbook_attention
from bench.common import OUT, ROOT, D, H, Server, attention_body, status_kb, tensors
from service.core import attention

T_ALL = (64, 128, 256, 512, 1024, 2048, 4096)
T_BASELINE_MAX = 1024
T_TEXTBOOK_MAX = 2048  # in-process textbook numpy: 8 x 4096 x 4096 float64 scores are 1 GiB per temporary
# The sweep's b64 T=4096 body without weights (33.6 MB) passes the default 32 MiB ATTN_MAX_BODY_BYTES,
# which would refuse it 413 before reading: the service here allows 64 MiB, and the memory in flight
# to match. Larger bodies (nested T=4096) are not sent.
BODY_LIMIT = 64 << 20
MAX_WEIGHTS_T = 2048  # the default ATTN_MAX_WEIGHTS_ELEMENTS (2**25) admits 8 x 2048 x 2048 weights


class Client:
    """One requests.Session, as it comes; times a POST from the first byte sent to the last read."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/attention"
        self.session = requests.Session()

    def post(self, body: bytes) -> tuple[float, int, bytes, dict]:
        start = time.perf_counter()
        resp = self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}, timeout=300)
        data = resp.content
        return (time.perf_counter() - start) * 1000, resp.status_code, data, resp.headers


def raw_bytes(T: int, weights: bool) -> int:
    """q, k, v and out in float32, plus the weights when they are returned."""
    n = 4 * H * T * D * 4
    return n + (H * T * T * 4 if weights else 0)


def timed(fn, reps: int, budget_s: float) -> list[float]:
    """Run fn up to reps times (at least twice, more while within budget_s), returning ms each."""
    times = []
    start = time.perf_counter()
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
        if i >= 1 and time.perf_counter() - start > budget_s:
            break
    return times


# --- the benchmark -------------------------------------------------------------------------------


class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.monotonic()
        self.compute: dict[tuple, float] = {}  # (impl, T) -> median ms
        self.e2e: dict[tuple, dict] = {}  # (service, encoding, weights, T) -> row
        self.memory: list[dict] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t_start)

    # compute in-process
    def run_compute(self, torch_times: dict) -> None:
        with threadpool_limits(1):
            for T in self.args.sizes:
                q, k, v = tensors(T)
                attention(q, k, v, causal=True, return_weights=T <= MAX_WEIGHTS_T)  # warm
                self.compute[("this, no weights", T)] = statistics.median(
                    timed(lambda q=q, k=k, v=v: attention(q, k, v, causal=True, return_weights=False), 7, 3)
                )
                if T <= MAX_WEIGHTS_T:
                    self.compute[("this, weights", T)] = statistics.median(
                        timed(lambda q=q, k=k, v=v: attention(q, k, v, causal=True), 7, 3)
                    )
                if T <= T_TEXTBOOK_MAX and self.left() > 60:
                    self.compute[("textbook numpy", T)] = statistics.median(timed(lambda q=q, k=k, v=v: textbook_attention(q, k, v), 5, 4))
                if T in torch_times:
                    self.compute[("torch SDPA", T)], self.compute[("this beside torch", T)] = torch_times[T]

    # one cell of the service sweep
    def run_cell(self, server: Server, client: Client, encoding: str, weights: bool, T: int, reps: int, cell_budget: float) -> None:
        key = (server.name, encoding, weights, T)
        label = f"{server.name} {encoding} T={T} {'weights' if weights else 'no weights'}"
        if self.left() < 20:
            self.skipped.append(label)
            return
        body = attention_body(T, encoding, weights)
        if len(body) > BODY_LIMIT:  # nested T=4096: ~126 MB of float text
            self.notes.append(
                f"{label}: not sent, its body of {len(body) / 1e6:.0f} MB is over the {BODY_LIMIT >> 20} MiB the server here allows"
            )
            return
        ms, status, data, headers = client.post(body)  # warm-up (and the check below)
        if status != 200:
            self.notes.append(f"{label}: HTTP {status}: {data[:200]!r}")
            return
        if server.name == "this" and T <= 1024:
            self.check(data, encoding, weights, T)
        results = [(ms, headers)] if ms > 2000 else []  # a slow first request is as good a sample as any
        budget = min(cell_budget, max(5.0, self.left() - 60))
        beside = []  # the same attention in this process, one run after each request: the load is the same
        q, k, v = tensors(T)
        start = time.perf_counter()
        while len(results) < reps and (len(results) < 2 or time.perf_counter() - start < budget):
            ms, status, data, headers = client.post(body)
            results.append((ms, headers))
            if server.name == "this":
                with threadpool_limits(1):
                    t0 = time.perf_counter()
                    attention(q, k, v, causal=True, return_weights=weights)
                    beside.append((time.perf_counter() - t0) * 1000)
        phases: dict[str, list[float]] = {}
        for _, hdr in results:
            for name, dur in parse_server_timing(hdr.get("Server-Timing")).items():
                phases.setdefault(name, []).append(dur)
        self.e2e[key] = {
            "ms": statistics.median(r[0] for r in results),
            "n": len(results),
            "phases": {name: statistics.median(v) for name, v in phases.items()},
            "bytes": len(data),
            "beside": statistics.median(beside) if beside else None,
            "request_bytes": len(body),
        }
        print(f"  {label}: {self.e2e[key]['ms']:.1f} ms (n={len(results)})", flush=True)

    def check(self, data: bytes, encoding: str, weights: bool, T: int) -> None:
        """The response is the core's answer: a benchmark of wrong answers measures nothing."""
        doc = orjson.loads(data)
        out = doc["out"]
        got = (
            np.frombuffer(pybase64.b64decode(out["b64"]), np.float32).reshape(out["shape"])
            if encoding == "b64"
            else np.array(out, np.float32)
        )
        q, k, v = tensors(T)
        expect, _ = attention(q, k, v, causal=True, return_weights=False)
        np.testing.assert_allclose(got, expect, atol=1e-5)
        assert ("weights" in doc) == weights

    def run_memory(self, name: str, argv: list[str], env: dict, encoding: str, weights: bool, T: int) -> None:
        """One request on a fresh one-worker server: the worker's peak RSS over the request minus
        its RSS after a small warm-up request of the same kind (imports, caches), so nothing a
        previous big request left in the allocator's free lists hides the peak."""
        label = f"memory {name} {encoding} T={T} {'weights' if weights else 'no weights'}"
        if self.left() < 25:
            self.skipped.append(label)
            return
        server = Server(name, argv, env={**env, "WEB_CONCURRENCY": "1"})
        try:
            server.wait_ready()
            client = Client(server.port)
            client.post(attention_body(64, encoding, weights))
            (pid,) = server.workers()
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            before = status_kb(pid, "VmRSS")
            body = attention_body(T, encoding, weights)
            _, status, data, _ = client.post(body)
            peak = (status_kb(pid, "VmHWM") - before) * 1024
            after = status_kb(pid, "VmRSS") * 1024
        finally:
            server.stop()
        if status != 200:
            self.notes.append(f"{label}: HTTP {status}")
            return
        self.memory.append(
            {
                "service": name,
                "encoding": encoding,
                "weights": weights,
                "T": T,
                "peak": peak,
                "raw": raw_bytes(T, weights),
                "body": len(body),
                "rss_before": before * 1024,
                "rss_after": after,
            }
        )
        print(f"  {label}: {peak / 2**20:.0f} MiB peak for {raw_bytes(T, weights) / 2**20:.0f} MiB of tensors", flush=True)


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
    candidates = [sys.executable]
    if os.environ.get("BENCH_TORCH_PYTHON"):
        candidates.insert(0, os.environ["BENCH_TORCH_PYTHON"])
    for python in candidates:
        if not shutil.which(python) and not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
        if probe.returncode != 0:
            continue
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        run = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=600, env=env)
        if run.returncode == 0:
            doc = json.loads(run.stdout.strip().splitlines()[-1])
            return (
                {int(t): (ms, doc["ours"][t]) for t, ms in doc["ms"].items()},
                f"torch {doc['version']} ({'BENCH_TORCH_PYTHON' if python != sys.executable else 'this interpreter'}); "
                "torch and this core timed alternately in that interpreter",
            )
    return {}, "torch not installed: no SDPA column (set BENCH_TORCH_PYTHON to an interpreter that has it)"


# --- report ------------------------------------------------------------------------------------------


def fmt(x, digits=1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and x >= 100:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def report(b: Bench, torch_note: str, env_note: list[str]) -> str:
    lines = ["# Benchmark: this service against the textbook one", ""]
    lines += [f"Made by `python -m bench textbook` on {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}.", ""]
    lines += [f"- {n}" for n in env_note] + [f"- {torch_note}", ""]
    lines += [
        "B=1, H=8, d=64, causal, float32. Medians; n = requests measured per cell. End to end = first byte of the",
        "request sent to last byte of the response read, over loopback, concurrency 1. Phases are this service's",
        "Server-Timing (ms); a b64 response is encoded while it is sent, so its encoding shows in end to end only.",
        "In-process compute, beside: the same attention in the benchmark's process, timed right after each request",
        "of the cell (so under the same load); the goals' end to end / in-process ratios use it.",
        "",
    ]

    # compute
    impls = ["textbook numpy", "this, weights", "this, no weights", "torch SDPA"]
    lines += [
        "## Compute in-process (ms, one BLAS thread as in a worker)",
        "",
        "| T | "
        + " | ".join(impls)
        + " | textbook / this (weights) | textbook / this (no weights) | this (no weights) / torch, timed alternately |",
        "|---:|" + "---:|" * (len(impls) + 3),
    ]
    for T in b.args.sizes:
        c = {i: b.compute.get((i, T)) for i in impls}
        r1 = c["textbook numpy"] / c["this, weights"] if c["textbook numpy"] and c["this, weights"] else None
        r2 = c["textbook numpy"] / c["this, no weights"] if c["textbook numpy"] and c["this, no weights"] else None
        beside = b.compute.get(("this beside torch", T))
        r3 = beside / c["torch SDPA"] if c["torch SDPA"] and beside else None
        lines.append(f"| {T} | " + " | ".join(fmt(c[i], 2) for i in impls) + f" | {fmt(r1, 1)}x | {fmt(r2, 1)}x | {fmt(r3, 2)} |")
    lines.append("")

    # end to end
    lines += [
        "## End to end (ms)",
        "",
        "| encoding | weights | T | textbook | this | textbook / this | decode | validate | compute | encode | total (server) | in-process compute, beside | this / in-process | response bytes | n |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for encoding in ("b64", "nested"):
        for weights in (True, False):
            for T in b.args.sizes:
                this = b.e2e.get(("this", encoding, weights, T))
                base = b.e2e.get(("textbook", encoding, weights, T))
                if not this and not base:
                    continue
                comp = this["beside"] if this else None
                ph = this["phases"] if this else {}
                lines.append(
                    f"| {encoding} | {'yes' if weights else 'no'} | {T} | {fmt(base['ms']) if base else '–'} | {fmt(this['ms']) if this else '–'} | "
                    f"{fmt(base['ms'] / this['ms']) + 'x' if base and this else '–'} | "
                    + " | ".join(fmt(ph.get(p), 2) for p in ("decode", "validate", "compute", "encode", "total"))
                    + f" | {fmt(comp, 2)} | {fmt(this['ms'] / comp, 2) if this and comp else '–'} | {this['bytes'] if this else '–'} | {this['n'] if this else '–'} |"
                )
    lines.append("")

    # memory
    if b.memory:
        lines += [
            "## Peak worker memory for one request",
            "",
            "One request on a fresh one-worker server, after a T=64 warm-up of the same kind: VmHWM over the request",
            "minus VmRSS before it.",
            "",
            "| service | encoding | weights | T | raw tensor bytes (MiB) | request body (MiB) | worker RSS before (MiB) | peak over it (MiB) | peak / raw | RSS after (MiB) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in b.memory:
            lines.append(
                f"| {m['service']} | {m['encoding']} | {'yes' if m['weights'] else 'no'} | {m['T']} | {mib(m['raw'])} | {mib(m['body'])} | {mib(m['rss_before'])} | {mib(m['peak'])} | {m['peak'] / m['raw']:.2f} | {mib(m['rss_after'])} |"
            )
        lines.append("")

    lines += ["## Goals", "", "| figure | measured | goal | |", "|---|---:|---:|---|"]
    for name, value, goal, ok in goals(b):
        lines.append(f"| {name} | {value} | {goal} | {'met' if ok else ('missed' if ok is False else 'not measured')} |")
    lines.append("")
    if b.skipped:
        lines += ["Skipped (time budget): " + ", ".join(b.skipped), ""]
    if b.notes:
        lines += ["Notes: " + "; ".join(b.notes), ""]
    return "\n".join(lines)


def goals(b: Bench):
    def e2e(svc, enc, w, T):
        row = b.e2e.get((svc, enc, w, T))
        return row["ms"] if row else None

    rows = []
    for T in (256, 1024):
        base, this = e2e("textbook", "nested", True, T), e2e("this", "nested", True, T)
        r = base / this if base and this else None
        rows.append((f"nested JSON, T={T} with weights: textbook / this", fmt(r) + "x" if r else "–", ">= 20x", r >= 20 if r else None))
    for w, goal in ((False, 1.5), (True, 3.0)):
        row = b.e2e.get(("this", "b64", w, 1024))
        this, comp = (row["ms"], row["beside"]) if row else (None, None)
        r = this / comp if this and comp else None
        rows.append(
            (
                f"b64, T=1024, {'with' if w else 'no'} weights: end to end / in-process compute",
                fmt(r, 2) if r else "–",
                f"<= {goal}",
                r <= goal if r else None,
            )
        )
    tb, this = b.compute.get(("textbook numpy", 1024)), b.compute.get(("this, weights", 1024))
    r = tb / this if tb and this else None
    rows.append(
        ("compute, T=1024, textbook numpy / this (both returning weights)", fmt(r) + "x" if r else "–", ">= 3.5x", r >= 3.5 if r else None)
    )
    tb_nw = b.compute.get(("this, no weights", 1024))
    if tb and tb_nw:
        rows.append(("compute, T=1024, textbook numpy / this without weights (for reference)", fmt(tb / tb_nw) + "x", "", True))
    ratios = [
        b.compute[("this beside torch", T)] / b.compute[("torch SDPA", T)]
        for T in b.args.sizes
        if T >= 256 and ("torch SDPA", T) in b.compute
    ]
    worst = max(ratios) if ratios else None
    rows.append(
        (
            "compute, no weights, causal, T=256..4096: this / torch SDPA (worst T)",
            fmt(worst, 2) if worst else "–",
            "<= 1.5",
            worst <= 1.5 if worst else None,
        )
    )
    for w, goal in ((True, 2048), (False, 4096)):
        ok_T = [T for T in b.args.sizes if (e2e("this", "b64", w, T) or math.inf) <= 1000]
        best = max(ok_T) if ok_T else None
        rows.append(
            (
                f"largest T within 1 s (b64, concurrency 1), {'with' if w else 'without'} weights",
                str(best) if best else "–",
                f">= {goal}",
                best >= goal if best else None,
            )
        )
    mem = [m["peak"] / m["raw"] for m in b.memory if m["service"] == "this"]
    worst_mem = max(mem) if mem else None
    rows.append(
        (
            "peak worker memory for one request / raw bytes of its tensors (b64, worst measured)",
            fmt(worst_mem, 2) if worst_mem else "–",
            "<= 2",
            worst_mem <= 2 if worst_mem else None,
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    parser.add_argument("--max-t", type=int, default=4096, help="largest T (default 4096)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the textbook service")
    parser.add_argument("--reps", type=int, default=7, help="requests per cell at most (default 7)")
    args = parser.parse_args()
    args.sizes = [T for T in T_ALL if T <= args.max_t]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started here on the way out

    b = Bench(args)
    blas = [
        f"{i['internal_api']} {i.get('version')} {i.get('architecture')} ({i['num_threads']} threads by default)" for i in threadpool_info()
    ]
    load = os.getloadavg()
    env_note = [
        f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}, BLAS: {'; '.join(blas)}",
        f"load average at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (other work on the machine makes absolute times noisy: read the ratios)",
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}, OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', 'unset')}",
    ]
    argv = {
        "this": [sys.executable, "-m", "service"],
        "textbook": [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            "127.0.0.1:{port}",
            "--workers",
            "1",
            "--timeout",
            "300",
            "--log-level",
            "warning",
            "bench.baseline_service:app",
        ],
    }
    envs = {
        "this": {"ATTN_WARMUP": "false", "ATTN_MAX_BODY_BYTES": str(BODY_LIMIT), "ATTN_MAX_INFLIGHT_BYTES": str(2 << 30)},
        "textbook": {},
    }
    servers = {name: Server(name, argv[name], envs[name]) for name in (("this",) if args.no_baseline else ("this", "textbook"))}
    try:
        for s in servers.values():
            s.wait_ready()
        print("compute in-process ...", flush=True)
        torch_times, torch_note = torch_compute([T for T in args.sizes])
        b.run_compute(torch_times)
        clients = {name: Client(s.port) for name, s in servers.items()}
        print("this service ...", flush=True)
        this, c = servers["this"], clients["this"]
        for encoding in ("b64", "nested"):
            for weights in (False, True):
                for T in args.sizes:
                    if weights and T > MAX_WEIGHTS_T:
                        continue
                    slow = encoding == "nested" and T >= 2048
                    b.run_cell(this, c, encoding, weights, T, 3 if slow else args.reps, 8 if slow else 6)
        if "textbook" in servers:
            print("textbook service ...", flush=True)
            base, c = servers["textbook"], clients["textbook"]
            for T in (256, 1024):  # the goal cells first, then the rest of the sweep
                if T in args.sizes:
                    b.run_cell(base, c, "nested", True, T, 3, 60)
            for encoding in ("b64", "nested"):
                for weights in (False, True):
                    for T in [T for T in args.sizes if T <= T_BASELINE_MAX]:
                        if ("textbook", encoding, weights, T) not in b.e2e:
                            b.run_cell(base, c, encoding, weights, T, 3 if T >= 512 else 5, 30)
    finally:
        for s in servers.values():
            s.stop()
    print("memory ...", flush=True)
    for T, w in ((1024, False), (1024, True), (2048, True), (4096, False)):
        if T in args.sizes:
            b.run_memory("this", argv["this"], envs["this"], "b64", w, T)
    if not args.no_baseline and 1024 in args.sizes:
        b.run_memory("textbook", argv["textbook"], envs["textbook"], "b64", True, 1024)
    text = report(b, torch_note, env_note)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.md").write_text(text)
    print()
    print(text)
    print(f"written to {OUT / 'results.md'} in {time.monotonic() - b.t_start:.0f} s")


if __name__ == "__main__":
    main()
