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
# Bytes beyond the arrays that a response holds while it is written: b64 text is encoded 4 MiB at
# a time, nested text in blocks of 2**18 numbers (~6 MB); plus the core's O(block) scratch.
RESPONSE_CHUNK_BYTES = 8 * 2**20
SCRATCH_BYTES = 4 * 2**20


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

    @property
    def output_elements(self) -> int:
        """The elements of out: B*T*dv for /attention, B*n*d for /mha."""
        raise NotImplementedError

    def _core_bytes(self, itemsize: int) -> int:
        """The numeric core's own arrays beyond the inputs and the weights."""
        raise NotImplementedError

    def working_bytes(self) -> int:
        """Predicted peak bytes of validating, computing and answering the job, beyond its body.

        Counted (itemsize: 4 for float32, 8 for float64): the cast inputs, plus 8 bytes a number
        decoded from JSON text (float64 or int64, alive until the cast; b64 of the compute dtype
        is its decoded bytes, no copy), the core's arrays (_core_bytes), the weights if returned,
        a response chunk and the core's scratch, both bounded by the job's own size. Measured
        against the peak RSS of the same pipeline (bench/peak_rss.py): 0.84-1.24x for b64 bodies;
        the parse of a JSON body peaks before the job exists (the gate charges it, see
        service.web.admission)."""
        itemsize = np.dtype(self.dtype).itemsize
        elements = sum(a.size for a in vars(self).values() if isinstance(a, np.ndarray))
        total = elements * itemsize
        if self.encoding != "b64":
            total += elements * 8
        total += self._core_bytes(itemsize)
        answered = self.output_elements + (self.score_elements if self.return_weights else 0)
        if self.return_weights:
            total += self.score_elements * itemsize
        total += min(RESPONSE_CHUNK_BYTES, answered * 24)  # a chunk of text: up to ~24 bytes a number
        return total + min(SCRATCH_BYTES, self.score_elements * itemsize)

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

    @property
    def output_elements(self) -> int:
        return math.prod(self.q.shape[:-1]) * self.v.shape[-1]  # B*T*dv

    def _core_bytes(self, itemsize: int) -> int:
        """The scaled q, v with its column of ones, and out."""
        rows = self.v.size // self.v.shape[-1]
        return (self.q.size + self.v.size + rows + self.output_elements) * itemsize

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

    @property
    def output_elements(self) -> int:
        return math.prod(self.x.shape[:-1]) * self.wo.shape[-1]  # B*n*d

    def _core_bytes(self, itemsize: int) -> int:
        """The three (n, d) projections, the per-head copies of q, k, v and out, the merged heads
        and out @ wo: about 9 x.size."""
        return 9 * self.x.size * itemsize

    def _compute(self):
        return core.mha(self.x, self.wq, self.wk, self.wv, self.wo, self.heads, causal=self.causal, return_weights=self.return_weights)
