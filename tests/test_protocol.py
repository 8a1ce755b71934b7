"""Conformance of the /v2 door to material its authors did not write: the Open Inference Protocol's
own OpenAPI document (tests/data/open_inference_rest.yaml, as KServe publishes it) run with
schemathesis against a live server, and protocol cases in the style of Triton's HTTP tests
(qa/L0_http: tritonclient.http and raw requests), where an invalid request is 400, Triton's status
and the protocol's.

The document is used as published but for what a test must do to run it and for its own defects,
each patched in protocol_document() and named there:

1. Its paths spell parameters `${NAME}`, not OpenAPI's `{NAME}` templates (schemathesis would send
   the text as it is): made templates.
2. The server metadata path is `/v2/`; the protocol's text (inference_rest.md) names it `v2` and
   Triton serves `/v2` alone: made `/v2`.
3. The model operations document no status for a model that is not served (the text says such a
   request gets an error object, and defines metadata_model_error_response, which the document
   never uses): 404 with that object added to each.

And one choice, not a defect: the document is generic over models, so the model and version
parameters are given the served ones (attention, mha; version 1) as their enum; schemathesis'
negative cases still send others, and get 404."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import requests
import tritonclient.http as triton
import yaml
from tritonclient.utils import InferenceServerException

from .helpers import ROOT

DOCUMENT = ROOT / "tests" / "data" / "open_inference_rest.yaml"
REPORT = ROOT / "out" / "schemathesis-protocol.json"
MAX_EXAMPLES = 200  # per operation and phase: small enough for CI (the run prints its running time)
MODELS, VERSIONS = ["attention", "mha"], ["1"]


def protocol_document() -> dict:
    """The protocol's document with the changes the module docstring lists (1, 2, 3, the enums)."""
    doc = yaml.safe_load(DOCUMENT.read_text())
    doc["paths"] = {re.sub(r"\$\{(\w+)\}", r"{\1}", path): item for path, item in doc["paths"].items()}  # 1
    doc["paths"]["/v2"] = doc["paths"].pop("/v2/")  # 2
    not_served = {
        "description": "the model or version is not served",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/metadata_model_error_response"}}},
    }
    for path, item in doc["paths"].items():
        for param in item.get("parameters", []):
            param["schema"]["enum"] = MODELS if param["name"] == "MODEL_NAME" else VERSIONS
        if "{MODEL_NAME}" in path:
            for method in ("get", "post"):
                if method in item:
                    item[method]["responses"]["404"] = not_served  # 3
    return doc


def test_the_stored_document_is_the_published_one():
    """Its source, commit and licence are named above the unmodified text."""
    head = DOCUMENT.read_text().splitlines()[:6]
    assert any("open-inference-protocol" in line and "open_inference_rest.yaml" in line for line in head)
    assert any(re.search(r"commit [0-9a-f]{40}", line) for line in head) and any("Apache-2.0" in line for line in head)
    doc = protocol_document()
    assert set(doc["paths"]) == {
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}",
        "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/ready",
        "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer",
    }


@pytest.mark.live
@pytest.mark.timeout(300)
def test_schemathesis_against_the_protocols_document(live_server, tmp_path):
    """Every check but positive_data_acceptance (a schema-valid infer request is rarely a valid
    attention request: JSON Schema cannot say that k's d equals q's), on every operation of the
    document, in every phase that applies: no 5xx, no undocumented status, no response outside
    its schema."""
    schema = tmp_path / "open_inference_rest.json"
    schema.write_text(json.dumps(protocol_document()))
    REPORT.parent.mkdir(exist_ok=True)
    seed = ["--seed", "20261201"] if os.environ.get("CI") else []
    cmd = [
        *(sys.executable, "-m", "schemathesis.cli", "run", str(schema), "--url", live_server),
        *("--max-examples", str(MAX_EXAMPLES), "--request-timeout", "30", "--workers", "2"),
        *("--checks", "all", "--exclude-checks", "positive_data_acceptance", "--no-color"),
        *("--report", "json", "--report-json-path", str(REPORT), *seed),
    ]
    proc = subprocess.run(cmd, cwd=REPORT.parent, capture_output=True, text=True, timeout=280)
    report = json.loads(REPORT.read_text())
    cases = report["test_cases"]
    print(f"\nschemathesis, the protocol's document: seed {report['seed']}, {cases['generated']} cases, {report['running_time']:.1f} s")
    assert proc.returncode == 0 and report["exit_code"] == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert report["complete"] and report["operations"]["tested"] == 6
    assert cases["with_failures"] == 0 and not report["failures"] and not report["errors"]
    assert all(report["phases"][p]["status"] == "success" for p in ("coverage", "fuzzing"))
    assert cases["generated"] >= MAX_EXAMPLES * 2  # it really ran


# --- Triton's HTTP cases ----------------------------------------------------------------------------

SHAPE = [2, 3, 4]  # (H, T, d)
RNG = np.random.default_rng(23)
ARRAYS = {n: RNG.standard_normal(SHAPE, dtype=np.float32) for n in ("q", "k", "v")}


