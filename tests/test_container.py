"""The image and the Kubernetes manifests, built and run for real in a container engine.

Engine, in order: `ATTN_CONTAINER_ENGINE=docker|podman` forces one, used as it is; a Docker
engine that answers is used as it is (such a machine reaches a registry); else, as root,
`../shared/tools/container-sandbox` (beside the repo, as CI lays it) installs podman and a local
python:3.11-slim built from Debian, for machines with no registry (as .ci/run's are); else a podman on PATH. Only where none of these
can be had do the tests skip, and they say why (they fail under ATTN_REQUIRE_TOOLS=1).

The image is built once per session, under a tag of its own (removed at the end), so that two
runs side by side never run each other's image; calls to the sandbox are serialized through a file
lock, since two installs at once would fight over apt's lock and the base image's build directory.
The whole module takes one to three minutes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml

from .helpers import ROOT, WORKED_OUT, WORKED_WEIGHTS, Q, V, free_port, unavailable

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

SANDBOX = ROOT.parent / "shared" / "tools" / "container-sandbox"  # CI lays shared/ beside the clone
SANDBOX_LOCK = Path(tempfile.gettempdir()) / "attention-container-sandbox.lock"
IMAGE = f"localhost/attention-service:test-{uuid.uuid4().hex[:8]}"
CONTAINER_PORT = 8000


def _run(cmd: list[str], env: dict, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _answers(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Engine:
    """The container CLI in use, and the environment it needs."""

    def __init__(self, name: str, env: dict, via_sandbox: bool):
        self.name, self.env, self.via_sandbox = name, env, via_sandbox

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.name, *args], self.env, timeout=timeout, check=check)

    @property
    def is_podman(self) -> bool:
        return self.name == "podman"


def _find_engine() -> Engine:
    env = dict(os.environ)
    forced = os.environ.get("ATTN_CONTAINER_ENGINE")
    if forced:
        if not shutil.which(forced):
            pytest.fail(f"ATTN_CONTAINER_ENGINE={forced} but {forced} is not on PATH")
        return Engine(forced, env, via_sandbox=False)
    if shutil.which("docker") and _answers(["docker", "info"]):
        return Engine("docker", env, via_sandbox=False)
    if SANDBOX.is_file() and (os.geteuid() == 0 or shutil.which("podman")):
        # Installs podman and the local base image once per machine (about two minutes), then
        # prints `export CONTAINERS_CONF=...`. A failure here is a failure, not a skip.
        proc = _sandbox_env(env)
        for line in proc.stdout.splitlines():
            if line.startswith("export ") and "=" in line:
                key, _, value = line[len("export ") :].partition("=")
                env[key.strip()] = value.strip().strip("'\"")
        return Engine("podman", env, via_sandbox=True)
    if shutil.which("podman") and _answers(["podman", "info"]):
        return Engine("podman", env, via_sandbox=False)
    unavailable(
        "no container engine: no Docker engine answers, no podman on PATH, and "
        f"{SANDBOX} (which installs podman as root) is absent or this user is not root"
    )


def _sandbox_env(env: dict) -> subprocess.CompletedProcess:
    """`container-sandbox env`, one run at a time among these tests on this machine. Anything else
    installing at the same time (apt's lock held, the base image's directory written by a second
    sandbox) makes a run fail for a while: then it is tried again, three times at most."""
    with open(SANDBOX_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the install, if any, is done
        for _ in range(3):
            proc = _run(["bash", str(SANDBOX), "env"], env, timeout=900, check=False)
            if proc.returncode == 0:
                return proc
            time.sleep(30)
    raise AssertionError(f"container-sandbox env exited {proc.returncode} three times:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _wait_for(url: str, deadline_s: float, logs) -> float:
    """Poll url until it answers 200; return the monotonic time it first did."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            r = requests.get(url, timeout=2)
            if r.status_code == 200:
                return time.monotonic()
            last = f"{r.status_code} {r.text[:200]}"
        except requests.RequestException as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise AssertionError(f"{url} not 200 after {deadline_s}s (last: {last})\n{logs()}")


def _logs(engine: Engine, name: str) -> str:
    proc = engine("logs", name, check=False)
    return (proc.stdout + proc.stderr)[-6000:]


