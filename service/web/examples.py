"""The requests the OpenAPI document shows as examples (what /docs pre-fills), for both doors:
each is answered 200, as tests/test_openapi.py checks."""

from __future__ import annotations

# The worked example: three tokens, d = 2; query 0 sees only key 0 under causal, query 2 all three.
WORKED_Q = [[1, 0], [0, 1], [1, 1]]
WORKED_V = [[1, 0], [0, 10], [5, 5]]
MHA_X = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]
EYE4 = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]

ATTENTION = {
    "worked_example": {"summary": "the worked example, causal", "value": {"q": WORKED_Q, "k": WORKED_Q, "v": WORKED_V, "causal": True}},
    "flat_batched": {
        "summary": "flat encoding, batch of 2, key padding",
        "value": {
            "q": {"shape": [2, 2, 2], "data": [1, 0, 0, 1, 1, 1, 0, 1]},
            "k": {"shape": [2, 3, 2], "data": [1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]},
            "v": {"shape": [2, 3, 1], "data": [1, 2, 3, 4, 5, 6]},
            "key_lengths": [3, 2],
            "return_weights": False,
        },
    },
    "b64": {
        "summary": "b64 encoding, bottom-right causal, float64",
        "value": {
            "q": {"shape": [1, 2], "dtype": "float32", "b64": "AACAPwAAAAA="},
            "k": {"shape": [2, 2], "dtype": "float32", "b64": "AACAPwAAAAAAAAAAAACAPw=="},
            "v": {"shape": [2, 1], "dtype": "float32", "b64": "AACAPwAAAEA="},
            "causal": "bottom_right",
            "dtype": "float64",
        },
    },
}
MHA = {
    "identity_projections": {
        "summary": "identity projections, 2 heads",
        "value": {"x": MHA_X, "wq": EYE4, "wk": EYE4, "wv": EYE4, "wo": EYE4, "heads": 2},
    }
}


def _v2_input(name: str, data: list, datatype: str = "FP32") -> dict:
    shape = [len(data), len(data[0])] if isinstance(data[0], list) else [len(data)]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


_WORKED = [_v2_input("q", WORKED_Q), _v2_input("k", WORKED_Q), _v2_input("v", WORKED_V)]
# Keyed model_..., so that each is sent to its model.
V2_INFER = {
    "attention_worked_example": {
        "summary": "attention: the worked example, causal",
        "value": {"inputs": _WORKED, "parameters": {"causal": True}},
    },
    "attention_flat_out_only": {
        "summary": "attention: flat data, float64, only the out output",
        "value": {
            "id": "flat-1",
            "inputs": [{**i, "data": [x for row in i["data"] for x in row]} for i in _WORKED],
            "outputs": [{"name": "out"}],
            "parameters": {"causal": True, "dtype": "float64"},
        },
    },
    "mha_identity_projections": {
        "summary": "mha: identity projections, 2 heads (name: mha)",
        "value": {
            "inputs": [_v2_input(n, m) for n, m in (("x", MHA_X), ("wq", EYE4), ("wk", EYE4), ("wv", EYE4), ("wo", EYE4))],
            "parameters": {"heads": 2},
        },
    },
}
