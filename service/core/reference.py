"""The textbook attention, every variant the service supports, in plain numpy: read this first.

    scores  = q kᵀ · scale + bias - slope · |t + S - T - s|      (..., T, S)
    scores  = -inf where a key is hidden (mask, causal, window, key_lengths)
    weights = exp(scores - shift) / its sum                     a row with no key: all 0
    out     = weights v                                         (..., T, dv)
    lse     = shift + log(its sum)                              (..., T); a row with no key: the lowest finite

shift is 0 for a row whose sum of exp(scores) lies comfortably in the dtype's range (the same
softmax, two passes fewer), else the row's maximum, as the textbook subtracts (_shift).

reference() is what attention() computes; attention() computes it in blocks (kernels.py) where
a problem is large, and calls reference() where it is small. It also owns the rules both paths
share: which keys a query may see (causal_offset, bounds), how query heads share key/value heads
(groups), and the errors a result that is not finite raises.

Shape legend: ... the leading (batch, heads) axes, T queries, S keys, d query/key width, dv value
width; H query heads and Hkv key/value heads on axis -3 under enable_gqa, g = H / Hkv.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from functools import lru_cache

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")
# A product or an exp that stays above the dtype's smallest normal times this keeps its precision
# where it counts: what underflows below it weighs less than 2**-40 of the sum it is part of.
UNDERFLOW_MARGIN = 2.0**40

# What attention() and reference() return: (out, weights or None), and lse with return_lse.
Result = tuple[np.ndarray, np.ndarray | None] | tuple[np.ndarray, np.ndarray | None, np.ndarray]


class ScoreOverflow(ArithmeticError):
    """q kᵀ · scale left the dtype's finite range, so the softmax would be meaningless."""

    def __init__(self, dtype: np.dtype):
        super().__init__(f"q kᵀ · scale overflows {dtype}")
        self.dtype = dtype


class ResultOverflow(ArithmeticError):
    """The output (or the weights) holds a value that is not finite in the dtype: a caller must
    never answer with it. The last line of defence; the core avoids every overflow it can."""

    def __init__(self, what: str, dtype: np.dtype):
        super().__init__(f"{what} is not finite in {dtype}")
        self.what, self.dtype = what, dtype


class Stopped(Exception):
    """The caller's stop() said to stop: the computation was abandoned between two blocks (its
    partial results are discarded). The core does not know why (a deadline, a client gone)."""


def reference(
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
) -> Result:
    """attention() as the textbook computes it: the whole (..., T, S) score matrix at once.

    The arguments, results and errors are attention()'s (threads and pool are accepted and
    unused: this is one pass on the caller's thread). Memory is a few (..., T, S) arrays."""
    *lead, T, d = q.shape
    S = k.shape[-2]
    g = groups(q.shape, k.shape, v.shape, enable_gqa)
    if average_weights and q.ndim < 3:
        raise ValueError("average_weights needs q of rank >= 3 (the heads axis -3)")
    dtype = np.result_type(q, k, v, np.float16)  # float32 stays float32; integers become float64
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (np.asarray(a, dtype) for a in (q, k, v))
    if g > 1:  # query head h reads key/value head h // g
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)  # (..., Hkv, S, d|dv) -> (..., H, S, d|dv)

    s = np.arange(S)  # (S,)
    allowed = visible(T, S, causal, window)  # (T, S)
    if mask is not None:
        allowed = allowed & np.asarray(mask, bool)  # (..., T, S)
    if key_lengths is not None:
        allowed = allowed & (s < np.asarray(key_lengths)[..., None, None])  # (..., T, S)

    def hidden_scores() -> np.ndarray:  # (..., T, S): scaled, biased, -inf where a key is hidden
        scores = (q * dtype.type(scale)) @ np.swapaxes(k, -1, -2)
        if bias is not None:
            scores += np.asarray(bias)
        if alibi_slopes is not None:
            distance = np.abs(np.arange(T)[:, None] + S - T - s).astype(dtype)  # (T, S)
            scores -= np.asarray(alibi_slopes, dtype)[..., None, None] * distance
        np.copyto(scores, -np.inf, where=~allowed)
        return scores

    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is found below, by row
        weights = hidden_scores()
        np.exp(weights, out=weights)  # (..., T, S) unshifted (_shift: the rows it does not suit again); hidden keys exactly 0
        # The row sums pairwise where the weights are returned (each row then sums to 1 within an
        # ulp or two), else one GEMV. Normalised before v where the weights are returned or are no
        # more numbers than out (S <= dv), else out is (e v) / total.
        if return_weights:
            total = weights.sum(axis=-1, keepdims=True)  # (..., T, 1)
        else:
            total = (weights @ ones(S, dtype))[..., None]
        weights_first = return_weights or S <= v.shape[-1]
        shift = _shift(weights, total, allowed, hidden_scores)  # (..., T, 1) or None: every row unshifted
        lse = log_sum_exp(np.zeros((), dtype) if shift is None else shift, total)[..., 0] if return_lse else None  # (..., T)
        total[total == 0] = 1  # a row with no key keeps weights and output exactly 0
        if weights_first:
            weights /= total  # normalised before v: sum_s w_s v_s <= max |v| stays finite
            out = weights @ v  # (..., T, dv)
        else:
            out = _v_then_normalise(weights, total, v)
    check_finite("out", out)  # the weights are finite: each is exp(s) over a sum that holds it
    if return_weights and average_weights:
        weights = weights.mean(axis=-3)  # (..., T, S) without axis -3
    result = (out, weights if return_weights else None)
    return (*result, lse) if lse is not None else result


