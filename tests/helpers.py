"""Plain helpers shared by the test modules (fixtures live in conftest.py): the seed's worked
example, the three wire encodings of a tensor and their decoding, and a real server
(`python -m service`) on a free loopback port, with the waits that go with it.

Nothing here imports the service's packages at import time: a server is a subprocess, a tensor
is JSON (numeric_core() imports the core when an answer is checked against it)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import requests
from threadpoolctl import threadpool_limits

from bench.common import terminate

ROOT = Path(__file__).resolve().parent.parent

# --- the seed's worked example -----------------------------------------------------------------

Q = [[1, 0], [0, 1], [1, 1]]  # q = k, (T=3, d=2)
V = [[1, 0], [0, 10], [5, 5]]
WORKED = {"q": Q, "k": Q, "v": V, "causal": True}
# Its answer to two decimals (default scale 1/sqrt(2)); the masked weights are exactly 0.
WORKED_WEIGHTS = [[1, 0, 0], [0.33, 0.67, 0], [0.25, 0.25, 0.50]]
WORKED_OUT = [[1, 0], [0.33, 6.70], [2.77, 5]]


# --- tensors on the wire -----------------------------------------------------------------------


def b64(arr, dtype: str = "float32") -> dict:
    """{"shape", "dtype", "b64"}: arr cast to dtype, its raw little-endian bytes in base64."""
    arr = np.ascontiguousarray(arr, dtype=dtype)
    return {"shape": list(arr.shape), "dtype": dtype, "b64": base64.b64encode(arr.tobytes()).decode()}


def flat(arr) -> dict:
    """{"shape", "data"}: data row-major."""
    arr = np.asarray(arr)
    return {"shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def encoding_of(value) -> str:
    """The wire encoding a tensor is written in: "nested", "flat" or "b64"; fails on anything else."""
    if isinstance(value, list):
        return "nested"
    if isinstance(value, dict) and "b64" in value:
        assert set(value) == {"shape", "dtype", "b64"} and isinstance(value["b64"], str), value.keys()
        return "b64"
    if isinstance(value, dict) and "data" in value:
        assert set(value) <= {"shape", "dtype", "data"} and isinstance(value["data"], list), value.keys()
        return "flat"
    raise AssertionError(f"not a tensor in any wire encoding: {str(value)[:200]}")


def tensor(value) -> np.ndarray:
    """Decode a tensor in any wire encoding; nested arrays must be rectangular."""
    encoding = encoding_of(value)
    if encoding == "nested":
        arr = np.array(value)
        assert arr.dtype != object, "ragged nested array"
        return arr
    if encoding == "b64":
        return np.frombuffer(base64.b64decode(value["b64"]), dtype=value["dtype"]).reshape(value["shape"])
    return np.array(value["data"], dtype=value.get("dtype")).reshape(value["shape"])


def post(client, body, path: str = "/attention", **kwargs):
    """POST body (a dict as JSON, or bytes or str as they are) through a Flask test client."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body, allow_nan=False)  # stdlib: any int size
    kwargs.setdefault("content_type", "application/json")
    return client.post(path, data=data, **kwargs)


def big_body(T: int, weights: bool = True, seed: int = 0) -> bytes:
    """A /attention body of B=1, H=8, d=64 float32 q, k, v in b64: 8.4 MB at T=1024 (and 47 MB of
    weights back, if asked for)."""
    rng = np.random.default_rng(seed)
    doc = {name: b64(rng.standard_normal((1, 8, T, 64))) for name in ("q", "k", "v")}
    return json.dumps({**doc, "return_weights": weights}).encode()


# --- the system tools some tests need -----------------------------------------------------------

REQUIRE_TOOLS = "ATTN_REQUIRE_TOOLS"  # "1" (.ci/run sets it): a missing tool fails the test


def unavailable(reason: str) -> NoReturn:
    """A system tool a test needs (Chromium, Prometheus, a container engine) is missing and
    cannot be installed here: the test is skipped, saying why; where ATTN_REQUIRE_TOOLS=1 it fails
    instead, so that a green run has run every test."""
    if os.environ.get(REQUIRE_TOOLS) == "1":
        pytest.fail(f"{REQUIRE_TOOLS}=1, and {reason}", pytrace=False)
    pytest.skip(reason)


