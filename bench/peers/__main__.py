"""This service against KServe's Python model server and MLServer, serving the same attention.

    make bench-peers                                   # = python -m bench.peers (about 4 minutes)
    python -m bench.peers --runs 5 --duration 2        # a quicker, noisier run
    python -m bench.peers --only ours,kserve           # a subset

Starts the three servers on free loopback ports, each as its users would run it:

- ours: `python -m service` (as `make run`: deploy/gunicorn.conf.py, 2 gthread workers);
- kserve: bench/peers/kserve_model.py, a kserve.Model on KServe's ModelServer, `--workers 2`
  (uvicorn worker processes), gRPC off (only REST is measured);
- mlserver: `mlserver start bench/peers/mlserver`, a custom MLModel runtime, `parallel_workers`
  2 (one HTTP process hands each request to one of two inference processes);

all computing with this repository's service.core and one BLAS thread per worker process. Then,
with tritonclient.http (the Open Inference Protocol's client), end to end from numpy arrays to
numpy arrays, q, k, v (1, 8, T, 64) float32, causal:

- latency at T = 64, 256, 1024, with and without weights (the request names its outputs), one
  request at a time, the servers alternating within each repetition (order rotated), median;
  --runs repetitions at T=64, fewer at 256 and 1024, and a cell stops early (after 3) once it
  has taken --cell-budget seconds, so that a slow peer on a loaded machine cannot stretch the run;
- throughput at T = 64 without weights: --clients threads, each with its own client, for
  --duration seconds per server, --rounds rounds alternating, median of the rounds' req/s.

Binary tensors both ways where the server speaks the binary extension (ours, KServe); JSON for
MLServer, whose REST server refuses binary bodies. Every server's outputs are checked against the
core computed here before anything is timed. Writes the tables to bench/out/peers.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.http as triton

from bench.peers import venvs
from bench.server import ROOT, Server, free_port
from service import core

HERE = Path(__file__).resolve().parent
OUT = ROOT / "bench" / "out" / "peers.md"
B, H, D = 1, 8, 64
LENGTHS = (64, 256, 1024)
BLAS_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Peer(Server):
    """A server of this benchmark: ready when /v2/health/ready answers 200 (all three speak it);
    a failure to start says so with the tail of its log."""

    def wait_ready(self, timeout: float = 120, in_a_row: int = 4, path: str = "/v2/health/ready") -> None:
        super().wait_ready(timeout, in_a_row, path)

    def stop(self) -> None:
        """SIGTERM and wait (Server.stop), then SIGKILL whatever is left of its process group
        (start_new_session made it the group's leader): no worker outlives the run."""
        super().stop()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Target:
    name: str
    server: Peer
    binary: bool  # the binary tensor extension both ways, else JSON
    workers: str  # how it computes in parallel, for the report
    versions: str
    latency: dict = field(default_factory=dict)  # (T, weights) -> [ms]
    rounds: list = field(default_factory=list)  # req/s per throughput round
    errors: int = 0  # failed requests in the throughput rounds
    first_error: str = ""

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(f"127.0.0.1:{self.server.port}", connection_timeout=60, network_timeout=600)


def versions(python: Path, *packages: str) -> str:
    code = "import importlib.metadata as m, sys; print(' '.join(p + ' ' + m.version(p) for p in sys.argv[1:]))"
    return subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True).stdout.strip()


