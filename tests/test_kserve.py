"""The Open Inference Protocol front door (/v2): the official Triton client against the live
server, equal to the native endpoints; and the protocol's error shape via the Flask client."""

from __future__ import annotations

import json
import urllib.parse

import numpy as np
import orjson
import pytest
import requests
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from schemas import RequestError
from schemas.kserve import BinaryInput
from service import core
from service.web.context import services
from service.web.kserve import ENVELOPES
from service.wire import json as wire_json
from service.wire import stream

from .helpers import Q, V, b64, tensor

# --- the official client against the live server ------------------------------------------------


@pytest.fixture(scope="module")
def triton_client(live_server):
    client = triton.InferenceServerClient(live_server.removeprefix("http://"), network_timeout=60)
    yield client
    client.close()


def native(live_server: str, path: str, body: dict) -> dict[str, np.ndarray]:
    """POST the native endpoint with b64 tensors; the response's tensors as arrays."""
    wire = {k: b64(v, v.dtype.name) if isinstance(v, np.ndarray) else v for k, v in body.items()}
    resp = requests.post(f"{live_server}{path}", json=wire, timeout=60)
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    return {name: tensor(doc[name]) for name in ("out", "weights") if name in doc}


def triton_inputs(arrays: dict[str, np.ndarray], binary: bool) -> list:
    types = {
        np.dtype("float32"): "FP32",
        np.dtype("float64"): "FP64",
        np.dtype("bool"): "BOOL",
        np.dtype("int32"): "INT32",
        np.dtype("int64"): "INT64",
    }
    inputs = []
    for name, arr in arrays.items():
        inp = triton.InferInput(name, list(arr.shape), types[arr.dtype])
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    return inputs


@pytest.mark.live
def test_health_and_metadata(triton_client):
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready("attention")
    assert triton_client.is_model_ready("mha")
    assert triton_client.is_model_ready("mha", model_version="1")
    assert not triton_client.is_model_ready("no-such-model")
    assert "binary_tensor_data" in triton_client.get_server_metadata()["extensions"]

    meta = triton_client.get_model_metadata("attention")
    assert meta["name"] == "attention" and meta["versions"] == ["1"]
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert list(inputs) == ["q", "k", "v", "mask", "key_lengths", "bias", "alibi_slopes"]
    assert inputs["q"]["datatype"] == "FP32" and inputs["mask"]["datatype"] == "BOOL" and inputs["key_lengths"]["datatype"] == "INT64"
    assert all(all(n == -1 for n in t["shape"]) for t in meta["inputs"] + meta["outputs"])
    assert [t["name"] for t in meta["outputs"]] == ["out", "weights", "lse"]
    assert {"enable_gqa", "window", "bias"} - set(meta["parameters"]) == {"bias"}  # bias is an input
    mha = triton_client.get_model_metadata("mha")
    assert [t["name"] for t in mha["inputs"]] == ["x", "wq", "wk", "wv", "wo"]
    assert {"scale", "kv_heads", "window", "weights_dtype"} <= set(mha["parameters"])


@pytest.mark.live
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_batched_causal_equals_native(triton_client, live_server, rng, binary):
    q = rng.standard_normal((2, 3, 16, 8), dtype=np.float32)
    k = rng.standard_normal((2, 3, 16, 8), dtype=np.float32)
    v = rng.standard_normal((2, 3, 16, 4), dtype=np.float32)
    outputs = [triton.InferRequestedOutput("out", binary_data=binary), triton.InferRequestedOutput("weights", binary_data=binary)]
    result = triton_client.infer(
        "attention",
        triton_inputs({"q": q, "k": k, "v": v}, binary),
        outputs=outputs,
        parameters={"causal": True},
        request_id="batched-causal",
    )
    want = native(live_server, "/attention", {"q": q, "k": k, "v": v, "causal": True})

    assert result.get_response()["id"] == "batched-causal"
    for name in ("out", "weights"):
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and got.shape == want[name].shape
        np.testing.assert_array_equal(got, want[name])
        assert ("binary_data_size" in (result.get_output(name).get("parameters") or {})) == binary
    assert np.all(np.triu(result.as_numpy("weights"), k=1) == 0)  # causal: nothing above the diagonal


@pytest.mark.live
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_bool_mask_equals_native(triton_client, live_server, rng, binary):
    q = rng.standard_normal((4, 6, 8), dtype=np.float32)
    k = rng.standard_normal((4, 10, 8), dtype=np.float32)
    v = rng.standard_normal((4, 10, 3), dtype=np.float32)
    mask = rng.random((6, 10)) > 0.4
    mask[2] = False  # a row with no allowed key: zeros, not NaN
    inputs = triton_inputs({"q": q, "k": k, "v": v, "mask": mask}, binary)
    result = triton_client.infer(
        "attention", inputs, outputs=[triton.InferRequestedOutput(n, binary_data=binary) for n in ("out", "weights")]
    )
    want = native(live_server, "/attention", {"q": q, "k": k, "v": v, "mask": mask})
    for name in ("out", "weights"):
        np.testing.assert_array_equal(result.as_numpy(name), want[name])
    assert np.all(result.as_numpy("weights")[:, ~mask] == 0)
    assert np.all(result.as_numpy("out")[:, 2] == 0)


