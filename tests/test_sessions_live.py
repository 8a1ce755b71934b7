"""Sessions on the real gunicorn server with two workers (contract 1.3, "Where sessions live"):
a session made through one worker is served by the other; a worker killed between steps, or
during one (a step made slow on purpose), leaves every session as it was before that request; a
decode loop equals the float64 reference at every step; two keys; a full pool; expiry."""

from __future__ import annotations

import os
import re
import signal
import threading

import numpy as np
import pytest
import requests

from . import faults, oracle
from .helpers import b64, serving, tensor, wait_until, worker_pids
from .test_sessions import Loop

pytestmark = pytest.mark.live


class Http:
    """requests behind the test client's interface (post/get/delete, status_code, get_json()):
    a fresh connection for every request, so that the server's two workers share them."""

    class Answer:
        def __init__(self, r: requests.Response):
            self.status_code, self.headers, self._r = r.status_code, r.headers, r

        def get_json(self):
            return self._r.json()

    def __init__(self, url: str):
        self.url = url

    def post(self, path, json=None, headers=None):
        return self.Answer(requests.post(self.url + path, json=json, headers=headers, timeout=120))

    def get(self, path, headers=None):
        return self.Answer(requests.get(self.url + path, headers=headers, timeout=120))

    def delete(self, path, headers=None):
        return self.Answer(requests.delete(self.url + path, headers=headers, timeout=120))


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> faults.Held:
    return faults.Held(tmp_path_factory.mktemp("held"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, held):
    """Two workers; a step sent with scale=faults.TRIGGER is held in the core until its worker is
    killed (tests/faults.py): a step slow on purpose."""
    env = faults.faulty_env(tmp_path_factory.mktemp("site"), "hold", held.directory)
    with serving({"ATTN_WARMUP": "0", "WEB_CONCURRENCY": "2", **env}) as srv:
        yield srv


def session_pids(log: str) -> set[int]:
    """The workers that answered requests under /sessions (the access log's pid)."""
    return {int(pid) for pid in re.findall(r'"route":"/sessions[^"]*".*?"pid":(\d+)', log)}


def test_any_worker_serves_any_session_and_a_decode_loop_equals_the_reference(server):
    c, rng = Http(server.url), np.random.default_rng(7)
    loops = [Loop(c, 4, 2, 8, 8, dtype, {"window": [6, -1]} if dtype == "float64" else {}, rng) for dtype in ("float32", "float64")]

    def drive(loop):
        loop.step(9)  # prefill
        for _ in range(12):
            loop.step(1)
        loop.step(3)
        loop.truncate(loop.k.shape[1] - 2)
        child = loop.fork(loop.k.shape[1] - 4)
        for _ in range(3):
            child.step(1)
            loop.step(1)

    threads = [threading.Thread(target=drive, args=(loop,)) for loop in loops]
    failures: list[BaseException] = []
    for t in threads:
        t.run = (lambda run: lambda: _record(run, failures))(t.run)
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures
    assert len(session_pids(server.log_text())) == 2  # both workers served these sessions
    # A batched step over both sessions of the float32 loop's shapes.
    a = loops[0]
    b = Loop(c, 4, 2, 8, 8, "float32", {}, rng)
    b.step(5)
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    r = c.post("/sessions/attention", json={"sessions": [a.id, b.id], "q": b64(q), "return_lse": True})
    assert r.status_code == 200, r.get_json()
    got = r.get_json()
    assert got["lengths"] == [a.k.shape[1], b.k.shape[1]]
    for i, s in enumerate((a, b)):
        want = oracle.reference(q[i], s.k, s.v, causal="bottom_right", enable_gqa=True)[0]
        np.testing.assert_allclose(tensor(got["out"])[i], want, rtol=1e-4, atol=1e-4)


def _record(run, failures):
    try:
        run()
    except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
        failures.append(exc)


def _kill_workers(server) -> None:
    """SIGKILL every worker; wait for the arbiter's replacements."""
    pids = worker_pids(server.proc)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not (worker_pids(server.proc) & pids) and len(worker_pids(server.proc)) == 2, timeout=60, what="two new workers")
    wait_until(lambda: requests.get(server.url + "/readyz", timeout=5).status_code == 200, timeout=60, what="ready")


