"""The attention variants through POST /attention and POST /mha (contract: "Attention variants"):
each field's accepted forms answer what the numeric core computes (the core itself is checked
against PyTorch and FlashAttention in test_attention_variants.py), each refusal has its status,
code and field, the limits count what is computed and returned, and the textbook's multi-head
listing is answered as printed."""

from __future__ import annotations

import numpy as np
import pytest

from schemas import AttentionRequest, MhaRequest
from service import core
from service.config import Settings
from service.cost import work_of

from .helpers import WORKED, b64, post, tensor

# --- /attention: accepted --------------------------------------------------------------------------


def arrays(rng, lead=(2, 4), kv_lead=None, T=5, S=7, d=3, dv=2):
    q = rng.standard_normal((*lead, T, d))
    k = rng.standard_normal((*(kv_lead or lead), S, d))
    v = rng.standard_normal((*(kv_lead or lead), S, dv))
    return q, k, v


ACCEPT = [
    # (id, kv_lead, fields sent as JSON, keyword arguments of core.attention)
    ("gqa 4 over 2", (2, 2), {"enable_gqa": True}, {"enable_gqa": True}),
    ("gqa 4 over 1", (2, 1), {"enable_gqa": True}, {"enable_gqa": True}),
    ("gqa with equal heads", None, {"enable_gqa": True}, {"enable_gqa": True}),
    ("window both sides", None, {"window": [2, 1]}, {"window": (2, 1)}),
    ("window left only, causal", None, {"window": [3, -1], "causal": True}, {"window": (3, -1), "causal": "top_left"}),
    ("window right 0, bottom_right", None, {"window": [-1, 0], "causal": "bottom_right"}, {"window": (-1, 0), "causal": "bottom_right"}),
    ("window [0, 0]", None, {"window": [0, 0]}, {"window": (0, 0)}),
    ("window unbounded", None, {"window": [-1, -1]}, {"window": (-1, -1)}),
    ("bias (T, S)", None, {"bias": "TS"}, {"bias": "TS"}),
    ("bias (H, 1, S)", None, {"bias": "H1S"}, {"bias": "H1S"}),
    ("alibi (H,)", None, {"alibi_slopes": "H"}, {"alibi_slopes": "H"}),
    ("alibi (B, H)", None, {"alibi_slopes": "BH"}, {"alibi_slopes": "BH"}),
    ("average_weights", None, {"average_weights": True}, {"average_weights": True}),
    (
        "all at once",
        (2, 2),
        {"enable_gqa": True, "window": [2, 0], "bias": "TS", "alibi_slopes": "H", "average_weights": True, "causal": "bottom_right"},
        {"enable_gqa": True, "window": (2, 0), "bias": "TS", "alibi_slopes": "H", "average_weights": True, "causal": "bottom_right"},
    ),
]
EXTRA = {  # the tensors named in ACCEPT, for lead (2, 4), T=5, S=7
    "TS": lambda rng: rng.standard_normal((5, 7)),
    "H1S": lambda rng: rng.standard_normal((4, 1, 7)),
    "H": lambda rng: np.array([0.5, 0.25, 0.125, 0.0625]),
    "BH": lambda rng: rng.uniform(0, 1, (2, 4)),
}


@pytest.mark.parametrize("kv_lead, sent, kwargs", [a[1:] for a in ACCEPT], ids=[a[0] for a in ACCEPT])
def test_variants_answer_what_the_core_computes(client, rng, kv_lead, sent, kwargs):
    q, k, v = arrays(rng, kv_lead=kv_lead)
    made = {name: EXTRA[value](rng) for name, value in sent.items() if isinstance(value, str) and value in EXTRA}
    body = {"q": b64(q, "float64"), "k": b64(k, "float64"), "v": b64(v, "float64"), "dtype": "float64", **sent}
    body.update({name: b64(arr, "float64") for name, arr in made.items()})
    r = post(client, body)
    assert r.status_code == 200, r.json
    expect_out, expect_w = core.attention(q, k, v, **{**kwargs, **made})
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tensor(r.json["weights"]), expect_w, rtol=1e-12, atol=1e-12)
    assert tensor(r.json["weights"]).shape == ((2, 5, 7) if kwargs.get("average_weights") else (2, 4, 5, 7))


def test_without_the_new_fields_nothing_changes(client):
    """The defaults sent explicitly answer byte for byte what a request without them answers."""
    plain = post(client, WORKED)
    explicit = post(client, {**WORKED, "enable_gqa": False, "average_weights": False})
    assert plain.status_code == explicit.status_code == 200
    assert tensor(plain.json["out"]).tolist() == tensor(explicit.json["out"]).tolist()
    assert tensor(plain.json["weights"]).tolist() == tensor(explicit.json["weights"]).tolist()
    assert plain.json["cost"]["flops"] == explicit.json["cost"]["flops"]


