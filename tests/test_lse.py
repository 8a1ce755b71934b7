"""return_lse through both front doors (contract: "Attention states"): POST /attention's `lse`
field and /v2's parameter return_lse and output `lse` equal the float64 oracle's log-sum-exp over
every variant (a hypothesis property); a row with no key has the dtype's lowest finite value, in
strict JSON; without the field, answers are byte for byte what they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.config import Settings
from service.web import create_app

from . import oracle
from .helpers import b64, flat, post, tensor

CAUSAL = [False, True, "top_left", "bottom_right"]


@pytest.fixture(scope="module")
def door():
    app = create_app(Settings(warmup=False))  # stateless between requests: one app for every example
    app.testing = True
    return app.test_client()


@st.composite
def requests(draw):
    """(native fields, oracle keyword arguments): a random problem with every variant drawn or left out."""
    Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H, T, S, d, dv = Hkv * group, draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    elems = st.floats(-3, 3, allow_nan=False, width=32)
    q = draw(hnp.arrays(np.float32, (H, T, d), elements=elems))
    k = draw(hnp.arrays(np.float32, (Hkv, S, d), elements=elems))
    v = draw(hnp.arrays(np.float32, (Hkv, S, dv), elements=elems))
    fields = {"causal": draw(st.sampled_from(CAUSAL)), "enable_gqa": True}
    kw = dict(fields)
    if draw(st.booleans()):
        kw["window"] = draw(st.tuples(st.integers(-1, 6), st.integers(-1, 6)))
        fields["window"] = list(kw["window"])
    if draw(st.booleans()):
        kw["mask"] = draw(hnp.arrays(bool, (T, S)))
        fields["mask"] = kw["mask"].tolist()
    if draw(st.booleans()):
        kw["key_lengths"] = draw(hnp.arrays(np.int64, (H,), elements=st.integers(0, S)))
        fields["key_lengths"] = kw["key_lengths"].tolist()
    if draw(st.booleans()):
        kw["bias"] = draw(hnp.arrays(np.float32, (T, S), elements=st.floats(-2, 2, width=32)))
        fields["bias"] = kw["bias"].tolist()
    if draw(st.booleans()):
        kw["alibi_slopes"] = draw(hnp.arrays(np.float32, (H,), elements=st.floats(0, 1, width=32)))
        fields["alibi_slopes"] = kw["alibi_slopes"].tolist()
    fields["average_weights"] = draw(st.booleans())
    return {"q": q, "k": k, "v": v, **fields}, kw


def native_body(fields: dict, encoding: str) -> dict:
    enc = {"nested": lambda a: a.tolist(), "flat": flat, "b64": b64}[encoding]
    return {name: enc(value) if isinstance(value, np.ndarray) else value for name, value in fields.items()}


def v2_body(fields: dict) -> dict:
    """The same request as /v2 JSON inputs and parameters."""
    inputs, parameters = [], {}
    for name, value in fields.items():
        if isinstance(value, np.ndarray) or (name in ("mask", "key_lengths", "bias", "alibi_slopes")):
            arr = np.asarray(value)
            datatype = {"b": "BOOL", "i": "INT64"}.get(arr.dtype.kind, "FP32")
            inputs.append({"name": name, "datatype": datatype, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()})
        elif name == "window":
            parameters[name] = f"{value[0]},{value[1]}"
        else:
            parameters[name] = value
    return {"inputs": inputs, "parameters": {**parameters, "return_lse": True}}


def check(lse: np.ndarray, kw: dict, fields: dict) -> None:
    _, _, expect = oracle.reference(fields["q"], fields["k"], fields["v"], return_lse=True, **kw)
    none = np.isneginf(expect)
    assert lse.shape == fields["q"].shape[:-1]  # the heads kept, even under average_weights
    assert (lse[none] == np.finfo(np.float32).min).all()
    np.testing.assert_allclose(lse[~none], expect[~none], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.sampled_from(["nested", "flat", "b64"]), st.booleans())
def test_native_lse_equals_the_oracle(door, problem, encoding, return_weights):
    fields, kw = problem
    resp = post(door, {**native_body(fields, encoding), "return_lse": True, "return_weights": return_weights})
    assert resp.status_code == 200, resp.get_json()
    body = json.loads(resp.data, parse_constant=pytest.fail)  # strict JSON: no -Infinity
    lse = tensor(body["lse"])
    assert lse.dtype == np.float32 or encoding == "nested"
    check(lse.astype(np.float32), kw, fields)
    assert ("weights" in body) == return_weights


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_v2_lse_equals_the_oracle(door, problem):
    fields, kw = problem
    resp = door.post("/v2/models/attention/infer", data=json.dumps(v2_body(fields)), content_type="application/json")
    assert resp.status_code == 200, resp.get_json()
    outputs = {o["name"]: o for o in resp.get_json()["outputs"]}
    assert list(outputs) == ["out", "weights", "lse"] and outputs["lse"]["datatype"] == "FP32"
    check(np.array(outputs["lse"]["data"], np.float32).reshape(outputs["lse"]["shape"]), kw, fields)


def test_fully_masked_rows_and_default_off(door):
    """key_lengths 0: out 0, lse float32's lowest finite value (-3.4028235e38). Without return_lse
    the body is the one without the field, and lse is absent."""
    q = [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [2.0, 0.0]]]
    base = {"q": q, "k": q, "v": q, "key_lengths": [0, 2], "return_weights": False, "response_encoding": "flat"}
    body = post(door, {**base, "return_lse": True}).get_json()
    lse = tensor(body["lse"])
    assert lse.shape == (2, 2) and (lse[0] == np.float32(-3.4028235e38)).all() and (tensor(body["out"])[0] == 0).all()
    assert lse[1, 0] == pytest.approx(np.logaddexp(2 / 2**0.5, 2 / 2**0.5), rel=1e-6)
    plain, off = post(door, base).get_json(), post(door, {**base, "return_lse": False}).get_json()
    assert "lse" not in plain and plain["out"] == off["out"] == body["out"]


def test_v2_lse_output_on_request_and_refused_without_the_parameter(door):
    q = {"name": "q", "datatype": "FP32", "shape": [2, 2], "data": [1, 0, 0, 1]}
    inputs = [q, {**q, "name": "k"}, {**q, "name": "v"}]
    asked = door.post("/v2/models/attention/infer", json={"inputs": inputs, "outputs": [{"name": "lse"}]})
    assert asked.status_code == 200 and [o["name"] for o in asked.get_json()["outputs"]] == ["lse"]
    refused = door.post(
        "/v2/models/attention/infer", json={"inputs": inputs, "parameters": {"return_lse": False}, "outputs": [{"name": "lse"}]}
    )
    assert refused.headers["X-Error-Code"] == "bad_option" and "return_lse" in refused.get_json()["error"]
    plain = door.post("/v2/models/attention/infer", json={"inputs": inputs}).get_json()
    assert [o["name"] for o in plain["outputs"]] == ["out", "weights"]
    mha = door.get("/v2/models/mha").get_json()
    assert [o["name"] for o in mha["outputs"]] == ["out", "weights"]