def json_input(name: str, arr: np.ndarray, datatype: str = "FP32", shape: list | None = None) -> dict:
    return {"name": name, "datatype": datatype, "shape": list(arr.shape) if shape is None else shape, "data": arr.ravel().tolist()}


def request(**changes) -> dict:
    body = {"inputs": [json_input(n, a) for n, a in ARRAYS.items()], **changes}
    return {k: v for k, v in body.items() if v is not None}


def binary_request(sizes: dict | None = None, extra: bytes = b"") -> tuple[bytes, dict]:
    inputs = [
        {"name": n, "datatype": "FP32", "shape": SHAPE, "parameters": {"binary_data_size": (sizes or {}).get(n, a.nbytes)}}
        for n, a in ARRAYS.items()
    ]
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(a.tobytes() for a in ARRAYS.values()) + extra, {"Inference-Header-Content-Length": str(len(head))}


def with_input(name: str, **spec) -> dict:
    body = request()
    body["inputs"] = [{**i, **spec} if i["name"] == name else i for i in body["inputs"]]
    return body


TRITON_400 = [
    # (id, body or (bytes, headers), the X-Error-Code): each one Triton answers 400
    ("no-inputs", {"outputs": [{"name": "out"}]}, "missing_field"),
    ("q-as-int32", with_input("q", datatype="INT32", data=[1] * 24), "bad_type"),
    ("23-values-for-shape-2-3-4", with_input("q", data=[0.5] * 23), "bad_shape"),
    ("v-missing", {"inputs": request()["inputs"][:2]}, "missing_field"),
    ("an-output-asked-twice", request(outputs=[{"name": "out"}, {"name": "out"}]), "bad_option"),
    ("binary-data-size-past-what-follows", binary_request(sizes={"v": 200}), "bad_shape"),
    ("4-bytes-after-the-binary-data", binary_request(extra=bytes(4)), "bad_shape"),
    ("shape-2-minus-5", with_input("k", shape=[2, -5], data=[0.5] * 10), "bad_shape"),
    ("k-of-the-wrong-width", with_input("k", shape=[2, 3, 5], data=[0.5] * 30), "shape_mismatch"),
    ("an-unknown-output", request(outputs=[{"name": "OUTPUT0"}]), "unknown_field"),
    ("an-empty-input-list", {"inputs": []}, "bad_type"),
    ("not-json", (b"{inputs", {}), "bad_json"),
]


@pytest.mark.live
@pytest.mark.parametrize(("body", "code"), [c[1:] for c in TRITON_400], ids=[c[0] for c in TRITON_400])
def test_triton_answers_400_and_so_does_v2(live_server, body, code):
    data, headers = body if isinstance(body, tuple) else (json.dumps(body).encode(), {})
    resp = requests.post(f"{live_server}/v2/models/attention/infer", data=data, headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text[:300]
    assert resp.headers["X-Error-Code"] == code and set(resp.json()) == {"error"} and resp.json()["error"]


@pytest.mark.live
def test_the_native_door_keeps_422(live_server):
    resp = requests.post(f"{live_server}/attention", json={"q": [[1.0]], "k": [[1.0, 2.0]], "v": [[1.0]]}, timeout=30)
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "shape_mismatch"


@pytest.fixture
def triton_client(live_server):
    client = triton.InferenceServerClient(live_server.removeprefix("http://"), network_timeout=60)
    yield client
    client.close()


def triton_inputs(arrays: dict[str, np.ndarray], binary: bool = True) -> list:
    inputs = []
    for name, arr in arrays.items():
        tensor = triton.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT32")
        tensor.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(tensor)
    return inputs


@pytest.mark.live
@pytest.mark.parametrize(
    ("arrays", "outputs", "code"),
    [
        ({**ARRAYS, "q": ARRAYS["q"].astype(np.int32)}, None, "bad_type"),
        ({"q": ARRAYS["q"], "k": ARRAYS["k"]}, None, "missing_field"),
        ({**ARRAYS, "k": RNG.standard_normal((2, 3, 5), dtype=np.float32)}, None, "shape_mismatch"),
        (ARRAYS, ["out", "out"], "bad_option"),
        (ARRAYS, ["OUTPUT0"], "unknown_field"),
    ],
    ids=["q-as-int32", "v-missing", "k-of-the-wrong-width", "an-output-asked-twice", "an-unknown-output"],
)
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_sees_400(triton_client, arrays, outputs, code, binary):
    requested = [triton.InferRequestedOutput(n, binary_data=binary) for n in outputs] if outputs else None
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer("attention", triton_inputs(copy.deepcopy(arrays), binary), outputs=requested)
    assert info.value.status() == "400", (info.value.message(), code)


@pytest.mark.live
def test_tritonclient_json_and_binary_answers_agree(triton_client):
    """The valid request the cases above spoil, answered alike in JSON and in binary."""
    answers = [triton_client.infer("attention", triton_inputs(ARRAYS, binary)).as_numpy("out") for binary in (True, False)]
    np.testing.assert_array_equal(*answers)
    assert answers[0].shape == (2, 3, 4)