@pytest.mark.parametrize("weights_dtype, itemsize", [("float16", 2), ("float32", 4), ("float64", 8)])
def test_weights_dtype_is_the_weights_precision_on_the_wire(client, rng, weights_dtype, itemsize):
    q, k, v = arrays(rng)
    body = {"q": b64(q), "k": b64(k), "v": b64(v), "weights_dtype": weights_dtype}
    r = post(client, body)
    assert r.status_code == 200, r.json
    weights, out = r.json["weights"], r.json["out"]
    assert weights["dtype"] == weights_dtype and out["dtype"] == "float32"  # out stays in the compute dtype
    w = tensor(weights)
    assert w.dtype.itemsize == itemsize
    _, expect = core.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(w, expect, atol=1e-3 if itemsize == 2 else 1e-6)


def test_float16_b64_inputs_are_computed_in_dtype(client, rng):
    q, k, v = (a.astype(np.float16) for a in arrays(rng))
    r = post(client, {"q": b64(q, "float16"), "k": b64(k, "float16"), "v": b64(v, "float16"), "dtype": "float64"})
    assert r.status_code == 200, r.json
    assert r.json["out"]["dtype"] == "float64"
    expect_out, _ = core.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(tensor(r.json["out"]), expect_out, rtol=1e-12)


def test_a_window_lifts_the_score_limit(client):
    """SMALL allows 20000 score elements: 8 x 64 x 64 are refused, but a window of 5 keys computes
    about 8 x 64 x (5 + the block edges), which is admitted."""
    x = np.ones((8, 64, 2)).tolist()
    body = {"q": x, "k": x, "v": x, "return_weights": False}
    assert post(client, body).json["error"]["code"] == "too_large"
    r = post(client, {**body, "window": [4, 0]})
    assert r.status_code == 200, r.json
    assert r.json["cost"]["score_elements"] == 8 * 64 * 64  # the scores of the attention, as before


def test_average_weights_lifts_the_weights_limit(client):
    """SMALL returns at most 10000 weights: 3 heads x 64 x 64 are refused, averaged they are 4096."""
    x = np.ones((3, 64, 2)).tolist()
    body = {"q": x, "k": x, "v": x}
    r = post(client, body)
    assert (r.json["error"]["code"], r.json["error"]["field"]) == ("too_large", "return_weights")
    r = post(client, {**body, "average_weights": True})
    assert r.status_code == 200, r.json
    assert tensor(r.json["weights"]).shape == (64, 64)


