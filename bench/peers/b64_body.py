"""The native door's b64 JSON body for the peers without the Open Inference Protocol (LitServe,
Ray Serve, BentoML), read with the standard library as their users would: {"q", "k", "v":
{"shape", "dtype", "b64"}, "causal", "return_weights"} in, {"out"[, "weights"]} out (docs/api.md),
computed by service.core."""

from __future__ import annotations

import base64

import numpy as np

from service import core


def tensor(field: dict) -> np.ndarray:
    """A b64 tensor of the body -> its array (little-endian, read-only: a view of the bytes)."""
    dtype = np.dtype(field["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(field["b64"]), dtype=dtype).reshape(field["shape"])


def encoded(a: np.ndarray) -> dict:
    """An array -> its b64 tensor."""
    little = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return {"shape": list(a.shape), "dtype": a.dtype.name, "b64": base64.b64encode(little.data).decode("ascii")}


def answer(body: dict) -> dict:
    """POST /attention's answer to `body` (the parsed JSON): out, and weights when asked for."""
    return_weights = bool(body.get("return_weights", True))
    q, k, v = (tensor(body[name]) for name in ("q", "k", "v"))
    out, weights = core.attention(q, k, v, causal=bool(body.get("causal", False)), return_weights=return_weights)
    return {"out": encoded(out), **({"weights": encoded(weights)} if return_weights else {})}