def _shift(e: np.ndarray, total: np.ndarray, allowed: np.ndarray, hidden_scores: Callable[[], np.ndarray]) -> np.ndarray | None:
    """Each row's shift, (..., T, 1), or None where every row's is 0.

    e (..., T, S) is exp(scores) and total (..., T, 1) its row sums. A row whose total lies in
    [the dtype's smallest normal times UNDERFLOW_MARGIN, its maximum] keeps them, shift 0: that is
    the softmax exp(scores - the row's maximum) gives, to rounding (no exp overflowed, and any that
    underflowed weighs below 2**-40 of the total); so does a row with no key (e and total 0). Any
    other row (scores too large or too small to exponentiate as they are, or overflowed) is
    exponentiated again from hidden_scores(), shifted by its maximum as the textbook does, in e and
    total, in place; a maximum that is not finite there is an overflow (ScoreOverflow). float16 has
    no room for this and shifts every row. A row's choice reads its own total only, so no row
    depends on another."""
    info = np.finfo(e.dtype)
    floor = float(info.tiny) * UNDERFLOW_MARGIN if info.bits > 16 else np.inf
    unshifted = (total >= floor) & (total <= info.max)  # (..., T, 1); False for NaN
    if unshifted.all():
        return None
    rows = np.nonzero(~unshifted[..., 0])  # an index into (..., T)
    has_key = np.broadcast_to(allowed, e.shape)[rows].any(axis=-1)  # (n,)
    rows = tuple(r[has_key] for r in rows)
    if not rows[0].size:
        return None
    s = hidden_scores()[rows]  # (n, S), a copy
    row_max = s.max(axis=-1, keepdims=True)  # (n, 1); each row has a key
    if not np.isfinite(row_max).all():  # +inf or NaN, or -inf in a row that may see a key
        raise ScoreOverflow(row_max.dtype)
    s -= row_max
    e[rows] = np.exp(s, out=s)
    total[rows] = s.sum(axis=-1, keepdims=True)
    shift = np.zeros_like(total)
    shift[rows] = row_max
    return shift


@lru_cache(maxsize=8)
def ones(n: int, dtype: np.dtype) -> np.ndarray:
    """(n,) ones, read-only: ones @ x, x (..., n, m), is x summed over axis -2, (..., m), and
    y @ ones, y (..., m, n), y summed over its last axis, (..., m): one GEMV. Cached per request
    size (slice it for fewer)."""
    x = np.ones(n, dtype)
    x.flags.writeable = False
    return x


