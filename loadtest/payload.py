"""The request body of one cell: random q, k, v of shape (batch, heads, T, d), encoded once.

Encoding happens here, before any timing, so a sweep measures the server and not the
client's JSON encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson

from client import encode_tensor

Encoding = Literal["nested", "b64"]


@dataclass(frozen=True)
class Workload:
    """What every request of a sweep asks for; only T changes from cell to cell."""

    batch: int = 1
    heads: int = 1
    d: int = 64
    causal: bool = False
    weights: bool = True
    encoding: Encoding = "b64"
    seed: int = 0

    def describe(self) -> str:
        """One line for progress and the report."""
        return (
            f"q, k, v of shape ({self.batch}, {self.heads}, T, {self.d}) float32, "
            f"{'causal' if self.causal else 'not causal'}, "
            f"{'with' if self.weights else 'no'} weights, {self.encoding} encoding"
        )


def build_body(workload: Workload, T: int) -> bytes:
    """The JSON body of POST /attention for self-attention over T positions (S = T).

    q, k, v: (batch, heads, T, d), standard normal, seeded by (seed, T) so a cell's
    body is the same from run to run.
    """
    rng = np.random.default_rng([workload.seed, T])
    shape = (workload.batch, workload.heads, T, workload.d)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    body = {
        "q": encode_tensor(q, workload.encoding),  # the project's client's wire encoding
        "k": encode_tensor(k, workload.encoding),
        "v": encode_tensor(v, workload.encoding),
        "causal": workload.causal,
        "return_weights": workload.weights,
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
