"""What the scenarios share: a server started for a measurement, request bodies, timing side by
side, medians and markdown tables. The scenarios speak HTTP with `requests` (as users do) or the
project's client; only the hostile ones write raw bytes on purpose."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson
import pybase64
import requests

from attention_client.loadtest.transport import parse_server_timing

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
H, D = 8, 64  # every scenario's heads and head size unless it says otherwise
GIGABIT = 125e6  # bytes per second of a gigabit link


# --- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop proc: SIGTERM, up to grace_s for it to exit, then SIGKILL; nothing if it has exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """A gunicorn master started here on a free loopback port; its workers are its children.
    argv may name the port as "{port}"; HOST and PORT are set in its environment, and
    PROMETHEUS_MULTIPROC_DIR is not inherited (each server keeps its own metrics); nor are ATTN_*
    settings if inherit_settings is false (the defaults, as `make run` in a clean shell). cwd is
    the checkout it serves. A context manager: started ready, stopped on leaving."""

    def __init__(self, name: str, argv: list[str] | None = None, env: dict | None = None, cwd: Path = ROOT, inherit_settings: bool = True):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        inherited = {
            k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR" and (inherit_settings or not k.startswith("ATTN_"))
        }
        full_env = {**inherited, "HOST": "127.0.0.1", "PORT": str(self.port), **(env or {})}
        argv = [a.replace("{port}", str(self.port)) for a in (argv or [sys.executable, "-m", "service"])]
        self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 90, in_a_row: int = 1, path: str = "/readyz") -> None:
        """Wait until path (GET) answers 200 in_a_row times running, each on a new connection (each
        worker warms up on its own: many in a row reach them all). The timeout only stops a hang;
        either failure says so with the tail of the server's log."""
        deadline, ok = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready; its log ends:\n{self.log_tail()}"
                )
            try:
                ok = ok + 1 if requests.get(self.url + path, timeout=2).status_code == 200 else 0  # a new connection each time
            except requests.RequestException:
                ok = 0
            if ok >= in_a_row:
                return
            if not ok:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s ({self.url}{path}); its log ends:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def workers(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def stop(self) -> None:
        """SIGTERM, and time for gunicorn's 30 s graceful shutdown; then SIGKILL. The log file goes too."""
        terminate(self.proc, 35)
        Path(self.log.name).unlink(missing_ok=True)


@contextlib.contextmanager
def served(url: str | None, name: str = "service", in_a_row: int = 4, env: dict | None = None) -> Iterator[str]:
    """The server at url, or one started here as `make run` starts it (with env; in_a_row:
    readiness checks in a row, to warm its workers), for the block: its URL."""
    if url:
        yield url.rstrip("/")
        return
    with Server(name, env=env) as server:
        server.wait_ready(in_a_row=in_a_row)
        yield server.url


def status_kb(pid: int | str, field: str) -> int:
    """A /proc/PID/status figure in kB (VmRSS, VmHWM); pid may be "self"."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int | str) -> int:
    """Reset the process's peak RSS (VmHWM) to its RSS now (/proc/PID/clear_refs): that RSS, kB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_kb(pid, "VmRSS")


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def venv(path: Path, pip_args: Sequence[str], digest: str) -> Path:
    """The Python of a venv at path, pip-installed with pip_args; rebuilt only when digest (of
    what it holds) differs from the stamp of its last install, so a run after the first spends no
    time here."""
    python, stamp = path / "bin" / "python", path / ".requirements-sha256"
    if not (python.exists() and stamp.exists() and stamp.read_text().strip() == digest):
        print(f"building the venv {path} (a few minutes, once)", file=sys.stderr, flush=True)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *pip_args], check=True)
        stamp.write_text(digest + "\n")
    return python


def publish(name: str, text: str) -> None:
    """Print a scenario's report, and keep it in bench/out/name (not in git)."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(text)
    print(f"\n{text}\nwritten to bench/out/{name}", flush=True)


# --- requests ----------------------------------------------------------------------------------


def tensors(T: int, seed: int = 0, B: int = 1, h: int = H, d: int = D) -> list[np.ndarray]:
    """q, k, v of shape (B, h, T, d), float32, standard normal."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, h, T, d)).astype(np.float32) for _ in range(3)]