# --- a real server on loopback -----------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of n consecutive loopback ports nothing listens on (at the time of asking), below
    the kernel's ephemeral range, where no outgoing connection takes one meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = np.random.default_rng()
    for _ in range(200):
        first = int(rng.integers(10_000, low - n))
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1, what: str | None = None):
    """Poll predicate() until it returns a true value (returned), or fail after timeout seconds
    naming `what` (else the predicate's docstring). The timeout only stops a hang: callers wait
    for an event, never for a time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not true within {timeout} s: {what or predicate.__doc__ or predicate}")


# Each worker warms up on its own: one 200 may come from the first one ready while another still
# says 503. Many in a row, each on a new connection, reach them all.
READY_IN_A_ROW = 20


SERVER_BLAS_THREADS = 1  # the BLAS threads of each worker of a test server (start_server)


def server_blas():
    """A context in which this process's BLAS runs as a test server's workers do, so that a result
    computed here has the server's bits (threadpoolctl)."""
    return threadpool_limits(limits=SERVER_BLAS_THREADS, user_api="blas")


def start_server(env: dict | None = None, timeout: float = 120.0):
    """Start `python -m service` on a free loopback port; returns (process, base_url) once ready."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # each server its own
    # The server runs as deployed, one BLAS thread a worker (deploy/gunicorn.conf.py), whatever the
    # test process was given: tests that compare its bits compute theirs under SERVER_BLAS_THREADS.
    blas = {var: str(SERVER_BLAS_THREADS) for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    full_env = {**inherited, **blas, "HOST": "127.0.0.1", "PORT": str(port), **(env or {})}
    log = tempfile.NamedTemporaryFile(prefix="attention-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_path = log.name  # read by tests that inspect the server's log
    url = f"http://127.0.0.1:{port}"

    in_a_row = 0

    def ready():
        """the server answers /readyz with 200, READY_IN_A_ROW times on fresh connections"""
        nonlocal in_a_row
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
        try:
            ok = requests.get(f"{url}/readyz", timeout=5).status_code == 200
        except requests.RequestException:
            ok = False
        in_a_row = in_a_row + 1 if ok else 0
        return in_a_row >= READY_IN_A_ROW

    try:
        wait_until(ready, timeout=timeout)
    except AssertionError:
        stop_server(proc)
        raise RuntimeError(f"server not ready within {timeout} s: {Path(log.name).read_text()[-2000:]}") from None
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (gunicorn drains for up to 30 s), then SIGKILL; the server's log file goes with it."""
    terminate(proc, 35)
    Path(proc.log_path).unlink(missing_ok=True)


@dataclass
class Server:
    """A server started by serving(): its process, base URL, port and log file."""

    proc: subprocess.Popen
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        """Everything the server has logged so far (stdout and stderr)."""
        return Path(self.proc.log_path).read_text(errors="replace")


@contextlib.contextmanager
def serving(env: dict | None = None, timeout: float = 120.0) -> Iterator[Server]:
    """start_server() as a context: the Server while it runs, stopped at the end."""
    proc, url = start_server(env, timeout=timeout)
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


def all_ready(url: str) -> bool:
    """every worker answers /readyz with 200 (warm-up done)"""
    return all(requests.get(f"{url}/readyz", timeout=30).status_code == 200 for _ in range(8))


def worker_pids(proc: subprocess.Popen) -> set[int]:
    """The gunicorn arbiter's children: its workers (Linux /proc)."""
    return {int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()}


def wait_for_workers(proc: subprocess.Popen, n: int = 2, gone: int | None = None) -> set[int]:
    """Wait until the arbiter has n workers (and none is the pid gone); their pids."""

    def workers():
        """the arbiter has its workers"""
        pids = worker_pids(proc)
        return pids if len(pids) == n and gone not in pids else None

    return wait_until(workers, timeout=60)


# --- the attack suite and the soak: raw exchanges, and the check that the server took no harm ---


def numeric_core():
    """The in-process numeric core (attention, mha)."""
    from service import core

    return core


def assert_seed_answered(url: str, session: requests.Session | None = None) -> None:
    """The seed example gets 200 and the in-process core's answer: the server took no harm."""
    r = (session or requests).post(f"{url}/attention", json=WORKED, timeout=30)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    q, k, v = (np.array(WORKED[n], dtype=np.float32) for n in ("q", "k", "v"))
    out, weights = numeric_core().attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.array(body["out"]), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(body["weights"]), weights, rtol=1e-5, atol=1e-6)


class _KeepOpen(io.BufferedReader):
    """One buffered reader for several responses on one socket (http.client closes its reader
    after each response; pipelined answers share the buffer)."""

    def close(self) -> None:
        pass


class _OneReader:
    def __init__(self, reader):
        self.reader = reader

    def makefile(self, *args, **kwargs):
        return self.reader


# --- raw sockets against a live server (the slow and hostile clients' tests) -----------------------

HANG = 30.0  # seconds: a raw socket's timeout, which only ever stops a hang


