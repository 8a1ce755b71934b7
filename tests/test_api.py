"""POST /attention and POST /mha through the Flask test client: the worked examples in every
encoding, the response's promises, and the accept/reject catalogue of every error code."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import orjson
import pytest
from gunicorn.http.errors import ChunkMissingTerminator, InvalidChunkExtension, InvalidChunkSize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import AttentionRequest, MhaRequest, RequestError
from service.web.errors import status_of
from service.wire import json as wire_json

from . import oracle
from .helpers import WORKED, WORKED_OUT, WORKED_WEIGHTS, Q, V, b64, encoding_of, flat, post, tensor

# Each encoding of a tensor a client may send, by the name response_encoding gives it.
ENCODE = {"nested": lambda a: np.asarray(a).tolist(), "flat": flat, "b64": b64}


# --- what a client relies on ------------------------------------------------------------------


@pytest.mark.parametrize("weights", [True, False])
def test_large_values_are_answered_not_overflowed(client, weights):
    """exp(63) * 1e12 overflows float32; the softmax of one key is 1, so out is v."""
    r = post(client, {"q": [[63.0]], "k": [[1.0]], "v": [[1e12]], "scale": 1.0, "return_weights": weights})
    assert r.status_code == 200, r.json
    assert tensor(r.json["out"]).tolist() == [[1e12]]


def test_many_unknown_fields_are_one_error_naming_the_first(client):
    """Refused before any field is read (walking 200,000 of them once took 30 s)."""
    body = {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]], **{f"f{i}": i for i in range(10000)}}
    r = post(client, body)
    assert r.status_code == 422 and r.json["error"]["code"] == "unknown_field" and r.json["error"]["field"] == "f0", r.json
    assert len(r.json["error"]["message"]) < 1000


def test_an_overflowing_result_is_non_finite_not_200(client):
    """The output projection of /mha can overflow float32 where attention did not: 422, never inf."""
    eye = [[1, 0], [0, 1]]
    body = {"x": [[1.0, 1.0]] * 2, "wq": eye, "wk": eye, "wv": eye, "wo": [[3e38, 3e38], [3e38, 3e38]], "heads": 1}
    r = post(client, body, "/mha")
    assert r.status_code == 422 and r.json["error"]["code"] == "non_finite", r.json


@pytest.mark.parametrize("encoding", list(ENCODE))
def test_worked_example_in_every_encoding(client, encoding):
    encode = ENCODE[encoding]
    r = post(client, {"q": encode(Q), "k": encode(Q), "v": encode(V), "causal": True})
    assert r.status_code == 200, r.json
    body = r.json
    w, out = tensor(body["weights"]), tensor(body["out"])
    np.testing.assert_allclose(w, WORKED_WEIGHTS, atol=0.01)
    np.testing.assert_allclose(out, WORKED_OUT, atol=0.01)
    assert w[0, 1] == 0 and w[0, 2] == 0 and w[1, 2] == 0
    assert encoding_of(body["out"]) == encoding_of(body["weights"]) == encoding  # answered as asked in


@pytest.mark.parametrize("asked", [None, "nested", "flat", "b64"], ids=["default", "nested", "flat", "b64"])
@pytest.mark.parametrize("sent", list(ENCODE), ids=[f"q-{e}" for e in ENCODE])
def test_response_encoding_is_the_one_asked_for(client, sent, asked):
    """Every returned tensor is in response_encoding; by default in q's encoding (k and v are
    sent in another one, so that only q's can be the default)."""
    other = ENCODE["b64" if sent != "b64" else "flat"]
    body = {"q": ENCODE[sent](Q), "k": other(Q), "v": other(V), "causal": True}
    if asked:
        body["response_encoding"] = asked
    r = post(client, body)
    assert r.status_code == 200, r.json
    assert encoding_of(r.json["out"]) == encoding_of(r.json["weights"]) == (asked or sent)
    np.testing.assert_allclose(tensor(r.json["weights"]), WORKED_WEIGHTS, atol=0.01)
    np.testing.assert_allclose(tensor(r.json["out"]), WORKED_OUT, atol=0.01)


