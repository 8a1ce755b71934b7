"""Splitting an over-limit request: pure functions of shapes and limits, no I/O.

Attention is independent across leading indices (batch, heads), and each query row depends on
no other query. So a request splits exactly into blocks of (leading indices, query rows), each
sent with all its keys; and, where one row's keys do not fit, into key ranges too, whose
attention states (out, lse) merge exactly (_states). Each block carries its share of the mask,
the bias and key_lengths; the causal mask, the window and ALiBi, which are defined by positions
(t + S - T - s), are re-expressed for the block's own rows and keys (band, alibi_bias): as a window
where one says exactly the same, else as an explicit mask, and ALiBi as a bias where the block's
diagonal moved. Blocks no row may see are not sent."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Block:
    """Leading indices b0:b1 (of the flattened leading axes), query rows t0:t1 and keys s0:s1
    (s1 None: all of them)."""

    b0: int
    b1: int
    t0: int
    t1: int
    s0: int = 0
    s1: int | None = None


MAX_BLOCKS = 1024  # requests one call may become: past it, limits that small are not followed


def plan(n_lead: int, n_rows: int, fits: Callable[[int, int], bool]) -> list[Block] | None:
    """Blocks that cover n_lead x n_rows, each fitting, as few and as even as possible: whole rows
    over fewer leading indices first, then rows of one leading index. None when a single row of a
    single leading index does not fit (splitting cannot help), or when it would take more than
    MAX_BLOCKS blocks (limits that small, a server's mistake or lie, turned one call into a request
    per row: a million rows, a million requests). fits(lead, rows) must be monotone."""
    if fits(n_lead, n_rows):
        return [Block(0, n_lead, 0, n_rows)]
    if fits(1, n_rows):
        per = _largest(lambda b: fits(b, n_rows), n_lead)
        return [Block(b0, b1, 0, n_rows) for b0, b1 in _even(n_lead, per)] if math.ceil(n_lead / per) <= MAX_BLOCKS else None
    if fits(1, 1):
        per = _largest(lambda t: fits(1, t), n_rows)
        if n_lead * math.ceil(n_rows / per) > MAX_BLOCKS:
            return None
        return [Block(b, b + 1, t0, t1) for b in range(n_lead) for t0, t1 in _even(n_rows, per)]
    return None


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest x in 1..hi with ok(x), given ok(1) and ok monotone decreasing."""
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _even(n: int, per: int) -> list[tuple[int, int]]:
    """0..n in ceil(n/per) ranges of nearly equal size, none over per."""
    count = math.ceil(n / per)
    size = math.ceil(n / count)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def b64_len(nbytes: int) -> int:
    return 4 * ((nbytes + 2) // 3)


def broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if shape broadcasts to exactly target."""
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def plan_keys(
    n_lead: int,
    T: int,
    S: int,
    fits: Callable[[int, int, int], bool],
    key_chunks: int | None = None,
    sees: Callable[[Block], bool] | None = None,
) -> list[Block] | None:
    """Blocks over leading indices, query rows and key ranges, each fitting: key ranges of the
    most keys one row may send with (fits(1, 1, keys)), at most ceil(S / key_chunks); then as
    many rows, then leading indices, as fit beside them. sees(block): whether any of its rows may
    see any of its keys (the causal mask, the window, key_lengths); blocks it rules out are not
    returned. None when one key of one row does not fit, or past MAX_BLOCKS blocks.
    fits(lead, rows, keys) must be monotone in each."""
    if not fits(1, 1, 1):
        return None
    keys = _largest(lambda s: fits(1, 1, s), S)
    if key_chunks:
        keys = min(keys, -(-S // key_chunks))
    rows = _largest(lambda t: fits(1, t, keys), T)
    per = _largest(lambda b: fits(b, rows, keys), n_lead)
    if math.ceil(n_lead / per) * math.ceil(T / rows) * math.ceil(S / keys) > MAX_BLOCKS:
        return None
    blocks = [Block(b0, b1, t0, t1, s0, s1) for b0, b1 in _even(n_lead, per) for t0, t1 in _even(T, rows) for s0, s1 in _even(S, keys)]
    return [b for b in blocks if sees is None or sees(b)]


def diagonals(T: int, S: int, causal: str | None, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(lo, hi): query t may see key s iff lo <= s - t <= hi by the causal mask and the window
    (None: that side open). causal None | "top_left" | "bottom_right"; window as FlashAttention's."""
    hi = None if not causal else (0 if causal == "top_left" else S - T)
    lo = None
    if window is not None:
        left, right = window
        if right >= 0:
            hi = S - T + right if hi is None else min(hi, S - T + right)
        if left >= 0:
            lo = S - T - left
    return lo, hi


def sees_band(lo: int | None, hi: int | None, t0: int, t1: int, s0: int, s1: int) -> bool:
    """Whether some row t0:t1 may see some key s0:s1 within lo <= s - t <= hi."""
    least, most = s0 - (t1 - 1), (s1 - 1) - t0  # the block's smallest and largest s - t
    return (hi is None or least <= hi) and (lo is None or most >= lo) and (lo is None or hi is None or lo <= hi)


def band(lo: int | None, hi: int | None, t0: int, t1: int, s0: int, s1: int) -> tuple[tuple[int, int] | None, np.ndarray | None]:
    """The band lo <= s - t <= hi for the block's rows t0:t1 and keys s0:s1, as the block's own
    request says it: (window, None) when FlashAttention's window_size over the block's (tb, sb)
    says exactly that (None: nothing to hide), else (None, an explicit (tb, sb) mask)."""
    tb, sb = t1 - t0, s1 - s0
    shift = t0 - s0  # s - t = s' - t' - shift for the block's t' = t - t0, s' = s - s0
    blo = None if lo is None or lo + shift <= -(tb - 1) else lo + shift  # a side no row reaches is open
    bhi = None if hi is None or hi + shift >= sb - 1 else hi + shift
    if blo is None and bhi is None:
        return None, None
    base = sb - tb  # the block's window_size is centred on s' - t' = sb - tb
    left, right = -1 if blo is None else base - blo, -1 if bhi is None else bhi - base
    if left >= -1 and right >= -1 and not (blo is not None and left == -1) and not (bhi is not None and right == -1):
        return (left, right), None
    d = np.arange(sb)[None, :] - np.arange(tb)[:, None]  # (tb, sb): s' - t'
    allowed = np.ones((tb, sb), bool)
    if blo is not None:
        allowed &= d >= blo
    if bhi is not None:
        allowed &= d <= bhi
    return None, allowed


def alibi_moves(T: int, S: int, t0: int, t1: int, s0: int, s1: int) -> bool:
    """Whether ALiBi's distance |t + S - T - s| differs from the block's own |t' + sb - tb - s'|."""
    return (t0 - s0) + S - T != (s1 - s0) - (t1 - t0)


def alibi_bias(slopes: np.ndarray, T: int, S: int, t0: int, t1: int, s0: int, s1: int, dtype) -> np.ndarray:
    """(nb, tb, sb): ALiBi's -slope * |t + S - T - s| over the block's rows and keys, slopes (nb,)."""
    dist = np.abs(np.arange(t0, t1)[:, None] + S - T - np.arange(s0, s1)[None, :])  # (tb, sb)
    return (-np.asarray(slopes, np.float64)[:, None, None] * dist).astype(dtype)