def test_the_jobs_count_the_variants():
    """A window's work is B*T*min(S, left+right+1) and the block edges (the core's plan);
    GQA's blocks are the core's; a bias is a working input; averaged weights are B/H*T*S."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 64, 4)) for _ in range(3))
    schema = AttentionRequest(Settings(warmup=False))  # the default limits
    full = schema.load({"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "return_weights": False})
    windowed = schema.load({"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "return_weights": False, "window": [7, 0]})
    assert work_of(full).score_elements == 8 * 64 * 64
    assert work_of(windowed).score_elements == core.plan(8, 64, 64, 4, window=(7, 0), return_weights=False).scores < 8 * 64 * 64 / 2
    assert work_of(windowed).blocks == core.plan(8, 64, 64, 4, window=(7, 0), return_weights=False).count
    gqa = schema.load({"q": q.tolist(), "k": k[:, :2].tolist(), "v": v[:, :2].tolist(), "enable_gqa": True})
    assert gqa.groups == 4 and work_of(gqa).blocks == core.plan(8, 64, 64, 4, groups=4).count
    bias = rng.standard_normal((8, 64, 64))
    biased = schema.load({"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "bias": b64(bias)})
    plain = schema.load({"q": q.tolist(), "k": k.tolist(), "v": v.tolist()})
    assert biased.working_bytes() - plain.working_bytes() >= bias.astype(np.float32).nbytes  # an input, in the compute dtype
    averaged = schema.load({"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "average_weights": True})
    assert averaged.weights_elements == 64 * 64 and plain.weights_elements == 8 * 64 * 64
    assert plain.output_elements == 8 * 64 * 4


# --- /attention: refused ---------------------------------------------------------------------------

H2 = [[[1.0, 0.0], [0.0, 1.0]]] * 2  # (2, 2, 2): 2 heads, T=S=2, d=2
H3 = [[[1.0, 0.0], [0.0, 1.0]]] * 3
H4 = [[[1.0, 0.0], [0.0, 1.0]]] * 4
GQA = {"q": H4, "k": H2, "v": H2}

REJECT = [
    # (id, body, status, code, field, words the message must hold)
    ("gqa not bool", {**GQA, "enable_gqa": "yes"}, 422, "bad_type", "enable_gqa", []),
    ("gqa heads do not divide", {"q": H4, "k": H3, "v": H3, "enable_gqa": True}, 422, "shape_mismatch", "k", ["3", "4"]),
    ("gqa on rank 2", {**WORKED, "enable_gqa": True}, 422, "bad_option", "enable_gqa", ["rank"]),
    ("gqa ranks differ", {"q": [H4], "k": H2, "v": H2, "enable_gqa": True}, 422, "shape_mismatch", "k", []),
    ("head mismatch without gqa", GQA, 422, "shape_mismatch", "k", ["enable_gqa"]),
    ("window not a list", {**WORKED, "window": 4}, 422, "bad_type", "window", []),
    ("window of one", {**WORKED, "window": [4]}, 422, "bad_type", "window", []),
    ("window of three", {**WORKED, "window": [1, 2, 3]}, 422, "bad_type", "window", []),
    ("window floats", {**WORKED, "window": [1.5, 0]}, 422, "bad_type", "window", []),
    ("window booleans", {**WORKED, "window": [True, 0]}, 422, "bad_type", "window", []),
    ("window below -1", {**WORKED, "window": [-2, 0]}, 422, "bad_option", "window", ["-1"]),
    ("bias strings", {**WORKED, "bias": [["a"] * 3] * 3}, 422, "bad_type", "bias", []),
    ("bias booleans", {**WORKED, "bias": [[True] * 3] * 3}, 422, "bad_type", "bias", []),
    ("bias overflows float32", {**WORKED, "bias": [[1e39] * 3] * 3}, 422, "non_finite", "bias", []),
    ("bias does not broadcast", {**WORKED, "bias": [[0.0] * 2] * 3}, 422, "shape_mismatch", "bias", ["[3, 3]"]),
    ("bias grows the batch", {**WORKED, "bias": [[[0.0] * 3] * 3] * 2}, 422, "shape_mismatch", "bias", []),
    ("alibi does not broadcast", {"q": H4, "k": H4, "v": H4, "alibi_slopes": [1.0, 0.5]}, 422, "shape_mismatch", "alibi_slopes", []),
    ("alibi on rank 2", {**WORKED, "alibi_slopes": [1.0]}, 422, "shape_mismatch", "alibi_slopes", []),
    ("alibi overflows", {"q": H2, "k": H2, "v": H2, "alibi_slopes": [1e39, 1.0]}, 422, "non_finite", "alibi_slopes", []),
    ("alibi strings", {"q": H2, "k": H2, "v": H2, "alibi_slopes": ["a", "b"]}, 422, "bad_type", "alibi_slopes", []),
    ("average_weights not bool", {"q": H2, "k": H2, "v": H2, "average_weights": 1}, 422, "bad_type", "average_weights", []),
    ("average_weights on rank 2", {**WORKED, "average_weights": True}, 422, "bad_option", "average_weights", ["rank"]),
    ("weights_dtype bfloat16", {**WORKED, "weights_dtype": "bfloat16"}, 422, "bad_option", "weights_dtype", []),
    ("weights_dtype a number", {**WORKED, "weights_dtype": 16}, 422, "bad_option", "weights_dtype", []),
    ("float16 b64 length", {**WORKED, "q": {"shape": [3, 2], "dtype": "float16", "b64": "AAA="}}, 422, "bad_shape", "q", []),
    (
        "float16 overflow",
        {**WORKED, "v": {"shape": [3, 2], "dtype": "float16", "b64": b64([[np.inf, 0]] * 3, "float16")["b64"]}},
        422,
        "non_finite",
        "v",
        [],
    ),
]


@pytest.mark.parametrize("body, status, code, field, words", [r[1:] for r in REJECT], ids=[r[0] for r in REJECT])
def test_variant_rejects(client, body, status, code, field, words):
    r = post(client, body)
    assert r.status_code == status, r.json
    err = r.json["error"]
    assert (err["status"], err["code"], err["field"]) == (status, code, field)
    assert field in err["message"] and "Traceback" not in err["message"]
    for word in words:
        assert word in err["message"]


# --- /mha generalised ------------------------------------------------------------------------------

TEXTBOOK = {
    "x": [[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]],
    "wq": [[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]],
    "wk": [[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]],
    "wv": [[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]],
    "heads": 1,
    "scale": 1,
    "causal": False,
}


def test_mha_textbook_listing(client):
    """The textbook's listing: x (3, 4) projected to width 3, scale 1, no output projection."""
    r = post(client, TEXTBOOK, path="/mha")
    assert r.status_code == 200, r.json
    out, weights = tensor(r.json["out"]), tensor(r.json["weights"])
    assert out.shape == (3, 3) and weights.shape == (1, 3, 3)
    np.testing.assert_allclose(out[0], [1.9366, 6.6831, 1.5951], atol=1e-4)
    np.testing.assert_allclose(weights[0, 0], [0.0634, 0.4683, 0.4683], atol=1e-4)