@pytest.mark.live
def test_infer_default_outputs_are_binary_and_options_apply(triton_client, rng):
    """No outputs requested: the client asks binary_data_output; parameters carry the options."""
    q = rng.standard_normal((5, 4))
    k = rng.standard_normal((7, 4))
    v = rng.standard_normal((7, 2))
    lengths = np.array(5, dtype=np.int32)
    result = triton_client.infer(
        "attention",
        triton_inputs({"q": q, "k": k, "v": v, "key_lengths": lengths}, binary=True),
        parameters={"causal": "bottom_right", "scale": 0.5, "dtype": "float64"},
    )
    out, weights = result.as_numpy("out"), result.as_numpy("weights")
    assert out.dtype == np.float64 and result.get_output("out")["datatype"] == "FP64"
    assert "binary_data_size" in result.get_output("out")["parameters"]
    want_out, want_w = core.attention(q, k, v, causal="bottom_right", key_lengths=lengths.astype(np.int64), scale=0.5)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights, want_w, rtol=0, atol=1e-12)


@pytest.mark.live
def test_infer_only_out_skips_the_weights(triton_client, rng):
    q = rng.standard_normal((3, 4), dtype=np.float32)
    result = triton_client.infer(
        "attention", triton_inputs({"q": q, "k": q, "v": q}, binary=True), outputs=[triton.InferRequestedOutput("out")]
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["out"]
    assert result.as_numpy("weights") is None


@pytest.mark.live
def test_mha_equals_native(triton_client, live_server, rng):
    x = rng.standard_normal((2, 12, 16), dtype=np.float32)
    ws = {n: (rng.standard_normal((16, 16)) / 4).astype(np.float32) for n in ("wq", "wk", "wv", "wo")}
    result = triton_client.infer("mha", triton_inputs({"x": x, **ws}, binary=True), parameters={"heads": 4})
    want = native(live_server, "/mha", {"x": x, **ws, "heads": 4})
    np.testing.assert_array_equal(result.as_numpy("out"), want["out"])
    np.testing.assert_array_equal(result.as_numpy("weights"), want["weights"])
    assert result.as_numpy("weights").shape == (2, 4, 12, 12)


@pytest.mark.live
def test_client_sees_refusals_as_exceptions(triton_client, rng):
    q = rng.standard_normal((3, 4), dtype=np.float32)
    k = rng.standard_normal((3, 5), dtype=np.float32)
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer("attention", triton_inputs({"q": q, "k": k, "v": k}, binary=True))
    assert info.value.status() == "400"
    assert info.value.message() == "input k has d=5 but q has d=4."


@pytest.mark.live
def test_infer_sets_server_timing(live_server):
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [2, 2], "data": [1, 0, 0, 1]} for n in ("q", "k", "v")]}
    resp = requests.post(f"{live_server}/v2/models/attention/infer", data=json.dumps(body), timeout=30)
    assert resp.status_code == 200
    phases = [part.split(";")[0] for part in resp.headers["Server-Timing"].split(", ")]
    assert phases == ["decode", "validate", "compute", "encode", "total"]


# --- the envelope and its errors, via the Flask client ---------------------------------------------

