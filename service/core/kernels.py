"""The blocked attention: what reference() computes, in blocks of query rows, for large problems.

attention() is the core's entry point. A small problem (plan(...).reference) is computed by
reference(), the textbook; any other is cut into blocks (plan()), so that every pass of the
softmax runs over a buffer that stays in the core's cache: the scores of a block are written by
one matmul (into the weights when they are returned, else into a small scratch buffer), masked,
exponentiated and summed in place, and multiplied by v. Under a causal mask a block only computes
the keys up to its last row's diagonal, which skips about half the work; under a sliding window
it also skips the keys before its first row's window, so a window of W keys costs O(T * W), not
O(T * S). Without weights the memory beyond the inputs and the output is O(block), not O(T * S),
and the output is normalised instead of the weights (T * dv divisions, not T * S).

The blocks write disjoint parts of the outputs, so one computation can be shared between threads
(threads=, pool=; numpy releases the GIL in its matmuls and ufuncs): each thread takes the next
block from one queue and computes it exactly as one thread would, so the result is the same to
the bit. The caller decides when that pays (the web layer: a large request alone on the server).

The variants of PyTorch's SDPA (enable_gqa, a float bias) and of FlashAttention (window_size,
alibi_slopes) are computed per block too, with reference()'s semantics: grouped query heads share
their key/value head through a broadcast matmul (no repeat), and no (..., T, S) mask or bias is
ever built.

Shape legend as in reference.py, and: B the product of the leading axes, Bkv = B / g key/value
items; a block is (nb key/value items, their g query heads, tn query rows) over the keys lo:hi
some row of it may see.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .reference import (
    ALIGNMENTS,
    UNDERFLOW_MARGIN,
    Result,
    ScoreOverflow,
    Stopped,
    bounds,
    causal_offset,
    check_finite,
    groups,
    log_sum_exp,
    ones,
    reference,
)

# Score elements per block: 2**19 float32 scores are 2 MiB, one core's L2 cache on the machines
# this serves; larger blocks run their matmuls nearer BLAS's peak, smaller ones pay for Python
# per block. It keeps a thread's scratch within schemas.jobs.SCRATCH_BYTES in float32.
BLOCK_ELEMENTS = 2**19
MIN_ROWS = 16  # fewer query rows per matmul than this and BLAS runs far below its peak
CAUSAL_BLOCKS = 16  # under a causal mask, at least this many row blocks: each skips the keys past its diagonal
# A problem of at most BLOCK_ELEMENTS // SMALL_SHARE float32 scores' bytes goes to reference(): there
# numpy's cost per call outweighs the keys a causal mask lets the blocks skip. Not under a window's
# left edge: there the blocks keep its O(T * W) (and the admission's count). Tests raise it to send
# small problems through the blocks.
SMALL_SHARE = 1
LOG2_E = 1 / math.log(2)  # exp(x) = exp2(x * LOG2_E)
# Scores within +-EXP_SAFE need no max subtracted: exp stays normal and finite, and a row of up to
# 2**20 keys sums below the dtype's maximum (float32: e**64 * 2**20 < 3.4e38 and e**-64 > 1.2e-38).
EXP_SAFE = {np.float16: 0.0, np.float32: 64.0, np.float64: 640.0}

Block = tuple[int, int, int, int]  # (b0, b1, t0, t1): key/value items b0:b1, query rows t0:t1


@dataclass(frozen=True)
class Plan:
    """How attention() cuts one problem: shapes only, no arrays. The cost model reads the same
    plan (count, scores) that the computation runs.

    Bkv key/value items of groups query heads each, T queries, S keys; blocks of `rows` query rows
    and `items` key/value items; query t may see key s iff t + lower <= s <= t + upper (None:
    that side open). reference: the whole problem is one call of reference(), no blocks."""

    Bkv: int
    groups: int
    T: int
    S: int
    rows: int
    items: int
    upper: int | None
    lower: int | None
    reference: bool

    @property
    def blocks(self) -> list[Block]:
        """Every block, items outer, rows inner: the order the threads take them in."""
        return [
            (b0, min(self.Bkv, b0 + self.items), t0, min(self.T, t0 + self.rows))
            for b0 in range(0, self.Bkv, max(self.items, 1))
            for t0 in range(0, self.T, max(self.rows, 1))
        ]

    @property
    def count(self) -> int:
        """How many blocks there are (the reference path: one); each costs a few numpy calls
        beyond its arithmetic, which the cost model counts."""
        return -(-self.Bkv // max(self.items, 1)) * -(-self.T // max(self.rows, 1))

    @property
    def scores(self) -> int:
        """How many scores are computed (and exponentiated): B * T * S on the reference path;
        in blocks about half under a causal mask and about B * T * min(S, left + right + 1) under
        a window (plus the block edges)."""
        if self.reference:
            return self.Bkv * self.groups * self.T * self.S
        per_item = 0
        for t0 in range(0, self.T, max(self.rows, 1)):
            t1 = min(self.T, t0 + self.rows)
            lo, hi = _key_range(t0, t1, self.S, self.upper, self.lower)
            per_item += (t1 - t0) * (hi - lo)
        return self.Bkv * self.groups * per_item


def plan(
    B: int,
    T: int,
    S: int,
    dv: int,
    *,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    groups: int = 1,
    itemsize: int = 4,
    return_weights: bool = True,
) -> Plan:
    """The blocks attention() computes for B items (the product of q's leading axes, heads
    included) of T queries over S keys, values dv wide, groups query heads per key/value head,
    in a dtype of itemsize bytes.

    The rows do not shrink with groups: g matmuls of tn rows each run faster than as many of
    tn / g rows, even when the block then outgrows the cache. Without weights a block's row also
    makes dv outputs and a sum, so where v is wider than k is long the rows are counted by dv + 1,
    and a block's outputs stay O(block) too. A small problem goes to reference() while its scores
    fit in BLOCK_ELEMENTS float32s' bytes (float64 counts its own bytes: past the cache, one pass
    runs slower than the blocks)."""
    upper, lower = bounds(T, S, causal, window)
    Bkv = B // groups
    row_out = dv + 1 if dv and not return_weights else 0  # a row's outputs and its sum
    if lower is None and B * T * max(S, row_out) * max(itemsize, 4) <= 4 * BLOCK_ELEMENTS // SMALL_SHARE:
        return Plan(Bkv, groups, T, S, T, Bkv, upper, lower, reference=True)
    tn = BLOCK_ELEMENTS // max(S, row_out, 1)
    if upper is not None or lower is not None:
        tn = min(tn, T // CAUSAL_BLOCKS)
    if upper is not None and lower is not None:
        tn = min(tn, (upper - lower + 1) // 4)  # a band: a block computes at most ~1.25x the keys its rows see
    tn = min(T, max(MIN_ROWS, tn))  # query rows per block
    width = S if upper is None or lower is None else min(S, max(1, tn + upper - lower))  # keys per block, at most
    nb = min(Bkv, max(1, BLOCK_ELEMENTS // (max(tn, 1) * groups * max(width, row_out, 1))))  # key/value items per block
    return Plan(Bkv, groups, T, S, tn, nb, upper, lower, reference=False)


def causal_share(T: int, S: int, causal: bool | str) -> float:
    """The share of the (T, S) scores a causal mask allows: 1 without one, ~1/2 for T = S."""
    offset = causal_offset(T, S, causal)
    if offset is None:
        return 1.0
    # Row t sees min(max(t + offset + 1, 0), S) keys; summed in closed form (no arrays: this runs
    # for every request).
    return (_clamped_sum(offset + T, S) - _clamped_sum(offset, S)) / (T * S)


def _clamped_sum(n: int, S: int) -> int:
    """sum(min(x, S) for x in 1..n), 0 for n <= 0."""
    if n <= 0:
        return 0
    m = min(n, S)
    return m * (m + 1) // 2 + (n - m) * S


@lru_cache(maxsize=8)
def _causal_mask(T: int, S: int, align: str) -> np.ndarray:
    offset = causal_offset(T, S, align)
    assert offset is not None  # align is one of ALIGNMENTS
    mask = np.arange(S)[None, :] <= np.arange(T)[:, None] + offset  # (T, S)
    mask.flags.writeable = False  # shared between requests
    return mask


def causal_mask(T: int, S: int | None = None, align: str = "top_left") -> np.ndarray:
    """Boolean (T, S), True where key s may be seen by query t.

    top_left: s <= t (PyTorch's is_causal). bottom_right: s <= t + S - T, the alignment of decoding
    with a KV cache, where the last query sees every key. Read-only and cached per shape."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, not {align!r}")
    return _causal_mask(int(T), int(T if S is None else S), align)


