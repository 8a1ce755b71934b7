"""Triton's statistics and system shared-memory extensions at /v2: the statistics' fields and
counts (through the Flask client, and over both workers of a live server), tritonclient's
shared-memory flow answering as the binary wire does, and every hostile region refused with a 400
while the server keeps serving."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
from multiprocessing import shared_memory

import jsonschema
import numpy as np
import pytest
import requests
import tritonclient.http as triton
import tritonclient.utils.shared_memory as triton_shm

from service.config import Settings
from service.web.app import create_app
from service.web.kserve import MODELS

from .helpers import all_ready, assert_seed_answered, wait_for_workers, wait_until
from .test_openapi import json_schema

rng = np.random.default_rng(7)
Q, K, V = (rng.standard_normal((2, 4, 16, 8), dtype=np.float32) for _ in range(3))
INFER = "/v2/models/attention/infer"


def infer_body(**parameters) -> dict:
    return {
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.reshape(-1).tolist()}
            for n, a in zip("qkv", (Q, K, V), strict=True)
        ],
        "parameters": parameters,
    }


# --- statistics, through the Flask client ------------------------------------------------------------


@pytest.fixture
def shm_app():
    return create_app(Settings(warmup=False, allow_client_shm=True))


def stats_of(client, path: str = "/v2/models/attention/stats") -> dict:
    resp = client.get(path)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    (stat,) = resp.get_json()["model_stats"]
    return stat


def test_server_metadata_lists_the_extensions(client, shm_app):
    assert "statistics" in client.get("/v2").get_json()["extensions"]
    assert "system_shared_memory" not in client.get("/v2").get_json()["extensions"]  # off by default
    assert "system_shared_memory" in shm_app.test_client().get("/v2").get_json()["extensions"]


def test_statistics_have_every_field_triton_documents(client):
    stat = stats_of(client)
    assert set(stat) == {"name", "version", "last_inference", "inference_count", "execution_count", "inference_stats", "batch_stats"}
    assert stat["name"] == "attention" and stat["version"] == "1"
    durations = {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss"}
    assert set(stat["inference_stats"]) == durations
    assert all(set(d) == {"count", "ns"} for d in stat["inference_stats"].values())
    every = client.get("/v2/models/stats").get_json()["model_stats"]
    assert [s["name"] for s in every] == list(MODELS)  # every model served, attention_sequence too


def test_the_document_describes_the_extensions_answers_and_parameters(shm_app):
    """The statistics and a region's status validate against the document's schemas, and the
    shared-memory parameters are part of the infer request's tensors there."""
    client, stem = shm_app.test_client(), secrets.token_hex(4)
    doc = client.get("/openapi.json").get_json()
    assert client.post(INFER, json=infer_body()).status_code == 200
    jsonschema.validate(client.get("/v2/models/stats").get_json(), json_schema(doc, "stats_model_response"))
    obj = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=64)
    try:
        assert client.post("/v2/systemsharedmemory/region/r/register", json={"key": f"/attn-{stem}", "byte_size": 64}).status_code == 200
        status = client.get("/v2/systemsharedmemory/status").get_json()
        assert [r["name"] for r in status] == ["r"]
        jsonschema.validate(status, json_schema(doc, "system_shared_memory_status_response"))
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(status[0], json_schema(doc, "system_shared_memory_status_response"))  # an array, not one region
    finally:
        client.post("/v2/systemsharedmemory/unregister")
        obj.close()
        obj.unlink()
    shm = {"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"}
    for tensor in ("request_input", "request_output"):
        assert shm <= set(doc["components"]["schemas"][tensor]["properties"]["parameters"]["properties"])


def test_statistics_count_successes_and_failures_with_their_phases(client):
    before = stats_of(client)
    for _ in range(3):
        assert client.post(INFER, json=infer_body()).status_code == 200
    bad = infer_body()
    bad["inputs"] = bad["inputs"][:2]  # no v
    assert client.post(INFER, json=bad).status_code == 400
    assert client.post("/attention", json={"q": Q.tolist(), "k": K.tolist(), "v": V.tolist()}).status_code == 200  # not /v2: not counted
    after = stats_of(client, "/v2/models/attention/versions/1/stats")
    inc = {name: after["inference_stats"][name]["count"] - before["inference_stats"][name]["count"] for name in after["inference_stats"]}
    assert inc == {
        "success": 3,
        "fail": 1,
        "queue": 3,
        "compute_input": 3,
        "compute_infer": 3,
        "compute_output": 3,
        "cache_hit": 0,
        "cache_miss": 0,
    }
    assert after["inference_count"] - before["inference_count"] == 3 == after["execution_count"] - before["execution_count"]
    spent = {name: after["inference_stats"][name]["ns"] - before["inference_stats"][name]["ns"] for name in after["inference_stats"]}
    assert all(spent[name] > 0 for name in ("success", "fail", "compute_input", "compute_infer", "compute_output"))
    assert spent["success"] >= spent["compute_input"] + spent["compute_infer"] + spent["compute_output"]
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 1_600_000_000_000  # ms since the epoch
    (batch,) = after["batch_stats"]
    assert batch["batch_size"] == 1 and batch["compute_infer"] == after["inference_stats"]["compute_infer"]