@pytest.mark.parametrize("asked", [None, "nested", "flat", "b64"], ids=["default", "nested", "flat", "b64"])
@pytest.mark.parametrize("sent", list(ENCODE), ids=[f"x-{e}" for e in ENCODE])
def test_mha_response_encoding_is_the_one_asked_for(client, rng, sent, asked):
    """The same for /mha, where x's encoding is the default."""
    x = rng.standard_normal((4, 8)).astype(np.float32)
    ws = {name: (rng.standard_normal((8, 8)) / 4).astype(np.float32) for name in ("wq", "wk", "wv", "wo")}
    other = ENCODE["b64" if sent != "b64" else "flat"]
    body = {"x": ENCODE[sent](x), **{name: other(w) for name, w in ws.items()}, "heads": 2}
    if asked:
        body["response_encoding"] = asked
    r = post(client, body, path="/mha")
    assert r.status_code == 200, r.json
    assert encoding_of(r.json["out"]) == encoding_of(r.json["weights"]) == (asked or sent)
    expect_out, expect_w = oracle.mha(x, *ws.values(), 2)
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, atol=1e-5)
    np.testing.assert_allclose(tensor(r.json["weights"]), expect_w, atol=1e-5)


def test_response_carries_cost_timing_and_headers(client):
    r = post(client, WORKED, headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123"
    phases = dict(p.strip().split(";dur=") for p in r.headers["Server-Timing"].split(","))
    assert set(phases) == {"decode", "validate", "compute", "encode", "total"}
    assert all(float(v) >= 0 for v in phases.values())
    assert float(phases["total"]) >= float(phases["compute"])
    assert r.json["cost"]["flops"] == 4 * 3 * 3 * 2 and r.json["cost"]["score_elements"] == 9
    assert r.json["cost"]["predicted_ms"] > 0
    assert set(r.json["timing_ms"]) == {"decode", "validate", "compute"}
    assert len(post(client, WORKED).headers["X-Request-Id"]) >= 16  # generated when not sent


@pytest.mark.parametrize(
    "sent", ["x" * 129, "caf\u00e9", "a\u2028b", "tab\there", ""], ids=["129-chars", "latin1", "unicode-separator", "control", "empty"]
)
def test_request_ids_not_printable_ascii_are_replaced(client, sent):
    """Only 1..128 printable ASCII characters are echoed (the id goes into headers and logs)."""
    got = client.get("/healthz", headers={"X-Request-Id": sent}).headers["X-Request-Id"]
    assert got != sent and len(got) >= 16 and got.isascii() and got.isprintable()
    assert client.get("/healthz", headers={"X-Request-Id": "x" * 128}).headers["X-Request-Id"] == "x" * 128


@pytest.mark.parametrize("encoding", ["nested", "flat", "b64"])
def test_response_encoding_and_float64(client, rng, encoding):
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    r = post(
        client,
        {
            "q": b64(q, "float64"),
            "k": b64(k, "float64"),
            "v": b64(v, "float64"),
            "dtype": "float64",
            "response_encoding": encoding,
            "causal": "bottom_right",
        },
    )
    assert r.status_code == 200
    assert encoding_of(r.json["out"]) == encoding_of(r.json["weights"]) == encoding
    expect_out, expect_w = oracle.attention(q, k, v, causal="bottom_right")
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, atol=1e-12)
    np.testing.assert_allclose(tensor(r.json["weights"]), expect_w, atol=1e-12)


def test_mask_key_lengths_scale_and_no_weights(client, rng):
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))
    mask = rng.random((4, 6)) < 0.6
    body = {
        "q": q.tolist(),
        "k": k.tolist(),
        "v": v.tolist(),
        "mask": mask.astype(int).tolist(),
        "key_lengths": [5, 3],
        "scale": 0.7,
        "dtype": "float64",
    }
    r = post(client, body)
    expect_out, expect_w = oracle.attention(q, k, v, mask, key_lengths=np.array([5, 3]), scale=0.7)
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, atol=1e-12)
    np.testing.assert_allclose(tensor(r.json["weights"]), expect_w, atol=1e-12)
    r = post(client, {**body, "return_weights": False})
    assert "weights" not in r.json
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, atol=1e-12)