def test_workers_killed_between_steps_leave_sessions_intact(server):
    c, rng = Http(server.url), np.random.default_rng(8)
    loop = Loop(c, 2, 1, 4, 4, "float32", {}, rng)
    loop.step(6)
    _kill_workers(server)
    assert c.get(f"/sessions/{loop.id}").get_json()["length"] == 6
    loop.step(1)  # equal to the reference over all 7 keys: the 6 made before the kill are intact
    _kill_workers(server)
    loop.step(2)


def test_a_worker_killed_during_a_step_leaves_the_session_as_it_was(server, held):
    c, rng = Http(server.url), np.random.default_rng(9)
    loop = Loop(c, 4, 2, 8, 8, "float32", {}, rng)
    loop.step(700)  # three pages (of 256) and a part
    used = requests.get(server.url + "/limits", timeout=10).json()["sessions"]["used_bytes"]
    # A step with 300 new tokens (two more pages), held in the core until its worker is killed.
    nk, nv = loop.tokens(300)
    q = rng.standard_normal((4, 300, 8)).astype(np.float32)
    body = {"q": b64(q), "k": b64(nk), "v": b64(nv), "at": 700, "scale": faults.TRIGGER}
    outcome: list = []
    step = threading.Thread(target=lambda: outcome.append(_post_or_error(server.url + f"/sessions/{loop.id}/attention", body)))
    step.start()
    wait_until(lambda: held.entered() >= 1, timeout=60, what="the step held in the core")
    (entered,) = held.directory.glob("entered-*")
    computing = int(entered.name.split("-")[1])  # the worker holding the session's lock, its new tokens written
    os.kill(computing, signal.SIGKILL)
    step.join(60)
    assert isinstance(outcome[0], requests.RequestException), outcome  # its worker died: no answer
    entered.unlink()
    assert c.get(f"/sessions/{loop.id}").get_json()["length"] == 700  # as before the request (the other worker answers)
    assert requests.get(server.url + "/limits", timeout=10).json()["sessions"]["used_bytes"] == used  # its pages given back
    loop.step(1)  # the keys are the ones before it, and the session goes on
    wait_until(lambda: len(worker_pids(server.proc)) == 2 and computing not in worker_pids(server.proc), timeout=60, what="a new worker")


def _post_or_error(url, body):
    try:
        return requests.post(url, json=body, timeout=300)
    except requests.RequestException as exc:
        return exc


KEYS = {"alice": {"Authorization": "Bearer alice-key"}, "bob": {"Authorization": "Bearer bob-key"}}


