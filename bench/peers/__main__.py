"""`make bench-peers` (`python -m bench peers`): this service against the servers a user would pick
instead, serving the same attention (bench/peers/: each peer's model and pinned requirements).

    python -m bench peers --lengths 64,256,1024 --runs 15   # more cells, more repetitions
    python -m bench peers --only ours,bentoml               # a subset

Each server starts on a free loopback port as its users run it, two processes computing, one BLAS
thread each, every socket checked to be on loopback (ss, after start and at the end). ours is
measured at both doors; KServe (/v2 binary) and MLServer (/v2 JSON) through tritonclient.http;
LitServe, Ray Serve and BentoML are sent the native door's b64 JSON body (b64_body.py), through a
requests.Session with its default headers, as ours is. Numpy to numpy, q, k, v (1, 8, T, 64),
causal, every answer checked against the core first. Latency: one request at a time, the servers
in turn (order rotated), medians, a cell stopped after --cell-budget s (at least 3 runs).
Throughput: T=64 without weights, --clients threads for --duration s, --rounds rounds alternating,
with the server's and the clients' CPU per request (/proc). Writes bench/out/peers.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import ipaddress
import os
import platform
import re
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

from bench.common import ROOT, NativeClient, Server, free_port, publish, table, triton_inputs, venv
from service import core
from service.config import ONE_BLAS_THREAD

HERE = Path(__file__).resolve().parent
B, H, D = 1, 8, 64
LENGTHS = (64, 1024)
SERVERS = ("ours", "kserve", "mlserver", "litserve", "rayserve", "bentoml")
NATIVE, V2_BINARY, V2_JSON = "native", "v2 binary", "v2 JSON"
WIRES = {
    NATIVE: "b64 JSON at POST /attention",
    V2_BINARY: "/v2 binary tensors both ways",
    V2_JSON: "/v2 JSON both ways (no binary extension on its REST server)",
}


def peers_dir() -> Path:
    """Where the peers' venvs and working directories are: $BENCH_PEERS_DIR, else .peers/ (gitignored)."""
    return Path(os.environ.get("BENCH_PEERS_DIR") or ROOT / ".peers")


def ensure(name: str) -> Path:
    """The Python of peer name's venv (bench/peers/requirements-NAME.txt), built, or rebuilt when
    the requirements changed since its last install (a stamp holds their hash)."""
    requirements = HERE / f"requirements-{name}.txt"
    return venv(peers_dir() / name, ["-r", str(requirements)], hashlib.sha256(requirements.read_bytes()).hexdigest())


def process_table() -> dict[int, tuple[int, int, int, int]]:
    """{pid: (parent pid, session, CPU clock ticks so far (utime + stime), start time)} from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2 :].split()  # fields 3 (state) on: f[i] is field i + 3
            table[int(entry.name)] = (int(f[1]), int(f[3]), int(f[11]) + int(f[12]), int(f[19]))
    return table


class Peer(Server):
    """A server of this benchmark, ready when `ready_path` answers 200; a failure to start says so
    with the tail of its log. Its processes are the leader's descendants and its session's."""

    def __init__(self, name: str, argv: list[str], ready_path: str = "/v2/health/ready", **kwargs):
        super().__init__(name, argv, **kwargs)
        self.ready_path = ready_path

    def wait_ready(self, timeout: float = 180, in_a_row: int = 4, path: str | None = None) -> None:
        super().wait_ready(timeout, in_a_row, path or self.ready_path)

    def processes(self) -> dict[int, tuple[int, int, int, int]]:
        """process_table()'s rows of this server's processes."""
        table, leader = process_table(), self.proc.pid
        members, grew = {leader}, True
        while grew:
            more = {pid for pid, (ppid, session, _, _) in table.items() if ppid in members or session == leader} - members
            members |= more
            grew = bool(more)
        return {pid: table[pid] for pid in members if pid in table}

    def cpu_seconds(self) -> float:
        return sum(row[2] for row in self.processes().values()) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM and wait (Server.stop), then SIGKILL whatever is left of its processes (the same
        pid and start time: never a process that took a pid freed meanwhile): no worker or
        daemon outlives the run."""
        started = {pid: row[3] for pid, row in self.processes().items()}
        super().stop()
        now = process_table()
        for pid, start in started.items():
            if pid in now and now[pid][3] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