def connect(srv: Server, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    """A connection to srv from source, an address of the loopback network (127.0.0.0/8: each one
    is a client of its own to the server), with a receive buffer of rcvbuf bytes if given."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(HANG)
    s.bind((source, 0))
    s.connect(("127.0.0.1", srv.port))
    return s


def post_head(length: int, path: str = "/attention", extra: str = "") -> bytes:
    """A JSON POST's head declaring a body of length bytes; extra: more header lines, each ending in CRLF."""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n".encode()


def read_to_end(s: socket.socket) -> tuple[bytes, bool]:
    """Everything until the server closes; (bytes, whether it ended with a reset)."""
    data = bytearray()
    while True:
        try:
            chunk = s.recv(1 << 20)
        except ConnectionResetError:
            return bytes(data), True
        if not chunk:
            return bytes(data), False
        data += chunk


def unread_bytes(port: int) -> int:
    """Bytes on their way to the server on port that it has not read yet: what the clients' side
    still holds unsent and the server's side holds received but unread, over the established
    loopback connections (Linux /proc/net/tcp: tx_queue and rx_queue)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, (tx, rx) = fields[1], fields[2], fields[3], fields[4].split(":")
        if state == "01":  # ESTABLISHED
            if int(remote.split(":")[1], 16) == port:
                total += int(tx, 16)
            if int(local.split(":")[1], 16) == port:
                total += int(rx, 16)
    return total


def raw_exchange(
    url: str, data: bytes | list[bytes], *, responses: int = 1, shut_write: bool = False, timeout: float = 30.0
) -> list[tuple[int | None, dict, bytes]]:
    """Send bytes as they are on a fresh connection (a list: one write each); read up to
    `responses` HTTP responses. Each is (status, headers lower-cased, body); status None where the
    server closed the connection instead of answering."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        for part in [data] if isinstance(data, bytes) else data:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        reader = _OneReader(_KeepOpen(socket.SocketIO(sock, "rb")))
        for _ in range(responses):
            resp = http.client.HTTPResponse(reader)
            try:
                resp.begin()
                body = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, http.client.IncompleteRead):
                out.append((None, {}, b""))
                break
            out.append((resp.status, {k.lower(): v for k, v in resp.getheaders()}, body))
    return out


# The promise (docs/api.md): each row of the weights with an allowed key sums to 1 within 1e-6 in
# float32 and 1e-12 in float64; a row with none is all zeros.
ROW_SUM_TOLERANCE = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}


def assert_rows_sum_to_one(weights: np.ndarray, has_key) -> None:
    """The promise above, for weights (..., T, S) whose rows has_key (broadcast to (..., T)) have
    an allowed key. The sum is taken in float64: the error measured is the weights', not the sum's."""
    sums = np.asarray(weights, np.float64).sum(-1)
    has_key = np.broadcast_to(has_key, sums.shape)
    np.testing.assert_allclose(sums[has_key], 1, rtol=0, atol=ROW_SUM_TOLERANCE[weights.dtype])
    assert (sums[~has_key] == 0).all()


def set_blocks(monkeypatch, elements: int, rows: int) -> list:
    """The numeric core's blocking made small for a test: every problem in blocks (none is sent to
    reference() for being small), BLOCK_ELEMENTS scores a block, at least rows rows, and 3 causal
    blocks, so that small arrays make many blocks. Returns the plans attention() makes from then
    on (a list that fills), so that a test can check the blocks it meant to run did run."""
    from service.core import kernels

    monkeypatch.setattr(kernels, "SMALL_SHARE", 2**62)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", elements)
    monkeypatch.setattr(kernels, "MIN_ROWS", rows)
    monkeypatch.setattr(kernels, "CAUSAL_BLOCKS", 3)
    plans: list = []
    real = kernels.plan

    def plan(*args, **kwargs):
        plans.append(made := real(*args, **kwargs))
        return made

    monkeypatch.setattr(kernels, "plan", plan)  # attention()'s own; the cost model's core.plan is another name
    return plans


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in server's handler (http.server): _send() answers a JSON document with a status and
    headers; nothing is logged."""

    def _send(self, status: int, doc, headers: dict | None = None) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Hostile:
    """One loopback connection: reads a request's head and its Content-Length body (if any), then
    runs answer(conn), which writes what it likes in a loop bounded in count. `sent` counts the
    bytes the client took before it closed (a send that fails ends the answer); a client that
    closes before its request is whole gets no answer."""

    def __init__(self, answer):
        self.answer, self.sent = answer, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        with self.listener, contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += (piece := conn.recv(65536))
                    if not piece:  # closed before its head ended: recv would return b"" forever
                        return
                head, body = data.split(b"\r\n\r\n", 1)
                declared = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
                length = int(declared.group(1)) if declared else 0  # a GET has none
                while len(body) < length:
                    body += (piece := conn.recv(65536))
                    if not piece:
                        return
                for piece in self.answer():
                    conn.sendall(piece)
                    self.sent += len(piece)

    def close(self):
        with contextlib.suppress(OSError):
            self.listener.close()
        self.thread.join(timeout=60)
