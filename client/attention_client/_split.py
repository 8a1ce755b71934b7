"""Splitting an over-limit request: pure functions of shapes and limits, no I/O.

Attention is independent across leading indices (batch, heads), and each query row depends on
every key but on no other query. So a request splits exactly into blocks of (leading indices,
query rows), each sent with all its keys and with its own share of the mask; a causal mask is
sent as the explicit slice of rows, since a block's rows no longer start at row 0 (top_left) nor
end at row T-1 (bottom_right)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Block:
    """Leading indices b0:b1 (of the flattened leading axes) and query rows t0:t1."""

    b0: int
    b1: int
    t0: int
    t1: int


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


def causal_rows(T: int, S: int, align: str, t0: int, t1: int) -> np.ndarray:
    """Rows t0:t1 of the (T, S) causal mask: top_left allows s <= t, bottom_right s <= t + S - T."""
    offset = 0 if align == "top_left" else S - T
    return np.arange(S)[None, :] <= np.arange(t0, t1)[:, None] + offset  # (t1 - t0, S)


def broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if shape broadcasts to exactly target."""
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False