class V2Client:
    """tritonclient.http at /v2/models/attention/infer, numpy to numpy."""

    def __init__(self, port: int, binary: bool):
        self.http = triton.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=60, network_timeout=600)
        self.binary = binary

    def infer(self, qkv: dict, weights: bool) -> dict[str, np.ndarray]:
        inputs = triton_inputs(qkv, self.binary)
        names = ("out", "weights") if weights else ("out",)
        outputs = [triton.InferRequestedOutput(n, binary_data=self.binary) for n in names]
        result = self.http.infer("attention", inputs, outputs=outputs, parameters={"causal": True})
        return {n: result.as_numpy(n) for n in names}

    def close(self) -> None:
        self.http.close()


@dataclass
class Target:
    name: str
    server: Peer
    wire: str  # NATIVE, V2_BINARY or V2_JSON
    workers: str  # how it computes in parallel, for the report
    versions: str
    latency: dict = field(default_factory=dict)  # (T, weights) -> [ms]
    rounds: list = field(default_factory=list)  # req/s per throughput round
    cpu_ms: list = field(default_factory=list)  # the server's CPU ms per request, per round
    client_cpu_ms: list = field(default_factory=list)  # this process's (the clients'), likewise
    errors: int = 0  # failed requests in the throughput rounds
    first_error: str = ""

    def client(self) -> V2Client | NativeClient:
        return NativeClient(self.server.port) if self.wire == NATIVE else V2Client(self.server.port, self.wire == V2_BINARY)


def versions(python: Path, *packages: str) -> str:
    code = "import importlib.metadata as m, sys; print(' '.join(p + ' ' + m.version(p) for p in sys.argv[1:]))"
    return subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True).stdout.strip()


def run_dir(name: str) -> Path:
    """A working directory of the peer's own, for what it writes there (MLServer's .metrics/, BentoML's home)."""
    path = peers_dir() / f"{name}-run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def start(only: list[str], targets: list[Target]) -> None:
    """Start the chosen servers into `targets` (all at once: each loads while the others do; the
    caller stops them, also those started before one failed), and wait until each is ready."""
    peer_env = {"PYTHONPATH": str(ROOT), **ONE_BLAS_THREAD}
    if "ours" in only:
        ours = Peer("ours", [sys.executable, "-m", "service"], "/readyz", inherit_settings=False)
        mine = f"this service, numpy {importlib.metadata.version('numpy')}"
        targets.append(Target("ours", ours, NATIVE, "2 gunicorn gthread workers", mine))
        targets.append(Target("ours /v2", ours, V2_BINARY, "the same server", mine))
    if "kserve" in only:
        python = ensure("kserve")
        argv = [str(python), str(HERE / "kserve_model.py"), "--http_port", "{port}", "--workers", "2", "--enable_grpc", "false"]
        server = Peer("kserve", argv, env=peer_env)
        targets.append(Target("kserve", server, V2_BINARY, "2 uvicorn worker processes (--workers 2)", versions(python, "kserve", "numpy")))
    if "mlserver" in only:
        python = ensure("mlserver")
        ports = {f"MLSERVER_{kind}_PORT": str(free_port()) for kind in ("GRPC", "METRICS")}
        argv = ["env", "MLSERVER_HTTP_PORT={port}", str(python.parent / "mlserver"), "start", str(HERE / "mlserver")]
        server = Peer("mlserver", argv, env={**peer_env, **ports}, cwd=run_dir("mlserver"))
        workers = "1 HTTP process + 2 inference processes (parallel_workers 2)"
        targets.append(Target("mlserver", server, V2_JSON, workers, versions(python, "mlserver", "numpy")))
    if "litserve" in only:
        python = ensure("litserve")
        server = Peer(
            "litserve", [str(python), str(HERE / "litserve_model.py"), "{port}"], "/health", env=peer_env, cwd=run_dir("litserve")
        )
        workers = "1 API server process + 2 inference workers (workers_per_device 2)"
        targets.append(Target("litserve", server, NATIVE, workers, versions(python, "litserve", "numpy")))
    if "rayserve" in only:
        python = ensure("rayserve")
        # The node's address as 127.0.0.1 (Ray's agents bind to it) and no usage reporting.
        ray_env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        argv = [str(python), str(HERE / "rayserve_model.py"), "{port}"]
        server = Peer("rayserve", argv, "/attention", env={**peer_env, **ray_env}, cwd=run_dir("rayserve"))
        workers = "Serve's HTTP proxy + 2 replicas (num_replicas 2)"
        targets.append(Target("rayserve", server, NATIVE, workers, versions(python, "ray", "numpy")))
    if "bentoml" in only:
        python = ensure("bentoml")
        home = run_dir("bentoml")
        argv = [str(python.parent / "bentoml"), "serve", "bentoml_service:Attention", "--working-dir", str(HERE)]
        argv += ["--host", "127.0.0.1", "--port", "{port}"]
        env = {**peer_env, "BENTOML_DO_NOT_TRACK": "1", "BENTOML_HOME": str(home)}
        server = Peer("bentoml", argv, "/readyz", env=env, cwd=home)
        targets.append(Target("bentoml", server, NATIVE, "2 worker processes (workers=2)", versions(python, "bentoml", "numpy")))
    for server in servers(targets):
        server.wait_ready()


