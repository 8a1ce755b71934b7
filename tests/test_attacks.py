"""The attack suite: what a hostile or careless client sends, against the real gunicorn server.

Four groups: bodies (numbers, nesting, fields, encodings, overflow, limits), headers (lengths,
methods, media types, Content-Length lies, chunked bodies, request ids, deadlines), connections
(pipelining, abrupt closes) and the /v2 protocol (binary header lengths that lie, odd datatypes,
inputs of the wrong type, readiness while draining). Each case asserts the exact status and error
code the contract (API.md) gives -- native: body["error"]["code"]; /v2: {"error": str} -- and that
the next valid request on the server is answered correctly. Never a 5xx. A hypothesis fuzz at the
end mutates valid requests of both front doors. docs/reliability.md maps each case to its class.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import faults
from .helpers import WORKED, assert_seed_answered, raw_exchange, start_server, stop_server, wait_until

pytestmark = pytest.mark.live

DROP = object()  # a field value that removes the field
BODY_LIMIT = 32 * 2**20  # the attack server's ATTN_MAX_BODY_BYTES (conftest.attack_server)


# --- request builders -----------------------------------------------------------------------------


def attn(**changes) -> dict:
    """The seed example with fields replaced (DROP removes one)."""
    body = {**copy.deepcopy(WORKED), **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def batched(**changes) -> dict:
    """The seed example with a leading axis of 1, so key_lengths may have shape [1]."""
    body = {"q": [WORKED["q"]], "k": [WORKED["k"]], "v": [WORKED["v"]], **changes}
    return {k: v for k, v in body.items() if v is not DROP}


EYE = [[1.0, 0.0], [0.0, 1.0]]
MHA = {"x": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], "wq": EYE, "wk": EYE, "wv": EYE, "wo": EYE, "heads": 2}


def mha(**changes) -> dict:
    body = {**copy.deepcopy(MHA), **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def b64(a, dtype: str = "float32", shape: list | None = None) -> dict:
    arr = np.asarray(a, dtype=dtype)
    return {"shape": list(arr.shape) if shape is None else shape, "dtype": dtype, "b64": base64.b64encode(arr.tobytes()).decode()}


V2_SEED = {
    "inputs": [
        {"name": "q", "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 1, 1, 1]},
        {"name": "k", "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 1, 1, 1]},
        {"name": "v", "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 10, 5, 5]},
    ],
    "parameters": {"causal": True},
}


def v2(**changes) -> dict:
    body = {**copy.deepcopy(V2_SEED), **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def v2_key_lengths(datatype: str, value: int) -> dict:
    """The /v2 seed with one leading item (q, k, v (1, 3, 2)) and key_lengths [value] of datatype."""
    inputs = [{**spec, "shape": [1, *spec["shape"]]} for spec in copy.deepcopy(V2_SEED["inputs"])]
    return v2(inputs=[*inputs, {"name": "key_lengths", "datatype": datatype, "shape": [1], "data": [value]}])


def v2_input(which: str, **changes) -> dict:
    """The /v2 seed with one input's fields replaced (DROP removes one)."""
    body = copy.deepcopy(V2_SEED)
    for spec in body["inputs"]:
        if spec["name"] == which:
            spec.update(changes)
            for key in [k for k, v in spec.items() if v is DROP]:
                del spec[key]
    return body


def v2_binary(header_length: str | None = None, sizes: dict | None = None, extra: bytes = b"", **changes) -> tuple[bytes, dict]:
    """The /v2 seed with binary inputs: (body, headers). header_length replaces the true
    Inference-Header-Content-Length, sizes the declared binary_data_size of inputs."""
    arrays = {n: np.array(WORKED[n], dtype=np.float32) for n in ("q", "k", "v")}
    inputs = [
        {"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": (sizes or {}).get(n, a.nbytes)}}
        for n, a in arrays.items()
    ]
    for spec in inputs:
        spec.update(changes.get(spec["name"], {}))
    head = json.dumps({"inputs": inputs, "parameters": {"causal": True}}).encode()
    blob = b"".join(a.tobytes() for a in arrays.values()) + extra
    return head + blob, {"Inference-Header-Content-Length": str(len(head)) if header_length is None else header_length}


# --- the runner -------------------------------------------------------------------------------------


@dataclass
class Case:
    """One request and its exact answer. body: a dict (sent as JSON), bytes, a (bytes, headers)
    pair, or a callable giving any of those (big bodies are built when the case runs). code: the
    native error code (or a set where the contract allows either); None for a /v2 error or a 200.
    check: called with the parsed 200 body."""

    id: str
    body: object
    status: int
    code: str | frozenset | None = None
    path: str = "/attention"
    headers: dict = field(default_factory=dict)
    check: object = None
    message_has: str | None = None
    message_lacks: str | None = None
    field_is: str | None = None  # the error's field (/v2: its X-Error-Field header), checked when given


def send(url: str, case: Case, session: requests.Session) -> requests.Response:
    body, headers = case.body() if callable(case.body) else case.body, {"Content-Type": "application/json"}
    if isinstance(body, tuple):
        body, extra = body
        headers.update(extra)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers.update(case.headers)
    headers = {k: v for k, v in headers.items() if v is not None}  # None: leave the header out
    return session.post(f"{url}{case.path}", data=body, headers=headers, timeout=120, stream=True)


def assert_answer(resp: requests.Response, case: Case) -> dict:
    """The exact status and error shape the case expects; the parsed body."""
    assert resp.status_code == case.status, f"{case.id}: {resp.status_code} {resp.raw.read(600)!r}"
    body = resp.json()
    if case.status >= 400:
        if case.path.startswith("/v2"):
            assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
            assert resp.headers.get("X-Error-Code"), resp.headers  # the code the protocol's body has no room for
            text = body["error"]
            if case.field_is is not None:  # the protocol's body has no field: the header names it
                assert resp.headers.get("X-Error-Field") == case.field_is, (resp.headers, text)
        else:
            err = body["error"]
            assert set(err) == {"status", "code", "message", "field"} and err["status"] == case.status, body
            codes = case.code if isinstance(case.code, frozenset) else {case.code}
            assert err["code"] in codes, body
            text = err["message"]
            if case.field_is is not None:
                assert err["field"] == case.field_is, err
        if case.message_has:
            assert case.message_has in text, text
        if case.message_lacks:
            assert case.message_lacks not in text, text
    elif case.check is not None:
        case.check(body)
    return body


def run_case(url: str, case: Case) -> None:
    with requests.Session() as session:
        resp = send(url, case, session)
        try:
            assert_answer(resp, case)
        finally:
            resp.close()
        assert_seed_answered(url, session)


def tensor(value) -> np.ndarray:
    """A response tensor in any of the three encodings, as float64."""
    if isinstance(value, dict) and "b64" in value:
        return np.frombuffer(base64.b64decode(value["b64"]), dtype=value["dtype"]).reshape(value["shape"]).astype(np.float64)
    if isinstance(value, dict):
        return np.array(value["data"], dtype=np.float64).reshape(value["shape"])
    return np.array(value, dtype=np.float64)


def out_is(expected):
    def check(body):
        np.testing.assert_allclose(tensor(body["out"]), expected, rtol=1e-6)

    return check


def v2_out_is(expected):
    def check(body):
        out = next(o for o in body["outputs"] if o["name"] == "out")
        np.testing.assert_allclose(np.array(out["data"], dtype=np.float64), np.ravel(expected), rtol=1e-5, atol=1e-6)

    return check


SEED_OUT = [[1.0, 0.0], [0.33023843, 6.6976156], [2.7657044, 5.0]]


# --- group 1: bodies --------------------------------------------------------------------------------


def seed_text(**replace: str) -> bytes:
    """The seed example as JSON text, with raw text substituted for fields (tokens JSON forbids)."""
    parts = {k: json.dumps(v) for k, v in WORKED.items()}
    parts.update(replace)
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in parts.items()) + "}").encode()


def many_unknown_fields(n: int = 50_000) -> bytes:
    return json.dumps({**WORKED, **{f"f{i}": i for i in range(n)}}).encode()


