"""Jobs: validated requests, the unit every other module talks to. A job holds its arrays in the
compute dtype, knows its shapes (B, T, S, the head widths, flops and score elements), its working
memory, and how to compute itself on the numeric core. What computing it takes in time is the
cost model's (service.cost reads the shapes).

Shape legend as in service.core: B the product of the attention's leading axes (heads included),
T queries, S keys, d query/key width, dv value width, n sequence length, h heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


class _Job:
    """What AttentionJob and MhaJob share. A subclass gives the attention's B, T, S, the widths
    d and dv of one head, the flops beside the attention (projections), and _compute()."""

    causal: bool | str
    return_weights: bool
    encoding: str

    window: tuple[int, int] | None = None  # FlashAttention's window_size, or no window
    weights_dtype: str | None = None  # the weights' precision on the wire (cast as they are sent); None: the compute dtype
    overflow_field = "q"  # the field a score overflow is blamed on
    float64_hint = '"dtype": "float64", '  # what an overflow's message tells a float32 request to send

    # What a subclass gives, read off its arrays:
    @property
    def B(self) -> int:
        """The product of the attention's leading axes, heads included."""
        raise NotImplementedError

    @property
    def T(self) -> int:
        """Query positions."""
        raise NotImplementedError

    @property
    def S(self) -> int:
        """Key positions."""
        raise NotImplementedError

    @property
    def head_widths(self) -> tuple[int, int]:
        """(d, dv) of one head of the attention."""
        raise NotImplementedError

    @property
    def dtype(self) -> str:
        """The compute dtype's name."""
        raise NotImplementedError

    @property
    def other_flops(self) -> int:
        """Flops beside the attention (projections)."""
        return 0

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return 1

    @property
    def averaged_over(self) -> int:
        """The heads the returned weights are averaged over (1: not averaged)."""
        return 1

    @property
    def score_elements(self) -> int:
        """B*T*S: the scores of the attention (heads included)."""
        return self.B * self.T * self.S

    @property
    def flops(self) -> int:
        """Every multiply-add counted twice: q kᵀ and weights v, plus any projections."""
        return self.other_flops + 2 * self.score_elements * sum(self.head_widths)

    @property
    def key_end(self) -> int:
        """No key at or past this is computed: S (AttentionJob: the largest key_lengths)."""
        return self.S

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

    @property
    def output_elements(self) -> int:
        """The elements of out: B*T*dv for /attention, B*n*d for /mha."""
        raise NotImplementedError

    @property
    def lse_elements(self) -> int:
        """The returned lse, B*T, when asked for."""
        return self.B * self.T if getattr(self, "return_lse", False) else 0

    def _core_bytes(self, itemsize: int) -> int:
        """The numeric core's own arrays beyond the inputs and the weights."""
        raise NotImplementedError

    def working_bytes(self) -> int:
        """Predicted peak bytes of validating, computing and answering the job, beyond its body.

        Counted (itemsize: 4 for float32, 8 for float64): the cast inputs, plus 8 bytes a number
        decoded from JSON text (float64 or int64, alive until the cast; b64 of the compute dtype
        is its decoded bytes, no copy), the core's arrays (_core_bytes), the weights if returned,
        a response chunk and the core's scratch, both bounded by the job's own size, and checked
        against the peak RSS of the same pipeline (git log -- bench/peak_rss.py). The parse
        of a JSON body peaks before the job exists (the gate charges it, see service.admission.charge)."""
        itemsize = np.dtype(self.dtype).itemsize
        elements = sum(a.size for a in vars(self).values() if isinstance(a, np.ndarray))  # a bias included
        total = elements * itemsize
        if self.encoding != "b64":
            total += elements * 8
        total += self._core_bytes(itemsize)
        answered = self.output_elements + self.weights_elements + self.lse_elements
        total += self.lse_elements * itemsize
        if self.return_weights:
            total += self.score_elements * itemsize  # the core's (B, T, S) buffer, in the compute dtype
            if self.weights_elements != self.score_elements:
                total += self.weights_elements * itemsize  # averaged over the heads
            if self.weights_itemsize != itemsize and self.encoding != "b64":
                total += self.weights_elements * self.weights_itemsize  # cast whole (b64 casts chunk by chunk as it is sent)
        total += min(RESPONSE_CHUNK_BYTES, answered * 24)  # a chunk of text: up to ~24 bytes a number
        # The scratch: a block's scores per thread, or on the reference path its (B, T, S) scores
        # and, where a row's sum leaves the dtype's range, their copy (core.reference's _shift).
        return total + min(SCRATCH_BYTES, 2 * self.score_elements * itemsize)

    def compute(self, threads: int = 1, pool: Executor | None = None, stop: Callable[[], bool] | None = None) -> core.Result:
        """(out, weights or None), and lse when the job asks for it, from the numeric core, on
        threads threads (pool's and the caller's; the same bits as one); non_finite if the scores
        or the result overflow (never a 200 with inf or NaN in it). stop: the core's (core.Stopped
        when it says to stop)."""
        try:
            result = self._compute(threads, pool, stop)
        except core.ScoreOverflow as exc:
            field, terms = self._score_overflow()
            raise RequestError(
                "non_finite",
                f"The scores {terms} overflow {exc.dtype}; send {self._float64_hint(exc.dtype)}smaller values or a smaller scale.",
                field,
            ) from None
        except core.ResultOverflow as exc:
            raise RequestError(
                "non_finite",
                f"The result ({exc.what}) overflows {exc.dtype}; send {self._float64_hint(exc.dtype)}smaller values.",
                self.overflow_field,
            ) from None
        return result  # in the compute dtype: the front doors send the weights in weights_dtype

    def _float64_hint(self, dtype) -> str:
        """The hint to compute in float64, where the request did not already and can ask."""
        return "" if np.dtype(dtype) == np.float64 else self.float64_hint

    def _score_overflow(self) -> tuple[str, str]:
        """(the field a score overflow is blamed on, the terms the scores add up)."""
        return self.overflow_field, "q·kᵀ·scale"

    def _compute(self, threads: int, pool: Executor | None, stop: Callable[[], bool] | None) -> core.Result:
        raise NotImplementedError


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
    return_lse: bool = False

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

    def _compute(self, threads, pool, stop):
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
            return_lse=self.return_lse,
            threads=threads,
            pool=pool,
            stop=stop,
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

    def _compute(self, threads, pool, stop):
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
            stop=stop,
        )