def mha_arrays(rng, d=6, heads=4, kv_heads=2, dk=3, dv=5, d_out=7, n=9):
    x = rng.standard_normal((2, n, d))
    ws = {
        "wq": rng.standard_normal((d, heads * dk)) / 3,
        "wk": rng.standard_normal((d, kv_heads * dk)) / 3,
        "wv": rng.standard_normal((d, kv_heads * dv)) / 3,
        "wo": rng.standard_normal((heads * dv, d_out)) / 3,
    }
    return x, ws


MHA_ACCEPT = [
    # (id, request options, core.mha keyword arguments, drop wo)
    ("kv_heads 2 of 4", {"kv_heads": 2}, {"kv_heads": 2}, False),
    ("no wo", {"kv_heads": 2}, {"kv_heads": 2}, True),
    ("scale and window", {"kv_heads": 2, "scale": 0.5, "window": [3, 0]}, {"kv_heads": 2, "scale": 0.5, "window": (3, 0)}, False),
    ("window, not causal", {"kv_heads": 2, "window": [2, 2], "causal": False}, {"kv_heads": 2, "window": (2, 2), "causal": False}, False),
]


@pytest.mark.parametrize("options, kwargs, no_wo", [a[1:] for a in MHA_ACCEPT], ids=[a[0] for a in MHA_ACCEPT])
def test_mha_general_answers_what_the_core_computes(client, rng, options, kwargs, no_wo):
    x, ws = mha_arrays(rng)
    if no_wo:
        ws.pop("wo")
    body = {"x": b64(x, "float64"), **{n: b64(w, "float64") for n, w in ws.items()}, "heads": 4, "dtype": "float64", **options}
    r = post(client, body, path="/mha")
    assert r.status_code == 200, r.json
    expect_out, expect_w = core.mha(x, ws["wq"], ws["wk"], ws["wv"], ws.get("wo"), 4, **kwargs)
    out = tensor(r.json["out"])
    assert out.shape == ((2, 9, 20) if no_wo else (2, 9, 7))
    np.testing.assert_allclose(out, expect_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tensor(r.json["weights"]), expect_w, rtol=1e-12, atol=1e-12)


def test_mha_job_counts_its_projections(settings, rng):
    x, ws = mha_arrays(rng)
    job = MhaRequest(settings).load({"x": x.tolist(), **{n: w.tolist() for n, w in ws.items()}, "heads": 4, "kv_heads": 2})
    rows = 2 * 9
    assert job.other_flops == 2 * rows * (6 * (12 + 6 + 10) + 20 * 7)
    assert job.head_widths == (3, 5) and job.groups == 2 and job.output_elements == rows * 7


def mha_body(**changes):
    rng = np.random.default_rng(0)
    x, ws = mha_arrays(rng)
    body = {"x": x.tolist(), **{n: w.tolist() for n, w in ws.items()}, "heads": 4, "kv_heads": 2}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


MHA_REJECT = [
    # (id, body, code, field)
    ("wq rows", mha_body(wq=np.ones((5, 12)).tolist()), "shape_mismatch", "wq"),
    ("heads do not divide wq", mha_body(heads=5), "bad_option", "heads"),
    ("kv_heads do not divide heads", mha_body(kv_heads=3), "bad_option", "kv_heads"),
    ("kv_heads zero", mha_body(kv_heads=0), "bad_option", "kv_heads"),
    ("kv_heads a string", mha_body(kv_heads="2"), "bad_type", "kv_heads"),
    ("wk width", mha_body(wk=np.ones((6, 12)).tolist()), "shape_mismatch", "wk"),
    ("wv width", mha_body(wv=np.ones((6, 7)).tolist()), "shape_mismatch", "wv"),
    ("wo rows", mha_body(wo=np.ones((10, 7)).tolist()), "shape_mismatch", "wo"),
    ("scale zero", mha_body(scale=0), "bad_option", "scale"),
    ("scale a string", mha_body(scale="1"), "bad_type", "scale"),
    ("window below -1", mha_body(window=[0, -5]), "bad_option", "window"),
    ("window a string", mha_body(window="256,0"), "bad_type", "window"),
    ("weights_dtype", mha_body(weights_dtype="int8"), "bad_option", "weights_dtype"),
]


@pytest.mark.parametrize("body, code, field", [r[1:] for r in MHA_REJECT], ids=[r[0] for r in MHA_REJECT])
def test_mha_variant_rejects(client, body, code, field):
    r = post(client, body, path="/mha")
    assert r.status_code == 422, r.json
    err = r.json["error"]
    assert (err["code"], err["field"]) == (code, field)
    assert field in err["message"]