@lru_cache(maxsize=64)
def _band(rows: int, cols: int, shift: int, below: bool = False, key_major: bool = False) -> np.ndarray:
    """Boolean (rows, cols), True where column c lies past row r's diagonal: c > r + shift (or,
    below, before it: c < r + shift). The causal mask or window edge of one block's partly
    visible keys; a handful of shapes per request size. key_major: stored (cols, rows), the layout
    of key-major scores (np.copyto runs faster when the mask's layout is the scores')."""
    c, r = np.arange(cols)[None, :], np.arange(rows)[:, None] + shift
    band = c < r if below else c > r  # (rows, cols)
    if key_major:
        band = np.ascontiguousarray(band.T).T  # (rows, cols), a view of (cols, rows)
    band.flags.writeable = False
    return band


@lru_cache(maxsize=64)
def _distance(rows: int, cols: int, shift: int, dtype: np.dtype) -> np.ndarray:
    """(rows, cols) |r + shift - c|: ALiBi's distance between query and key within one block."""
    dist = np.abs(np.arange(rows)[:, None] + shift - np.arange(cols)[None, :]).astype(dtype)
    dist.flags.writeable = False
    return dist


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    causal: bool | str = False,
    key_lengths: np.ndarray | None = None,
    scale: float | None = None,
    return_weights: bool = True,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    bias: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    average_weights: bool = False,
    return_lse: bool = False,
    threads: int = 1,
    pool: Executor | None = None,
    stop: Callable[[], bool] | None = None,
) -> Result:
    """softmax(q kᵀ · scale + bias + alibi, masked) v over any leading axes.

    q (..., T, d), k (..., S, d), v (..., S, dv); mask broadcasts to (..., T, S), True = attend;
    causal False | True ("top_left") | "bottom_right"; key_lengths broadcasts to (...).
    enable_gqa: k and v may have Hkv heads on axis -3 where Hkv divides q's H (PyTorch's SDPA).
    window (left, right), ints >= -1: query t sees keys t+S-T-left <= s <= t+S-T+right
    (FlashAttention's window_size, -1 unbounded), ANDed with mask and causal.
    bias broadcasts to (..., T, S), added to the scaled scores (SDPA's float attn_mask).
    alibi_slopes broadcasts to (...): adds -slope * |t + S - T - s| (FlashAttention's).
    Returns out (..., T, dv) and weights (..., T, S), or (..., T, S) without the heads axis -3
    when average_weights (their mean over it); None unless return_weights. Masked weights
    are exactly 0; a row with no allowed key has all-zero weights and output. return_lse: also
    lse (..., T), the log of the sum of exp(score) over the keys each row may see (heads kept under
    average_weights), the dtype's lowest finite value for a row with no key. Raises ScoreOverflow
    when a score leaves the dtype's range, ResultOverflow when out or weights would not be finite.
    threads > 1 computes the blocks on that many threads (pool's, plus the caller's; a pool of
    threads - 1 made for the call without one): the same blocks as one thread, so the same bits.
    stop, if given, is called before each block (and before the reference path's one pass): when
    it returns True the computation is abandoned and Stopped raised, so a caller whose answer is no
    longer wanted gets its CPU back within one block.
    """
    if stop is not None and stop():
        raise Stopped()
    *lead, T, d = q.shape
    S, dv = k.shape[-2], v.shape[-1]
    B = math.prod(lead)
    g = groups(q.shape, k.shape, v.shape, enable_gqa)
    if average_weights and q.ndim < 3:
        raise ValueError("average_weights needs q of rank >= 3 (the heads axis -3)")
    dtype = np.result_type(q, k, v, np.float16)  # float32 stays float32; integers become float64
    p = plan(B, T, S, dv, causal=causal, window=window, groups=g, itemsize=dtype.itemsize, return_weights=return_weights)
    if p.reference:
        return reference(
            q,
            k,
            v,
            mask,
            causal=causal,
            key_lengths=key_lengths,
            scale=scale,
            return_weights=return_weights,
            enable_gqa=enable_gqa,
            window=window,
            bias=bias,
            alibi_slopes=alibi_slopes,
            average_weights=average_weights,
            return_lse=return_lse,
        )
    masks = _Masks(lead, g, T, S, mask, key_lengths, p.upper, p.lower, bias, alibi_slopes, dtype)
    ops = _operands(p, q, k, v, masks, dtype, 1.0 / math.sqrt(d) if scale is None else scale, return_weights, return_lse)
    # A block's scores (with weights: in the weights instead) and, without weights, its row sums.
    scratch_size = 0 if return_weights else p.items * g * p.rows * (masks.widest(p.rows) + 1)

    def compute(todo: Iterator[Block]) -> None:  # the blocks todo yields, with this thread's own scratch
        scratch = np.empty(scratch_size, dtype) if scratch_size else None
        with np.errstate(over="ignore", invalid="ignore"):  # per thread: numpy's error state is not inherited
            for block in todo:
                if stop is not None and stop():
                    raise Stopped()
                _block(ops, scratch, block)
                b0, b1, t0, t1 = block  # checked while the block is in the cache
                check_finite("out", ops.out[b0:b1, :, t0:t1])
                check_finite("weights", None if ops.weights is None else ops.weights[b0:b1, :, t0:t1])

    _share(compute, p.blocks, threads, pool)
    result = _shaped(ops.out, ops.weights, lead, average_weights)
    return result if ops.lse is None else (*result, ops.lse.reshape(*lead, T))  # (Bkv, g, T) -> (..., T)