def test_all_masked_rows_are_zero_in_strict_json(client):
    r = post(client, {"q": [[1.0, 2.0]] * 3, "k": [[1.0, 0.0]], "v": [[3.0, 4.0]], "causal": "bottom_right"})
    assert r.status_code == 200
    assert b"NaN" not in r.data and b"null" not in r.data and b"Infinity" not in r.data
    np.testing.assert_array_equal(tensor(r.json["weights"]), [[0], [0], [1]])
    np.testing.assert_array_equal(tensor(r.json["out"]), [[0, 0], [0, 0], [3, 4]])


def test_mha_gpt_block(client, rng):
    x = rng.standard_normal((6, 12))
    ws = {name: (rng.standard_normal((12, 12)) / 4).tolist() for name in ("wq", "wk", "wv", "wo")}
    r = post(client, {"x": x.tolist(), **ws, "heads": 3, "dtype": "float64"}, path="/mha")
    assert r.status_code == 200, r.json
    out, a = tensor(r.json["out"]), tensor(r.json["weights"])
    assert out.shape == (6, 12) and a.shape == (3, 6, 6)
    np.testing.assert_allclose(a.sum(-1), 1, atol=1e-12)
    assert (a[:, 0, 1:] == 0).all()
    expect_out, _ = oracle.mha(x, *(np.array(ws[n]) for n in ("wq", "wk", "wv", "wo")), 3)
    np.testing.assert_allclose(out, expect_out, atol=1e-10)
    x2 = x.copy()
    x2[-1] *= 50
    r2 = post(client, {"x": x2.tolist(), **ws, "heads": 3, "dtype": "float64"}, path="/mha")
    np.testing.assert_array_equal(tensor(r2.json["out"])[:5], out[:5])


def test_mha_batched_b64(client, rng):
    x = rng.standard_normal((2, 5, 8))
    ws = {name: b64(rng.standard_normal((8, 8))) for name in ("wq", "wk", "wv", "wo")}
    r = post(client, {"x": b64(x), **ws, "heads": 2, "causal": False}, path="/mha")
    assert r.status_code == 200
    assert r.json["out"]["shape"] == [2, 5, 8] and r.json["weights"]["shape"] == [2, 2, 5, 5]
    assert r.json["out"]["dtype"] == "float32"


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mha_matches_the_oracle(client, rng, causal, weights):
    """Batched, float64, with causal and return_weights either way: out (and weights) as the
    float64 oracle computes them."""
    x = rng.standard_normal((2, 5, 8))
    ws = {name: rng.standard_normal((8, 8)) / 4 for name in ("wq", "wk", "wv", "wo")}
    body = {
        "x": b64(x, "float64"),
        **{n: b64(w, "float64") for n, w in ws.items()},
        "heads": 2,
        "causal": causal,
        "return_weights": weights,
        "dtype": "float64",
    }
    r = post(client, body, path="/mha")
    assert r.status_code == 200, r.json
    expect_out, expect_w = oracle.mha(x, *ws.values(), 2, causal=causal)
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, atol=1e-12)
    if weights:
        w = tensor(r.json["weights"])
        np.testing.assert_allclose(w, expect_w, atol=1e-12)
        assert (w[..., 0, 1:] > 0).all() != causal  # the first query sees later keys only without causal
    else:
        assert "weights" not in r.json


def test_limits_endpoint(client, settings):
    body = client.get("/limits").json
    assert body["max_t"] == settings.max_t and body["max_body_bytes"] == settings.max_body_bytes
    assert body["max_score_elements"] == settings.max_score_elements and body["max_rank"] == 6
    assert body["default_dtype"] == "float32" and "version" in body and "a" in body["cost_model"]
    assert "api_keys" not in body
    assert body["max_output_elements"] == settings.max_output_elements