@pytest.mark.parametrize("path", ["/v2/models/nope/stats", "/v2/models/attention/versions/2/stats"])
def test_statistics_of_a_model_not_served_are_404(client, path):
    resp = client.get(path)
    assert resp.status_code == 404 and "error" in resp.get_json()


def test_shared_memory_is_refused_unless_allowed(client):
    resp = client.post("/v2/systemsharedmemory/region/r/register", json={"key": "/x", "byte_size": 8})
    assert resp.status_code == 400 and "ATTN_ALLOW_CLIENT_SHM" in resp.get_json()["error"]
    assert client.get("/v2/systemsharedmemory/status").status_code == 400
    body = infer_body()
    body["inputs"][0] = {
        "name": "q",
        "datatype": "FP32",
        "shape": list(Q.shape),
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": Q.nbytes},
    }
    assert client.post(INFER, json=body).status_code == 400


# --- a live server of two workers, shared memory allowed ---------------------------------------------


@pytest.fixture
def server(shm_server):
    return shm_server


def infer_pids(srv, after: int = 0) -> set[int]:
    """The workers that logged /v2 infer answers (the access log's pid), in the log past offset after."""
    pids = set()
    for line in srv.log_text()[after:].splitlines():
        if '"route":"/v2/models/<name>/infer"' in line and '"status":200' in line:
            pids.add(json.loads(line)["pid"])
    return pids


@pytest.mark.live
def test_statistics_count_every_worker(server):
    """Requests on fresh connections reach both workers; every worker's stats answer counts them all."""
    url = server.url
    before = requests.get(f"{url}/v2/models/attention/stats", timeout=30).json()["model_stats"][0]
    mark, sent = len(server.log_text()), 0

    def both_workers_answered():
        """infer requests on fresh connections reached both workers"""
        nonlocal sent
        assert requests.post(f"{url}{INFER}", json=infer_body(), timeout=60).status_code == 200
        sent += 1
        return len(infer_pids(server, mark)) == 2

    wait_until(both_workers_answered, timeout=120, interval=0)
    assert requests.post(f"{url}{INFER}", json={"inputs": []}, timeout=60).status_code == 400
    for _ in range(8):  # whichever worker answers, the counts are the server's
        after = requests.get(f"{url}/v2/models/attention/stats", timeout=30).json()["model_stats"][0]
        assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == sent
        assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 1
        assert after["inference_count"] - before["inference_count"] == sent


@pytest.mark.live
def test_statistics_outlive_a_worker(server):
    """A worker killed takes none of the counts with it: they are the server's since it started,
    and so are the regions registered."""
    url, stem = server.url, secrets.token_hex(4)
    region = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=64)
    try:
        assert register(url, stem, f"/attn-{stem}", 64).status_code == 200
        for _ in range(4):
            assert requests.post(f"{url}{INFER}", json=infer_body(), timeout=60).status_code == 200
        before = requests.get(f"{url}/v2/models/attention/stats", timeout=30).json()["model_stats"][0]
        pids = wait_for_workers(server.proc)
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        wait_for_workers(server.proc, gone=victim)
        wait_until(lambda: all_ready(url), timeout=120, what="the new worker is ready")
        for _ in range(8):  # whichever worker answers, old or new
            after = requests.get(f"{url}/v2/models/attention/stats", timeout=30).json()["model_stats"][0]
            assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"]
            assert after["last_inference"] == before["last_inference"]
            assert [r["name"] for r in requests.get(f"{url}/v2/systemsharedmemory/status", timeout=30).json()] == [stem]
    finally:
        requests.post(f"{url}/v2/systemsharedmemory/unregister", timeout=30)
        region.close()
        region.unlink()


# --- tritonclient's shared-memory flow (its simple_http_shm_client example) ---------------------------


def triton_inputs(binary: bool) -> list:
    inputs = []
    for name, arr in zip("qkv", (Q, K, V), strict=True):
        inp = triton.InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    return inputs


