"""Jobs: validated requests, the unit every other module talks to. A job holds its arrays in the
compute dtype and knows what computing it costs (flops, score elements, the numeric core's blocks,
the working memory) and how to compute itself on the numeric core.

Shape legend as in service.core: B the product of the attention's leading axes (heads included),
T queries, S keys, d query/key width, dv value width, n sequence length, h heads.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from service import core

from .errors import RequestError

COMPUTE_DTYPES = ("float32", "float64")  # the dtypes a job computes in (request field "dtype")
WEIGHTS_DTYPES = ("float16", "float32", "float64")  # the precisions weights may be returned in (weights_dtype)
# Bytes beyond the arrays that a response holds while it is written: b64 text is encoded 4 MiB at
# a time, nested text in blocks of 2**18 numbers (~6 MB); plus the core's O(block) scratch.
RESPONSE_CHUNK_BYTES = 8 * 2**20
SCRATCH_BYTES = 4 * 2**20


# What a bias, ALiBi or a mask multiply a plain request's time by, (with weights, without): the
# CPU time of each against a plain request of the same shape, B=1 H=8 d=64, T=256 and 1024
# (bench/README.md, `python -m bench.cost_variants`, two runs). With weights a bias measured
# 1.3-2.0x, ALiBi 2.2-3.4x, a mask 1.5-2.4x; without, 2.3-4.2x, 2.7-6.4x and 1.6-2.9x: each adds passes
# over every score, and turns off the no-weights path's bounded scores (which skip two passes),
# more of its time the larger T. Several add up: 1 + the sum of (factor - 1).
EXTRA_COST = {"bias": (1.5, 2.5), "alibi_slopes": (2.5, 3.5), "mask": (1.8, 2.2)}
# With weights, the core writes 0 to each weight past the largest key_lengths and checks it: about
# half a computed score's time each (key_lengths=1 with weights: 0.17-0.40x a plain request's time).
ZEROED_WEIGHT_SHARE = 0.5
# What each element of q and out, and of k and v, costs beside the matmuls, in computed scores:
# q is scaled and out divided (a pass or two each), k and v read once for their bounds.
# Negligible where S and T are alike and large; all of the time where one is tiny (T=4096 with S=1
# ran 26-39x its prediction without them, T=1 with S=1024 3.4-3.6x; bench/README.md).
QUERY_ELEMENT_WEIGHT, KEY_ELEMENT_WEIGHT = 1.0, 0.25


@dataclass(frozen=True)
class Work:
    """What the cost model reads of a job: the arithmetic the numeric core actually does.

    cost_factor is what a bias, ALiBi or a mask multiply the plain work's time by (EXTRA_COST);
    fitted False marks work whose cost the features only estimate (those, and key_lengths), which
    the fit predicts but does not learn from."""

    flops: int
    score_elements: int
    dtype: str
    T: int  # query positions (n for /mha)
    blocks: int = 1  # the numeric core's blocks (core.plan(...).count)
    cost_factor: float = 1.0  # the plain work's time x this (a bias, ALiBi, a mask)
    fitted: bool = True  # the fit may learn from its measured time
    query_elements: int = 0  # the elements of q and out (QUERY_ELEMENT_WEIGHT scores each)
    key_elements: int = 0  # the elements of k and v (KEY_ELEMENT_WEIGHT scores each)

    def features(self) -> np.ndarray:
        """(GFLOP, M score elements, blocks) x cost_factor: what the fit's a, b, c multiply; the
        score elements count q, k, v and out's elements too, at their weights."""
        scores = self.score_elements + QUERY_ELEMENT_WEIGHT * self.query_elements + KEY_ELEMENT_WEIGHT * self.key_elements
        return np.array([self.flops / 1e9, scores / 1e6, float(self.blocks)]) * self.cost_factor


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
    window: tuple[int, int] | None = None  # FlashAttention's window_size, or no window
    groups: int = 1  # query heads per key/value head (grouped-query attention)
    weights_dtype: str | None = None  # the weights' precision on the wire (cast as they are sent); None: the compute dtype
    averaged_over: int = 1  # the heads the returned weights are averaged over (1: not averaged)
    overflow_field = "q"  # the field a score overflow is blamed on

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
        the keys past each block's diagonal (about half; a small problem goes to reference(),
        which computes them all); with weights it writes the whole (T, S) buffer, and measured here
        saved 0-36%: all is counted. A window's band is what the core
        computes either way (B*T*min(S, left+right+1) and the block edges: core.plan(...).scores), and
        no key past the largest key_lengths is."""
        if self.window is not None:
            share = self.plan.scores / self.score_elements
        else:  # the reference path computes every score, as the weights path does
            share = 1.0 if self.return_weights or self.plan.reference else core.causal_share(self.T, self.S, self.causal)
        # The core computes no key at or past the largest key_lengths (key_lengths of 1: one key a
        # row): exact without a band (causal, window), the lesser count (an upper bound) with one.
        return min(share, self.key_end / self.S) if self.S else share

    @property
    def key_end(self) -> int:
        """No key at or past this is computed: S (AttentionJob: the largest key_lengths)."""
        return self.S

    @property
    def cost_factor(self) -> float:
        """What a bias, ALiBi or a mask multiply the plain work's time by (EXTRA_COST)."""
        return 1.0

    @property
    def fitted(self) -> bool:
        """Whether the features count this job's cost as calibration timed it (the fit learns from it)."""
        return True

    @property
    def plan(self) -> core.Plan:
        """The blocks the numeric core computes this job in (core.plan)."""
        return core.plan(
            self.B,
            self.T,
            self.S,
            self.head_widths[1],
            causal=self.causal,
            window=self.window,
            groups=self.groups,
            itemsize=self.itemsize,
            return_weights=self.return_weights,
        )

    @property
    def blocks(self) -> int:
        return self.plan.count

    @property
    def itemsize(self) -> int:
        """The compute dtype's bytes per number (the core's one-block bound depends on it)."""
        return np.dtype(self.dtype).itemsize

    @property
    def weights_elements(self) -> int:
        """The weights returned: B*T*S, without the heads axis when they are averaged over it."""
        return self.score_elements // self.averaged_over if self.return_weights else 0

    @property
    def weights_itemsize(self) -> int:
        return np.dtype(self.weights_dtype or self.dtype).itemsize

    def work(self) -> Work:
        """Computed once: admission predicts from it and the compute is measured against it (a job
        is frozen, so the answer cannot change; ~50 us of a small request's fixed cost)."""
        work = self.__dict__.get("_work")
        if work is None:
            share = self.computed_share
            attention_flops = self.flops - self.other_flops
            flops = self.other_flops + share * attention_flops
            scores = self.score_elements * share
            if self.return_weights:  # the weights past the largest key_lengths: not computed, but written 0
                scores += ZEROED_WEIGHT_SHARE * self.B * self.T * (self.S - self.key_end) / self.cost_factor  # no bias on them
            d, dv = self.head_widths
            rows, keys = self.B * self.T * (d + dv), self.B // self.groups * self.S * (d + dv)  # q and out; k and v
            work = Work(int(flops), int(scores), self.dtype, int(self.T), self.blocks, self.cost_factor, self.fitted, rows, keys)
            object.__setattr__(self, "_work", work)  # frozen dataclass: its fields are fixed, this is a cache
        return work

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
        elements = sum(a.size for a in vars(self).values() if isinstance(a, np.ndarray))  # a bias included
        total = elements * itemsize
        if self.encoding != "b64":
            total += elements * 8
        total += self._core_bytes(itemsize)
        answered = self.output_elements + self.weights_elements
        if self.return_weights:
            total += self.score_elements * itemsize  # the core's (B, T, S) buffer, in the compute dtype
            if self.weights_elements != self.score_elements:
                total += self.weights_elements * itemsize  # averaged over the heads
            if self.weights_itemsize != itemsize and self.encoding != "b64":
                total += self.weights_elements * self.weights_itemsize  # cast whole (b64 casts chunk by chunk as it is sent)
        total += min(RESPONSE_CHUNK_BYTES, answered * 24)  # a chunk of text: up to ~24 bytes a number
        return total + min(SCRATCH_BYTES, self.score_elements * itemsize)

    def compute(self, threads: int = 1, pool: Executor | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(out, weights or None) from the numeric core, on threads threads (pool's and the
        caller's; the same bits as one); non_finite if the scores or the result overflow (never a
        200 with inf or NaN in it)."""
        try:
            out, weights = self._compute(threads, pool)
        except core.ScoreOverflow as exc:
            field, terms = self._score_overflow()
            raise RequestError(
                "non_finite",
                f"The scores {terms} overflow {exc.dtype}; send {_float64_hint(exc.dtype)}smaller values or a smaller scale.",
                field,
            ) from None
        except core.ResultOverflow as exc:
            raise RequestError(
                "non_finite",
                f"The result ({exc.what}) overflows {exc.dtype}; send {_float64_hint(exc.dtype)}smaller values.",
                self.overflow_field,
            ) from None
        return out, weights  # in the compute dtype: the front doors send them in weights_dtype

    def _score_overflow(self) -> tuple[str, str]:
        """(the field a score overflow is blamed on, the terms the scores add up)."""
        return self.overflow_field, "q·kᵀ·scale"

    def _compute(self, threads: int, pool: Executor | None) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError


def _float64_hint(dtype) -> str:
    """The hint to compute in float64, where the request did not already."""
    return "" if np.dtype(dtype) == np.float64 else '"dtype": "float64", '


@dataclass(frozen=True)
class AttentionJob(_Job):
    """A validated /attention request: arrays in the compute dtype, options normalised."""

    q: np.ndarray  # (..., T, d)
    k: np.ndarray  # (..., S, d), or (..., Hkv, S, d) under enable_gqa
    v: np.ndarray  # (..., S, dv), as k
    mask: np.ndarray | None  # bool, broadcasts to (..., T, S)
    causal: bool | str  # False, "top_left" or "bottom_right"
    key_lengths: np.ndarray | None  # int64, broadcasts to (...)
    scale: float | None
    return_weights: bool
    encoding: str
    enable_gqa: bool = False
    window: tuple[int, int] | None = None
    bias: np.ndarray | None = None  # compute dtype, broadcasts to (..., T, S)
    alibi_slopes: np.ndarray | None = None  # compute dtype, broadcasts to (...)
    average_weights: bool = False
    weights_dtype: str | None = None

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
    def groups(self) -> int:
        return self.q.shape[-3] // self.k.shape[-3] if self.enable_gqa else 1

    @property
    def averaged_over(self) -> int:
        return self.q.shape[-3] if self.average_weights else 1

    @property
    def key_end(self) -> int:
        return self.S if self.key_lengths is None else min(self.S, int(self.key_lengths.max(initial=0)))

    @property
    def cost_factor(self) -> float:
        extra = (factors[0 if self.return_weights else 1] - 1 for name, factors in EXTRA_COST.items() if getattr(self, name) is not None)
        return 1.0 + sum(extra, 0.0)

    @property
    def fitted(self) -> bool:
        """Without a bias, ALiBi, a mask or key_lengths: their cost is estimated, not what calibration timed,
        and a stream of them fed to the fit would move every plain request's prediction."""
        return self.cost_factor == 1.0 and self.key_lengths is None

    @property
    def output_elements(self) -> int:
        """The returned out, B*T*dv."""
        return self.B * self.T * self.v.shape[-1]

    def _core_bytes(self, itemsize: int) -> int:
        """out, and, bounded above as when the core copied them, a scaled q (its scaled rows are
        now one block's per thread), v (copied only where it is not contiguous) and a number per
        row of v (the row sums: now one block's scratch). Not tightened: an upper bound errs on the
        safe side of the memory check."""
        rows = self.v.size // self.v.shape[-1]
        return (self.q.size + self.v.size + rows + self.output_elements) * itemsize

    def _score_overflow(self) -> tuple[str, str]:
        """A bias or ALiBi term within a factor 4 of the dtype's maximum is the likely cause: it is
        named (a score overflow that only they cause is not q's)."""
        terms = "q·kᵀ·scale" + (" + bias" if self.bias is not None else "") + (" + the ALiBi term" if self.alibi_slopes is not None else "")
        near = np.finfo(self.q.dtype).max / 4
        if self.bias is not None and np.abs(self.bias).max() >= near:
            return "bias", terms
        if self.alibi_slopes is not None and np.abs(self.alibi_slopes).max() * max(self.T, self.S) >= near:
            return "alibi_slopes", terms
        return self.overflow_field, terms

    def _compute(self, threads, pool):
        return core.attention(
            self.q,
            self.k,
            self.v,
            self.mask,
            causal=self.causal,
            key_lengths=self.key_lengths,
            scale=self.scale,
            return_weights=self.return_weights,
            enable_gqa=self.enable_gqa,
            window=self.window,
            bias=self.bias,
            alibi_slopes=self.alibi_slopes,
            average_weights=self.average_weights,
            threads=threads,
            pool=pool,
        )


@dataclass(frozen=True)
class MhaJob(_Job):
    """A validated /mha request: projections (d, h*dk), (d, hkv*dk), (d, hkv*dv) and an optional
    (h*dv, d_out) around attention over h query heads sharing hkv = kv_heads key/value heads."""

    x: np.ndarray  # (..., n, d)
    wq: np.ndarray  # (d, h * dk)
    wk: np.ndarray  # (d, hkv * dk)
    wv: np.ndarray  # (d, hkv * dv)
    wo: np.ndarray | None  # (h * dv, d_out), or None: the heads concatenated
    heads: int
    causal: bool
    return_weights: bool
    encoding: str
    scale: float | None = None
    kv_heads: int | None = None
    window: tuple[int, int] | None = None
    weights_dtype: str | None = None

    overflow_field = "x"

    @property
    def B(self) -> int:
        return math.prod(self.x.shape[:-2]) * self.heads

    @property
    def T(self) -> int:
        return self.x.shape[-2]

    S = T  # self-attention: the keys are the n positions too

    @property
    def groups(self) -> int:
        return self.heads // (self.kv_heads or self.heads)

    @property
    def head_widths(self) -> tuple[int, int]:
        return self.wq.shape[-1] // self.heads, self.wv.shape[-1] // (self.kv_heads or self.heads)

    @property
    def other_flops(self) -> int:
        rows, d = math.prod(self.x.shape[:-1]), self.x.shape[-1]
        projections = self.wq.shape[-1] + self.wk.shape[-1] + self.wv.shape[-1]  # 3d for the GPT block
        out = 0 if self.wo is None else self.wo.shape[0] * self.wo.shape[1]
        return 2 * rows * (d * projections + out)  # x Wq, x Wk, x Wv and the heads Wo: 8 n d² for the GPT block

    @property
    def output_elements(self) -> int:
        """The returned out, B*n*d_out (or B*n*h*dv without wo)."""
        width = self.wv.shape[-1] * self.groups if self.wo is None else self.wo.shape[-1]
        return math.prod(self.x.shape[:-1]) * width

    @property
    def dtype(self) -> str:
        return self.x.dtype.name

    def _core_bytes(self, itemsize: int) -> int:
        """The three projections, the core's copies of q and v, out, the merged heads and out @ wo:
        9 x.size for the GPT block's (d, d) projections."""
        rows = self.x.size // self.x.shape[-1]
        widths = self.wq.shape[-1] + self.wk.shape[-1] + self.wv.shape[-1]
        heads_out = self.heads * self.head_widths[1]
        return rows * (2 * widths + 2 * heads_out + (0 if self.wo is None else self.wo.shape[-1])) * itemsize

    def _compute(self, threads, pool):
        return core.mha(
            self.x,
            self.wq,
            self.wk,
            self.wv,
            self.wo,
            self.heads,
            causal=self.causal,
            return_weights=self.return_weights,
            scale=self.scale,
            kv_heads=self.kv_heads,
            window=self.window,
            threads=threads,
            pool=pool,
        )