_W64 = {"shape": [64, 64], "data": [0.0] * 4096}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/attention", {"q": [[[1.0]] * 64] * 2, "k": [[[1.0]]] * 2, "v": [[[1.0] * 64]] * 2, "return_weights": False}),
        ("/mha", {"x": [[[1.0] * 64] * 64] * 2, **{w: _W64 for w in ("wq", "wk", "wv", "wo")}, "heads": 1, "return_weights": False}),
    ],
    ids=["attention B*T*dv", "mha B*n*d"],
)
def test_output_over_the_limit_is_413(settings, path, body):
    """A small request can ask for a large out: q (2, 64, 1) with v (2, 1, 64) is 8192 elements
    (unbounded, an 88 KB body was once answered with 358 MB)."""
    schema = (AttentionRequest if path == "/attention" else MhaRequest)(replace(settings, max_output_elements=4096))
    with pytest.raises(RequestError) as err:
        schema.load(body)
    assert err.value.code == "too_large" and status_of(err.value.code) == 413 and "ATTN_MAX_OUTPUT_ELEMENTS" in err.value.message
    job = (AttentionRequest if path == "/attention" else MhaRequest)(replace(settings, max_output_elements=8192)).load(body)
    assert job.output_elements == 8192


def test_health_and_ready(client):
    assert client.get("/healthz").json == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


# --- the accept/reject catalogue -----------------------------------------------------------------