SEED = {
    "inputs": [
        {"name": "q", "datatype": "FP32", "shape": [3, 2], "data": Q},
        {"name": "k", "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 1, 1, 1]},
        {"name": "v", "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 10, 5, 5]},
    ],
    "parameters": {"causal": True},
}


def infer(client, body, *, headers=None, model="attention"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(f"/v2/models/{model}/infer", data=raw, headers=headers or {})


def binary_request(tensors: dict[str, np.ndarray], datatypes: dict[str, str], **extra) -> tuple[bytes, dict]:
    inputs = [
        {"name": n, "datatype": datatypes[n], "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
        for n, a in tensors.items()
    ]
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(a.tobytes() for a in tensors.values()), {"Inference-Header-Content-Length": str(len(header))}


def framed(header: dict, blob: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + blob, {"Inference-Header-Content-Length": str(len(head))}


def with_input(name: str, **changes) -> dict:
    body = json.loads(json.dumps(SEED))
    for spec in body["inputs"]:
        if spec["name"] == name:
            spec.update(changes)
            if spec["data"] is None:
                del spec["data"]
    return body


def renamed(name) -> dict:
    """SEED with its first input's name replaced (by any JSON value)."""
    body = json.loads(json.dumps(SEED))
    body["inputs"][0]["name"] = name
    return body


def test_seed_example_without_content_type(client):
    resp = infer(client, SEED)
    assert resp.request.content_type is None  # sent with no Content-Type at all, as tritonclient does
    assert resp.status_code == 200, resp.get_json()
    doc = resp.get_json()
    out = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in doc["outputs"]}
    q = np.array(Q, np.float32)
    want_out, want_w = core.attention(q, q, np.array(V, np.float32), causal="top_left")
    np.testing.assert_array_equal(out["out"], want_out)
    np.testing.assert_array_equal(out["weights"], want_w)
    assert doc["model_name"] == "attention" and doc["model_version"] == "1"
    assert doc["parameters"]["score_elements"] == 9


def test_binary_in_and_out_round_trip(client, rng):
    q = rng.standard_normal((2, 5, 4)).astype(np.float32)
    mask = rng.random((5, 5)) > 0.3
    body, headers = binary_request(
        {"q": q, "k": q, "v": q, "mask": mask},
        {"q": "FP32", "k": "FP32", "v": "FP32", "mask": "BOOL"},
        parameters={"binary_data_output": True},
        outputs=[{"name": "weights", "parameters": {"binary_data": False}}, {"name": "out"}],
    )
    resp = infer(client, body, headers=headers)
    assert resp.status_code == 200, resp.data[:300]
    assert resp.mimetype == "application/octet-stream"
    size = int(resp.headers["Inference-Header-Content-Length"])
    head = json.loads(resp.data[:size])
    assert [o["name"] for o in head["outputs"]] == ["weights", "out"]  # in the requested order
    weights = np.array(head["outputs"][0]["data"], np.float32).reshape(head["outputs"][0]["shape"])
    assert head["outputs"][1]["parameters"]["binary_data_size"] == 2 * 5 * 4 * 4
    out = np.frombuffer(resp.data[size:], dtype="<f4").reshape(head["outputs"][1]["shape"])
    want_out, want_w = core.attention(q, q, q, mask)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(weights, want_w)


def test_a_large_binary_answer_streams_the_same_bytes(client, monkeypatch, rng):
    """Past JOIN_MAX_BYTES the tensors go out in pieces of RAW_CHUNK (no joined copy), with the
    same bytes and length (both made small here, so that a small answer is large)."""
    monkeypatch.setattr(stream, "JOIN_MAX_BYTES", 64)
    monkeypatch.setattr(stream, "RAW_CHUNK", 50)
    q = rng.standard_normal((2, 3, 6, 4)).astype(np.float32)
    body, headers = binary_request(
        {"q": q, "k": q, "v": q}, {"q": "FP32", "k": "FP32", "v": "FP32"}, parameters={"binary_data_output": True}
    )
    resp = infer(client, body, headers=headers)
    assert resp.status_code == 200, resp.data[:300]
    assert resp.is_streamed and int(resp.headers["Content-Length"]) == len(resp.data)
    size = int(resp.headers["Inference-Header-Content-Length"])
    head = json.loads(resp.data[:size])
    want_out, want_w = core.attention(q, q, q)
    out_bytes = head["outputs"][0]["parameters"]["binary_data_size"]
    np.testing.assert_array_equal(np.frombuffer(resp.data[size : size + out_bytes], "<f4").reshape(want_out.shape), want_out)
    np.testing.assert_array_equal(np.frombuffer(resp.data[size + out_bytes :], "<f4").reshape(want_w.shape), want_w)


def test_binary_and_json_inputs_mix(client):
    v = np.array(V, np.float32)
    header = json.loads(json.dumps(SEED))
    header["inputs"][2] = {"name": "v", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": v.nbytes}}
    head = json.dumps(header).encode()
    resp = infer(client, head + v.tobytes(), headers={"Inference-Header-Content-Length": str(len(head))})
    assert resp.status_code == 200
    assert resp.get_json()["outputs"][0]["data"] == infer(client, SEED).get_json()["outputs"][0]["data"]


def test_versioned_paths(client):
    assert client.post("/v2/models/attention/versions/1/infer", data=json.dumps(SEED)).status_code == 200
    assert client.get("/v2/models/mha/versions/1").get_json()["name"] == "mha"


def test_get_on_infer_is_405_in_the_protocol_shape(client):
    resp = client.get("/v2/models/attention/infer")
    assert resp.status_code == 405 and isinstance(resp.get_json()["error"], str)


REFUSALS = [
    # (id, body or (bytes, headers), status, words the message must hold)
    ("bad-datatype", with_input("q", datatype="BF16"), 400, "input q has datatype 'BF16'; it must be FP32 or FP64 or FP16"),
    ("bool-q", with_input("q", datatype="BOOL", data=[True] * 6), 400, "input q has datatype 'BOOL'"),
    (
        "mask-not-bool",
        {**SEED, "inputs": SEED["inputs"] + [{"name": "mask", "datatype": "FP32", "shape": [3, 3], "data": [1] * 9}]},
        400,
        "input mask has datatype 'FP32'; it must be BOOL",
    ),
    ("shape-data-mismatch", with_input("k", shape=[3, 3]), 400, "input k has 6 data values but shape [3, 3] needs 9"),
    ("ragged", with_input("q", data=[[1, 0], [0], [1, 1, 1]]), 400, "input q has data that is not rectangular"),
    ("ragged-inside", with_input("q", data=[[1, [0]], [0, 1], [1, 1]]), 400, "input q has data that is not rectangular"),
    ("number-among-rows", with_input("q", data=[[1, 0], 5, [1, 1]]), 400, "input q has data that is not rectangular"),
    ("nested-against-shape", with_input("q", data=[[1, 0, 0], [1, 1, 1]]), 400, "input q has data nested as [2, 3] but shape [3, 2]"),
    ("string-data", with_input("q", data=["a"] * 6), 400, "input q must hold numbers"),
    ("zero-axis", with_input("q", shape=[0, 2], data=[]), 400, "every axis must be at least 1"),
    ("d-mismatch", with_input("k", shape=[2, 3]), 400, "input k has d=3 but q has d=2"),
    (
        "unknown-input",
        {**SEED, "inputs": SEED["inputs"] + [{"name": "z", "datatype": "FP32", "shape": [1], "data": [1]}]},
        400,
        "input 'z' is not an input of model attention",
    ),
    ("missing-input", {**SEED, "inputs": SEED["inputs"][:2]}, 400, "input v is required"),
    # every envelope value is type-checked before it is used as a key (a list is unhashable)
    ("name-is-a-list", renamed(["q"]), 400, "each of inputs needs a name (a string), not ['q']"),
    ("name-is-an-object", renamed({"q": 1}), 400, "each of inputs needs a name (a string)"),
    ("name-missing", renamed(None), 400, "each of inputs needs a name (a string), not None"),
    ("output-name-is-a-list", {**SEED, "outputs": [{"name": ["out"]}]}, 400, "each of outputs needs a name (a string)"),
    ("output-name-is-an-object", {**SEED, "outputs": [{"name": {}}]}, 400, "each of outputs needs a name (a string)"),
    ("duplicate-input", {**SEED, "inputs": SEED["inputs"] + SEED["inputs"][:1]}, 400, "input q is given twice"),
    ("unknown-parameter", {**SEED, "parameters": {"casual": True}}, 400, "parameter 'casual' is not a parameter of model attention"),
    ("bad-causal", {**SEED, "parameters": {"causal": "yes"}}, 400, "parameter causal must be one of"),
    ("bad-scale", {**SEED, "parameters": {"scale": -1}}, 400, "parameter scale"),
    ("unknown-output", {**SEED, "outputs": [{"name": "attn"}]}, 400, "output 'attn' is not an output"),
    (
        "weights-requested-but-off",
        {**SEED, "parameters": {"return_weights": False}, "outputs": [{"name": "weights"}]},
        400,
        "return_weights is false",
    ),
    ("unknown-request-field", {**SEED, "input": []}, 400, "'input' is not a field of an infer request"),
    ("no-inputs", {"parameters": {}}, 400, "inputs must be a non-empty list"),
    ("bad-json", b"{not json", 400, "not valid strict JSON"),
    ("nan", b'{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [NaN]}]}', 400, "not valid strict JSON"),
    ("over-max-t", with_input("q", shape=[65, 2], data=[1.0] * 130), 413, "input q has T=65, over the maximum of 64"),
    (
        "binary-size-short",
        framed(with_input("q", data=None, parameters={"binary_data_size": 20}), bytes(20)),
        400,
        "input q has 20 bytes but shape [3, 2] of float32 needs 24",
    ),
    (
        "binary-size-past-end",
        framed(with_input("q", data=None, parameters={"binary_data_size": 24}), bytes(4)),
        400,
        "input q declares binary_data_size=24 but only 4 bytes of binary data are left",
    ),
    (
        "binary-and-data",
        framed(with_input("q", parameters={"binary_data_size": 24}), bytes(24)),
        400,
        "input q has both data and binary_data_size",
    ),
    (
        "shared-memory",
        with_input("q", parameters={"shared_memory_region": "r"}),
        400,
        "input q needs both shared_memory_region and shared_memory_byte_size",
    ),
    ("binary-leftover", framed(SEED, bytes(2)), 400, "2 bytes of binary data follow the JSON header"),
    (
        "bad-header-length",
        (json.dumps(SEED).encode(), {"Inference-Header-Content-Length": "lots"}),
        400,
        "Inference-Header-Content-Length is 'lots'",
    ),
    (
        "header-length-past-end",
        (json.dumps(SEED).encode(), {"Inference-Header-Content-Length": "100000"}),
        400,
        "Inference-Header-Content-Length is '100000'",
    ),
    (
        "bool-bytes-not-0-1",
        binary_request(
            {
                "q": np.zeros((3, 2), np.float32),
                "k": np.zeros((3, 2), np.float32),
                "v": np.zeros((3, 2), np.float32),
                "mask": np.full((3, 3), 7, np.uint8),
            },
            {"q": "FP32", "k": "FP32", "v": "FP32", "mask": "BOOL"},
        ),
        400,
        "input mask has bool bytes other than 0 and 1",
    ),
    ("brotli", (json.dumps(SEED).encode(), {"Content-Encoding": "br"}), 415, "Content-Encoding 'br' is not accepted"),
    ("gzip-not-gzip", (json.dumps(SEED).encode(), {"Content-Encoding": "gzip"}), 400, "not a valid gzip stream"),
    ("body-too-large", framed(SEED, bytes(200_000)), 413, "larger than the limit of 200000 bytes (ATTN_MAX_BODY_BYTES)"),
]


@pytest.mark.parametrize(("body", "status", "words"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_are_protocol_errors(client, body, status, words):
    if isinstance(body, tuple):
        resp = infer(client, body[0], headers=body[1])
    else:
        resp = infer(client, body)
    doc = resp.get_json()
    assert resp.status_code == status, doc
    assert set(doc) == {"error"} and isinstance(doc["error"], str)
    assert words in doc["error"]
    # and the next request is served as if nothing had happened
    assert infer(client, SEED).status_code == 200


@pytest.mark.parametrize(
    "path", ["/v2/models/nope", "/v2/models/nope/ready", "/v2/models/attention/versions/2", "/v2/models/attention/versions/2/ready"]
)
def test_unknown_models_and_versions_are_404(client, path):
    for method in ("GET", "OPTIONS"):  # Flask answers OPTIONS without the view: the model is looked up all the same
        resp = client.open(path, method=method)
        assert resp.status_code == 404 and set(resp.get_json()) == {"error"}, (method, resp.get_json())


@pytest.mark.parametrize("path", ["/v2/models/attention", "/v2/models/mha/versions/1/infer"])
def test_options_on_a_served_model_lists_its_methods(client, path):
    resp = client.open(path, method="OPTIONS")
    assert resp.status_code == 200 and resp.get_json()["allow"] == sorted(resp.allow)


def test_unknown_model_infer_is_404(client):
    resp = infer(client, SEED, model="nope")
    assert resp.status_code == 404
    assert resp.get_json() == {"error": "Model 'nope' is not served here; the models are: attention, attention_sequence, mha."}


def test_not_ready_answers_503(app, client):
    services(app).ready = False
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/models/attention/ready").status_code == 503
    assert client.get("/v2/health/live").status_code == 200


# --- the attention variants under the protocol ---------------------------------------------------


@pytest.mark.live
def test_variants_through_the_official_client(triton_client, live_server, rng):
    """FP16 inputs, GQA, a window as the protocol's string parameter, a bias and ALiBi slopes as
    inputs, FP16 weights: equal to the native endpoint given the same request."""
    q = rng.standard_normal((2, 4, 12, 8)).astype(np.float16)
    k = rng.standard_normal((2, 2, 12, 8)).astype(np.float16)
    v = rng.standard_normal((2, 2, 12, 4)).astype(np.float16)
    bias = rng.standard_normal((12, 12)).astype(np.float32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    inputs = []
    for name, arr, datatype in (
        ("q", q, "FP16"),
        ("k", k, "FP16"),
        ("v", v, "FP16"),
        ("bias", bias, "FP32"),
        ("alibi_slopes", slopes, "FP32"),
    ):
        inp = triton.InferInput(name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
    options = {"enable_gqa": True, "causal": True, "weights_dtype": "float16"}
    result = triton_client.infer("attention", inputs, parameters={**options, "window": "3,0"})
    want = native(live_server, "/attention", {"q": q, "k": k, "v": v, "bias": bias, "alibi_slopes": slopes, **options, "window": [3, 0]})
    assert result.get_output("weights")["datatype"] == "FP16" and result.get_output("out")["datatype"] == "FP32"
    np.testing.assert_array_equal(result.as_numpy("out"), want["out"])
    np.testing.assert_array_equal(result.as_numpy("weights"), want["weights"])


TEXTBOOK = {
    "x": [[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]],
    "wq": [[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]],
    "wk": [[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]],
    "wv": [[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]],
}


def test_mha_textbook_listing_without_wo(client):
    inputs = [{"name": n, "datatype": "FP64", "shape": [len(a), len(a[0])], "data": a} for n, a in TEXTBOOK.items()]
    resp = infer(client, {"inputs": inputs, "parameters": {"heads": 1, "scale": 1, "causal": False}}, model="mha")
    assert resp.status_code == 200, resp.get_json()
    out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in resp.get_json()["outputs"]}
    np.testing.assert_allclose(out["out"][0], [1.9366, 6.6831, 1.5951], atol=1e-4)
    np.testing.assert_allclose(out["weights"][0, 0], [0.0634, 0.4683, 0.4683], atol=1e-4)


@pytest.mark.parametrize("window", [[2, 0], "2,0", "2, 0"], ids=["list", "string", "string with a space"])
def test_window_parameter_as_list_or_string(client, window):
    body = json.loads(json.dumps(SEED))
    body["parameters"] = {"window": window, "average_weights": False}
    resp = infer(client, body)
    assert resp.status_code == 200, resp.get_json()
    want_out, _ = core.attention(np.array(Q, np.float32), np.array(Q, np.float32), np.array(V, np.float32), window=(2, 0))
    out = resp.get_json()["outputs"][0]
    np.testing.assert_array_equal(np.array(out["data"], np.float32).reshape(out["shape"]), want_out)


def with_parameters(**params) -> dict:
    body = json.loads(json.dumps(SEED))
    body["parameters"] = params
    return body


H4 = {"name": "q", "datatype": "FP32", "shape": [4, 2, 2], "data": [1, 0, 0, 1] * 4}
H3 = [{"name": n, "datatype": "FP32", "shape": [3, 2, 2], "data": [1, 0, 0, 1] * 3} for n in ("k", "v")]
H2 = [{"name": n, "datatype": "FP32", "shape": [2, 2, 2], "data": [1, 0, 0, 1] * 2} for n in ("k", "v")]

VARIANT_REFUSALS = [
    # (id, body, words the message must hold)
    ("window not two integers", with_parameters(window="a,b"), "parameter window must be [left, right]"),
    ("window below -1", with_parameters(window="-2,0"), "parameter window values must be integers >= -1"),
    ("weights_dtype", with_parameters(weights_dtype="int8"), "parameter weights_dtype must be one of"),
    ("average_weights on rank 2", with_parameters(average_weights=True), "parameter average_weights averages over the heads axis -3"),
    ("gqa heads do not divide", {"inputs": [H4, *H3], "parameters": {"enable_gqa": True}}, "input k has 3 key/value heads"),
    ("head mismatch without gqa", {"inputs": [H4, *H2]}, '"enable_gqa": true'),
    (
        "bias does not broadcast",
        {**SEED, "inputs": SEED["inputs"] + [{"name": "bias", "datatype": "FP32", "shape": [2], "data": [0, 0]}]},
        "input bias has shape [2]",
    ),
    (
        "alibi on rank 2",
        {**SEED, "inputs": SEED["inputs"] + [{"name": "alibi_slopes", "datatype": "FP32", "shape": [1], "data": [1]}]},
        "input alibi_slopes has shape [1]",
    ),
    ("bias as BOOL", {**SEED, "inputs": SEED["inputs"] + [{"name": "bias", "datatype": "BOOL", "shape": [1], "data": [True]}]}, "FP32"),
]


@pytest.mark.parametrize(("body", "words"), [r[1:] for r in VARIANT_REFUSALS], ids=[r[0] for r in VARIANT_REFUSALS])
def test_variant_refusals_are_protocol_errors(client, body, words):
    resp = infer(client, body)
    doc = resp.get_json()
    assert resp.status_code == 400, doc
    assert set(doc) == {"error"} and words in doc["error"]


def test_metadata_lists_the_variants(client):
    meta = client.get("/v2/models/attention").get_json()
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert inputs["bias"]["parameters"]["optional"] and inputs["alibi_slopes"]["parameters"]["optional"]
    assert "FP16" in inputs["q"]["parameters"]["datatypes"]
    assert {"enable_gqa", "window", "average_weights", "weights_dtype", "scale"} <= set(meta["parameters"])
    mha = client.get("/v2/models/mha").get_json()
    assert {t["name"]: t for t in mha["inputs"]}["wo"]["parameters"]["optional"]
    assert {"kv_heads", "scale", "window", "weights_dtype"} <= set(mha["parameters"])


def test_refusals_carry_their_code_and_field_in_headers(client):
    """The protocol's error body has only a message: X-Error-Code and X-Error-Field give a /v2
    client the code and field the native door's body has."""
    v2 = infer(client, with_input("k", shape=[3, 3], data=[1.0] * 9))
    native_resp = client.post("/attention", json={"q": Q, "k": [[1.0] * 3] * 3, "v": V})
    for resp, status in ((v2, 400), (native_resp, 422)):  # the protocol's status at /v2 (errors.PROTOCOL_STATUS)
        assert resp.status_code == status, resp.data[:300]
        assert (resp.headers["X-Error-Code"], resp.headers.get("X-Error-Field")) == ("shape_mismatch", "k"), resp.data[:300]
    assert native_resp.get_json()["error"]["code"] == "shape_mismatch"
    no_field = infer(client, b"{", headers={})
    assert no_field.status_code == 400 and no_field.headers["X-Error-Code"] == "bad_json" and "X-Error-Field" not in no_field.headers


@pytest.mark.parametrize("key", ["\u0100", "a\r\nSet-Cookie: x=1", "50%", "k" * 300])
def test_a_field_named_by_the_client_is_a_valid_header(live_server, key):
    """X-Error-Field names a key the client sent, which can be any text: the real server (gunicorn
    refuses a header value it cannot send: that was a 500) answers 422 with the field
    percent-encoded in printable ASCII, never split into another header, and none past 256."""
    resp = requests.post(
        f"{live_server}/attention", data=orjson.dumps({key: None}), headers={"Content-Type": "application/json"}, timeout=30
    )
    field = resp.json()["error"]["field"]  # a long key is shortened there
    assert resp.status_code == 422 and (field == key or len(key) > 256), resp.text[:300]
    assert "Set-Cookie" not in resp.headers
    header = resp.headers.get("X-Error-Field")
    if len(urllib.parse.quote(field)) > 256:
        assert header is None
    else:
        assert header.isascii() and header.isprintable() and urllib.parse.unquote(header) == field


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_unaligned_binary_inputs_give_the_native_bits(client, rng, pad):
    """tritonclient does not pad its JSON header, so a tensor can start at any byte of the body:
    the answer is still bit for bit the one of aligned arrays (numpy's unaligned loops round differently)."""
    q, k, v = (rng.standard_normal((1, 2, 48, 40)).astype(np.float32) for _ in range(3))
    body, headers = binary_request({"q": q, "k": k, "v": v}, dict.fromkeys("qkv", "FP32"), parameters={"causal": True})
    header_len = int(headers["Inference-Header-Content-Length"])
    body = body[:header_len] + b" " * pad + body[header_len:]  # JSON allows trailing whitespace in the header
    resp = infer(client, body, headers={"Inference-Header-Content-Length": str(header_len + pad)})
    assert resp.status_code == 200, resp.data[:300]
    outputs = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in resp.get_json()["outputs"]}
    want_out, want_w = core.attention(q, k, v, causal="top_left")
    np.testing.assert_array_equal(outputs["out"], want_out)
    np.testing.assert_array_equal(outputs["weights"], want_w)


# --- JSON inputs large enough for wire.loads' fast path answer as the plain parse does ----------------

BIG = [[float(i * 16 + j) / 7 for j in range(16)] for i in range(8)]  # 128 numbers: the fast path decodes them
BIG_FLAT = [x for row in BIG for x in row]


def big_seed(q_data, q_shape=(8, 16), q_type="FP32", extra=()) -> dict:
    """SEED at (8, 16) per tensor, with q's data, shape and datatype as given, plus extra inputs."""
    inputs = [
        {"name": "q", "datatype": q_type, "shape": list(q_shape), "data": q_data},
        {"name": "k", "datatype": "FP32", "shape": [8, 16], "data": BIG_FLAT},
        {"name": "v", "datatype": "FP64", "shape": [8, 16], "data": BIG},
    ]
    return {"inputs": inputs + list(extra), "parameters": {"causal": True}}


def mask_input(data, shape=(8, 8)) -> dict:
    return {"name": "mask", "datatype": "BOOL", "shape": list(shape), "data": data}


def with_row(row: int, value) -> list:
    rows = [r[:] for r in BIG]
    rows[row] = value
    return rows


BIG_BODIES = {
    "flat": big_seed(BIG_FLAT),
    "nested": big_seed(BIG),
    "integers": big_seed([i % 5 for i in range(128)]),
    "integers as INT64 for FP64": big_seed([i % 5 for i in range(128)], q_type="FP64"),
    "fractions for INT64": big_seed(BIG_FLAT, q_type="INT64"),
    "nested against the shape": big_seed(BIG, q_shape=(16, 8)),
    "flat too short": big_seed(BIG_FLAT[:-1] + [[1.0]]),
    "ragged": big_seed(with_row(3, BIG[3][:15])),
    "a list in a row": big_seed(with_row(3, BIG[3][:15] + [[1.0]])),
    "a number for a row": big_seed(with_row(3, 1.0)),
    "a boolean among numbers": big_seed(BIG_FLAT[:-1] + [True]),
    "a string among numbers": big_seed(BIG_FLAT[:-1] + ["1"]),
    "a null among numbers": big_seed(BIG_FLAT[:-1] + [None]),
    "big integers": big_seed([2**63 + 1] * 128),
    "a mask of booleans": big_seed(BIG_FLAT, extra=[mask_input([[c <= r for c in range(8)] for r in range(8)] * 1)]),
    "a mask of numbers": big_seed(BIG_FLAT, extra=[mask_input([1] * 64)]),
}


@pytest.mark.parametrize("body", list(BIG_BODIES.values()), ids=list(BIG_BODIES))
def test_json_inputs_answer_as_the_plain_parse_does(client, monkeypatch, body):
    """wire.loads decodes each input's "data" of 64 numbers or more to numpy (the fast path);
    what the client gets, answer or refusal, is what orjson's plain parse gives."""
    raw = orjson.dumps(body)
    fast = infer(client, raw)
    monkeypatch.setattr(wire_json, "_fast_loads", lambda body: None)
    plain = infer(client, raw)
    assert fast.status_code == plain.status_code, (fast.get_json(), plain.get_json())
    want = plain.get_json()
    got = fast.get_json()
    assert got.get("error") == want.get("error")
    assert got.get("outputs") == want.get("outputs")


@pytest.mark.parametrize("name", ["flat", "nested", "integers", "a boolean among numbers", "a mask of booleans"])
def test_json_inputs_take_the_fast_path(name):
    """Inputs of numbers come out of wire.loads as arrays, even beside an input it leaves to the schema."""
    doc = wire_json.loads(orjson.dumps(BIG_BODIES[name]))
    assert all(isinstance(spec["data"], np.ndarray) for spec in doc["inputs"][1:3])


def big_text(replace: bytes = b"", by: bytes = b"", q_data=BIG_FLAT) -> bytes:
    """big_seed's JSON text with q's first `replace` (after its "data":[) swapped for `by`: spellings
    orjson.dumps never writes (escapes, duplicates, 1E5, -0, numbers past float64)."""
    raw = orjson.dumps(big_seed(q_data))
    head, tail = raw.split(b'"data":[', 1)
    return head + b'"data":[' + tail.replace(replace, by, 1) if replace else raw


RAW_BODIES = {
    "-0, 1E5, 1e-400 and 5e-324": big_text(
        b"0.0,0.14285714285714285,0.2857142857142857,", b"-0,1E5,1e-400,", q_data=BIG_FLAT[:-1] + [5e-324]
    ),
    "integers with -0 first": big_text(b"0,1,2,", b"-0,-0,1E2,", q_data=[i % 5 for i in range(128)]),
    "a number past float64": big_text(b"0.0,", b"1e400,"),
    "a number past float32": big_text(b"0.0,", b"1e39,"),
    "an integer past uint64": big_text(b"0.0,", b"18446744073709551616,"),
    "an integer past int64 below": big_text(b"0.0,", b"-9223372036854775809,"),
    "a repeated data key": big_text(b"0.0,", b'1],"data":[0.0,'),
    "an escaped data key": big_text(b"0.0,", b'0.0],"d\\u0061ta":[0.0,'),
    "an escaped number-free string": big_text(b"0.0,", b'0.0],"note":"a\\"[b","x":[0.0,'),
    "inputs not a list": orjson.dumps({"inputs": big_seed(BIG_FLAT)["inputs"][0]}),
    "65 inputs": orjson.dumps({"inputs": big_seed(BIG_FLAT)["inputs"] + [mask_input([1] * 64)] * 62}),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 as FP32: refused after numpy's cast
@pytest.mark.parametrize("name", list(RAW_BODIES))
def test_json_texts_answer_as_the_plain_parse_does(client, monkeypatch, name):
    """Spellings of numbers and keys that orjson.dumps never writes: the fast path (simdjson)
    answers, or refuses, exactly as orjson's plain parse does."""
    raw = RAW_BODIES[name]
    fast = infer(client, raw)
    monkeypatch.setattr(wire_json, "_fast_loads", lambda body: None)
    plain = infer(client, raw)
    assert fast.status_code == plain.status_code, (fast.get_json(), plain.get_json())
    assert fast.status_code != 500, fast.get_json()
    assert fast.get_json().get("error") == plain.get_json().get("error")
    assert fast.get_json().get("outputs") == plain.get_json().get("outputs")


# --- the envelope's schema: read field by field as marshmallow's load reads it ---------------------


def _outcome(read, body: dict):
    try:
        env = read(json.loads(json.dumps(body)))
    except RequestError as exc:
        return "refused", exc.code, exc.message, exc.field
    native = {k: (v if isinstance(v, (bool, int, float, str, list, BinaryInput)) else sorted(v)) for k, v in env.native.items()}
    return "read", env.id, native, env.requested, env.binary


@pytest.mark.parametrize("model", ["attention", "attention_sequence", "mha"])
@pytest.mark.parametrize("body", [SEED] + [r[1] for r in REFUSALS + VARIANT_REFUSALS if isinstance(r[1], dict)])
def test_the_envelope_reads_as_marshmallow_loads(model, body):
    """The hot path's read (field by field, marshmallow's public Field.deserialize) and the
    schema's own load give the same envelope, or the same refusal."""
    schema = ENVELOPES[model]
    assert _outcome(schema.read, body) == _outcome(schema.load, body)