def servers(targets: list[Target]) -> list[Peer]:
    """The distinct servers behind the targets (ours serves two)."""
    return list({id(t.server): t.server for t in targets}.values())


def loopback(address: str) -> bool:
    """Whether an ss address ("127.0.0.1:80", "[::ffff:127.0.0.1]:80", "*:80", "[::1]:80") is loopback."""
    host = address.rsplit(":", 1)[0].strip("[]").split("%")[0]
    if host == "*":
        return False
    ip = ipaddress.ip_address(host)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def check_loopback(targets: list[Target]) -> int:
    """Every TCP and UDP socket of every server process is on loopback, both ends (ss); raises
    naming those that are not. Returns how many sockets were checked."""
    pids = {pid: s.name for s in servers(targets) for pid in s.processes()}
    lines = subprocess.run(["ss", "-tunapH"], capture_output=True, text=True, check=True).stdout.splitlines()
    checked, outside = 0, []
    for line in lines:
        cols = line.split()
        owners = {pids[int(p)] for p in re.findall(r"pid=(\d+)", line) if int(p) in pids}
        if not owners or len(cols) < 6:
            continue
        local, remote = cols[4], cols[5]
        checked += 1
        if not loopback(local) or not (remote.endswith(":*") or loopback(remote)):
            outside.append(f"{', '.join(sorted(owners))}: {line.strip()}")
    if outside:
        raise RuntimeError("sockets off loopback (leave that server out with --only):\n" + "\n".join(outside))
    return checked


def arrays(T: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((B, H, T, D), dtype=np.float32) for name in ("q", "k", "v")}


def check(targets: list[Target], clients: dict) -> None:
    """Every server answers what the core computes here (before anything is timed)."""
    qkv = arrays(64, seed=1)
    want_out, want_weights = core.attention(qkv["q"], qkv["k"], qkv["v"], causal=True)
    for t in targets:
        got = clients[t.name].infer(qkv, weights=True)
        for name, want in (("out", want_out), ("weights", want_weights)):
            if got[name].shape != want.shape or not np.allclose(got[name], want, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"{t.name} answers a different {name} than service.core")