@pytest.mark.live
def test_tritonclient_shared_memory_answers_as_the_binary_wire(server):
    client = triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    stem = secrets.token_hex(4)
    in_bytes, out_bytes, weights_bytes = Q.nbytes, Q.nbytes, Q.shape[0] * Q.shape[1] * 16 * 16 * 4
    inputs_region = triton_shm.create_shared_memory_region(f"in-{stem}", f"/attn-in-{stem}", 3 * in_bytes)
    outputs_region = triton_shm.create_shared_memory_region(f"out-{stem}", f"/attn-out-{stem}", out_bytes + weights_bytes)
    try:
        client.unregister_system_shared_memory()  # the example's clean start: both kinds
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []
        triton_shm.set_shared_memory_region(inputs_region, [Q, K, V])
        client.register_system_shared_memory(f"in-{stem}", f"/attn-in-{stem}", 3 * in_bytes)
        client.register_system_shared_memory(f"out-{stem}", f"/attn-out-{stem}", out_bytes + weights_bytes)
        status = client.get_system_shared_memory_status()
        assert {r["name"] for r in status} == {f"in-{stem}", f"out-{stem}"}

        inputs = triton_inputs(binary=True)
        for i, inp in enumerate(inputs):
            inp.set_shared_memory(f"in-{stem}", in_bytes, offset=i * in_bytes)
        outputs = [triton.InferRequestedOutput("out", binary_data=True), triton.InferRequestedOutput("weights", binary_data=True)]
        outputs[0].set_shared_memory(f"out-{stem}", out_bytes)
        outputs[1].set_shared_memory(f"out-{stem}", weights_bytes, offset=out_bytes)
        result = client.infer("attention", inputs, outputs=outputs)
        out_meta, weights_meta = result.get_output("out"), result.get_output("weights")
        assert "data" not in out_meta and "parameters" not in out_meta  # as Triton answers an output in shared memory
        out = triton_shm.get_contents_as_numpy(outputs_region, np.float32, out_meta["shape"])
        weights = triton_shm.get_contents_as_numpy(outputs_region, np.float32, weights_meta["shape"], offset=out_bytes)

        wire = client.infer(
            "attention", triton_inputs(binary=True), outputs=[triton.InferRequestedOutput(n, binary_data=True) for n in ("out", "weights")]
        )
        np.testing.assert_array_equal(out, wire.as_numpy("out"))  # the same server code and BLAS threads: the same bits
        np.testing.assert_array_equal(weights, wire.as_numpy("weights"))

        client.unregister_system_shared_memory(f"in-{stem}")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == [f"out-{stem}"]
    finally:
        client.unregister_system_shared_memory()
        triton_shm.destroy_shared_memory_region(inputs_region)
        triton_shm.destroy_shared_memory_region(outputs_region)
        client.close()


@pytest.mark.live
def test_a_region_registered_through_one_worker_serves_on_every_worker(server):
    url, stem = server.url, secrets.token_hex(4)
    region = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=3 * Q.nbytes)
    try:
        np.frombuffer(region.buf, np.float32, count=3 * Q.size)[:] = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
        assert register(url, stem, f"/attn-{stem}", 3 * Q.nbytes).status_code == 200
        mark = len(server.log_text())

        def both_workers_read_it():
            """infer requests reading the region reached both workers, each answered 200"""
            resp = requests.post(f"{url}{INFER}", json=shm_body(stem), timeout=60)
            assert resp.status_code == 200, resp.text
            np.testing.assert_allclose(np.array(resp.json()["outputs"][0]["data"]), expected_out().ravel(), rtol=1e-5, atol=1e-6)
            return len(infer_pids(server, mark)) == 2

        wait_until(both_workers_read_it, timeout=120, interval=0)
    finally:
        requests.post(f"{url}/v2/systemsharedmemory/unregister", timeout=30)
        region.close()
        region.unlink()


def expected_out() -> np.ndarray:
    from service import core

    return core.attention(Q, K, V)[0]


def register(url: str, name: str, key: str, byte_size: int, offset: int = 0) -> requests.Response:
    body = {"key": key, "offset": offset, "byte_size": byte_size}
    return requests.post(f"{url}/v2/systemsharedmemory/region/{name}/register", json=body, timeout=30)


