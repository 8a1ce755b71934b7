"""The textbook attention service `python -m bench textbook` measures this one against (as
`gunicorn bench.baseline_service:app`, one sync worker), written as a tutorial would: Flask's
stdlib json, a marshmallow List(List(...Float())) schema checking every number, textbook numpy
(the whole score matrix, float64 scale, np.where mask), `.tolist()` answers; b64 by stdlib base64."""

from __future__ import annotations

import base64
import json

import numpy as np
from flask import Flask, Response, request
from marshmallow import Schema, ValidationError, fields

DTYPES = {"float32": np.float32, "float64": np.float64}


def textbook_attention(q, k, v, causal=True):
    """softmax(q kᵀ / sqrt(d), masked) v, the way the textbooks write it: returns out and weights."""
    d = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)  # np.sqrt gives a float64 scalar: float64 scores
    if causal:
        T, S = scores.shape[-2:]
        mask = np.tril(np.ones((T, S), dtype=bool))
        scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights @ v, weights


class B64Tensor(Schema):
    shape = fields.List(fields.Integer(), required=True)
    dtype = fields.String(required=True)
    b64 = fields.String(required=True)


class Tensor(fields.Field):
    """A rank-4 nested list of floats (every number checked by marshmallow), or a b64 object."""

    nested = fields.List(fields.List(fields.List(fields.List(fields.Float()))))

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, dict):
            spec = B64Tensor().load(value)
            raw = base64.b64decode(spec["b64"])
            return np.frombuffer(raw, dtype=DTYPES[spec["dtype"]]).reshape(spec["shape"])
        return np.array(self.nested.deserialize(value))


class AttentionRequest(Schema):
    q = Tensor(required=True)
    k = Tensor(required=True)
    v = Tensor(required=True)
    causal = fields.Boolean(load_default=False)
    return_weights = fields.Boolean(load_default=True)


app = Flask(__name__)


@app.post("/attention")
def attention():
    try:
        req = AttentionRequest().load(request.get_json())
    except ValidationError as exc:
        return {"error": exc.messages}, 422
    b64 = isinstance(request.get_json()["q"], dict)
    out, weights = textbook_attention(req["q"], req["k"], req["v"], causal=req["causal"])
    body = {"out": encode(out, b64)}
    if req["return_weights"]:
        body["weights"] = encode(weights, b64)
    return Response(json.dumps(body), mimetype="application/json")


@app.get("/readyz")
def readyz():
    return {"status": "ready"}


def encode(arr: np.ndarray, b64: bool):
    if b64:
        arr = arr.astype(np.float32)
        return {"shape": list(arr.shape), "dtype": "float32", "b64": base64.b64encode(arr.tobytes()).decode()}
    return arr.tolist()