@dataclass(frozen=True)
class _Operands:
    """What every block of one call reads and writes, made once before the blocks are shared.

    q (Bkv, g, T, d) unscaled, kt (Bkv, 1, d, S), v (Bkv, 1, S, dv); out (Bkv, g, T, dv) and
    weights (Bkv, g, T, S) or None; lse (Bkv, g, T) or None; bound (Bkv, g, T, 1) True where a row's scores are provably
    small (no max subtracted); big_v (Bkv, 1, T, 1) True where S * max |v| may overflow (that
    row's exp(s) is normalised before the matmul); exp np.exp, or np.exp2 where row_scale
    (0-d or (Bkv, g, T, 1)) carries log2(e)."""

    q: np.ndarray
    kt: np.ndarray
    v: np.ndarray
    out: np.ndarray
    weights: np.ndarray | None
    lse: np.ndarray | None
    masks: _Masks
    bound: np.ndarray
    big_v: np.ndarray
    exp: Callable
    row_scale: np.ndarray  # 0-d, or (Bkv, g, T, 1)


def _operands(p: Plan, q, k, v, masks: _Masks, dtype: np.dtype, scale: float, return_weights: bool, return_lse: bool = False) -> _Operands:
    """The inputs in the blocks' layout, the outputs, and each row's choices (bound, big_v, its
    scale). Every choice is made per row from that row's own inputs over the keys it may see, so
    that values past its diagonal change none of its bits."""
    Bkv, g, T, S = p.Bkv, p.groups, p.T, p.S
    d, dv = q.shape[-1], v.shape[-1]
    qd = np.asarray(q, dtype).reshape(Bkv, g, T, d)  # (..., T, d) -> (Bkv, g, T, d), q itself where it is in dtype
    kt = np.swapaxes(np.asarray(k, dtype).reshape(Bkv, 1, S, d), -1, -2)  # (..., S, d) -> (Bkv, 1, d, S), a view
    vd = np.ascontiguousarray(v, dtype).reshape(Bkv, 1, S, dv)  # (..., S, dv) -> (Bkv, 1, S, dv)
    out = np.empty((Bkv, g, T, dv), dtype)
    weights = np.empty((Bkv, g, T, S), dtype) if return_weights else None
    lse = np.empty((Bkv, g, T), dtype) if return_lse else None
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected per block, not warned about
        # Each row's largest |v_s| over the keys it may see, bounded by |v_s| (the 2-norm:
        # max |v_s| <= |v_s| <= sqrt(dv) max |v_s|), by einsum: a max along v's short last axis
        # runs far slower. inf where v_s · v_s overflows.
        v3 = vd[:, 0]  # (Bkv, S, dv)
        v_reach = _reach(np.sqrt(np.einsum("bsd,bsd->bs", v3, v3)), T, p.upper, p.lower)  # (Bkv, T)
        bound = _bounded_rows(qd, kt, p.upper, p.lower, masks, v_reach / math.sqrt(max(dv, 1)), v_reach, scale)
        big_v = (v_reach * S > np.finfo(dtype).max / 4)[:, None, :, None]  # (Bkv, T) -> (Bkv, 1, T, 1)
    # A bounded row takes exp2, the same softmax in base 2 and as exact, with log2(e) in its scale;
    # any other row scales s - max (<= 0) by log2(e) in its block. A bias or ALiBi, or float16 (no
    # row is ever bounded): exp, as the textbook. The scale is folded into each block's rows of q
    # as the block starts (no (B, T, d) copy before the threads share the blocks).
    exp = np.exp if masks.biased or not EXP_SAFE.get(dtype.type) else np.exp2
    row_scale = np.asarray(scale, dtype)
    if exp is np.exp2 and bound.all():
        row_scale = np.asarray(scale * LOG2_E, dtype)
    elif exp is np.exp2 and bound.any():
        row_scale = np.where(bound, scale * LOG2_E, scale).astype(dtype)  # (Bkv, g, T, 1)
    return _Operands(qd, kt, vd, out, weights, lse, masks, bound, big_v, exp, row_scale)