def start(only: list[str], targets: list[Target]) -> None:
    """Start the chosen servers into `targets` (all at once: each loads while the others do; the
    caller stops them, also those started before one failed), and wait until each is ready."""
    if "ours" in only:
        ours = Peer("ours", [sys.executable, "-m", "service"], inherit_settings=False)
        targets.append(
            Target("ours", ours, True, "2 gunicorn gthread workers", f"this service, numpy {importlib.metadata.version('numpy')}")
        )
    if "kserve" in only:
        python = venvs.ensure("kserve")
        argv = [str(python), str(HERE / "kserve_model.py"), "--http_port", "{port}", "--workers", "2", "--enable_grpc", "false"]
        server = Peer("kserve", argv, env={"PYTHONPATH": str(ROOT), **BLAS_ONE_THREAD})
        targets.append(Target("kserve", server, True, "2 uvicorn worker processes (--workers 2)", versions(python, "kserve", "numpy")))
    if "mlserver" in only:
        python = venvs.ensure("mlserver")
        run_dir = venvs.peers_dir() / "mlserver-run"  # MLServer writes .metrics/ and .envs/ into its working directory
        run_dir.mkdir(parents=True, exist_ok=True)
        ports = {f"MLSERVER_{kind}_PORT": str(free_port()) for kind in ("GRPC", "METRICS")}
        argv = ["env", "MLSERVER_HTTP_PORT={port}", str(python.parent / "mlserver"), "start", str(HERE / "mlserver")]
        server = Peer("mlserver", argv, env={"PYTHONPATH": str(ROOT), **BLAS_ONE_THREAD, **ports}, cwd=run_dir)
        targets.append(
            Target(
                "mlserver",
                server,
                False,
                "1 HTTP process + 2 inference processes (parallel_workers 2)",
                versions(python, "mlserver", "numpy"),
            )
        )
    for t in targets:
        t.server.wait_ready()


def arrays(T: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((B, H, T, D), dtype=np.float32) for name in ("q", "k", "v")}


def infer(client: triton.InferenceServerClient, binary: bool, qkv: dict, weights: bool) -> dict[str, np.ndarray]:
    """One request, numpy to numpy: encode the inputs, infer, decode the outputs."""
    inputs = []
    for name, a in qkv.items():
        tensor = triton.InferInput(name, list(a.shape), "FP32")
        tensor.set_data_from_numpy(a, binary_data=binary)
        inputs.append(tensor)
    names = ("out", "weights") if weights else ("out",)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in names]
    result = client.infer("attention", inputs, outputs=outputs, parameters={"causal": True})
    return {n: result.as_numpy(n) for n in names}


def check(targets: list[Target], clients: dict) -> None:
    """Every server answers what the core computes here (before anything is timed)."""
    qkv = arrays(64, seed=1)
    want_out, want_weights = core.attention(qkv["q"], qkv["k"], qkv["v"], causal=True)
    for t in targets:
        got = infer(clients[t.name], t.binary, qkv, weights=True)
        for name, want in (("out", want_out), ("weights", want_weights)):
            if got[name].shape != want.shape or not np.allclose(got[name], want, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"{t.name} answers a different {name} than service.core")