def test_two_keys_a_full_pool_and_expiry():
    env = {
        "ATTN_WARMUP": "0",
        "WEB_CONCURRENCY": "2",
        "ATTN_API_KEYS": "alice-key,bob-key",
        "ATTN_SESSION_MEMORY_BYTES": str(64 * 4096),
        "ATTN_SESSION_PAGE_TOKENS": "16",
        "ATTN_SESSION_IDLE_S": "2",
    }
    with serving(env) as srv:
        c = Http(srv.url)
        made = c.post("/sessions", json={"heads": 2, "head_dim": 8}, headers=KEYS["alice"])
        sid = made.get_json()["id"]
        for method in ("get", "delete"):  # refused at the head by the worker, before any body: no key, no session
            assert getattr(requests, method)(f"{srv.url}/sessions/{sid}", timeout=10).status_code == 401
        assert (
            requests.post(f"{srv.url}/sessions/{sid}/append", json={}, headers={"Authorization": "Bearer nope"}, timeout=10).status_code
            == 401
        )
        for _ in range(8):  # whichever worker answers: another key's session does not exist
            assert c.get(f"/sessions/{sid}", headers=KEYS["bob"]).status_code == 404
            assert c.get(f"/sessions/{sid}", headers=KEYS["alice"]).status_code == 200
        # Fill the pool (a page of 16 tokens of 2 heads x (8 + 8) float32 is one unit of 4096 bytes).
        tokens = np.ones((2, 16 * 64, 8), np.float32)
        assert c.post(f"/sessions/{sid}/append", json={"k": b64(tokens), "v": b64(tokens)}, headers=KEYS["alice"]).status_code == 200
        other = c.post("/sessions", json={"heads": 2, "head_dim": 8}, headers=KEYS["bob"]).get_json()["id"]
        one = np.ones((2, 1, 8), np.float32)
        full = c.post(f"/sessions/{other}/append", json={"k": b64(one), "v": b64(one)}, headers=KEYS["bob"])
        assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
        assert c.get(f"/sessions/{sid}", headers=KEYS["alice"]).get_json()["length"] == 16 * 64  # nothing evicted
        # Idle past ATTN_SESSION_IDLE_S, both expire, and their pages come back.
        wait_until(lambda: c.get("/limits").get_json()["sessions"]["expired"] >= 2 or _touch(c), timeout=60, what="two expiries")
        assert c.get(f"/sessions/{sid}", headers=KEYS["alice"]).status_code == 404
        assert c.get("/limits").get_json()["sessions"]["used_bytes"] == 0
        assert "attention_session_expiries_total 2.0" in requests.get(srv.url + "/metrics", timeout=10).text


def _touch(c) -> bool:
    """A create and delete (each sweeps the idle sessions); False, so wait_until keeps waiting."""
    made = c.post("/sessions", json={"heads": 1, "head_dim": 1}, headers=KEYS["bob"])
    if made.status_code == 201:
        c.delete(f"/sessions/{made.get_json()['id']}", headers=KEYS["bob"])
    return False


def test_a_v2_sequence_through_tritonclient(server):
    """Triton's sequence extension, unchanged tritonclient: sequence_start makes the state, each
    request appends its k, v and attends over the whole sequence (equal to the float64 reference),
    sequence_end frees it; the model's configuration declares its sequence batching."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    config = c.get_model_config("attention_sequence")
    assert config["sequence_batching"]["max_sequence_idle_microseconds"] == 600 * 10**6
    rng = np.random.default_rng(11)
    H, Hkv, d, dv = 4, 2, 8, 4
    keys, values = np.zeros((Hkv, 0, d)), np.zeros((Hkv, 0, dv))
    steps = [5, 1, 1, 3, 1]
    for i, t in enumerate(steps):
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((H, t, d), (Hkv, t, d), (Hkv, t, dv)))
        inputs = []
        for name, arr in (("q", q), ("k", k), ("v", v)):
            tensor_in = httpclient.InferInput(name, list(arr.shape), "FP32")
            tensor_in.set_data_from_numpy(arr, binary_data=True)
            inputs.append(tensor_in)
        outputs = [httpclient.InferRequestedOutput("out", binary_data=True), httpclient.InferRequestedOutput("lse", binary_data=True)]
        answer = c.infer(
            "attention_sequence", inputs, outputs=outputs, sequence_id=4242, sequence_start=i == 0, sequence_end=i == len(steps) - 1
        )
        keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
        want_out, _, want_lse = oracle.reference(q, keys, values, causal="bottom_right", enable_gqa=True, return_lse=True)
        np.testing.assert_allclose(answer.as_numpy("out"), want_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(answer.as_numpy("lse"), want_lse, rtol=1e-4, atol=1e-4)
    one = [httpclient.InferInput(n, [H if n == "q" else Hkv, 1, d if n != "v" else dv], "FP32") for n in ("q", "k", "v")]
    for tensor_in in one:
        tensor_in.set_data_from_numpy(np.ones(tensor_in.shape(), np.float32))
    with pytest.raises(InferenceServerException, match="not held"):  # ended: its state is gone
        c.infer("attention_sequence", one, sequence_id=4242)
