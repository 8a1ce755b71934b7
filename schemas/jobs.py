"""Jobs: validated requests, the unit every other module talks to. A job holds its arrays in the
compute dtype and knows what computing it costs (flops, score elements, the numeric core's blocks,
the working memory) and how to compute itself on the numeric core.

Shape legend as in service.core: B the product of the attention's leading axes (heads included),
T queries, S keys, d query/key width, dv value width, n sequence length, h heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from service import core

from .errors import RequestError

COMPUTE_DTYPES = ("float32", "float64")  # the dtypes a job computes in (request field "dtype")


@dataclass(frozen=True)
class Work:
    """What the cost model reads of a job: the arithmetic the numeric core actually does."""

    flops: int
    score_elements: int
    dtype: str
    T: int  # query positions (n for /mha)
    blocks: int = 1  # the numeric core's blocks (core.block_count)

    def features(self) -> np.ndarray:
        return np.array([self.flops / 1e9, self.score_elements / 1e6, float(self.blocks)])


class _Job:
    """What AttentionJob and MhaJob share. A subclass gives the attention's B, T, S, the widths
    d and dv of one head, the flops beside the attention (projections), and _compute()."""

    causal: bool | str
    return_weights: bool
    encoding: str

    B: int
    T: int
    S: int
    head_widths: tuple[int, int]  # (d, dv) of the attention
    other_flops: int = 0
    dtype: str

    @property
    def score_elements(self) -> int:
        """B*T*S: the scores of the attention (heads included)."""
        return self.B * self.T * self.S

    @property
    def flops(self) -> int:
        """Every multiply-add counted twice: q kᵀ and weights v, plus any projections."""
        return self.other_flops + 2 * self.score_elements * sum(self.head_widths)

    @property
    def computed_share(self) -> float:
        """The share of the scores the core computes. Without weights under a causal mask it skips
        the keys past each block's diagonal (about half); with weights it writes the whole (T, S)
        buffer, and measured here saved 0-36%: all is counted."""
        return 1.0 if self.return_weights else core.causal_share(self.T, self.S, self.causal)

    @property
    def blocks(self) -> int:
        return core.block_count(self.B, self.T, self.S, self.causal)

    def work(self) -> Work:
        share = self.computed_share
        attention_flops = self.flops - self.other_flops
        flops = self.other_flops + share * attention_flops
        return Work(int(flops), int(self.score_elements * share), self.dtype, int(self.T), self.blocks)

    def working_bytes(self) -> int:
        """Estimated peak bytes of computing and answering the job, beyond its body. Measured here
        (B=1, H=8, d=64, float32, bytes over the worker's idle size per score B*T*S): with weights,
        b64 4.8-5.9 (the weights and a mask byte; base64 is encoded as it is sent), nested 30
        (decimal text); without weights 0.9 (the core works in blocks of query rows)."""
        itemsize = np.dtype(self.dtype).itemsize
        if not self.return_weights:
            per = 1
        elif self.encoding == "b64":
            per = itemsize + 1
        else:
            per = itemsize + 1 + 24
        return self.score_elements * per

    def compute(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(out, weights or None) from the numeric core; non_finite if the scores or the result
        overflow (never a 200 with inf or NaN in it)."""
        try:
            return self._compute()
        except core.ScoreOverflow as exc:
            raise RequestError(
                "non_finite",
                f'The scores q·kᵀ·scale overflow {exc.dtype}; send "dtype": "float64", smaller values or a smaller scale.',
                self.overflow_field,
            ) from None
        except core.ResultOverflow as exc:
            raise RequestError(
                "non_finite", f'The result ({exc.what}) overflows {exc.dtype}; send "dtype": "float64" or smaller values.', None
            ) from None

    overflow_field = "q"

    def _compute(self) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionJob(_Job):
    """A validated /attention request: arrays in the compute dtype, options normalised."""

    q: np.ndarray  # (..., T, d)
    k: np.ndarray  # (..., S, d)
    v: np.ndarray  # (..., S, dv)
    mask: np.ndarray | None  # bool, broadcasts to (..., T, S)
    causal: bool | str  # False, "top_left" or "bottom_right"
    key_lengths: np.ndarray | None  # int64, broadcasts to (...)
    scale: float | None
    return_weights: bool
    encoding: str

    @property
    def B(self) -> int:
        return math.prod(self.q.shape[:-2])

    @property
    def T(self) -> int:
        return self.q.shape[-2]

    @property
    def S(self) -> int:
        return self.k.shape[-2]

    @property
    def head_widths(self) -> tuple[int, int]:
        return self.q.shape[-1], self.v.shape[-1]

    @property
    def dtype(self) -> str:
        return self.q.dtype.name

    def _compute(self):
        return core.attention(
            self.q,
            self.k,
            self.v,
            self.mask,
            causal=self.causal,
            key_lengths=self.key_lengths,
            scale=self.scale,
            return_weights=self.return_weights,
        )


@dataclass(frozen=True)
class MhaJob(_Job):
    """A validated /mha request: four (d, d) projections around attention over h heads."""

    x: np.ndarray  # (..., n, d)
    wq: np.ndarray  # (d, d)
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    heads: int
    causal: bool
    return_weights: bool
    encoding: str

    overflow_field = "x"

    @property
    def B(self) -> int:
        return math.prod(self.x.shape[:-2]) * self.heads

    @property
    def T(self) -> int:
        return self.x.shape[-2]

    S = T  # self-attention: the keys are the n positions too

    @property
    def head_widths(self) -> tuple[int, int]:
        hd = self.x.shape[-1] // self.heads
        return hd, hd

    @property
    def other_flops(self) -> int:
        rows, d = math.prod(self.x.shape[:-1]), self.x.shape[-1]
        return 8 * rows * d * d  # x Wq, x Wk, x Wv and the heads Wo

    @property
    def dtype(self) -> str:
        return self.x.dtype.name

    def _compute(self):
        return core.mha(self.x, self.wq, self.wk, self.wv, self.wo, self.heads, causal=self.causal, return_weights=self.return_weights)