def shm_body(region: str, offsets=(0, 1, 2), size: int = Q.nbytes, outputs: list | None = None) -> dict:
    """An infer request whose q, k, v are in region (at offsets x size), outputs inline by default."""
    body = {
        "inputs": [
            {
                "name": n,
                "datatype": "FP32",
                "shape": list(Q.shape),
                "parameters": {"shared_memory_region": region, "shared_memory_offset": i * size, "shared_memory_byte_size": size},
            }
            for n, i in zip("qkv", offsets, strict=True)
        ],
        "parameters": {"return_weights": False},
    }
    if outputs is not None:
        body["outputs"] = outputs
    return body


# --- hostile regions: each a 400 with a message, the server serving after it ----------------------------


@pytest.fixture
def region(server):
    """A fresh 3 x q's bytes shared-memory object holding q, k, v; unlinked after the test, every region unregistered."""
    stem = secrets.token_hex(4)
    obj = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=3 * Q.nbytes)
    np.frombuffer(obj.buf, np.float32, count=3 * Q.size)[:] = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
    yield stem, obj
    requests.post(f"{server.url}/v2/systemsharedmemory/unregister", timeout=30)
    obj.close()
    obj.unlink()


def refused(resp: requests.Response, pattern: str) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.headers["X-Error-Code"] == "bad_shared_memory"
    assert re.search(pattern, resp.json()["error"]), resp.json()["error"]


@pytest.mark.live
@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("/attn-does-not-exist", "no shared-memory object named"),
        ("/../etc", "not the name of a shared-memory object"),
        ("/a/b", "not the name of a shared-memory object"),
        (7, "key must be a string"),
    ],
    ids=["missing", "dot-dot", "slash", "not-a-string"],
)
def test_registering_a_key_that_is_no_object_is_400(server, key, pattern):
    refused(register(server.url, "r", key, 64), pattern)
    assert_seed_answered(server.url)


@pytest.mark.live
def test_a_region_past_its_object_is_400(server, region):
    stem, obj = region
    refused(register(server.url, stem, f"/attn-{stem}", obj.size + 1), "which holds")
    refused(register(server.url, stem, f"/attn-{stem}", 16, offset=obj.size), "which holds")
    assert_seed_answered(server.url)


@pytest.mark.live
def test_a_name_registered_twice_is_400(server, region):
    stem, obj = region
    assert register(server.url, stem, f"/attn-{stem}", obj.size).status_code == 200
    refused(register(server.url, stem, f"/attn-{stem}", 16), "already registered")
    assert_seed_answered(server.url)


@pytest.mark.live
def test_tensors_past_a_regions_end_are_400(server, region):
    stem, obj = region
    assert register(server.url, stem, f"/attn-{stem}", obj.size).status_code == 200
    refused(requests.post(f"{server.url}{INFER}", json=shm_body(stem, offsets=(0, 1, 3)), timeout=30), "pass the end of region")
    too_small = [{"name": "out", "parameters": {"shared_memory_region": stem, "shared_memory_byte_size": 64}}]
    refused(requests.post(f"{server.url}{INFER}", json=shm_body(stem, outputs=too_small), timeout=30), "give it a region of at least")
    assert_seed_answered(server.url)


@pytest.mark.live
def test_a_region_unregistered_is_400(server, region):
    stem, obj = region
    assert register(server.url, stem, f"/attn-{stem}", obj.size).status_code == 200
    assert requests.post(f"{server.url}{INFER}", json=shm_body(stem), timeout=30).status_code == 200
    assert requests.post(f"{server.url}/v2/systemsharedmemory/region/{stem}/unregister", timeout=30).status_code == 200
    refused(requests.post(f"{server.url}{INFER}", json=shm_body(stem), timeout=30), "no shared-memory region named")
    refused(requests.get(f"{server.url}/v2/systemsharedmemory/region/{stem}/status", timeout=30), "no shared-memory region named")
    assert_seed_answered(server.url)


@pytest.mark.live
def test_a_region_resized_or_unlinked_under_the_server_is_400(server, region):
    """The object shrunk (ftruncate) after its region was registered: reading or writing it would
    touch a mapping past its file (SIGBUS); it is refused instead, and so is an object unlinked."""
    stem, obj = region
    assert register(server.url, stem, f"/attn-{stem}", obj.size).status_code == 200
    os.ftruncate(obj._fd, Q.nbytes)  # noqa: SLF001 - the object's own descriptor: what a client that resizes it does
    refused(requests.post(f"{server.url}{INFER}", json=shm_body(stem), timeout=30), "which holds")
    out_region = [{"name": "out", "parameters": {"shared_memory_region": stem, "shared_memory_byte_size": Q.nbytes}}]
    body = infer_body(return_weights=False)
    body["outputs"] = out_region
    refused(requests.post(f"{server.url}{INFER}", json=body, timeout=30), "which holds")
    obj.unlink()
    obj.unlink = lambda: None  # the fixture's unlink: done
    refused(requests.post(f"{server.url}{INFER}", json=shm_body(stem), timeout=30), "no shared-memory object named")
    assert_seed_answered(server.url)