def b64_garbage(size: int = 8 * 2**20) -> bytes:
    return b'"b64":""' * (size // 8)  # not even JSON


def one_element_rows(size: int = 15 * 2**20) -> bytes:
    rows = size // 4
    return b'{"q": [' + b"[0]," * rows + b'[0]], "k": [[0]], "v": [[0]]}'


def overflow_body(weights: bool) -> dict:
    return {"q": [[63.0]], "k": [[1.0]], "v": [[1e12]], "scale": 1.0, "return_weights": weights}


NUMBERS = [
    Case("number-1e999", seed_text(v="[[1e999, 0], [0, 1], [1, 1]]"), 400, "bad_json"),
    Case("number-NaN-token", seed_text(q="[[NaN, 0], [0, 1], [1, 1]]"), 400, "bad_json"),
    Case("number-Infinity-token", seed_text(k="[[Infinity, 0], [0, 1], [1, 1]]"), 400, "bad_json"),
    Case("number-minus-Infinity-token", seed_text(v="[[-Infinity, 0], [0, 1], [1, 1]]"), 400, "bad_json"),
    Case("number-negative-zero", attn(q=[[-0.0, 0], [0, 1], [1, 1]]), 200, check=lambda b: np.isfinite(np.array(b["out"])).all()),
    Case("number-huge-int-1e30-in-v", b'{"q": [[0]], "k": [[0]], "v": [[1000000000000000000000000000000]]}', 200, check=out_is([[1e30]])),
    Case("number-2**64-in-v", b'{"q": [[0]], "k": [[0]], "v": [[18446744073709551616]]}', 200, check=out_is([[2.0**64]])),
    Case("number-1e39-overflows-float32", attn(v=[[1e39, 0], [0, 1], [1, 1]]), 422, "non_finite"),
    Case("number-1e39-fits-float64", {"q": [[0.0]], "k": [[0.0]], "v": [[1e39]], "dtype": "float64"}, 200, check=out_is([[1e39]])),
    Case("number-scores-overflow-float32", {"q": [[1e20]], "k": [[1e20]], "v": [[1.0]]}, 422, "non_finite", message_has="float64"),
    Case("number-float-where-int-heads", mha(heads=2.0), 422, "bad_type", path="/mha"),
    Case("number-float-where-int-key-lengths", batched(key_lengths=[1.5]), 422, "bad_type"),
    Case("number-key-lengths-2**63", batched(key_lengths=[2**63]), 422, "bad_option"),
    Case("number-key-lengths-negative", batched(key_lengths=[-1]), 422, "bad_option", message_has="key_lengths", field_is="key_lengths"),
    Case(
        "number-key-lengths-int32-4294967297",
        batched(key_lengths={"shape": [1], "dtype": "int32", "data": [4294967297]}),
        422,
        frozenset({"bad_option", "bad_type"}),
    ),
    Case(
        "number-key-lengths-int32-minus-2**32-plus-2",
        batched(key_lengths={"shape": [1], "dtype": "int32", "data": [-4294967294]}),
        422,
        frozenset({"bad_option", "bad_type"}),
    ),
    Case("number-scale-1e300-float32", attn(scale=1e300), 422, "non_finite"),
    Case("number-scale-zero", attn(scale=0), 422, "bad_option"),
    Case("number-scale-negative", attn(scale=-1.0), 422, "bad_option"),
]

NESTING = [
    Case("nesting-deep-array-5000", b'{"q": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "bad_json"),
    Case("nesting-deep-array-100-in-q", b'{"q": ' + b"[" * 100 + b"1" + b"]" * 100 + b', "k": [[1]], "v": [[1]]}', 400, "bad_json"),
    Case("nesting-deep-object-30", json.loads('{"a":' * 30 + "1" + "}" * 30), 400, "bad_json"),
    Case("nesting-deep-object-5000", b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, "bad_json"),
    Case("nesting-rank-7-q", attn(q=[[[[[[[1.0]]]]]]]), 422, "bad_rank"),
    Case("nesting-rank-7-mask", attn(mask=[[[[[[[True]]]]]]]), 422, "bad_rank"),
    Case("nesting-rank-1-q", attn(q=[1.0, 0.0]), 422, "bad_rank"),
    Case("nesting-ragged-rows", attn(q=[[1, 0], [0], [1, 1]]), 422, "ragged"),
    Case("nesting-ragged-depth", attn(q=[[1, 0], [0, [1]], [1, 1]]), 422, "ragged"),
    Case("nesting-ragged-mask", attn(mask=[[True], [True, False], [True, True, True]]), 422, "ragged"),
    Case("nesting-empty-array", attn(q=[]), 422, "bad_shape"),
    Case("nesting-empty-rows", attn(k=[[], [], []]), 422, "bad_shape"),
    Case("nesting-string-in-array", attn(q=[[1, "0"], [0, 1], [1, 1]]), 422, "bad_type"),
    Case("nesting-null-in-array", attn(q=[[1, None], [0, 1], [1, 1]]), 422, "bad_type"),
    Case("nesting-bool-in-q", attn(q=[[True, False], [False, True], [True, True]]), 422, "bad_type"),
    Case("nesting-object-in-array", attn(v=[[1, {}], [0, 1], [1, 1]]), 422, "bad_type"),
    Case("nesting-mask-of-twos", attn(mask=[[2, 0, 0], [1, 1, 0], [1, 1, 1]]), 422, "bad_type"),
]

# Every field of /attention and /mha with a value of the wrong type.
WRONG_TYPES = [
    ("q", "abc", "bad_type"),
    ("q", 5, "bad_rank"),
    ("q", None, "bad_type"),
    ("q", {}, "bad_encoding"),
    ("k", "abc", "bad_type"),
    ("k", {"shape": [3, 2]}, "bad_encoding"),
    ("v", True, "bad_type"),
    ("v", [[True, False], [False, True], [True, True]], "bad_type"),
    ("mask", "all", "bad_type"),
    ("mask", 1.5, "bad_type"),
    ("causal", "yes", "bad_option"),
    ("causal", 1, "bad_option"),
    ("causal", [True], "bad_option"),
    ("key_lengths", "3", "bad_type"),
    ("key_lengths", {"3": 3}, "bad_encoding"),
    ("scale", "1", "bad_type"),
    ("scale", True, "bad_type"),
    ("scale", [1.0], "bad_type"),
    ("return_weights", "false", "bad_type"),
    ("return_weights", 0, "bad_type"),
    ("return_weights", None, "bad_type"),
    ("dtype", "float16", "bad_option"),
    ("dtype", 32, "bad_option"),
    ("dtype", None, None),
    ("response_encoding", "xml", "bad_option"),
    ("response_encoding", ["b64"], "bad_option"),
]
MHA_WRONG_TYPES = [
    ("x", "abc", "bad_type"),
    ("x", [[True, False]], "bad_type"),
    ("wq", 1, "bad_rank"),
    ("wk", None, "bad_type"),
    ("wv", {"shape": [2, 2]}, "bad_encoding"),
    ("wo", [["1", "0"], ["0", "1"]], "bad_type"),
    ("heads", "2", "bad_type"),
    ("heads", True, "bad_type"),
    ("heads", 0, "bad_option"),
    ("heads", 3, "bad_option"),
    ("heads", [2], "bad_type"),
    ("causal", "top_left", "bad_type"),
    ("causal", 1, "bad_type"),
    ("return_weights", "yes", "bad_type"),
    ("dtype", "int8", "bad_option"),
    ("response_encoding", 5, "bad_option"),
]


def _wrong(path, builder, name, value, code) -> Case:
    label = "null" if value is None else type(value).__name__
    if code is None:  # null where the default is null: the default
        return Case(f"{path[1:]}-{name}-{label}", builder(**{name: value}), 200, path=path)
    return Case(f"{path[1:]}-{name}-{label}-{json.dumps(value)[:12]}", builder(**{name: value}), 422, code, path=path)


FIELDS = [
    Case("fields-unknown-casual", attn(casual=True), 422, "unknown_field"),
    Case("fields-50000-unknown", many_unknown_fields, 422, "unknown_field"),
    Case("fields-missing-q", attn(q=DROP), 422, "missing_field"),
    Case("fields-missing-x-mha", mha(x=DROP), 422, "missing_field", path="/mha"),
    Case("fields-empty-object", {}, 422, "missing_field"),
    Case("fields-body-is-array", b"[1, 2, 3]", 400, "bad_json"),
    Case("fields-body-is-string", b'"q"', 400, "bad_json"),
    Case("fields-body-empty", b"", 400, "bad_json"),
    Case("fields-body-bom", b"\xef\xbb\xbf" + json.dumps(WORKED).encode(), 400, "bad_json"),
    # A repeated key: the last one counts, on every parsing path (as in Python's json and orjson).
    Case(
        "fields-duplicate-v-last-wins",
        seed_text(v='[[1, 0], [0, 10], [5, 5]], "v": [[0, 0], [0, 0], [0, 0]]'),
        200,
        check=out_is(np.zeros((3, 2))),
    ),
    Case(
        "fields-duplicate-data-in-flat-last-wins",
        seed_text(q='{"shape": [3, 2], "data": [0, 0, 0, 0, 0, 0], "data": [1, 0, 0, 1, 1, 1]}'),
        200,
        check=out_is(SEED_OUT),
    ),
    *(_wrong("/attention", attn, *row) for row in WRONG_TYPES),
    *(_wrong("/mha", mha, *row) for row in MHA_WRONG_TYPES),
]

RANK65 = [1] * 65
ENCODINGS = [
    Case("encoding-flat-65-dims-q", attn(q={"shape": RANK65, "data": [1.0]}), 422, "bad_rank"),
    Case("encoding-b64-65-dims-q", attn(q=b64([1.0], shape=RANK65)), 422, "bad_rank"),
    Case("encoding-flat-65-dims-mask", attn(mask={"shape": RANK65, "data": [True]}), 422, "bad_rank"),
    Case("encoding-b64-65-dims-mask", attn(mask=b64([True], "bool", shape=RANK65)), 422, "bad_rank"),
    Case("encoding-flat-1000-dims-k", attn(k={"shape": [1] * 1000, "data": [1.0]}), 422, "bad_rank"),
    Case("encoding-b64-not-base64", attn(q={"shape": [3, 2], "dtype": "float32", "b64": "!!!not base64!!!"}), 422, "bad_encoding"),
    Case("encoding-b64-not-a-string", attn(q={"shape": [3, 2], "dtype": "float32", "b64": 5}), 422, "bad_encoding"),
    Case("encoding-b64-wrong-byte-count", attn(q=b64(np.zeros(5), shape=[3, 2])), 422, "bad_shape"),
    Case("encoding-b64-dtype-missing", attn(q={k: v for k, v in b64(np.zeros((3, 2))).items() if k != "dtype"}), 422, "bad_type"),
    Case("encoding-b64-dtype-unknown", attn(q=b64(np.zeros((3, 2))) | {"dtype": "float128"}), 422, "bad_type"),
    Case(
        "encoding-b64-bool-bytes-not-0-1",
        attn(mask={"shape": [3, 3], "dtype": "bool", "b64": base64.b64encode(bytes([2] * 9)).decode()}),
        422,
        "bad_type",
    ),
    Case("encoding-flat-dtype-unknown", attn(q={"shape": [3, 2], "data": [1, 0, 0, 1, 1, 1], "dtype": "complex64"}), 422, "bad_type"),
    Case("encoding-flat-extra-key", attn(q={"shape": [3, 2], "data": [1, 0, 0, 1, 1, 1], "order": "F"}), 422, "bad_encoding"),
    Case("encoding-flat-data-not-list", attn(q={"shape": [3, 2], "data": "101011"}), 422, "bad_type"),
    Case("encoding-flat-data-nested", attn(q={"shape": [3, 2], "data": [[1, 0], [0, 1], [1, 1]]}), 422, "bad_shape"),
    Case("encoding-flat-count-mismatch", attn(q={"shape": [3, 2], "data": [1, 0, 0]}), 422, "bad_shape"),
    Case("encoding-shape-not-a-list", attn(q={"shape": 6, "data": [1, 0, 0, 1, 1, 1]}), 422, "bad_shape"),
    Case("encoding-shape-string", attn(q={"shape": "3,2", "data": [1, 0, 0, 1, 1, 1]}), 422, "bad_shape"),
    Case("encoding-shape-zero", attn(q={"shape": [0, 2], "data": []}), 422, "bad_shape"),
    Case("encoding-shape-negative", attn(q={"shape": [-3, -2], "data": [1, 0, 0, 1, 1, 1]}), 422, "bad_shape"),
    Case("encoding-shape-bool", attn(q={"shape": [True, 2], "data": [1, 0]}), 422, "bad_shape"),
    Case("encoding-shape-float", attn(q={"shape": [3.0, 2], "data": [1, 0, 0, 1, 1, 1]}), 422, "bad_shape"),
    Case("encoding-shape-product-overflows", attn(q=b64([1.0], shape=[2**40, 2**40])), 422, "bad_shape"),
    Case("encoding-shape-2**70", attn(q={"shape": [2**70], "data": [1.0]}), 422, "bad_shape"),
    # NaN or infinity in the raw bytes: no dtype makes them finite, so none is suggested.
    Case("encoding-b64-nan-bytes", attn(q=b64([[np.nan, 0], [0, 1], [1, 1]])), 422, "non_finite", message_lacks="float64", field_is="q"),
    Case("encoding-b64-inf-float16", attn(bias=b64(np.full((3, 3), np.inf), "float16")), 422, "non_finite", message_lacks="float64"),
    Case("encoding-1e39-suggests-float64", attn(v=[[1e39, 0], [0, 1], [1, 1]]), 422, "non_finite", message_has='"float64"', field_is="v"),
    Case("encoding-8MB-of-b64-garbage", b64_garbage, 400, "bad_json"),
    Case("encoding-15MB-of-one-element-rows", one_element_rows, 413, "too_long"),
]

OVERFLOW = [
    Case("overflow-no-weights-exp63-times-1e12", overflow_body(False), 200, check=out_is([[1e12]])),
    Case("overflow-with-weights-exp63-times-1e12", overflow_body(True), 200, check=out_is([[1e12]])),
    Case(
        "overflow-no-weights-batched-causal",
        {"q": [[[63.0], [60.0]]], "k": [[[1.0], [1.0]]], "v": [[[1e12], [1e12]]], "scale": 1.0, "causal": True, "return_weights": False},
        200,
        check=out_is([[[1e12], [1e12]]]),
    ),
    # The output of /mha passes through wo: 1e19 * 1e19 * 1e19 is past float32, so no 200 can be honest.
    Case(
        "overflow-mha-output-non-finite",
        mha(
            x=[[1e19, 0.0]],
            wq=[[0.0, 0.0], [0.0, 0.0]],
            wk=[[0.0, 0.0], [0.0, 0.0]],
            wv=[[1e19, 0.0], [0.0, 0.0]],
            wo=[[1e19, 0.0], [0.0, 0.0]],
            heads=1,
        ),
        422,
        "non_finite",
        path="/mha",
    ),
    Case("overflow-mha-projection-scores", mha(x=[[1e19, 1e19]], wq=[[1e19, 0.0], [0.0, 1e19]], heads=1), 422, "non_finite", path="/mha"),
    # A score overflow names what caused it, and suggests float64 only where it is not already.
    Case(
        "overflow-scores-float64-no-float64-hint",
        {"q": [[1e155]], "k": [[1e155]], "v": [[1.0]], "dtype": "float64"},
        422,
        "non_finite",
        message_lacks='"float64"',
        field_is="q",
    ),
    Case(
        "overflow-float64-rows-of-1.7e308-stay-finite",
        {"q": [[0.0], [0.0]], "k": [[0.0], [0.0]], "v": [[1.7e308], [1.7e308]], "scale": 1.0, "dtype": "float64"},
        200,
        check=out_is([[1.7e308], [1.7e308]]),
    ),
    Case(
        "overflow-mha-result-float64-names-a-field",
        mha(x=[[1e154, 0.0]], wq=EYE, wk=EYE, wv=[[1e154, 0.0], [0.0, 0.0]], wo=[[1e10, 0.0], [0.0, 0.0]], heads=1, dtype="float64"),
        422,
        "non_finite",
        path="/mha",
        message_lacks='"float64"',
        field_is="x",
    ),
    Case(
        "overflow-alibi-slopes-blamed",
        batched(alibi_slopes=[-3e38], return_weights=False),
        422,
        "non_finite",
        message_has="ALiBi",
        field_is="alibi_slopes",
    ),
    Case(
        "overflow-bias-blamed",
        {"q": [[1e19]], "k": [[1e19]], "v": [[1.0]], "scale": 1.0, "bias": [[3e38]]},
        422,
        "non_finite",
        message_has="bias",
        field_is="bias",
    ),
    # out is B*T*dv = 4*4096*4096 = 67M elements from an 88 KB request: refused before computing.
    Case(
        "limits-output-too-large-b64",
        {"q": b64(np.zeros((4, 4096, 1))), "k": b64(np.zeros((4, 1, 1))), "v": b64(np.zeros((4, 1, 4096))), "return_weights": False},
        413,
        "too_large",
        message_has="ATTN_MAX_OUTPUT_ELEMENTS",
    ),
    Case(
        "limits-output-too-large-nested-weights",
        lambda: {"q": [[[0.0]] * 4096] * 4, "k": [[[0.0]]] * 4, "v": [[[0.0] * 4096]] * 4},
        413,
        "too_large",
        message_has="ATTN_MAX_OUTPUT_ELEMENTS",
    ),
    Case(
        "limits-T-over-max",
        lambda: {"q": b64(np.zeros((4097, 1))), "k": b64(np.zeros((1, 1))), "v": b64(np.zeros((1, 1)))},
        413,
        "too_long",
    ),
    Case(
        "limits-scores-over-max",
        lambda: {
            "q": b64(np.zeros((16, 4096, 1))),
            "k": b64(np.zeros((16, 4096, 1))),
            "v": b64(np.zeros((16, 4096, 1))),
            "return_weights": False,
        },
        413,
        "too_large",
    ),
]


@pytest.mark.parametrize("case", NUMBERS + NESTING + FIELDS + ENCODINGS + OVERFLOW, ids=lambda c: c.id)
def test_body(attack_server, case):
    run_case(attack_server[1], case)


def test_limits_report_the_output_limit(attack_server):
    limits = requests.get(f"{attack_server[1]}/limits", timeout=10).json()
    assert limits.get("max_output_elements") == 2**24, limits


@pytest.mark.parametrize(
    "path, body, status",
    [
        (
            "/attention",
            {"q": np.zeros((10, 4)), "k": np.zeros((4, 4)), "v": np.zeros((4, 100)), "return_weights": False},
            200,
        ),  # out 10*100 = the limit
        ("/attention", {"q": np.zeros((10, 4)), "k": np.zeros((4, 4)), "v": np.zeros((4, 101)), "return_weights": False}, 413),
        (
            "/attention",
            {"q": np.zeros((2, 5, 4)), "k": np.zeros((2, 1, 4)), "v": np.zeros((2, 1, 101)), "return_weights": False},
            413,
        ),  # B counts
        (
            "/mha",
            {"x": np.zeros((25, 40)), **{w: np.eye(40) for w in ("wq", "wk", "wv", "wo")}, "heads": 4, "return_weights": False},
            200,
        ),  # n*d = 1000
        ("/mha", {"x": np.zeros((26, 40)), **{w: np.eye(40) for w in ("wq", "wk", "wv", "wo")}, "heads": 4, "return_weights": False}, 413),
        (
            "/mha",
            {"x": np.zeros((2, 13, 40)), **{w: np.eye(40) for w in ("wq", "wk", "wv", "wo")}, "heads": 4, "return_weights": False},
            413,
        ),  # B*n*d
    ],
    ids=["attention-at-the-limit", "attention-over", "attention-batched-over", "mha-at-the-limit", "mha-over", "mha-batched-over"],
)
def test_output_limit_counts_out(small_output_server, path, body, status):
    """ATTN_MAX_OUTPUT_ELEMENTS counts out: B*T*dv for /attention, B*n*d for /mha, on both front doors."""
    url = small_output_server
    wire = {k: b64(v) if isinstance(v, np.ndarray) else v for k, v in body.items()}
    resp = requests.post(f"{url}{path}", json=wire, timeout=30)
    assert resp.status_code == status, resp.text[:300]
    if status == 413:
        err = resp.json()["error"]
        assert err["code"] == "too_large" and "ATTN_MAX_OUTPUT_ELEMENTS" in err["message"], err
    model = path.strip("/")
    inputs = [
        {"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.ravel().tolist()}
        for k, v in body.items()
        if isinstance(v, np.ndarray)
    ]
    params = {k: v for k, v in body.items() if not isinstance(v, np.ndarray)}
    resp = requests.post(f"{url}/v2/models/{model}/infer", json={"inputs": inputs, "parameters": params}, timeout=30)
    assert resp.status_code == status, resp.text[:300]
    if status == 413:
        assert "ATTN_MAX_OUTPUT_ELEMENTS" in resp.json()["error"]
    assert_seed_answered(url)


@pytest.fixture(scope="module")
def small_output_server():
    proc, url = start_server({"ATTN_MAX_OUTPUT_ELEMENTS": "1000", "WEB_CONCURRENCY": "1", "ATTN_WARMUP": "0"})
    yield url
    stop_server(proc)


# --- group 2: headers -------------------------------------------------------------------------------


def http_request(
    method: str = "POST",
    path: str = "/attention",
    headers: dict | list | None = None,
    body: bytes = b"",
    length: bool = True,
    version: str = "HTTP/1.1",
) -> bytes:
    """Raw request bytes; headers as given (a list keeps repeats), Content-Length added unless
    length is False or already given."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    names = {k.lower() for k, _ in pairs}
    if "host" not in names:
        pairs.insert(0, ("Host", "127.0.0.1"))
    if length and "content-length" not in names and "transfer-encoding" not in names and (body or method == "POST"):
        pairs.append(("Content-Length", str(len(body))))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in pairs) + "\r\n"
    return head.encode("latin-1") + body


SEED_BYTES = json.dumps(WORKED).encode()
JSON = {"Content-Type": "application/json"}


def chunked(body: bytes, size: int = 2**20) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def chunked_over_limit() -> bytes:
    body = b"[" + b"0," * ((BODY_LIMIT + 2**20) // 2) + b"0]"
    return http_request(headers={**JSON, "Transfer-Encoding": "chunked"}, body=chunked(body))


@dataclass
class Raw:
    """A request sent as raw bytes. status None: the server closes the connection without an
    answer. code: the native error code (None for a 200). Requests whose framing is broken or
    incomplete are refused by the worker's event loop; a head gunicorn's parser refuses (a bad
    request line or header, a line or headers over its limits) by the worker's handle_error: both
    in the API's shape, with a code, never gunicorn's HTML page."""

    id: str
    data: object  # bytes, a list of writes, or a callable giving either
    status: int | None
    code: str | None = None
    shut_write: bool = False
    check: object = None


HEADERS = [
    Raw("header-100KB-value", http_request(headers={**JSON, "X-Filler": "a" * 100_000}, body=SEED_BYTES), 431, "headers_too_large"),
    Raw("header-9KB-value", http_request(headers={**JSON, "X-Filler": "a" * 9000}, body=SEED_BYTES), 431, "headers_too_large"),
    Raw(
        "header-500-headers",
        http_request(headers=[*JSON.items(), *((f"X-H{i}", "1") for i in range(500))], body=SEED_BYTES),
        431,
        "headers_too_large",
    ),
    Raw("header-request-line-10KB", http_request("GET", "/healthz?" + "a" * 10_000), 414, "uri_too_long"),
    Raw(
        "header-no-colon",
        http_request(headers=[*JSON.items()], body=SEED_BYTES).replace(b"Content-Type: application/json", b"Content-Type application/json"),
        400,
        "bad_request",
    ),
    Raw("method-made-up-on-healthz", http_request("FROBNICATE", "/healthz"), 405, "method_not_allowed"),
    Raw("method-made-up-on-attention", http_request("BREW", "/attention", headers=JSON, body=SEED_BYTES), 405, "method_not_allowed"),
    Raw("method-get-on-attention", http_request("GET", "/attention"), 405, "method_not_allowed"),
    Raw("method-delete-on-limits", http_request("DELETE", "/limits"), 405, "method_not_allowed"),
    Raw("path-unknown", http_request("GET", "/nowhere"), 404, "not_found"),
    Raw("path-nul-escape", http_request("GET", "/healthz%00"), 404, "not_found"),
    Raw("content-type-absent", http_request(body=SEED_BYTES), 415, "unsupported_media_type"),
    Raw("content-type-text-plain", http_request(headers={"Content-Type": "text/plain"}, body=SEED_BYTES), 415, "unsupported_media_type"),
    Raw(
        "content-type-form",
        http_request(headers={"Content-Type": "application/x-www-form-urlencoded"}, body=b"q=1"),
        415,
        "unsupported_media_type",
    ),
    Raw(
        "content-type-multipart",
        http_request(headers={"Content-Type": "multipart/form-data; boundary=x"}, body=b"--x--"),
        415,
        "unsupported_media_type",
    ),
    Raw("content-type-jsonp", http_request(headers={"Content-Type": "application/jsonp"}, body=SEED_BYTES), 415, "unsupported_media_type"),
    Raw("content-type-json-charset-ok", http_request(headers={"Content-Type": "application/json; charset=utf-8"}, body=SEED_BYTES), 200),
    Raw("content-encoding-gzip-ok", http_request(headers={**JSON, "Content-Encoding": "gzip"}, body=gzip.compress(SEED_BYTES)), 200),
    Raw("content-encoding-br", http_request(headers={**JSON, "Content-Encoding": "br"}, body=SEED_BYTES), 415, "unsupported_media_type"),
    Raw("content-encoding-identity-ok", http_request(headers={**JSON, "Content-Encoding": "identity"}, body=SEED_BYTES), 200),
    Raw("content-length-shorter-than-body", http_request(headers={**JSON, "Content-Length": "10"}, body=SEED_BYTES), 400, "bad_json"),
    Raw(
        "content-length-longer-than-body-then-eof",
        http_request(headers={**JSON, "Content-Length": str(len(SEED_BYTES) + 100)}, body=SEED_BYTES),
        400,
        "incomplete_request",
        shut_write=True,
    ),  # an incomplete request is not computed, however valid its first bytes
    Raw(
        "content-length-over-the-limit-no-body",
        http_request(headers={**JSON, "Content-Length": str(BODY_LIMIT + 1)}),
        413,
        "body_too_large",
    ),
    Raw("content-length-negative", http_request(headers={**JSON, "Content-Length": "-5"}, body=SEED_BYTES), 400, "bad_framing"),
    Raw("content-length-not-a-number", http_request(headers={**JSON, "Content-Length": "lots"}, body=SEED_BYTES), 400, "bad_framing"),
    Raw(
        "content-length-twice-differing",
        http_request(headers=[*JSON.items(), ("Content-Length", str(len(SEED_BYTES))), ("Content-Length", "5")], body=SEED_BYTES),
        400,
        "bad_framing",
    ),
    Raw(
        "content-length-and-chunked",
        http_request(headers={**JSON, "Content-Length": "5", "Transfer-Encoding": "chunked"}, body=chunked(SEED_BYTES)),
        400,
        "bad_framing",
    ),
    Raw(
        "transfer-encoding-unknown",
        http_request(headers={**JSON, "Transfer-Encoding": "gzip, chunked"}, body=chunked(SEED_BYTES)),
        501,
        "not_implemented",
    ),
    Raw("chunked-valid", http_request(headers={**JSON, "Transfer-Encoding": "chunked"}, body=chunked(SEED_BYTES, 7)), 200),
    Raw("chunked-over-the-limit", chunked_over_limit, 413, "body_too_large"),
    Raw(
        "chunked-bad-chunk-size",
        http_request(headers={**JSON, "Transfer-Encoding": "chunked"}, body=b"zz\r\n{}\r\n0\r\n\r\n"),
        400,
        "bad_framing",
    ),
    Raw(
        "chunked-missing-terminator",
        http_request(headers={**JSON, "Transfer-Encoding": "chunked"}, body=b"2\r\n{}XX0\r\n\r\n"),
        400,
        "bad_framing",
    ),
    Raw("deadline-not-a-number", http_request(headers={**JSON, "X-Deadline-Ms": "soon"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-negative", http_request(headers={**JSON, "X-Deadline-Ms": "-5"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-zero", http_request(headers={**JSON, "X-Deadline-Ms": "0"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-nan", http_request(headers={**JSON, "X-Deadline-Ms": "nan"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-infinity", http_request(headers={**JSON, "X-Deadline-Ms": "inf"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-1e999", http_request(headers={**JSON, "X-Deadline-Ms": "1e999"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-underscore", http_request(headers={**JSON, "X-Deadline-Ms": "1_000"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-hex-float", http_request(headers={**JSON, "X-Deadline-Ms": "0x1p10"}, body=SEED_BYTES), 422, "bad_option"),
    Raw("deadline-decimal-ok", http_request(headers={**JSON, "X-Deadline-Ms": "30000.5"}, body=SEED_BYTES), 200),
    Raw("deadline-exponent-ok", http_request(headers={**JSON, "X-Deadline-Ms": "3e4"}, body=SEED_BYTES), 200),
    Raw("deadline-empty", http_request(headers={**JSON, "X-Deadline-Ms": ""}, body=SEED_BYTES), 422, "bad_option"),
    Raw(
        "request-id-over-long-not-echoed",
        http_request(headers={**JSON, "X-Request-Id": "r" * 1000}, body=SEED_BYTES),
        200,
        check=lambda h: h["x-request-id"] != "r" * 1000 and 0 < len(h["x-request-id"]) <= 128,
    ),
    Raw(
        "request-id-control-chars-refused",
        http_request(headers={**JSON, "X-Request-Id": "abc\x01\x1b[31mdef"}, body=SEED_BYTES),
        400,
        "bad_request",
    ),
    Raw(
        "request-id-latin1-not-echoed",
        http_request(headers={**JSON, "X-Request-Id": "caf\xe9"}, body=SEED_BYTES),
        200,
        check=lambda h: h["x-request-id"].isascii(),
    ),
    Raw(
        "request-id-plain-echoed",
        http_request(headers={**JSON, "X-Request-Id": "trace-42"}, body=SEED_BYTES),
        200,
        check=lambda h: h["x-request-id"] == "trace-42",
    ),
    Raw(
        "expect-100-continue",
        [http_request(headers={**JSON, "Expect": "100-continue", "Content-Length": str(len(SEED_BYTES))}), SEED_BYTES],
        200,
    ),
    Raw("http-1.0-no-host", b"GET /healthz HTTP/1.0\r\n\r\n", 200),
    Raw("http-version-2.0-text", b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 400, "bad_request"),
    Raw("request-line-not-http", b"hello there\r\n\r\n", 400, "bad_request"),
    Raw("method-lowercase", http_request("get", "/healthz"), 400, "bad_request"),
    Raw("header-name-with-space", b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400, "bad_request"),
    Raw("header-obsolete-folding", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  2\r\n\r\n", 400, "bad_request"),
    Raw(
        "v2-request-line-10KB",
        http_request("GET", "/v2/models/attention?" + "a" * 10_000),
        414,
        check=lambda h: h["x-error-code"] == "uri_too_long",
    ),
    Raw("host-twice", b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "bad_request"),
    Raw("bare-lf-head", b"GET /healthz HTTP/1.1\nHost: x\n\n", 400, "bad_framing"),  # at once, not 408 after the header timeout
    Raw("expect-unknown", http_request(headers={**JSON, "Expect": "200-ok"}, body=SEED_BYTES), 417, "expectation_failed"),
    Raw(
        "request-id-echoed-by-the-worker-413",
        http_request(headers={**JSON, "X-Request-Id": "rid-413", "Content-Length": str(BODY_LIMIT + 1)}),
        413,
        "body_too_large",
        check=lambda h: h["x-request-id"] == "rid-413",
    ),
    Raw(
        "request-id-echoed-by-the-worker-400-framing",
        http_request(headers={**JSON, "X-Request-Id": "rid-400", "Content-Length": "-5"}, body=SEED_BYTES),
        400,
        "bad_framing",
        check=lambda h: h["x-request-id"] == "rid-400",
    ),
    Raw(
        "request-id-echoed-for-a-head-gunicorn-refuses",
        http_request("GET", "/healthz", headers={"X-Request-Id": "rid-431", "X-Filler": "a" * 9000}),
        431,
        "headers_too_large",
        check=lambda h: h["x-request-id"] == "rid-431",
    ),
    Raw("tls-client-hello-bytes", bytes.fromhex("16030100a5010000a10303") + bytes(range(32)), 400, "incomplete_request", shut_write=True),
]


@pytest.mark.parametrize("case", HEADERS, ids=lambda c: c.id)
def test_header(attack_server, case):
    url = attack_server[1]
    data = case.data() if callable(case.data) else case.data
    status, headers, body = raw_exchange(url, data, shut_write=case.shut_write)[0]
    assert status == case.status, (status, body[:300])
    if status is not None:  # every answer has a request id, whoever makes it (the app, the worker, gunicorn's parser)
        assert 0 < len(headers.get("x-request-id", "")) <= 128 and "total;dur=" in headers.get("server-timing", ""), headers
    if status is not None and status >= 400:  # every refusal is JSON, never sniffed as anything else, whoever makes it
        assert headers["content-type"] == "application/json" and headers.get("x-content-type-options") == "nosniff", (headers, body[:300])
        err = json.loads(body)["error"]
        if isinstance(err, str):  # the /v2 protocol's shape
            assert err and headers["x-error-code"], (headers, err)
        else:
            assert err["code"] == case.code and err["status"] == status, err
    if case.check is not None:
        assert case.check(headers), headers
    assert status is None or status < 500 or status == 501, status  # 501: HTTP's own "not this transfer coding"
    assert_seed_answered(url)


ROUTES = {  # path -> the methods it answers (OPTIONS and HEAD aside)
    "/attention": {"POST"},
    "/mha": {"POST"},
    "/v2/models/attention/infer": {"POST"},
    "/v2/models/mha/versions/1/infer": {"POST"},
    "/healthz": {"GET"},
    "/readyz": {"GET"},
    "/limits": {"GET"},
    "/metrics": {"GET"},
    "/openapi.json": {"GET"},
    "/docs": {"GET"},
    "/": {"GET"},
    "/v2": {"GET"},
    "/v2/health/live": {"GET"},
    "/v2/health/ready": {"GET"},
    "/v2/models/attention": {"GET"},
    "/v2/models/mha/ready": {"GET"},
}


@pytest.mark.parametrize("path", list(ROUTES))
def test_options_and_head_on_every_route(attack_server, path):
    """OPTIONS answers 200 with the Allow header and the same methods as JSON (Flask's automatic
    answer was an empty text/html page); HEAD answers as GET would, without a body, or 405."""
    url = attack_server[1]
    resp = requests.options(f"{url}{path}", timeout=10)
    allowed = ROUTES[path] | {"OPTIONS"} | ({"HEAD"} if "GET" in ROUTES[path] else set())
    assert resp.status_code == 200 and resp.headers["Content-Type"] == "application/json", (resp.headers, resp.text[:200])
    assert set(resp.json()["allow"]) == allowed
    assert {m.strip() for m in resp.headers["Allow"].split(",")} == allowed
    head = requests.head(f"{url}{path}", timeout=10)
    assert head.status_code == (200 if "GET" in ROUTES[path] else 405) and head.content == b""
    assert_seed_answered(url)


def test_made_up_methods_do_not_grow_metrics(attack_server):
    """500 made-up methods: /metrics counts them under one bounded label ("other")."""
    url = attack_server[1]
    before = requests.get(f"{url}/metrics", timeout=10).text
    for i in range(500):
        status = raw_exchange(url, http_request(f"XM{i:04d}", "/healthz", headers={"Connection": "close"}))[0][0]
        assert status == 405
    after = requests.get(f"{url}/metrics", timeout=10).text
    assert 'method="XM' not in after
    assert 'method="other"' in after
    assert len(after) - len(before) < 20_000, (len(before), len(after))
    assert_seed_answered(url)


# --- group 3: connections ---------------------------------------------------------------------------


def test_pipelined_requests_are_answered_in_order(attack_server):
    url = attack_server[1]
    first = http_request(headers={**JSON, "X-Request-Id": "first"}, body=SEED_BYTES)
    second = http_request(headers={**JSON, "X-Request-Id": "second"}, body=json.dumps(attn(casual=True)).encode())
    third = http_request("GET", "/healthz", headers={"X-Request-Id": "third", "Connection": "close"})
    answers = raw_exchange(url, first + second + third, responses=3)
    assert [(s, h.get("x-request-id")) for s, h, _ in answers] == [(200, "first"), (422, "second"), (200, "third")]
    np.testing.assert_allclose(np.array(json.loads(answers[0][2])["out"]), SEED_OUT, rtol=1e-6)
    assert json.loads(answers[1][2])["error"]["code"] == "unknown_field"
    assert_seed_answered(url)


def test_pipelined_error_then_valid_on_v2(attack_server):
    url = attack_server[1]
    bad = http_request(
        path="/v2/models/attention/infer", headers={"Inference-Header-Content-Length": "-1"}, body=json.dumps(V2_SEED).encode()
    )
    good = http_request(path="/v2/models/attention/infer", headers={"Connection": "close"}, body=json.dumps(V2_SEED).encode())
    answers = raw_exchange(url, bad + good, responses=2)
    assert [a[0] for a in answers] == [400, 200]
    v2_out_is(SEED_OUT)(json.loads(answers[1][2]))


def _send_and_close(url: str, parts: list[bytes], reset: bool = False) -> None:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    for part in parts:
        sock.sendall(part)
    if reset:  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


CLOSES = {
    "close-mid-body": [http_request(headers={**JSON, "Content-Length": "100000"}, body=b'{"q": [[1, 0], [0')],
    "reset-mid-body": [http_request(headers={**JSON, "Content-Length": "100000"}, body=b'{"q": [[1, 0], [0')],
    "close-mid-headers": [b"POST /attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"],
    "close-mid-request-line": [b"POST /atten"],
    "close-before-anything": [],
    "close-mid-v2-binary": [
        http_request(
            path="/v2/models/attention/infer",
            headers={"Content-Length": "100000", "Inference-Header-Content-Length": "300"},
            body=b'{"inputs": [',
        )
    ],
}


@pytest.mark.parametrize("name", list(CLOSES), ids=list(CLOSES))
def test_abrupt_close_leaves_the_server_healthy(attack_server, name):
    url = attack_server[1]
    for _ in range(5):  # on both workers, most likely
        _send_and_close(url, CLOSES[name], reset=name.startswith("reset"))
    for _ in range(4):
        assert_seed_answered(url)


def test_close_before_reading_a_large_response(attack_server):
    """The client sends a request whose answer is large and leaves without reading it."""
    url = attack_server[1]
    rng = np.random.default_rng(0)
    doc = {n: b64(rng.standard_normal((1, 512, 64))) for n in ("q", "k", "v")}
    for _ in range(4):
        _send_and_close(url, [http_request(headers=JSON, body=json.dumps(doc).encode())], reset=True)
    for _ in range(4):
        assert_seed_answered(url)


# --- group 4: the /v2 protocol ----------------------------------------------------------------------

V2 = "/v2/models/attention/infer"
V2_MHA = "/v2/models/mha/infer"
MHA_V2 = {
    "inputs": [
        {"name": n, "datatype": "FP32", "shape": [2, 2] if n != "x" else [3, 2], "data": sum(MHA[n], [])}
        for n in ("x", "wq", "wk", "wv", "wo")
    ],
    "parameters": {"heads": 2},
}


def _true_header_length(spell) -> str:
    """The seed's true Inference-Header-Content-Length, spelled by spell(n)."""
    body, headers = v2_binary()
    return spell(int(headers["Inference-Header-Content-Length"]))


# The seed under causal and window [1, 0]: each query sees itself and the one key before it.
SEED_OUT_WINDOW_1_0 = [[1.0, 0.0], [0.33023845, 6.6976155], [3.3488077, 6.6511923]]

PROTOCOL = [
    Case("v2-seed-json", v2(), 200, path=V2, check=v2_out_is(SEED_OUT)),
    Case("v2-seed-binary", v2_binary(), 200, path=V2, check=v2_out_is(SEED_OUT)),
    Case("v2-seed-no-content-type", (json.dumps(V2_SEED).encode(), {"Content-Type": None}), 200, path=V2, check=v2_out_is(SEED_OUT)),
    Case("v2-header-length-negative", v2_binary("-1"), 400, path=V2),
    Case("v2-header-length-past-the-body", v2_binary("100000"), 400, path=V2),
    Case("v2-header-length-not-a-number", v2_binary("lots"), 400, path=V2),
    Case("v2-header-length-float", v2_binary("12.5"), 400, path=V2),
    Case("v2-header-length-cuts-the-json", v2_binary("20"), 400, path=V2),
    Case("v2-header-length-zero", v2_binary("0"), 400, path=V2),
    Case("v2-header-length-huge", v2_binary("9" * 40), 400, path=V2),
    # int() reads "3_53", "+353" and Arabic-Indic digits as numbers; the header is ASCII digits only.
    Case("v2-header-length-underscore", lambda: v2_binary(_true_header_length(lambda n: f"{n // 10}_{n % 10}")), 400, path=V2),
    Case("v2-header-length-plus-sign", lambda: v2_binary(_true_header_length(lambda n: f"+{n}")), 400, path=V2),
    Case("v2-window-underscore", v2(parameters={"causal": True, "window": "1_0,0"}), 400, path=V2),
    Case("v2-window-arabic-indic-digits", v2(parameters={"causal": True, "window": "\u0661,0"}), 400, path=V2),
    Case("v2-window-spaces-ok", v2(parameters={"causal": True, "window": " 1 , 0 "}), 200, path=V2, check=v2_out_is(SEED_OUT_WINDOW_1_0)),
    Case("v2-binary-size-past-the-data", v2_binary(sizes={"v": 100}), 400, path=V2),
    Case("v2-binary-size-short-leaves-bytes", v2_binary(sizes={"v": 8}), 400, path=V2),
    Case("v2-binary-extra-bytes-after-the-data", v2_binary(extra=b"\x00" * 8), 400, path=V2),
    Case("v2-binary-size-negative", v2_binary(sizes={"q": -24}), 400, path=V2),
    Case("v2-binary-size-string", v2_binary(sizes={"q": "24"}), 400, path=V2),
    Case("v2-binary-size-float", v2_binary(sizes={"q": 24.0}), 400, path=V2),
    Case("v2-binary-size-huge", v2_binary(sizes={"q": 2**70}), 400, path=V2),
    Case("v2-binary-size-mismatches-shape", v2_binary(sizes={"q": 16, "k": 32}), 400, path=V2),
    Case(
        "v2-binary-nan-bytes",
        lambda: (
            v2_binary()[0][: -3 * 24] + np.full(18, np.nan, np.float32).tobytes(),
            v2_binary()[1],
        ),
        400,
        path=V2,
        message_lacks="float64",
        field_is="q",
    ),
    Case("v2-binary-name-is-a-list", v2_binary(q={"name": ["q"]}), 400, path=V2),
    Case("v2-datatype-BF16", v2_input("q", datatype="BF16"), 400, path=V2),
    Case("v2-datatype-BYTES", v2_input("q", datatype="BYTES"), 400, path=V2),
    Case("v2-datatype-UINT8", v2_input("k", datatype="UINT8"), 400, path=V2),
    Case("v2-datatype-lowercase-fp32", v2_input("v", datatype="fp32"), 400, path=V2),
    Case("v2-datatype-null", v2_input("q", datatype=None), 400, path=V2),
    Case("v2-datatype-list", v2_input("q", datatype=["FP32"]), 400, path=V2),
    Case("v2-datatype-missing", v2_input("q", datatype=DROP), 400, path=V2),
    Case("v2-name-is-a-list", v2_input("q", name=["q"]), 400, path=V2),
    Case("v2-name-is-an-object", v2_input("q", name={"q": 1}), 400, path=V2),
    Case("v2-name-is-a-number", v2_input("q", name=7), 400, path=V2),
    Case("v2-name-is-null", v2_input("q", name=None), 400, path=V2, field_is="inputs"),
    Case("v2-name-unknown", v2_input("q", name="query"), 400, path=V2),
    Case("v2-shape-is-a-string", v2_input("q", shape="3,2"), 400, path=V2),
    Case("v2-shape-is-null", v2_input("q", shape=None), 400, path=V2),
    Case("v2-shape-holds-a-string", v2_input("q", shape=[3, "2"]), 400, path=V2),
    Case("v2-shape-nested", v2_input("q", shape=[[3, 2]]), 400, path=V2),
    Case("v2-shape-65-dims", v2_input("q", shape=RANK65, data=[1.0]), 400, path=V2),
    Case("v2-shape-zero", v2_input("q", shape=[0, 2], data=[]), 400, path=V2),
    Case("v2-shape-wrong-count", v2_input("q", shape=[4, 2]), 400, path=V2),
    Case("v2-data-is-a-string", v2_input("q", data="100111"), 400, path=V2),
    Case("v2-data-is-an-object", v2_input("q", data={"0": 1}), 400, path=V2),
    Case("v2-data-is-null", v2_input("q", data=None), 400, path=V2),
    Case("v2-data-ragged", v2_input("q", data=[[1, 0], [0], [1, 1]]), 400, path=V2),
    Case("v2-data-nested-against-shape", v2_input("q", data=[[1, 0, 0], [1, 1, 1]]), 400, path=V2),
    Case("v2-data-holds-strings", v2_input("q", data=[1, 0, 0, "1", 1, 1]), 400, path=V2),
    Case("v2-data-holds-bools", v2_input("q", data=[True, False, False, True, True, True]), 400, path=V2),
    Case("v2-data-and-binary-both", v2_input("q", parameters={"binary_data_size": 24}), 400, path=V2),
    # The protocol's input and output objects have fixed keys: any other is refused, never ignored.
    Case("v2-input-unknown-key", v2_input("q", dtype="float64"), 400, path=V2, message_has="dtype"),
    Case("v2-input-typo-datatype", v2_input("q", data_type="FP64"), 400, path=V2, message_has="data_type"),
    Case("v2-binary-input-unknown-key", v2_binary(q={"contents": {}}), 400, path=V2, message_has="contents"),
    Case("v2-output-unknown-key", v2(outputs=[{"name": "out", "datatype": "FP64"}]), 400, path=V2, message_has="datatype"),
    Case("v2-inputs-is-an-object", v2(inputs={"q": 1}), 400, path=V2),
    Case("v2-inputs-empty", v2(inputs=[]), 400, path=V2),
    Case("v2-inputs-missing", v2(inputs=DROP), 400, path=V2),
    Case("v2-inputs-holds-a-number", v2(inputs=[5]), 400, path=V2, field_is="inputs"),
    Case("v2-input-given-twice", v2(inputs=V2_SEED["inputs"] + V2_SEED["inputs"][:1]), 400, path=V2),
    Case("v2-input-parameters-is-a-number", v2_input("q", parameters=5), 400, path=V2, field_is="q"),
    Case("v2-outputs-is-an-object", v2(outputs={"name": "out"}), 400, path=V2),
    Case("v2-outputs-holds-a-number", v2(outputs=[5]), 400, path=V2, field_is="outputs"),
    Case("v2-outputs-name-is-a-list", v2(outputs=[{"name": ["out"]}]), 400, path=V2, field_is="outputs"),
    Case("v2-outputs-unknown", v2(outputs=[{"name": "logits"}]), 400, path=V2),
    Case("v2-outputs-parameters-is-a-list", v2(outputs=[{"name": "out", "parameters": []}]), 400, path=V2, field_is="outputs"),
    Case(
        "v2-outputs-binary-data-string",
        v2(outputs=[{"name": "out", "parameters": {"binary_data": "yes"}}]),
        400,
        path=V2,
        field_is="outputs",
    ),
    Case("v2-parameters-is-a-list", v2(parameters=[]), 400, path=V2, field_is="parameters"),
    Case("v2-parameters-causal-string", v2(parameters={"causal": "yes"}), 400, path=V2),
    Case("v2-parameters-scale-string", v2(parameters={"scale": "1"}), 400, path=V2),
    Case("v2-parameters-binary-output-string", v2(parameters={"binary_data_output": "yes"}), 400, path=V2, field_is="binary_data_output"),
    Case("v2-parameters-unknown", v2(parameters={"casual": True}), 400, path=V2),
    Case("v2-parameters-dtype-number", v2(parameters={"dtype": 64}), 400, path=V2),
    Case("v2-id-is-a-number", v2(id=5), 400, path=V2),
    Case("v2-unknown-top-level-key", v2(model="attention"), 400, path=V2),
    Case("v2-body-not-json", b"inputs=q", 400, path=V2),
    Case("v2-body-is-an-array", b"[]", 400, path=V2),
    Case("v2-body-deep", b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, path=V2),
    Case(
        "v2-content-encoding-gzip",
        (gzip.compress(json.dumps(V2_SEED).encode()), {"Content-Encoding": "gzip"}),
        200,
        path=V2,
        check=v2_out_is(SEED_OUT),
    ),
    Case("v2-content-length-over-the-limit", lambda: (b"{" + b" " * (BODY_LIMIT + 1) + b"}", {}), 413, path=V2),
    Case(
        "v2-key-lengths-int32-wraps",
        v2_key_lengths("INT32", 4294967297),
        400,
        path=V2,
    ),
    Case(
        "v2-key-lengths-negative",
        v2_key_lengths("INT64", -1),
        400,
        path=V2,
        message_has="key_lengths",
        field_is="key_lengths",
    ),
    Case(
        "v2-overflow-no-weights",
        {
            "inputs": [
                {"name": "q", "datatype": "FP32", "shape": [1, 1], "data": [63.0]},
                {"name": "k", "datatype": "FP32", "shape": [1, 1], "data": [1.0]},
                {"name": "v", "datatype": "FP32", "shape": [1, 1], "data": [1e12]},
            ],
            "parameters": {"scale": 1.0, "return_weights": False},
        },
        200,
        path=V2,
        check=v2_out_is([[1e12]]),
    ),
    Case("v2-mha-seed", MHA_V2, 200, path=V2_MHA),
    Case("v2-mha-heads-string", {**MHA_V2, "parameters": {"heads": "2"}}, 400, path=V2_MHA),
    Case("v2-mha-name-is-a-list", {**MHA_V2, "inputs": [{**MHA_V2["inputs"][0], "name": ["x"]}, *MHA_V2["inputs"][1:]]}, 400, path=V2_MHA),
    Case("v2-model-unknown", v2(), 404, path="/v2/models/gpt/infer"),
    Case("v2-model-version-unknown", v2(), 404, path="/v2/models/attention/versions/7/infer"),
]


@pytest.mark.parametrize("case", PROTOCOL, ids=lambda c: c.id)
def test_protocol(attack_server, case):
    run_case(attack_server[1], case)


LONG = "n" * 1_000_000  # a 1 MB name or value where the server expects a short one
LONG_TEXT = [
    ("native-field", "/attention", {**WORKED, LONG: 1}),
    ("native-flat-key", "/attention", {**WORKED, "q": {"shape": [3, 2], "data": [1, 0, 0, 1, 1, 1], LONG: 1}}),
    ("native-b64-dtype", "/attention", {**WORKED, "q": {"shape": [3, 2], "dtype": LONG, "b64": "AAAA"}}),
    ("v2-field", V2, {**V2_SEED, LONG: 1}),
    ("v2-parameter", V2, v2(parameters={LONG: 1})),
    ("v2-input-name", V2, v2_input("q", name=LONG)),
    ("v2-input-parameter", V2, v2_input("q", parameters={LONG: 1})),
    ("v2-output-name", V2, v2(outputs=[{"name": LONG}])),
    ("v2-output-parameter", V2, v2(outputs=[{"name": "out", "parameters": {LONG: True}}])),
]


@pytest.mark.parametrize("path, body", [c[1:] for c in LONG_TEXT], ids=[c[0] for c in LONG_TEXT])
def test_a_long_name_is_cut_in_the_error_and_the_log(attack_server, path, body):
    """A name or value the client sent is shown cut in the error's message and field, and in the
    access log: a 1 MB key must not become a 1 MB answer and a 1 MB log line per request."""
    proc, url = attack_server
    log = Path(proc.log_path)
    before = log.stat().st_size
    resp = requests.post(f"{url}{path}", json=body, timeout=30)
    assert resp.status_code == (400 if path.startswith("/v2") else 422), resp.text[:300]  # the protocol's status at /v2
    assert len(resp.content) < 2000, resp.text[:300]
    assert_seed_answered(url)  # its access line is written after the error's
    assert log.stat().st_size - before < 20_000


def test_v2_readiness_follows_draining(tmp_path):
    """/v2/health/ready and /v2/models/<m>/ready say 503 whenever /readyz does: one source of
    readiness. One worker, kept busy by a request held in the core on purpose (tests/faults.py) so
    that it drains rather than exits, until the test has seen it draining."""
    held = faults.Held(tmp_path)
    proc, url = start_server({"WEB_CONCURRENCY": "1", **faults.faulty_env(tmp_path / "site", "hold", tmp_path)})
    try:
        wait_until(lambda: requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200, timeout=30)
        sessions = {path: requests.Session() for path in ("/readyz", "/v2/health/ready", "/v2/models/attention/ready")}
        for path, session in sessions.items():
            assert session.get(f"{url}{path}", timeout=5).status_code == 200  # kept-alive connections
        done = {}
        client = threading.Thread(
            target=lambda: done.update(status=requests.post(f"{url}/attention", json=attn(scale=faults.TRIGGER), timeout=300).status_code)
        )
        client.start()
        wait_until(lambda: held.entered() == 1, timeout=60, what="the request reached the core")
        os.kill(proc.pid, signal.SIGTERM)
        wait_until(lambda: sessions["/readyz"].get(f"{url}/readyz", timeout=5).status_code == 503, timeout=60, interval=0.02)
        for path in ("/v2/health/ready", "/v2/models/attention/ready"):
            assert sessions[path].get(f"{url}{path}", timeout=5).status_code == 503, path
        assert client.is_alive()  # the worker drained with the request in flight
        held.release()
        client.join(timeout=300)
        assert done.get("status") == 200
    finally:
        held.release()  # so that a test that failed holding it stops its server at once
        stop_server(proc)


# --- the fuzz: mutated valid requests of both front doors ---------------------------------------------


def _valid_native() -> list[tuple[str, dict]]:
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))
    return [
        ("/attention", {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "causal": True}),
        (
            "/attention",
            {"q": b64(q), "k": b64(k), "v": b64(v), "mask": b64(np.tril(np.ones((5, 5), bool)), "bool"), "return_weights": False},
        ),
        (
            "/attention",
            {
                "q": {"shape": [2, 5, 4], "data": q.ravel().tolist()},
                "k": k.tolist(),
                "v": v.tolist(),
                "key_lengths": [3, 5],
                "scale": 0.5,
                "dtype": "float64",
                "response_encoding": "flat",
            },
        ),
        (
            "/mha",
            {
                "x": q[0].tolist(),
                "wq": np.eye(4).tolist(),
                "wk": np.eye(4).tolist(),
                "wv": b64(np.eye(4)),
                "wo": np.eye(4).tolist(),
                "heads": 2,
            },
        ),
        (V2, copy.deepcopy(V2_SEED)),
        (V2_MHA, copy.deepcopy(MHA_V2)),
    ]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(doc, prefix=()):
    """Every path (tuple of keys and indices) into a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc[:6]):
            yield from _paths(value, (*prefix, i))


def _mutate(doc, path, op, value):
    if not path:
        return value if op == "retype" else doc
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if op == "drop":
        del parent[last]
    elif op == "retype":
        parent[last] = value
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(parent[last]))
    elif op == "duplicate":
        parent[f"{last}"] = copy.deepcopy(parent[last])
        parent[f"{last}_"] = copy.deepcopy(parent[last])
    return doc


@st.composite
def mutated_requests(draw):
    """(path, body bytes, headers): a valid request of either front door, mutated 1-3 times at
    the JSON level (drop, duplicate, retype any value: fields, shapes, dtypes, data), then perhaps
    at the byte level (corrupt b64 text, cut the body, lie in the binary header)."""
    path, doc = draw(st.sampled_from(_valid_native()))
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        where = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["drop", "retype", "duplicate", "dtype", "shape"]))
        if op == "dtype":
            op, value = "retype", draw(st.sampled_from(["float16", "float64", "bool", "int32", "FP16", "BOOL", "INT64", "", None]))
        elif op == "shape":
            op, value = "retype", draw(st.lists(st.integers(-2, 70), max_size=8) | st.just([1] * 65))
        else:
            value = draw(JSON_VALUES)
        try:
            doc = _mutate(doc, where, op, value)
        except (KeyError, IndexError, TypeError):
            pass
    body, headers = json.dumps(doc).encode(), {"Content-Type": "application/json"}
    tail = draw(st.sampled_from(["none", "b64", "cut", "binary"]))
    if tail == "b64" and b'"b64": "' in body:
        at = body.index(b'"b64": "') + 8 + draw(st.integers(0, 20))
        body = body[:at] + draw(st.sampled_from([b"!", b"=", b"\\u0041", b"A", b"\xff"])) + body[at:]
    elif tail == "cut":
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    elif tail == "binary" and path.startswith("/v2"):
        blob = draw(st.binary(max_size=64))
        headers["Inference-Header-Content-Length"] = str(draw(st.integers(-5, len(body) + len(blob) + 5)))
        body += blob
    return path, body, headers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutated=mutated_requests())
def test_fuzz_mutated_requests_never_5xx(attack_server, mutated):
    path, body, headers = mutated
    url = attack_server[1]
    resp = requests.post(f"{url}{path}", data=body, headers=headers, timeout=60)
    assert resp.status_code < 500 or resp.status_code in (503, 504), (resp.status_code, resp.text[:300], body[:300])
    head = resp.content
    if "Inference-Header-Content-Length" in resp.headers:  # binary outputs follow the JSON header
        head = head[: int(resp.headers["Inference-Header-Content-Length"])]
    doc = json.loads(head)  # strict JSON either way
    if resp.status_code >= 400 and path.startswith("/v2"):
        assert set(doc) == {"error"} and isinstance(doc["error"], str)
    elif resp.status_code >= 400:
        assert set(doc["error"]) == {"status", "code", "message", "field"} and doc["error"]["status"] == resp.status_code
    elif path.startswith("/v2"):
        assert doc["outputs"] and all(None not in o.get("data", []) for o in doc["outputs"])  # never a non-finite value in a 200
    else:
        assert "out" in doc and "null" not in resp.text  # never a non-finite value in a 200


def test_fuzz_left_the_server_healthy(attack_server):
    assert_seed_answered(attack_server[1])