def latency(targets: list[Target], clients: dict, lengths: list[int], runs: int, cell_budget: float) -> None:
    """Per (T, weights): repetitions of one request to each server in turn (the order rotated, so
    nobody always goes first), after one warm-up round at each new T; a cell stops repeating
    once it has at least 3 timed rounds and has taken more than cell_budget seconds."""
    for T in lengths:
        qkv = arrays(T)
        reps = {64: runs, 256: max(3, runs * 3 // 5)}.get(T, max(3, runs // 3))
        for weights in (False, True):
            warmup = 0 if weights else 1
            began = time.monotonic()
            for i in range(warmup + reps):
                order = targets[i % len(targets) :] + targets[: i % len(targets)]
                for t in order:
                    start = time.perf_counter()
                    clients[t.name].infer(qkv, weights)
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


def throughput(target: Target, clients: int, duration: float) -> None:
    """One round: `clients` threads, each with its own client, T=64 without weights, for
    `duration` s; appends the round's req/s and the server's and the clients' CPU ms per request.
    Each thread makes its client and connects (one request) before the clock starts: a
    tritonclient.http client belongs to the thread that made it (gevent's hub is per thread)."""
    qkv = arrays(64)
    counts = [0] * clients
    gate = threading.Barrier(clients + 1)
    deadline = [0.0]

    def attempt(client) -> bool:
        try:
            client.infer(qkv, False)
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
    cpu, client_cpu, began = target.server.cpu_seconds(), time.process_time(), time.perf_counter()
    deadline[0] = began + duration
    for th in threads:
        th.join()
    elapsed, cpu, client_cpu = time.perf_counter() - began, target.server.cpu_seconds() - cpu, time.process_time() - client_cpu
    done = max(1, sum(counts))
    target.rounds.append(sum(counts) / elapsed)
    target.cpu_ms.append(cpu * 1000 / done)
    target.client_cpu_ms.append(client_cpu * 1000 / done)


def report(targets: list[Target], args, lengths: list[int], sockets: int) -> str:
    names = [t.name for t in targets]
    base = targets[0] if targets[0].name == "ours" else None
    command = (
        f"python -m bench peers --lengths {','.join(map(str, lengths))} --runs {args.runs} --cell-budget {args.cell_budget:g}"
        f" --duration {args.duration:g} --rounds {args.rounds} --clients {args.clients}"
    )
    lines = [
        f"Made by `{command}`.",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; client tritonclient {importlib.metadata.version('tritonclient')} (/v2) or a requests.Session with its default headers (Accept-Encoding: gzip, deflate) sending orjson and pybase64 b64 JSON, in this process",
        f"- q, k, v (1, 8, T, 64) float32, causal; end to end numpy to numpy; medians; latency runs per cell: {', '.join(f'T={T} {len(targets[0].latency[T, False])}/{len(targets[0].latency[T, True])}' for T in lengths)} (without/with weights)",
        f"- every socket of every server process on loopback: {sockets} checked with ss, after start and at the end",
    ]
    for t in targets:
        lines.append(f"- {t.name}: {t.versions}; {t.workers}; one BLAS thread per process; {WIRES[t.wire]}")
    over = " (x = over ours, the native door)" if base else ""
    lines += ["", f"Latency, one request at a time (ms, median{over}):", ""]
    rows = []
    for T in lengths:
        for weights in (False, True):
            ms = {t.name: statistics.median(t.latency[T, weights]) for t in targets}
            cells = [f"{ms[t.name]:,.1f}" + (f" ({ms[t.name] / ms[base.name]:.1f}x)" if base and t is not base else "") for t in targets]
            rows.append([T, "yes" if weights else "no", *cells])
    lines += [table(["T", "weights", *names], rows), ""]
    lines += [
        f"Throughput, T=64 without weights, {args.clients} client threads (median of {args.rounds} passes of {args.duration:g} s):",
        "",
    ]
    rows = [["req/s", *(f"{statistics.median(t.rounds):,.1f}" for t in targets)]]
    if base:
        lead = [f"{statistics.median(base.rounds) / statistics.median(t.rounds):.2f}x" for t in targets[1:]]
        rows.append(["the native door's lead", "", *lead])
    rows.append(["server CPU ms per request", *(f"{statistics.median(t.cpu_ms):.2f}" for t in targets)])
    rows.append(["client CPU ms per request", *(f"{statistics.median(t.client_cpu_ms):.2f}" for t in targets)])
    rows.append(["failed requests", *(t.errors for t in targets)])
    lines.append(table(["", *names], rows))
    lines += [f"\nFirst failure ({t.name}): {t.first_error}" for t in targets if t.first_error]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SERVERS), help=f"comma-separated: {', '.join(SERVERS)}")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the T of the latency cells, comma-separated")
    p.add_argument("--runs", type=int, default=9, help="timed repetitions at T=64 (3/5 of them at 256, 1/3 beyond, at least 3)")
    p.add_argument("--cell-budget", type=float, default=30.0, help="seconds after which a latency cell stops repeating (at least 3 runs)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(only) - set(SERVERS)
    if unknown:
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]

    targets: list[Target] = []
    try:
        print("starting " + ", ".join(only), flush=True)
        start(only, targets)
        sockets = check_loopback(targets)
        clients = {t.name: t.client() for t in targets}
        check(targets, clients)
        print("latency (median so far):", flush=True)
        latency(targets, clients, lengths, args.runs, args.cell_budget)
        print("throughput:", flush=True)
        for r in range(args.rounds):
            for t in targets[r % len(targets) :] + targets[: r % len(targets)]:
                throughput(t, args.clients, args.duration)
            print(
                f"  round {r + 1}: " + ", ".join(f"{t.name} {t.rounds[-1]:.1f} req/s, {t.cpu_ms[-1]:.2f} CPU ms" for t in targets),
                flush=True,
            )
        for c in clients.values():
            c.close()
        sockets = max(sockets, check_loopback(targets))
    except BaseException:
        for s in servers(targets):
            print(f"{s.name}'s log: {s.log.name}", file=sys.stderr)
        raise
    finally:
        for s in servers(targets):
            s.stop()
    for s in servers(targets):  # a clean run keeps no server logs
        Path(s.log.name).unlink(missing_ok=True)
    publish("peers.md", report(targets, args, lengths, sockets))


if __name__ == "__main__":
    main()