def test_inputs_in_shared_memory_count_against_the_body_limit():
    """What a request reads out of regions is bounded as its body is (ATTN_MAX_BODY_BYTES)."""
    app = create_app(Settings(warmup=False, allow_client_shm=True, max_body_bytes=2 * Q.nbytes + 1024))
    client, stem = app.test_client(), secrets.token_hex(4)
    obj = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=3 * Q.nbytes)
    try:
        np.frombuffer(obj.buf, np.float32, count=3 * Q.size)[:] = np.concatenate([Q.ravel(), K.ravel(), V.ravel()])
        register = {"key": f"/attn-{stem}", "byte_size": obj.size}
        assert client.post(f"/v2/systemsharedmemory/region/{stem}/register", json=register).status_code == 200
        resp = client.post(INFER, json=shm_body(stem))
        assert resp.status_code == 413 and "ATTN_MAX_BODY_BYTES" in resp.get_json()["error"], resp.get_json()
        assert resp.get_json()["error"].startswith(f"the inputs in shared memory come to {3 * Q.nbytes} bytes by input v")
    finally:
        obj.close()
        obj.unlink()


def test_a_fifo_named_as_a_key_is_refused_without_blocking(shm_app):
    """A FIFO opened for reading blocks until a writer comes: the server must not open one so."""
    directory = "/dev/shm"
    if not os.path.isdir(directory):
        pytest.skip("no /dev/shm")
    name = f"attn-fifo-{secrets.token_hex(4)}"
    os.mkfifo(os.path.join(directory, name))
    try:
        resp = shm_app.test_client().post("/v2/systemsharedmemory/region/f/register", json={"key": f"/{name}", "byte_size": 8})
        assert resp.status_code == 400 and "not a regular file" in resp.get_json()["error"]
    finally:
        os.unlink(os.path.join(directory, name))


def test_cuda_shared_memory_has_no_region(shm_app):
    """No GPU: nothing to list or unregister (perf_analyzer and the tritonclient example clean up
    both kinds), and registering is a 400."""
    client = shm_app.test_client()
    assert client.post("/v2/cudasharedmemory/unregister").status_code == 200
    assert client.get("/v2/cudasharedmemory/status").get_json() == []
    resp = client.post("/v2/cudasharedmemory/region/g/register", json={"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8})
    assert resp.status_code == 400 and "no GPU" in resp.get_json()["error"]


def test_a_malformed_register_request_is_400(shm_app):
    resp = shm_app.test_client().post("/v2/systemsharedmemory/region/r/register", json={"key": "/x"})
    assert resp.status_code == 400 and '"key"' in resp.get_json()["error"]


@pytest.mark.parametrize(
    ("parameters", "pattern"),
    [
        ({"shared_memory_region": "r"}, "needs both shared_memory_region and shared_memory_byte_size"),
        ({"shared_memory_byte_size": 64}, "needs both"),
        ({"shared_memory_region": 5, "shared_memory_byte_size": 64}, "it must be a region's name"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, "it must be a byte count"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": "0"}, "it must be a byte count"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 1 << 62}, "pass the end of region"),
        ({"shared_memory_region": "elsewhere", "shared_memory_byte_size": 64}, "no shared-memory region named"),
    ],
    ids=["no-size", "no-region", "region-not-a-name", "negative-size", "offset-a-string", "offset-huge", "not-registered"],
)
def test_malformed_shared_memory_parameters_are_400(shm_app, parameters, pattern):
    client, stem = shm_app.test_client(), secrets.token_hex(4)
    obj = shared_memory.SharedMemory(f"/attn-{stem}", create=True, size=4096)
    try:
        assert client.post("/v2/systemsharedmemory/region/r/register", json={"key": f"/attn-{stem}", "byte_size": 4096}).status_code == 200
        body = infer_body()
        body["inputs"][0] = {"name": "q", "datatype": "FP32", "shape": list(Q.shape), "parameters": parameters}
        resp = client.post(INFER, json=body)
        assert resp.status_code == 400 and re.search(pattern, resp.get_json()["error"]), resp.get_json()
        body = infer_body()
        body["outputs"] = [{"name": "out", "parameters": parameters}]
        resp = client.post(INFER, json=body)
        assert resp.status_code == 400 and re.search(pattern, resp.get_json()["error"]), resp.get_json()
    finally:
        obj.close()
        obj.unlink()