def latency(targets: list[Target], clients: dict, runs: int, cell_budget: float) -> None:
    """Per (T, weights): repetitions of one request to each server in turn (the order rotated, so
    nobody always goes first), after one warm-up round at each new T; a cell stops repeating
    once it has at least 3 timed rounds and has taken more than cell_budget seconds."""
    for T in LENGTHS:
        qkv = arrays(T)
        reps = {64: runs, 256: max(3, runs * 3 // 5), 1024: max(3, runs // 3)}[T]
        for weights in (False, True):
            warmup = 0 if weights else 1
            began = time.monotonic()
            for i in range(warmup + reps):
                order = targets[i % len(targets) :] + targets[: i % len(targets)]
                for t in order:
                    start = time.perf_counter()
                    infer(clients[t.name], t.binary, qkv, weights)
                    ms = (time.perf_counter() - start) * 1000
                    if i >= warmup:
                        t.latency.setdefault((T, weights), []).append(ms)
                if i + 1 - warmup >= 3 and time.monotonic() - began > cell_budget:
                    break
            n = len(targets[0].latency[T, weights])
            print(
                f"  T={T} weights={weights} ({n} runs): "
                + ", ".join(f"{t.name} {statistics.median(t.latency[T, weights]):.1f} ms" for t in targets),
                flush=True,
            )


def throughput(target: Target, clients: int, duration: float) -> float:
    """req/s of `clients` threads, each with its own client, T=64 without weights, for `duration` s.
    Each thread makes its client and connects (one request) before the clock starts: a
    tritonclient.http client belongs to the thread that made it (gevent's hub is per thread)."""
    qkv = arrays(64)
    counts = [0] * clients
    gate = threading.Barrier(clients + 1)
    deadline = [0.0]

    def attempt(client: triton.InferenceServerClient) -> bool:
        try:
            infer(client, target.binary, qkv, False)
            return True
        except Exception as e:  # a refusal or a reset is counted and shown, not fatal
            target.errors += 1
            target.first_error = target.first_error or f"{type(e).__name__}: {e}"[:300]
            return False

    def loop(i: int) -> None:
        client = target.client()
        attempt(client)  # connect
        gate.wait()
        while time.perf_counter() < deadline[0]:
            counts[i] += attempt(client)
        client.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    deadline[0] = time.perf_counter() + duration + 3600  # until the gate opens: nobody stops early
    gate.wait()
    began = time.perf_counter()
    deadline[0] = began + duration
    for th in threads:
        th.join()
    return sum(counts) / (time.perf_counter() - began)


def report(targets: list[Target], args, load_start, load_end) -> str:
    names = [t.name for t in targets]
    lines = [
        f"Made by `make bench-peers` (`python -m bench.peers --runs {args.runs} --cell-budget {args.cell_budget:g} --duration {args.duration:g} --rounds {args.rounds} --clients {args.clients}`) on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; client tritonclient {importlib.metadata.version('tritonclient')} in this process",
        f"- load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}",
        f"- q, k, v (1, 8, T, 64) float32, causal; end to end numpy to numpy through tritonclient.http; medians; latency runs per cell: {', '.join(f'T={T} {len(targets[0].latency[T, False])}/{len(targets[0].latency[T, True])}' for T in LENGTHS)} (without/with weights)",
    ]
    for t in targets:
        wire = "binary tensors both ways" if t.binary else "JSON both ways (no binary extension on its REST server)"
        lines.append(f"- {t.name}: {t.versions}; {t.workers}; one BLAS thread per process; {wire}")
    lines += ["", "Latency, one request at a time (ms, median; x = over ours):", ""]
    lines.append("| T | weights | " + " | ".join(names) + " |")
    lines.append("|---|---|" + "---|" * len(names))
    for T in LENGTHS:
        for weights in (False, True):
            cells = []
            base = statistics.median(targets[0].latency[T, weights]) if targets[0].name == "ours" else None
            for t in targets:
                ms = statistics.median(t.latency[T, weights])
                ratio = f" ({ms / base:.1f}x)" if base and t.name != "ours" else ""
                cells.append(f"{ms:,.1f}{ratio}")
            lines.append(f"| {T} | {'yes' if weights else 'no'} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Throughput, T=64 without weights, {args.clients} client threads (req/s, median of {args.rounds} rounds of {args.duration:g} s):",
        "",
    ]
    lines.append("| | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    lines.append("| req/s | " + " | ".join(f"{statistics.median(t.rounds):,.1f}" for t in targets) + " |")
    lines.append("| failed requests | " + " | ".join(str(t.errors) for t in targets) + " |")
    lines += [f"\nFirst failure ({t.name}): {t.first_error}" for t in targets if t.first_error]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="ours,kserve,mlserver", help="comma-separated: ours, kserve, mlserver")
    p.add_argument("--runs", type=int, default=15, help="timed repetitions at T=64 (3/5 of them at 256, 1/3 at 1024, at least 3)")
    p.add_argument("--cell-budget", type=float, default=45.0, help="seconds after which a latency cell stops repeating (at least 3 runs)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(only) - {"ours", "kserve", "mlserver"}
    if unknown:
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")

    load_start = os.getloadavg()
    targets: list[Target] = []
    try:
        print("starting " + ", ".join(only), flush=True)
        start(only, targets)
        clients = {t.name: t.client() for t in targets}
        check(targets, clients)
        print("latency (median so far):", flush=True)
        latency(targets, clients, args.runs, args.cell_budget)
        print("throughput:", flush=True)
        for r in range(args.rounds):
            for t in targets[r % len(targets) :] + targets[: r % len(targets)]:
                t.rounds.append(throughput(t, args.clients, args.duration))
            print(f"  round {r + 1}: " + ", ".join(f"{t.name} {t.rounds[-1]:.1f} req/s" for t in targets), flush=True)
        for c in clients.values():
            c.close()
    except BaseException:
        for t in targets:
            print(f"{t.name}'s log: {t.server.log.name}", file=sys.stderr)
        raise
    finally:
        for t in targets:
            t.server.stop()
    for t in targets:  # a clean run keeps no server logs
        Path(t.server.log.name).unlink(missing_ok=True)
    text = report(targets, args, load_start, os.getloadavg())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print()
    print(text)
    print(f"written to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