@dataclass(frozen=True)
class SessionStepJob(_Job):
    """A step on a session (POST /sessions/{id}/attention): q (H, t, d) attends to the session's
    first S keys, held in pages of its pool (views, not copies)."""

    float64_hint = ""  # its dtype is its session's

    q: np.ndarray  # (H, t, d), the session's dtype
    keys: int  # S, the keys attended to: the session's length, the new tokens included
    pages: list  # [(k (Hkv, P, d), v (Hkv, P, dv))]: views into the pool, ceil(S / P) of them
    kv_heads: int
    value_dim: int
    causal: bool | str
    scale: float | None
    return_weights: bool
    encoding: str
    window: tuple[int, int] | None = None
    alibi_slopes: np.ndarray | None = None
    weights_dtype: str | None = None
    return_lse: bool = False

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def S(self) -> int:
        return self.keys

    @property
    def head_widths(self) -> tuple[int, int]:
        return self.q.shape[-1], self.value_dim

    @property
    def dtype(self) -> str:
        return self.q.dtype.name

    @property
    def groups(self) -> int:
        return self.q.shape[0] // self.kv_heads

    @property
    def output_elements(self) -> int:
        return self.B * self.T * self.head_widths[1]

    def _core_bytes(self, itemsize: int) -> int:
        """out, the scaled q, and the scores of one chunk of pages (core.paged_attention's scratch)."""
        return (2 * self.q.size + self.output_elements + min(self.score_elements, core.paged.SCRATCH_ELEMENTS)) * itemsize

    def _compute(self, threads, pool, stop):
        if not self.keys:  # an empty session: every row sees no key (out 0, lse the lowest finite value)
            H, T = self.q.shape[:2]
            out, lse = np.zeros((H, T, self.value_dim), self.q.dtype), np.full((H, T), np.finfo(self.q.dtype).min, self.q.dtype)
            weights = np.zeros((H, T, 0), self.q.dtype) if self.return_weights else None
            return (out, weights, lse) if self.return_lse else (out, weights)
        return core.paged_attention(
            self.q,
            self.pages,
            self.S,
            causal=self.causal,
            scale=self.scale,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
            return_weights=self.return_weights,
            return_lse=self.return_lse,
            stop=stop,
        )


@dataclass(frozen=True)
class SessionBatchJob(_Job):
    """Steps on several sessions (POST /sessions/attention) computed as one job: admitted and
    measured as their sum (B * H heads over their mean length). out (B, H, t, dv); weights (B, H, t,
    the longest S), 0 past each session's length; lse (B, H, t)."""

    steps: tuple[SessionStepJob, ...]
    float64_hint = ""  # their dtype is their sessions'

    def __getattr__(self, name: str):  # the options every step shares: causal, window, encoding ...
        return getattr(self.steps[0], name)

    @property
    def window(self) -> tuple[int, int] | None:  # type: ignore[override]
        return self.steps[0].window

    @property
    def weights_dtype(self) -> str | None:  # type: ignore[override]
        return self.steps[0].weights_dtype

    @property
    def B(self) -> int:
        return sum(step.B for step in self.steps)

    @property
    def T(self) -> int:
        return self.steps[0].T

    @property
    def S(self) -> int:
        return -(-sum(step.S for step in self.steps) // len(self.steps))

    @property
    def head_widths(self) -> tuple[int, int]:
        return self.steps[0].head_widths

    @property
    def dtype(self) -> str:
        return self.steps[0].dtype

    @property
    def groups(self) -> int:
        return self.steps[0].groups

    @property
    def output_elements(self) -> int:
        return sum(step.output_elements for step in self.steps)

    def working_bytes(self) -> int:
        return sum(step.working_bytes() for step in self.steps)

    def _compute(self, threads, pool, stop):
        """The steps in turn, or (a batch alone on the server: threads > 1) shared by threads threads,
        the caller's and pool's (numpy releases the GIL in the matmuls)."""
        groups = [self.steps[i::threads] for i in range(min(threads, len(self.steps)))] if pool is not None else [self.steps]
        futures = [pool.submit(lambda g=group: [step._compute(1, None, stop) for step in g]) for group in groups[1:]] if pool else []
        done = [[step._compute(1, None, stop) for step in groups[0]], *(f.result() for f in futures)]
        results = [done[i % len(groups)][i // len(groups)] for i in range(len(self.steps))]
        out = np.stack([r[0] for r in results])
        weights = None
        if self.steps[0].return_weights:
            weights = np.zeros((*out.shape[:3], max(step.S for step in self.steps)), out.dtype)
            for i, r in enumerate(results):
                weights[i, :, :, : r[1].shape[-1]] = r[1]
        result = (out, weights)
        return (*result, np.stack([r[2] for r in results])) if self.steps[0].return_lse else result
