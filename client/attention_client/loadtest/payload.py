"""The request body of one cell: random q of shape (batch, heads, T, d) and k, v of shape
(batch, kv_heads, T, d), encoded once; optionally a sliding window.

Encoding happens here, before any timing, so a sweep measures the server and not the
client's JSON encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson

from attention_client import encode_tensor

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
    window: tuple[int, int] | None = None  # FlashAttention's window_size: O(T * window) work, not O(T^2)
    kv_heads: int | None = None  # grouped-query attention: k, v with this many heads (dividing heads)

    def describe(self) -> str:
        """One line for progress and the report."""
        shapes = f"q, k, v of shape ({self.batch}, {self.heads}, T, {self.d}) float32"
        if self.kv_heads is not None:
            shapes = f"q ({self.batch}, {self.heads}, T, {self.d}), k, v ({self.batch}, {self.kv_heads}, T, {self.d}) float32 (GQA)"
        window = "" if self.window is None else f", window [{self.window[0]}, {self.window[1]}]"
        return (
            f"{shapes}, "
            f"{'causal' if self.causal else 'not causal'}{window}, "
            f"{'with' if self.weights else 'no'} weights, {self.encoding} encoding"
        )


def build_body(workload: Workload, T: int) -> bytes:
    """The JSON body of POST /attention for self-attention over T positions (S = T).

    q: (batch, heads, T, d), k, v: (batch, kv_heads or heads, T, d), standard normal, seeded
    by (seed, T) so a cell's body is the same from run to run.
    """
    rng = np.random.default_rng([workload.seed, T])
    shape = (workload.batch, workload.heads, T, workload.d)
    kv_shape = (workload.batch, workload.kv_heads or workload.heads, T, workload.d)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in (shape, kv_shape, kv_shape))
    options: dict[str, bool | list[int]] = {}
    if workload.kv_heads is not None:
        options["enable_gqa"] = True
    if workload.window is not None:
        options["window"] = list(workload.window)
    body = {
        "q": encode_tensor(q, workload.encoding),  # the project's client's wire encoding
        "k": encode_tensor(k, workload.encoding),
        "v": encode_tensor(v, workload.encoding),
        "causal": workload.causal,
        "return_weights": workload.weights,
        **options,  # absent without --window and --kv-heads: the body is as before
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