def _v_then_normalise(e: np.ndarray, total: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(e v) / total, e (..., T, S) exp'd scores, total (..., T, 1) their row sums (0 replaced by
    1): T * dv divisions, not T * S. A row whose total is below 1 (unshifted scores all below 0) is
    normalised first, else its products e_s v_s could underflow where w_s v_s would not; a row
    whose e v overflows is computed again normalised first (the textbook's order). Normalising a
    row sets its total to 1, so each row is divided once either way."""
    rows = np.nonzero(total[..., 0] < 1)
    while True:
        e[rows] /= total[rows]
        total[rows] = 1
        out = e @ v  # (..., T, dv)
        out /= total
        if np.isfinite(out).all():
            return out
        rows = np.nonzero(~np.isfinite(out).all(axis=-1) & (total[..., 0] != 1))
        if not rows[0].size:
            return out  # normalised first and still not finite: check_finite raises


def log_sum_exp(shift: np.ndarray, total: np.ndarray) -> np.ndarray:
    """A row's lse from what its softmax has: shift + log(total), total the sum of exp(score -
    shift) over the keys it may see; the dtype's lowest finite value where total is 0 (no key), so
    that exp(lse - m) is exactly 0 in a merge and JSON stays strict."""
    with np.errstate(divide="ignore"):
        lse = shift + np.log(total)
    return np.where(total > 0, lse, np.finfo(total.dtype).min).astype(total.dtype, copy=False)


def check_finite(what: str, arr: np.ndarray | None) -> None:
    """Raise ResultOverflow unless every value of arr is finite."""
    if arr is not None and arr.size and not np.isfinite(arr).all():
        raise ResultOverflow(what, arr.dtype)


def causal_offset(T: int, S: int, causal: bool | str) -> int | None:
    """Query t may see key s iff s <= t + offset; None when there is no causal mask.

    causal False | True ("top_left": offset 0) | "bottom_right" (offset S - T)."""
    if not causal:
        return None
    align = "top_left" if causal is True else causal
    if align not in ALIGNMENTS:
        raise ValueError(f"causal must be False, True or one of {ALIGNMENTS}, not {causal!r}")
    return 0 if align == "top_left" else S - T


def bounds(T: int, S: int, causal: bool | str, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(upper, lower): query t may see key s iff t + lower <= s <= t + upper; None leaves a side open.

    causal and window are ANDed. The window is bottom-right aligned as FlashAttention's window_size:
    t + S - T - left <= s <= t + S - T + right. A side that no row can reach (left >= S - 1,
    right >= T - 1) is left open, as FlashAttention does, so it costs nothing."""
    upper, lower = causal_offset(T, S, causal), None
    if window is not None:
        left, right = _window(window)
        if 0 <= right < T - 1:
            upper = S - T + right if upper is None else min(upper, S - T + right)
        if 0 <= left < S - 1:
            lower = S - T - left
    return upper, lower


def visible(T: int, S: int, causal: bool | str, window: tuple[int, int] | None) -> np.ndarray:
    """Boolean (T, S), True where query t may see key s by the causal mask and the window.
    Read-only and cached per shape."""
    return _visible(T, S, *bounds(T, S, causal, window))


@lru_cache(maxsize=16)
def _visible(T: int, S: int, upper: int | None, lower: int | None) -> np.ndarray:
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]  # (T, 1), (1, S)
    allowed = np.ones((T, S), bool)
    if upper is not None:
        allowed &= s <= t + upper
    if lower is not None:
        allowed &= s >= t + lower
    allowed.flags.writeable = False  # shared between requests
    return allowed


def _window(window) -> tuple[int, int]:
    """(left, right) as ints >= -1 (FlashAttention's window_size; -1 leaves that side open)."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), not {window!r}") from None
    if any(isinstance(n, bool) or int(n) != n or n < -1 for n in (left, right)):
        raise ValueError(f"window values must be integers >= -1, not {window!r}")
    return int(left), int(right)


def groups(q_shape: tuple, k_shape: tuple, v_shape: tuple, enable_gqa: bool) -> int:
    """g, the query heads per key/value head: 1, or H / Hkv under enable_gqa (PyTorch's SDPA:
    query head h reads key/value head h // g)."""
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(f"k {k_shape} and v {v_shape} must agree but for their last axis")
    if not enable_gqa:
        if k_shape[:-2] != q_shape[:-2]:
            raise ValueError(
                f"q {q_shape} and k {k_shape} have different leading axes (fewer key/value heads than query heads need enable_gqa)"
            )
        return 1
    if len(q_shape) < 3 or len(k_shape) != len(q_shape) or k_shape[:-3] != q_shape[:-3]:
        raise ValueError(f"enable_gqa needs q {q_shape} and k {k_shape} of rank >= 3 and equal but for the heads axis -3")
    H, Hkv = q_shape[-3], k_shape[-3]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"enable_gqa: {Hkv} key/value heads must divide {H} query heads")
    return max(1, H // Hkv)