def _check_worked_example(base: str) -> None:
    r = requests.post(f"{base}/attention", json={"q": Q, "k": Q, "v": V, "causal": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    weights, out = np.array(body["weights"]), np.array(body["out"])
    # The oracle: softmax(q k^T / sqrt(d)) with the future masked, then @ v.
    q, k, v = np.array(Q), np.array(Q), np.array(V)
    scores = np.where(np.tril(np.ones((3, 3), bool)), q @ k.T / np.sqrt(2), -np.inf)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    np.testing.assert_allclose(out, expected @ v, atol=1e-5)
    np.testing.assert_allclose(weights, WORKED_WEIGHTS, atol=0.005)
    np.testing.assert_allclose(out, WORKED_OUT, atol=0.005)
    assert weights[0, 1] == 0 and weights[0, 2] == 0 and weights[1, 2] == 0  # masked: exactly 0


@pytest.fixture(scope="module")
def engine() -> Engine:
    return _find_engine()


@pytest.fixture(scope="module")
def image(engine: Engine) -> dict:
    """Build the image once; report how long it took and how big it is."""
    args = ["build", "-t", IMAGE, "."]
    if engine.is_podman:
        # docker format: OCI silently drops HEALTHCHECK. --pull=never: the sandbox's base is local.
        args[1:1] = ["--format", "docker", "--pull=never" if engine.via_sandbox else "--pull=missing"]
    t0 = time.monotonic()
    engine(*args, timeout=900)
    build_s = time.monotonic() - t0
    size = int(engine("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    yield {"tag": IMAGE, "build_s": build_s, "size_bytes": size}
    # Only this run's tag goes: its layers stay, as the cache of the next build.
    engine(*(("untag", IMAGE, IMAGE) if engine.is_podman else ("image", "rm", "--no-prune", IMAGE)), check=False)


@pytest.fixture(scope="module")
def container(engine: Engine, image: dict):
    """`run -d -p 127.0.0.1:PORT:8000`, timed from the run command to /healthz and /readyz 200."""
    name = f"attention-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = lambda: _logs(engine, name)
    t0 = time.monotonic()
    engine("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:{CONTAINER_PORT}", IMAGE)
    try:
        healthy = _wait_for(f"{base}/healthz", 90, logs)
        ready = _wait_for(f"{base}/readyz", 90, logs)
        yield {"name": name, "base": base, "healthy_s": healthy - t0, "ready_s": ready - t0, "logs": logs}
    finally:
        engine("rm", "-f", name, check=False)


def test_serves_the_worked_example(container):
    r = requests.get(f"{container['base']}/healthz", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    _check_worked_example(container["base"])


def test_serves_the_playground_and_its_files(container):
    """The page's HTML, CSS and JS are in the image (COPY service/ brings service/web/static/ along)."""
    page = requests.get(f"{container['base']}/playground", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(playground/static/[^"]+)"', page.text)
    assert len(assets) >= 2
    for asset in assets:
        assert requests.get(f"{container['base']}/{asset}", timeout=5).status_code == 200, asset


def _assert_clean_log(logs: str) -> None:
    """A whole life, start to stop, as an unprivileged user with a read-only home: no errors."""
    bad = [ln for ln in logs.splitlines() if "[ERROR]" in ln or "[CRITICAL]" in ln or "Traceback" in ln]
    assert not bad, "errors in the container's log:\n" + "\n".join(bad)


def test_healthcheck_passes(engine, container):
    name = container["name"]
    if engine.is_podman:
        # Without systemd podman never runs HEALTHCHECK by itself: run it once, by hand.
        proc = engine("healthcheck", "run", name, check=False)
        assert proc.returncode == 0, f"healthcheck: {proc.stdout} {proc.stderr}\n{container['logs']()}"
    else:
        end = time.monotonic() + 180  # a hang-stopper: the first check runs after the interval
        while (status := engine("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip()) != "healthy":
            assert status in ("starting", "healthy") and time.monotonic() < end, status
            time.sleep(1)


def test_runs_as_non_root(engine, container):
    uid = engine("exec", container["name"], "id", "-u").stdout.strip()
    assert uid.isdigit() and int(uid) != 0, uid
    config_user = engine("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip()
    assert config_user and config_user.split(":")[0] not in ("0", "root"), config_user


def test_report_size_and_start_time(image, container, capsys):
    size_mb = image["size_bytes"] / 1e6
    with capsys.disabled():
        print(
            f"\n[container] image {image['tag']}: {size_mb:.0f} MB, built in {image['build_s']:.0f} s; "
            f"run -> /healthz 200 in {container['healthy_s']:.2f} s, -> /readyz 200 in {container['ready_s']:.2f} s"
        )
    assert size_mb < 1000, "the image should stay well under a gigabyte"


def test_stalled_request_gets_408(container):
    """The container runs the slow-client defence (service/transport/worker.py): a request head that stalls
    gets 408 after ATTN_HEADER_TIMEOUT_S (10 s by default) and the connection closes."""
    assert "Using worker: service.transport.worker.FrontWorker" in container["logs"]()
    port = int(container["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\nContent-")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "timeout"


def test_stops_gracefully_on_sigterm(engine, container):
    """`stop` sends SIGTERM to PID 1: gunicorn must get it and exit 0 (a SIGKILL after the 60 s
    grace would give 137), having logged no error in its life."""
    name = container["name"]
    t0 = time.monotonic()
    engine("stop", "-t", "60", name, timeout=120)
    took = time.monotonic() - t0
    code = engine("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    print(f"\n[container] stopped in {took:.1f} s, exit code {code}")
    assert code == "0", f"exit code {code} after {took:.1f} s\n{container['logs']()}"
    _assert_clean_log(container["logs"]())


def _kube_variant(tmp_path: Path, name: str, port: int) -> Path:
    """deploy/k8s's Deployment and Service, one replica, the test image, the port on loopback."""
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [
            d
            for d in yaml.safe_load_all(path.read_text())
            if d and d["kind"] in ("Deployment", "Service") and d["spec"].get("clusterIP") != "None"  # not the headless one
        ]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Service"], kinds
    for doc in docs:
        doc["metadata"]["name"] = name
        if doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = 1
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            c["image"], c["imagePullPolicy"] = IMAGE, "Never"
            (p,) = [p for p in c["ports"] if p.get("name") == "http"]
            p["hostPort"], p["hostIP"] = port, "127.0.0.1"
    out = tmp_path / "one-replica.yaml"
    out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out


def test_kube_play_one_replica(engine, image, tmp_path):
    if not engine.is_podman:
        pytest.skip(f"`kube play` is podman's; the engine here is {engine.name}")
    name = f"attention-kube-{uuid.uuid4().hex[:6]}"
    port = free_port()
    manifest = _kube_variant(tmp_path, name, port)
    engine("kube", "play", str(manifest), timeout=120)
    try:
        # podman 4.3 names it NAME-pod-0-attention, later versions NAME-pod-attention.
        ps = json.loads(engine("ps", "-a", "--filter", f"name={name}-pod", "--format", "json").stdout or "[]")
        names = [n for c in ps for n in c["Names"] if not c.get("IsInfra") and not n.endswith("-infra")]
        assert len(names) == 1, ps
        (cname,) = names
        logs = lambda: _logs(engine, cname)
        base = f"http://127.0.0.1:{port}"
        # podman turns the liveness probe into a `curl` healthcheck, and the slim image has no
        # curl: so the probes' paths are asked from here, as the kubelet would.
        (spec,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "Deployment"]
        (c,) = spec["spec"]["template"]["spec"]["containers"]
        probes = [c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in c]
        for path in probes:
            _wait_for(base + path, 90, logs)
        _check_worked_example(base)
        # What the manifest asks for is what runs: its user, its read-only root, its writable /tmp,
        # and the preStop hook's command.
        assert engine("exec", cname, "id", "-u").stdout.strip() == "10001"
        assert engine("exec", cname, "touch", "/app/x", check=False).returncode != 0, "root filesystem is writable"
        engine("exec", cname, "touch", "/tmp/x")
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        engine("exec", cname, pre_stop[0], "0")
        # Stopped as Kubernetes would (SIGTERM, then the grace period): it logged no error.
        grace = spec["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        engine("pod", "stop", "-t", str(grace), ps[0]["Pod"], timeout=grace + 30)
        _assert_clean_log(logs())
    finally:
        engine("kube", "down", str(manifest), timeout=120, check=False)