def with_(**changes):
    body = {**WORKED, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()
DEEP = b'{"q": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"

REJECT = [
    # (id, body, status, code, field)
    ("not json", b"{not json", 400, "bad_json", None),
    ("NaN literal", b'{"q": [[NaN]]}', 400, "bad_json", None),
    ("huge exponent", b'{"q": [[1e999999]]}', 400, "bad_json", None),
    ("not an object", b"[1, 2]", 400, "bad_json", None),
    ("too deep", DEEP, 400, "bad_json", None),
    ("missing v", with_(v=DROP), 422, "missing_field", "v"),
    ("typo casual", with_(casual=True), 422, "unknown_field", "casual"),
    ("strings in q", with_(q=[["1", "0"]] * 3), 422, "bad_type", "q"),
    ("booleans in q", with_(q=[[True, False]] * 3), 422, "bad_type", "q"),
    ("booleans mixed into k", with_(k=[[1, 0], [0, True], [1, 1]]), 422, "bad_type", "k"),
    ("null in v", with_(v=[[1, None], [0, 10], [5, 5]]), 422, "bad_type", "v"),
    ("q is a string", with_(q="abc"), 422, "bad_type", "q"),
    ("q is null", with_(q=None), 422, "bad_type", "q"),
    ("return_weights not bool", with_(return_weights="yes"), 422, "bad_type", "return_weights"),
    ("scale a string", with_(scale="2"), 422, "bad_type", "scale"),
    ("mask of 2s", with_(mask=[[2, 0, 0]] * 3), 422, "bad_type", "mask"),
    ("ragged", with_(q=[[1, 0], [0], [1, 1]]), 422, "ragged", "q"),
    ("overflows float32", with_(v=[[1e39, 0], [0, 10], [5, 5]]), 422, "non_finite", "v"),
    ("scores overflow float32", with_(q=[[1e20, 0]] * 3, k=[[1e20, 0]] * 3), 422, "non_finite", "q"),
    ("rank 1", with_(q=[1, 0]), 422, "bad_rank", "q"),
    ("rank 7", with_(q=[[[[[[[1.0]]]]]]], k=[[[[[[[1.0]]]]]]], v=[[[[[[[1.0]]]]]]]), 422, "bad_rank", "q"),
    ("flat count", with_(q={"shape": [3, 2], "data": [1, 0, 0]}), 422, "bad_shape", "q"),
    ("zero axis", with_(q={"shape": [0, 2], "data": []}), 422, "bad_shape", "q"),
    ("negative axis", with_(q={"shape": [-3, -2], "data": [1] * 6}), 422, "bad_shape", "q"),
    ("overflowing shape", with_(q={"shape": [2**40, 2**40], "dtype": "float32", "b64": ""}), 422, "bad_shape", "q"),
    ("b64 length", with_(q={"shape": [3, 2], "dtype": "float32", "b64": "AACAPwAAAEA="}), 422, "bad_shape", "q"),
    ("b64 garbage", with_(q={"shape": [1, 2], "dtype": "float32", "b64": "!!!not base64"}), 422, "bad_encoding", "q"),
    ("b64 dtype", with_(q={"shape": [1, 2], "dtype": "bfloat16", "b64": "AACAPw=="}), 422, "bad_type", "q"),
    ("empty nested", with_(q=[]), 422, "bad_shape", "q"),
    ("d mismatch", with_(k=[[1, 0, 0]] * 3), 422, "shape_mismatch", "k"),
    ("S mismatch", with_(v=[[1, 0]] * 2), 422, "shape_mismatch", "v"),
    ("leading axes differ", with_(q=[Q, Q], k=[Q], v=[V]), 422, "shape_mismatch", "k"),
    ("mask shape", with_(mask=[[True, False]] * 3), 422, "mask_not_broadcastable", "mask"),
    ("causal spelled wrong", with_(causal="diagonal"), 422, "bad_option", "causal"),
    ("causal as 1", with_(causal=1), 422, "bad_option", "causal"),
    ("dtype float16", with_(dtype="float16"), 422, "bad_option", "dtype"),
    ("encoding xml", with_(response_encoding="xml"), 422, "bad_option", "response_encoding"),
    ("negative scale", with_(scale=-1.0), 422, "bad_option", "scale"),
    ("key_lengths past S", with_(key_lengths=4), 422, "bad_option", "key_lengths"),
    ("key_lengths negative", with_(key_lengths=-1), 422, "bad_option", "key_lengths"),
    ("key_lengths floats", with_(key_lengths=2.5), 422, "bad_type", "key_lengths"),
    ("key_lengths wraps int32", with_(key_lengths={"shape": [1], "dtype": "int32", "data": [4294967297]}), 422, "bad_type", "key_lengths"),
    ("key_lengths past int64", with_(key_lengths=[2**63 + 1] * 64), 422, "bad_option", "key_lengths"),
    ("T over max", with_(q=[[1, 0]] * 65), 413, "too_long", "q"),
    ("S over max", with_(k=[[1, 0]] * 65, v=[[1, 0]] * 65), 413, "too_long", "k"),
    (
        "score elements",
        with_(q=[[[1, 0]] * 64] * 5, k=[[[1, 0]] * 64] * 5, v=[[[1, 0]] * 64] * 5, return_weights=False),
        413,
        "too_large",
        None,
    ),
    ("returned weights", with_(q=[[[1, 0]] * 64] * 3, k=[[[1, 0]] * 64] * 3, v=[[[1, 0]] * 64] * 3), 413, "too_large", "return_weights"),
]


@pytest.mark.parametrize("body, status, code, field", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_rejects(client, body, status, code, field):
    r = post(client, body)
    assert r.status_code == status, r.json
    err = r.json["error"]
    assert (err["status"], err["code"], err["field"]) == (status, code, field)
    assert err["message"] and "Traceback" not in err["message"]
    if field:
        assert field in err["message"]


def test_weights_limit_lifts_without_weights(client):
    body = with_(q=[[[1, 0]] * 64] * 3, k=[[[1, 0]] * 64] * 3, v=[[[1, 0]] * 64] * 3, return_weights=False)
    assert post(client, body).status_code == 200


def test_float64_accepts_what_float32_cannot(client):
    assert post(client, with_(v=[[1e39, 0], [0, 10], [5, 5]], dtype="float64")).status_code == 200


@pytest.mark.parametrize(
    "headers, content_type",
    [
        ({}, "text/plain"),
        ({}, None),
        ({"Content-Encoding": "br"}, "application/json"),
    ],
    ids=["text/plain", "no content type", "brotli"],
)
def test_unsupported_media_type(client, headers, content_type):
    r = client.post("/attention", data=orjson.dumps(WORKED), headers=headers, content_type=content_type)
    assert r.status_code == 415 and r.json["error"]["code"] == "unsupported_media_type"


def test_body_too_large_refused_before_parsing(client, settings):
    r = post(client, b"{" + b" " * settings.max_body_bytes + b"}")
    assert r.status_code == 413 and r.json["error"]["code"] == "body_too_large"
    assert str(settings.max_body_bytes) in r.json["error"]["message"]


def test_not_found_and_method_not_allowed(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"
    r = client.get("/attention")
    assert r.status_code == 405 and r.json["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["Allow"]


# A valid /mha body: x (n=3, d=4), 2 heads; each case below breaks one thing.
MHA_OK = {"x": [[1.0] * 4] * 3, "wq": [[1.0] * 4] * 4, "wk": [[1.0] * 4] * 4, "wv": [[1.0] * 4] * 4, "wo": [[1.0] * 4] * 4, "heads": 2}


@pytest.mark.parametrize(
    "body, field",
    [
        ({**MHA_OK, "wo": [[1.0] * 4] * 3}, "wo"),
        ({**MHA_OK, "heads": 3}, "heads"),
        ({**MHA_OK, "heads": 0}, "heads"),
        ({**MHA_OK, "heads": True}, "heads"),
        ({**MHA_OK, "causal": "top_left"}, "causal"),
        ({k: v for k, v in MHA_OK.items() if k not in ("wv", "wo")}, "wv"),
    ],
    ids=["wo rows", "heads divides", "heads zero", "heads bool", "causal bool only", "missing wv"],
)
def test_mha_rejects(client, body, field):
    r = post(client, body, path="/mha")
    assert r.status_code == 422 and r.json["error"]["field"] == field


def test_mha_ok_is_served(client):
    """The body the cases above break is itself valid: each refusal is for the one thing broken."""
    assert post(client, MHA_OK, path="/mha").status_code == 200


# --- nothing malformed ever produces a 500 -------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["q", "k", "v", "shape", "data", "b64", "dtype", "mask", "x"]), children, max_size=4)
    ),
    max_leaves=30,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        name: json_values | st.sampled_from([Q, V, flat(Q), b64(Q)])
        for name in (
            "q",
            "k",
            "v",
            "mask",
            "causal",
            "key_lengths",
            "scale",
            "dtype",
            "response_encoding",
            "return_weights",
            "x",
            "wq",
            "wk",
            "wv",
            "wo",
            "heads",
            "enable_gqa",
            "window",
            "bias",
            "alibi_slopes",
            "average_weights",
            "weights_dtype",
            "kv_heads",
        )
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the client is stateless
@given(body=fields, path=st.sampled_from(["/attention", "/mha"]))
def test_no_input_gives_500(client, body, path):
    r = post(client, body, path=path)
    assert r.status_code in (200, 400, 413, 422), r.json
    if r.status_code != 200:
        assert set(r.json["error"]) == {"status", "code", "message", "field"}


class _BrokenChunks:
    """A request stream that fails as gunicorn's does on a bad chunk."""

    def __init__(self, exc: Exception):
        self.exc = exc

    def read(self, *args):
        raise self.exc

    readinto = readline = read


@pytest.mark.parametrize("length", [None, 20])
@pytest.mark.parametrize("exc", [InvalidChunkSize(b"zz"), ChunkMissingTerminator(b"XX"), InvalidChunkExtension(b";\x00")], ids=type)
def test_a_body_the_server_cannot_read_is_400_not_500(client, exc, length):
    """Under another worker class, a broken body is found only as the app reads it: 400, never 500."""
    environ = {"wsgi.input": _BrokenChunks(exc), "CONTENT_LENGTH": str(length or "")}
    if length is None:
        environ.update(HTTP_TRANSFER_ENCODING="chunked", **{"wsgi.input_terminated": True})  # as gunicorn says of chunked
    r = client.post("/attention", content_type="application/json", environ_overrides=environ)
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["code"] == "bad_framing" and type(exc).__name__ in r.get_json()["error"]["message"]


@pytest.mark.parametrize("field", ["scale", "window", "causal", "dtype"])
@pytest.mark.parametrize("data", [[i / 3 for i in range(70)], [[1, 2, 3]] * 30, list(range(70))], ids=["floats", "rows", "ints"])
def test_a_field_sent_as_an_array_is_shown_as_sent_whichever_parse(client, monkeypatch, field, data):
    """An option sent as {"data": [64 numbers or more]} comes out of wire.loads' fast path as an
    array; its refusal shows the value as the client sent it ([0.0, 0.33...), the same message as
    orjson's plain parse gives, never numpy's array([...])."""
    body = orjson.dumps({"q": Q, "k": Q, "v": V, field: {"data": data}})
    fast = client.post("/attention", data=body, content_type="application/json").get_json()
    monkeypatch.setattr(wire_json, "_fast_loads", lambda body: None)
    plain = client.post("/attention", data=body, content_type="application/json").get_json()
    assert fast == plain and "array(" not in fast["error"]["message"], fast