def b64(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "dtype": str(a.dtype), "b64": pybase64.b64encode(np.ascontiguousarray(a).data).decode()}


def unb64(t: dict) -> np.ndarray:
    """A b64 tensor of an answer ({"shape", "dtype", "b64"}) -> its array (a view of the bytes)."""
    return np.frombuffer(pybase64.b64decode(t["b64"]), dtype=t["dtype"]).reshape(t["shape"])


def attention_body(T: int, encoding: str = "b64", weights: bool = False, seed: int = 0, h: int = H, d: int = D, **options) -> bytes:
    """A POST /attention body, causal: q, k, v of (1, h, T, d) in encoding (b64 or nested; the
    answer comes in the same), with or without weights, and any other options."""
    q, k, v = tensors(T, seed, h=h, d=d)
    doc: dict = {"causal": True, "return_weights": weights, **options}
    if encoding == "b64":
        doc.update(q=b64(q), k=b64(k), v=b64(v))
    else:
        doc.update(q=q, k=k, v=v)
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


class NativeClient:
    """POST /attention with the native door's b64 JSON body (pybase64, orjson), through a
    requests.Session as it comes: its default headers (Accept-Encoding: gzip, deflate), as users
    call a server with requests."""

    def __init__(self, port: int):
        self.url, self.session = f"http://127.0.0.1:{port}/attention", requests.Session()

    def infer(self, qkv: dict, weights: bool) -> dict[str, np.ndarray]:
        body = orjson.dumps({**{name: b64(a) for name, a in qkv.items()}, "causal": True, "return_weights": weights})
        resp = self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}, timeout=600)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.content[:300]!r}")
        doc = orjson.loads(resp.content)
        names = ("out", "weights") if weights else ("out",)
        return {n: unb64(doc[n]) for n in names}

    def close(self) -> None:
        self.session.close()


class Answer(NamedTuple):
    """One answer a closed-loop client got."""

    deadline: float | None  # the X-Deadline-Ms it sent
    status: int | str  # the exception's name where there was no answer
    ms: float  # the client's: request sent to answer read
    server_ms: float | None  # Server-Timing's total
    reason: str | None  # a refusal's code and message, numbers blanked (alike ones count together)
    retry_after: bool


def refusal(r: requests.Response) -> str:
    """A refusal's status, code and message, its numbers blanked."""
    try:
        error = r.json()["error"]
    except ValueError:
        return f"{r.status_code} (not JSON)"
    code, message = (error.get("code"), error.get("message", "")) if isinstance(error, dict) else (r.headers.get("X-Error-Code"), error)
    return f"{r.status_code} {code}: {re.sub(r'[0-9][0-9.e+]*', '#', message)[:160]}"