def _shaped(out: np.ndarray, weights: np.ndarray | None, lead: list, average_weights: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """out (Bkv, g, T, dv) and weights (Bkv, g, T, S) as (..., T, dv) and (..., T, S), or the
    weights' mean over the heads axis -3 when average_weights."""
    out = out.reshape(*lead, *out.shape[-2:])  # (Bkv, g, T, dv) -> (..., T, dv)
    if weights is None:
        return out, None
    weights = weights.reshape(*lead, *weights.shape[-2:])  # (Bkv, g, T, S) -> (..., T, S)
    return out, (weights.mean(axis=-3) if average_weights else weights)


def _block(ops: _Operands, scratch: np.ndarray | None, block: Block) -> None:
    """Attention for key/value items b0:b1 (all their g query heads) and query rows t0:t1,
    written into ops.out (and ops.weights); scratch holds the scores without weights."""
    b0, b1, t0, t1 = block
    lo, hi = ops.masks.keys(t0, t1, ops.kt.shape[-1])
    o = ops.out[b0:b1, :, t0:t1]  # (nb, g, tn, dv), a view
    if ops.weights is not None:
        ops.weights[b0:b1, :, t0:t1, :lo] = 0
        ops.weights[b0:b1, :, t0:t1, hi:] = 0
    if hi == lo:  # no row of this block may see any key
        o[...] = 0
        if ops.lse is not None:
            ops.lse[b0:b1, :, t0:t1] = np.finfo(o.dtype).min
        return
    s, st = _scores(ops, scratch, block, lo, hi)
    shift = _exponentiate(ops, s, block, lo, hi)
    if ops.weights is not None:
        total = s.sum(axis=-1, keepdims=True)  # (nb, g, tn, 1), pairwise: rows sum to 1 within an ulp or two
    else:
        assert scratch is not None and st is not None  # without weights the scores are in the scratch
        nb, g, tn = b1 - b0, ops.q.shape[1], t1 - t0
        total = scratch[-nb * g * tn :].reshape(nb, g, tn, 1)
        np.matmul(ones(ops.kt.shape[-1], s.dtype)[: hi - lo], st, out=total[..., 0])  # (nb, g, tn) row sums of the key-major scores, a GEMV
    if ops.lse is not None:  # the row's shift (natural units: a bounded row's is 0) and its sum are all it takes
        ops.lse[b0:b1, :, t0:t1] = log_sum_exp(np.zeros((), s.dtype) if shift is None else shift, total)[..., 0]
    if ops.weights is not None:
        _normalise_then_v(s, total, ops.v[b0:b1, :, lo:hi], o)
    else:
        _v_then_normalise(s, total, ops.v[b0:b1, :, lo:hi], ops.big_v[b0:b1, :, t0:t1], o)


def _scores(ops: _Operands, scratch: np.ndarray | None, block: Block, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The block's scaled scores s (nb, g, tn, keys), and st, the same memory key-major
    (nb, g, keys, tn), when they are in the scratch (no weights): there OpenBLAS computes k qᵀ
    faster than q kᵀ, and the row sums are one GEMV over it. With weights, s is the weights' own
    memory and st None."""
    b0, b1, t0, t1 = block
    nb, g, tn = b1 - b0, ops.q.shape[1], t1 - t0
    row_scale = ops.row_scale if ops.row_scale.ndim == 0 else ops.row_scale[b0:b1, :, t0:t1]
    qs = ops.q[b0:b1, :, t0:t1] * row_scale  # (nb, g, tn, d) scaled
    kt = ops.kt[b0:b1, :, :, lo:hi]  # (nb, 1, d, keys); g shares k
    if ops.weights is None:
        assert scratch is not None
        st = scratch[: nb * g * tn * (hi - lo)].reshape(nb, g, hi - lo, tn)
        np.matmul(np.swapaxes(kt, -1, -2), np.swapaxes(qs, -1, -2), out=st)  # (nb, g, keys, tn)
        s = np.swapaxes(st, -1, -2)  # (nb, g, tn, keys), a view
    else:
        st, s = None, ops.weights[b0:b1, :, t0:t1, lo:hi]  # (nb, g, tn, keys)
        np.matmul(qs, kt, out=s)
    ops.masks.add(s, b0, b1, t0, t1, lo, hi)  # bias and ALiBi, if any
    ops.masks.apply(s, b0, b1, t0, t1, lo, hi)
    return s, st


def _exponentiate(ops: _Operands, s: np.ndarray, block: Block, lo: int, hi: int) -> np.ndarray | None:
    """s (nb, g, tn, keys) -> exp(s - shift) in place, shift the row's max or, for a bounded
    row, 0; in base 2 where ops.exp is exp2 (a bounded row's scale already carries log2(e)).
    Returns the shift (nb, g, tn, 1), in the scores' natural units, or None where every row's is 0."""
    b0, b1, t0, t1 = block
    bound = ops.bound[b0:b1, :, t0:t1]  # (nb, g, tn, 1)
    shift = _shift(s, bound, ops.masks, b0, b1, t0, t1)
    if shift is not None:
        np.subtract(s, shift, out=s)
        if ops.exp is np.exp2:  # the shifted rows to base 2; a bounded row is already (times 1, exact)
            np.multiply(s, np.where(bound, 1, LOG2_E).astype(s.dtype), out=s)
    ops.exp(s, out=s)  # exp(-inf) = exp2(-inf) = 0 exactly: masked weights are 0
    return shift


def _normalise_then_v(e: np.ndarray, total: np.ndarray, v: np.ndarray, o: np.ndarray) -> None:
    """e (nb, g, tn, keys) exp'd scores, in the weights, total (nb, g, tn, 1) their row sums:
    weights = e / total, in place, then o (nb, g, tn, dv) = weights v, v (nb, 1, keys, dv).
    Normalised first, so sum_s w_s v_s <= max |v| stays finite."""
    total[total == 0] = 1  # a row with no allowed key: its weights and output stay exactly 0
    np.divide(e, total, out=e)
    np.matmul(e, v, out=o)


def _v_then_normalise(e: np.ndarray, total: np.ndarray, v: np.ndarray, big: np.ndarray, o: np.ndarray) -> None:
    """o (nb, g, tn, dv) = (e v) / total: e (nb, g, tn, keys) exp'd scores, total (nb, g, tn, 1)
    their row sums, v (nb, 1, keys, dv); T * dv divisions, not T * S. A row that big
    (nb, 1, tn, 1) marks, whose S * max |v| may overflow, is normalised first instead."""
    total[total == 0] = 1  # a row with no allowed key: its output stays exactly 0
    if big.any():  # each row its own way
        np.divide(e, np.where(big, total, 1), out=e)
        np.matmul(e, v, out=o)
        np.divide(o, np.where(big, 1, total), out=o)
        return
    np.matmul(e, v, out=o)  # (nb, g, tn, dv)
    np.divide(o, total, out=o)


def _range_max(x: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """(..., len(start)): the max of x[..., a : a + width] for each a in start, x >= 0 (..., S),
    taken as 0 outside x. log2(width) passes of doubling spans: each result is exact and reads
    only its own range."""
    S = x.shape[-1]
    if width < 1:
        return np.zeros((*x.shape[:-1], len(start)), x.dtype)
    m = np.zeros((*x.shape[:-1], S + 2 * width), x.dtype)
    m[..., width : width + S] = x  # index i + width holds x[i]
    span = 1
    while 2 * span <= width:
        m = np.maximum(m[..., :-span], m[..., span:])  # m[i] = max over [i, i + 2 span)
        span *= 2
    a = np.clip(start, -width, S) + width
    return np.maximum(m[..., a], m[..., a + width - span])


def _reach(x: np.ndarray, T: int, upper: int | None, lower: int | None) -> np.ndarray:
    """(Bkv, T): for x (Bkv, S) >= 0, its max over the keys t + lower <= s <= t + upper that row t may
    see (None: that side open); a row that sees no key gets some key's value (it computes nothing)."""
    Bkv, S = x.shape
    if S == 0:
        return np.zeros((Bkv, T), x.dtype)
    if upper is None and lower is None:
        return np.broadcast_to(x.max(axis=-1, keepdims=True), (Bkv, T))
    t = np.arange(T)
    if lower is None:
        assert upper is not None
        seen_max = np.maximum.accumulate(x, axis=-1)  # (Bkv, S): max x over s' <= s
        return seen_max[:, np.clip(t + upper, 0, S - 1)]  # over the keys up to the last row t may see
    if upper is None:
        seen_max = np.maximum.accumulate(x[:, ::-1], axis=-1)[:, ::-1]  # max x over s' >= s
        return seen_max[:, np.clip(t + lower, 0, S - 1)]
    return _range_max(x, t + lower, upper - lower + 1)  # over row t's window


def _bounded_rows(
    q: np.ndarray,
    kt: np.ndarray,
    upper: int | None,
    lower: int | None = None,
    masks=None,
    v_least: np.ndarray | None = None,
    v_most: np.ndarray | None = None,
    scale: float = 1.0,
) -> np.ndarray:
    """Boolean (Bkv, g, T, 1): True where every score row t may see is within +-limit, by
    Cauchy-Schwarz, |q_t . k_s| <= |q_t| |k_s|. Under a causal mask or a window only the keys row
    t may see count, so the bound (like the output) depends on nothing outside them. A bias or
    ALiBi is not bounded this way: then every row subtracts its maximum.

    Such a row is exponentiated unshifted and exp(s) v summed before it is normalised, so the
    limit is EXP_SAFE, lowered where the values are large: the sum over S keys of exp(s) |v| must
    stay finite, e**limit * S * max(1, max|v|) < the dtype's maximum; and where they are small:
    exp(-limit) max|v| must stay above the dtype's smallest normal times UNDERFLOW_MARGIN.
    v_least <= max |v| <= v_most, (Bkv, T), over the keys row t may see (None: 1).
    q (Bkv, g, T, d) unscaled: |q_t · scale| is |q_t| |scale|; kt (Bkv, 1, d, S)."""
    Bkv, g, T, d = q.shape
    if masks is not None and masks.biased:
        return np.zeros((Bkv, g, T, 1), bool)
    S = kt.shape[-1]
    info = np.finfo(q.dtype)
    most = np.ones((Bkv, T)) if v_most is None else v_most.astype(np.float64)  # (Bkv, T)
    least = np.ones((Bkv, T)) if v_least is None else v_least.astype(np.float64)
    room = math.log(float(info.max)) - 1.0 - np.log(max(S, 1) * np.maximum(most, 1.0))
    floor = math.log(float(info.tiny) * UNDERFLOW_MARGIN)
    room_below = np.log(np.maximum(least, np.finfo(np.float64).tiny)) - floor  # v of 0: ~-700, never small
    limit = np.minimum(EXP_SAFE.get(q.dtype.type, 0.0), np.minimum(room, room_below))[:, None]  # (Bkv, 1, T); negative: never small
    q3 = q.reshape(Bkv * g, T, d)  # (Bkv, g, T, d) -> (Bkv * g, T, d)
    q_norm = np.sqrt(np.einsum("btd,btd->bt", q3, q3)).reshape(Bkv, g, T) * abs(scale)  # inf if it overflows: no shortcut
    k3 = kt[:, 0]  # (Bkv, d, S)
    k_norm = np.sqrt(np.einsum("bds,bds->bs", k3, k3))  # (Bkv, S)
    small = q_norm * _reach(k_norm, T, upper, lower)[:, None] < limit  # (Bkv, g, T)
    # and q · scale · log2(e), the shortcut's scaled q, finite (q = 1e10, scale = 3e28: q · scale is, that is not)
    return (small & (q_norm * LOG2_E < info.max))[..., None]


class _PerItem:
    """An array broadcastable to (..., T|1, S|1) (a mask or a bias), read as one block
    (nb|1, g, tn|1, keys|1) at a time: a view when its leading axes allow, else gathered per
    block, never broadcast to (..., T, S)."""

    def __init__(self, arr: np.ndarray, lead, g: int):
        if arr.ndim < 2:
            arr = arr.reshape((1,) * (2 - arr.ndim) + arr.shape)  # (1|T, 1|S)
        rows, cols = arr.shape[-2:]
        B = math.prod(lead)
        self.g, self.index = g, None
        if all(n == 1 for n in arr.shape[:-2]):
            self.items = arr.reshape(1, 1, rows, cols)  # one for every item
            return
        full = np.broadcast_to(arr, (*lead, rows, cols))  # a view
        try:
            self.items = full.reshape(B // g, g, rows, cols, copy=False)
        except ValueError:  # e.g. (H, T, S) under (B, H): gather each block's items
            self.items = full
            self.index = np.unravel_index(np.arange(B), tuple(lead))  # flat item -> leading indices

    def block(self, b0: int, b1: int, t0: int, t1: int, lo: int, hi: int) -> np.ndarray:
        m = self.items
        rows = slice(t0, t1) if m.shape[-2] > 1 else slice(None)
        cols = slice(lo, hi) if m.shape[-1] > 1 else slice(None)
        if self.index is None:
            return m[slice(b0, b1) if m.shape[0] > 1 else slice(None), :, rows, cols]
        items = tuple(i[b0 * self.g : b1 * self.g] for i in self.index)  # the block's query items, in order
        part = m[items + (rows, cols)]  # (nb * g, tn|1, keys|1), a block-sized copy
        return part.reshape(b1 - b0, self.g, *part.shape[1:])


def _key_range(t0: int, t1: int, S: int, upper: int | None, lower: int | None, key_end: int | None = None) -> tuple[int, int]:
    """[lo, hi): the keys some row of t0..t1 may see; keys outside it are hidden from every row."""
    hi = S if key_end is None else min(S, key_end)
    if upper is not None:
        hi = min(hi, t1 + upper)  # row t1 - 1 sees keys up to t1 - 1 + upper
    hi = max(0, hi)
    lo = 0 if lower is None else min(hi, max(0, t0 + lower))  # row t0 sees keys from t0 + lower
    return lo, hi


class _Masks:
    """What hides or moves scores, in the form the blocks use: mask (a _PerItem), the band
    t + lower <= s <= t + upper (causal and window), key_lengths as (Bkv, g, 1, 1) and key_end, past
    which no row of any batch item may look; and the additive terms, bias (a _PerItem) and ALiBi
    slopes as (Bkv, g, 1, 1)."""

    def __init__(self, lead, g, T, S, mask, key_lengths, upper, lower=None, bias=None, alibi_slopes=None, dtype=None):
        B = math.prod(lead)
        self.T, self.S, self.g = T, S, g
        self.upper, self.lower = upper, lower
        self.mask = None if mask is None else _PerItem(np.asarray(mask, bool), lead, g)
        self.lengths = None
        self.key_end = S
        if key_lengths is not None:
            self.lengths = np.broadcast_to(np.asarray(key_lengths), tuple(lead)).reshape(B // g, g, 1, 1)
            self.key_end = int(self.lengths.max()) if B else 0
        self.bias = None if bias is None else _PerItem(np.asarray(bias), lead, g)
        self.slopes = None
        if alibi_slopes is not None:
            self.slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype), tuple(lead)).reshape(B // g, g, 1, 1)
        self.biased = bias is not None or alibi_slopes is not None

    def keys(self, t0: int, t1: int, S: int) -> tuple[int, int]:
        """[lo, hi): the keys some row of t0..t1 may see (by the band and key_lengths)."""
        return _key_range(t0, t1, S, self.upper, self.lower, self.key_end)

    def widest(self, tn: int) -> int:
        """At least as many keys as one block of tn rows computes."""
        width = min(self.S, self.key_end)
        if self.upper is not None and self.lower is not None:  # a band: tn rows see tn + upper - lower keys
            width = min(width, max(0, tn + self.upper - self.lower))
        return width

    def add(self, scores: np.ndarray, b0: int, b1: int, t0: int, t1: int, lo: int, hi: int) -> None:
        """Add bias and ALiBi to block (b0:b1, :, t0:t1, lo:hi) of scaled scores, in place."""
        if self.bias is not None:
            np.add(scores, self.bias.block(b0, b1, t0, t1, lo, hi), out=scores)
        if self.slopes is not None:
            dist = _distance(t1 - t0, hi - lo, t0 + self.S - self.T - lo, scores.dtype)  # (tn, keys)
            np.subtract(scores, self.slopes[b0:b1] * dist, out=scores)

    def apply(self, scores: np.ndarray, b0: int, b1: int, t0: int, t1: int, lo: int, hi: int, fill=-np.inf) -> None:
        """Set the masked entries of block (b0:b1, :, t0:t1, lo:hi) to fill (-inf for scores), in place."""
        rows = t1 - t0
        key_major = scores.ndim > 1 and scores.strides[-1] > scores.strides[-2]  # (..., tn, keys) viewing (..., keys, tn)
        if self.upper is not None:  # keys from t0 + upper + 1 on are past some row's diagonal
            start = max(lo, t0 + self.upper + 1)
            if start < hi:
                band = _band(rows, hi - start, t0 + self.upper - start, key_major=key_major)
                np.copyto(scores[..., start - lo :], fill, where=band)
        if self.lower is not None:  # keys before t1 - 1 + lower are before some row's window
            end = min(hi, t1 - 1 + self.lower)
            if lo < end:
                band = _band(rows, end - lo, t0 + self.lower - lo, below=True, key_major=key_major)
                np.copyto(scores[..., : end - lo], fill, where=band)
        if self.mask is not None:
            np.copyto(scores, fill, where=np.logical_not(self.mask.block(b0, b1, t0, t1, lo, hi)))
        if self.lengths is not None and self.lengths[b0:b1].min() < hi:
            np.copyto(scores, fill, where=np.arange(lo, hi) >= self.lengths[b0:b1])  # (nb, g, 1, keys)

    def has_key(self, b0: int, b1: int, t0: int, t1: int) -> np.ndarray:
        """Boolean (nb, g, tn, 1): whether each row of the block may see any key at all."""
        lo, hi = self.keys(t0, t1, self.S)
        allowed = np.ones((b1 - b0, self.g, t1 - t0, hi - lo), bool)  # keys outside lo:hi are masked for every row
        self.apply(allowed, b0, b1, t0, t1, lo, hi, fill=False)
        return np.asarray(allowed.any(axis=-1, keepdims=True))


def _shift(s, bound, masks: _Masks, b0, b1, t0, t1) -> np.ndarray | None:
    """What to subtract from each row of scores before exp, or None for nothing.

    A row whose scores are provably small (|q_t| * max |k_s| * scale under EXP_SAFE, over the keys
    it may see) needs no shift: exp neither overflows nor underflows to all zeros, and it skips
    two passes over the block. Any other row subtracts its maximum, as the textbook softmax does.
    The choice is made per row from that row's own inputs, so no row depends on another."""
    if bound is not None and bound.all():
        return None
    row_max = s.max(axis=-1, keepdims=True)  # (nb, g, tn, 1); -inf where a row sees no key
    if not np.isfinite(row_max).all():
        _check_overflow(row_max, masks.has_key(b0, b1, t0, t1))
        row_max[np.isneginf(row_max)] = 0
    if bound is not None:
        row_max[bound] = 0
    return row_max


def _check_overflow(row_max: np.ndarray, has_key: np.ndarray) -> None:
    """A row maximum of +inf or NaN, or -inf in a row that has an allowed key, means overflow."""
    if (np.isnan(row_max) | np.isposinf(row_max) | (np.isneginf(row_max) & has_key)).any():
        raise ScoreOverflow(row_max.dtype)


def _share(compute: Callable[[Iterator], None], blocks: list, threads: int, pool: Executor | None) -> None:
    """compute(todo) over every block, on up to `threads` threads at once: the caller's and
    threads - 1 tasks on pool. Each thread takes the next block from one shared queue, in order,
    so a causal mask's heavier late rows are balanced as they come; blocks write disjoint parts
    of the outputs, and each is computed exactly as on one thread. The first error stops the
    others at their next block and is raised here."""
    threads = min(threads, len(blocks))
    if threads <= 1:
        compute(iter(blocks))
        return
    lock, queue = threading.Lock(), iter(blocks)
    errors: list[BaseException] = []

    def todo() -> Iterator:
        while True:
            with lock:
                block = None if errors else next(queue, None)
            if block is None:
                return
            yield block

    def task() -> None:
        try:
            compute(todo())
        except BaseException as exc:  # raised again below, in the caller's thread
            with lock:
                errors.append(exc)

    executor = ThreadPoolExecutor(threads - 1) if pool is None else pool
    try:
        tasks = [executor.submit(task) for _ in range(threads - 1)]
        task()
        for t in tasks:
            if not t.cancel():  # one still queued behind another caller's work has nothing left to do
                t.result()
    finally:
        if pool is None:
            executor.shutdown()
    if errors:
        raise errors[0]


def mha(
    x: np.ndarray,
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    wo: np.ndarray | None,
    heads: int,
    *,
    causal: bool | str = True,
    return_weights: bool = True,
    scale: float | None = None,
    kv_heads: int | None = None,
    window: tuple[int, int] | None = None,
    threads: int = 1,
    pool: Executor | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Multi-head self-attention: the GPT block's, and grouped-query (Llama's layout).

    x (..., n, d); wq (d, h * dk), wk (d, hkv * dk), wv (d, hkv * dv) with hkv = kv_heads (default
    heads, dividing it); wo (h * dv, d_out) or None. Returns out (..., n, d_out), or the heads
    concatenated (..., n, h * dv) without wo, and weights (..., h, n, n) (None unless
    return_weights); scores are scaled by scale, default 1/sqrt(dk). window, threads, pool and stop
    as in attention() (the projections run on the caller's thread).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    dk, dv = wq.shape[-1] // heads, wv.shape[-1] // kv_heads
    if wq.shape[-1] != heads * dk or wk.shape[-1] != kv_heads * dk or wv.shape[-1] != kv_heads * dv:
        raise ValueError(f"wq {wq.shape}, wk {wk.shape}, wv {wv.shape} must have {heads} * dk, {kv_heads} * dk and {kv_heads} * dv columns")

    def split(t: np.ndarray, h: int) -> np.ndarray:
        return np.swapaxes(t.reshape(*t.shape[:-1], h, t.shape[-1] // h), -2, -3)  # (..., n, h * w) -> (..., h, n, w)

    with np.errstate(over="ignore", invalid="ignore"):  # an overflowed projection fails below, as a ScoreOverflow or ResultOverflow
        q, k, v = split(x @ wq, heads), split(x @ wk, kv_heads), split(x @ wv, kv_heads)  # (..., h|hkv, n, dk|dv)
    scale = 1.0 / np.sqrt(dk) if scale is None else scale
    out, weights = attention(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        return_weights=return_weights,
        enable_gqa=kv_heads != heads,
        window=window,
        threads=threads,
        pool=pool,
        stop=stop,
    )[:2]  # (out, weights): no lse here
    out = np.swapaxes(out, -2, -3).reshape(*x.shape[:-1], heads * dv)  # (..., h, n, dv) -> (..., n, h * dv)
    if wo is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            out = out @ wo
        check_finite("out", out)  # the output projection can overflow where attention did not
    return out, weights
