"""The cost model behind cost.predicted_ms and deadline admission:

    ms ~ a * gflops + b * mega_score_elements + c

a is the matmul rate, b the per-score softmax/mask pass, c the fixed overhead. Defaults were
measured on a 2-core machine; calibrate() refits them at start-up."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    a: float = 0.05   # ms per GFLOP
    b: float = 4.0    # ms per million score elements
    c: float = 0.05   # ms

    def predict(self, flops: int, score_elements: int) -> float:
        return self.a * flops / 1e9 + self.b * score_elements / 1e6 + self.c

    def coefficients(self) -> dict:
        return {"formula": "ms = a*GFLOP + b*M_score_elements + c", "a": self.a, "b": self.b, "c": self.c}