def burst(url: str, body: bytes, n: int) -> list[tuple[int | str, str | None]]:
    """n POST /attention of body at once, each on its own connection: (status, refusal or None)
    each, the exception's name for a status where there was no answer."""

    def one(_) -> tuple[int | str, str | None]:
        try:
            r = requests.post(f"{url}/attention", data=body, headers={"Content-Type": "application/json"}, timeout=120)
        except requests.RequestException as exc:
            return type(exc).__name__, None
        return r.status_code, None if r.status_code == 200 else refusal(r)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def closed_loops(url: str, body: bytes, clients: int, seconds: float, deadlines: Sequence[float] = ()) -> list[Answer]:
    """clients threads POST body to url/attention back to back for seconds, each on a keep-alive
    session of its own, the next request sent as soon as an answer is read (refusals included);
    client i sends X-Deadline-Ms deadlines[i % len(deadlines)], none if there are none."""
    answers: list[Answer] = []
    lock, stop = threading.Lock(), time.monotonic() + seconds

    def loop(deadline: float | None) -> None:
        headers = {"Content-Type": "application/json", **({"X-Deadline-Ms": f"{deadline:g}"} if deadline else {})}
        with requests.Session() as session:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    r = session.post(f"{url}/attention", data=body, headers=headers, timeout=120)
                    total = parse_server_timing(r.headers.get("Server-Timing")).get("total")
                    why = None if r.status_code == 200 else refusal(r)
                    answer = Answer(deadline, r.status_code, (time.perf_counter() - t0) * 1000, total, why, "Retry-After" in r.headers)
                except requests.RequestException as exc:
                    answer = Answer(deadline, type(exc).__name__, (time.perf_counter() - t0) * 1000, None, None, False)
                with lock:
                    answers.append(answer)

    threads = [threading.Thread(target=loop, args=(deadlines[i % len(deadlines)] if deadlines else None,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def summary(answers: Sequence[Answer], deadline: float | None = None) -> dict:
    """Closed loops' answers: statuses; the 200s, on time (read whole within 1.25x the deadline),
    late, their p50 and p99 ms, the client's time past the server's (the answer's sending), and
    those whose Server-Timing total is over the deadline; the 503s with Retry-After; the refusals
    (numbers blanked), their p50 ms as the client and the server saw them."""
    ok = sorted(a.ms for a in answers if a.status == 200)
    bound = 1.25 * deadline if deadline else math.inf
    sent = [a.ms - a.server_ms for a in answers if a.status == 200 and a.server_ms is not None]
    refused = [a for a in answers if a.status != 200 and a.reason is not None]
    served_ms = [a.server_ms for a in refused if a.server_ms is not None]
    return {
        "deadline_ms": deadline,
        "statuses": {str(k): n for k, n in Counter(a.status for a in answers).items()},
        "answers": len(ok),
        "on_time": sum(ms <= bound for ms in ok),
        "late_200": sum(ms > bound for ms in ok),
        "p50_ms": round(statistics.median(ok), 1) if ok else None,
        "p99_ms": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 1) if ok else None,
        "client_past_server_p50_ms": round(statistics.median(sent), 1) if sent else None,
        "200_over_deadline_server_time": sum(1 for a in answers if a.status == 200 and deadline and (a.server_ms or 0) > deadline),
        "503_with_retry_after": sum(a.status == 503 and a.retry_after for a in answers),
        "refusals": dict(Counter(a.reason for a in refused)),
        "refusal_p50_ms": round(statistics.median(a.ms for a in refused)) if refused else None,
        "refusal_server_p50_ms": round(statistics.median(served_ms)) if served_ms else None,
    }


def triton_inputs(arrays: dict[str, np.ndarray], binary: bool = True) -> list:
    """tritonclient.http's InferInputs of FP32 arrays by name, as a Triton user sets them."""
    import tritonclient.http as triton

    inputs = [triton.InferInput(name, list(a.shape), "FP32") for name, a in arrays.items()]
    for tensor, a in zip(inputs, arrays.values(), strict=True):
        tensor.set_data_from_numpy(a, binary_data=binary)
    return inputs


# --- timing and tables ---------------------------------------------------------------------------


def alternate(calls: Sequence[Callable[[], object]], reps: int) -> list[list[float]]:
    """Each call reps times, in turns: ms per call, one list per call. Sides measured this way see
    the same load. The order is rotated every round and reversed every other round, so that no call
    always follows the same one (rotation alone keeps each call's predecessor: with three, the first
    followed the third in every round, and what the third left behind was counted to the first)."""
    times: list[list[float]] = [[] for _ in calls]
    n = len(calls)
    for r in range(reps):
        order = list(range(n)) if r % 2 == 0 else list(range(n))[::-1]
        for i in (order * 2)[r % n : r % n + n]:
            t0 = time.perf_counter()
            calls[i]()
            times[i].append((time.perf_counter() - t0) * 1000)
    return times


def table(header: str | Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (header: its cells, or one string of them between " | "); floats with 2
    decimals below 10, 1 below 100, none above."""
    if isinstance(header, str):
        header = header.split(" | ")

    def cell(x: object) -> str:
        if isinstance(x, float):
            return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
