"""Attention over keys and values held in pages (a session's cache, service.sessions): the step of
a decode loop, computed over the pages where they lie, never gathered into one copy.

    pages = [(k_0, v_0), (k_1, v_1), ...]   k_i (Hkv, P, d), v_i (Hkv, P, dv): keys i*P .. i*P+P-1
    q (H, T, d)                              query head h reads key/value head h // (H / Hkv)

A run of m pages may come as one (k (m, Hkv, P, d), v (m, Hkv, P, dv)): a strided view of pages
that lie at equal distances in memory (a pool hands consecutive pages so), computed in one matmul
instead of m.

The pages are taken a chunk at a time (as many as fit a scratch of scratch_elements scores); in a
chunk each page's scores are one matmul into the chunk's buffer, the chunk's softmax is taken over
all of them, and the chunks' partial results are merged by their lse, exactly (FlashInfer's
merge_states: L = logsumexp_i(lse_i), out = sum_i exp(lse_i - L) out_i). A decode step (T = 1) is
one chunk up to hundreds of thousands of keys.

What a query may see is reference.py's rules over the whole sequence of S keys: causal
("bottom_right" aligns query t of T with key t + S - T), window, ALiBi (-slope * |t + S - T - s|).
Results are reference()'s: out (H, T, dv), weights (H, T, S) when asked, lse (H, T) when asked (a
row with no key: out 0, lse the dtype's lowest finite value)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .reference import Result, ScoreOverflow, Stopped, bounds, check_finite, log_sum_exp

Page = tuple[np.ndarray, np.ndarray]  # (k (Hkv, P, d), v (Hkv, P, dv)), or a run of m: (m, Hkv, P, d), (m, Hkv, P, dv)
SCRATCH_ELEMENTS = 2**21  # scores held at once: 8 MiB of float32


def paged_attention(
    q: np.ndarray,
    pages: Sequence[Page],
    S: int,
    *,
    causal: bool | str = "bottom_right",
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: np.ndarray | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    scratch_elements: int = SCRATCH_ELEMENTS,
    stop: Callable[[], bool] | None = None,
) -> Result:
    """Attention of q (H, T, d) over the first S keys of pages (each (Hkv, P, d), (Hkv, P, dv), or
    a run of them; ceil(S / P) pages in all, the last filled up to S). Computed in q's dtype;
    reference()'s results and errors (ScoreOverflow, ResultOverflow); Stopped when stop() says so
    between chunks."""
    H, T, d = q.shape
    dtype = q.dtype
    runs = _runs(pages)
    if not runs:
        raise ValueError("paged_attention needs at least one page")
    _, Hkv, P, _ = runs[0][1].shape
    dv = runs[0][2].shape[-1]
    count = runs[-1][0] + runs[-1][1].shape[0]
    if H % Hkv or count * P < S or S < 1:
        raise ValueError(f"q {q.shape} does not fit {count} pages of {runs[0][1].shape[1:]} holding {S} keys")
    g, rows = H // Hkv, H // Hkv * T
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qs = (q * dtype.type(scale)).reshape(Hkv, rows, d)  # head h = kv * g + j: rows (j, t)
    t = np.tile(np.arange(T), g)[None, None, :, None]  # (1, 1, rows, 1): each row's query position
    upper, lower = bounds(T, S, causal, window)  # row t sees keys t + lower <= s <= t + upper
    slopes = None
    if alibi_slopes is not None:
        slopes = np.repeat(np.broadcast_to(np.asarray(alibi_slopes, dtype), (H,)).reshape(Hkv, g), T, axis=1)[None, :, :, None]
    # Pages no row may see are skipped (a window's far past; keys after the last row's causal limit).
    first = 0 if lower is None else max(0, lower) // P
    end = S if upper is None else max(0, min(S, T - 1 + upper + 1))
    last = -(-end // P)
    per = max(1, scratch_elements // (Hkv * rows * P))
    weights = np.zeros((Hkv, rows, S), dtype) if return_weights else None
    out, lse = None, None
    chunks: list[tuple[int, int, np.ndarray]] = []  # (first key, last key + 1, lse) of each chunk's weights
    for c0 in range(first, last, per):
        if stop is not None and stop():
            raise Stopped
        c1 = min(last, c0 + per)
        o_c, lse_c = _chunk(qs, runs, c0, c1, S, T, t, upper, lower, slopes, weights)
        if weights is not None:
            chunks.append((c0 * P, min(S, c1 * P), lse_c))
        out, lse = (o_c, lse_c) if out is None or lse is None else _merge(out, lse, o_c, lse_c)
    if out is None or lse is None:  # no page any row may see
        out, lse = np.zeros((Hkv, rows, dv), dtype), np.full((Hkv, rows), np.finfo(dtype).min, dtype)
    if weights is not None:
        for k0, k1, lse_c in chunks:  # each chunk's weights were normalised by its own sum
            weights[:, :, k0:k1] *= np.exp(lse_c - lse, where=lse > np.finfo(dtype).min, out=np.zeros_like(lse))[..., None]
    out = out.reshape(H, T, dv)
    check_finite("out", out)
    result = (out, None if weights is None else weights.reshape(H, T, S))
    return (*result, lse.reshape(H, T)) if return_lse else result


def _runs(pages: Sequence[Page]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(index of its first page, k (m, Hkv, P, d), v (m, Hkv, P, dv)) for each run of pages."""
    runs, at = [], 0
    for k, v in pages:
        k, v = (k, v) if k.ndim == 4 else (k[None], v[None])
        runs.append((at, k, v))
        at += k.shape[0]
    return runs


def _pieces(runs, c0: int, c1: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The runs' parts within pages c0 .. c1 - 1: (their first page's index from c0, k, v)."""
    out = []
    for at, k, v in runs:
        a, b = max(c0, at), min(c1, at + k.shape[0])
        if a < b:
            out.append((a - c0, k[a - at : b - at], v[a - at : b - at]))
    return out


def _chunk(qs, runs, c0, c1, S, T, t, upper, lower, slopes, weights) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of pages c0 .. c1 - 1: (out normalised over its keys, its lse), both (Hkv, rows, ...);
    its weights written into weights' columns (normalised over the chunk)."""
    Hkv, rows, _ = qs.shape
    P, dtype = runs[0][1].shape[2], qs.dtype
    n = c1 - c0
    pieces = _pieces(runs, c0, c1)
    sc = np.empty((n, Hkv, rows, P), dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        for j, k, _ in pieces:
            np.matmul(qs, k.transpose(0, 1, 3, 2), out=sc[j : j + k.shape[0]])
        if slopes is not None:
            pos = np.arange(c0 * P, c1 * P).reshape(n, 1, 1, P)  # each column's key position
            sc -= slopes * np.abs(t + (S - T) - pos).astype(dtype)
        # Only the pages at the chunk's ends may hide a key from a row (past S, the causal limit, a
        # window's far side): every row sees keys T - 1 + lower .. min(S - 1, upper) (row t sees
        # t + lower .. t + upper). Those pages are masked; the run between them is left alone.
        lo = 0 if lower is None else T - 1 + lower
        hi = S - 1 if upper is None else min(S - 1, upper)
        a = min(n, max(0, -(-lo // P) - c0))  # the chunk's first page whose keys all rows see
        b = max(a, min(n, (hi + 1) // P - c0))  # ... and the page after its last
        for j0, j1 in ((0, a), (b, n)):
            if j0 < j1:
                np.copyto(sc[j0:j1], -np.inf, where=_hidden(c0 + j0, c0 + j1, P, S, t, upper, lower))
        top = sc.max(axis=(0, 3))  # (Hkv, rows)
        if not np.isfinite(top).all():
            seen = (~np.broadcast_to(_hidden(c0, c1, P, S, t, upper, lower), sc.shape)).any(axis=(0, 3))
            if (np.isnan(top) | np.isposinf(top) | (np.isneginf(top) & seen)).any():
                raise ScoreOverflow(dtype)
            top[np.isneginf(top)] = 0  # a row with no key here: exp(-inf) = 0 for all of it
        sc -= top[None, :, :, None]
        e = np.exp(sc, out=sc)
        total = e.sum(axis=(0, 3))  # (Hkv, rows)
        o = np.zeros((Hkv, rows, runs[0][2].shape[-1]), dtype)
        for j, _, v in pieces:
            m = v.shape[0]
            full = min(m, S // P - (c0 + j))  # pages filled whole; the last page's values past S may hold anything (NaN)
            if full > 0:
                o += (e[j : j + full] @ v[:full]).sum(axis=0)
            for i in range(max(0, full), m):  # never multiplied, even by 0
                valid = S - (c0 + j + i) * P
                o += e[j + i, :, :, :valid] @ v[i, :, :valid]
    lse = log_sum_exp(top, total)
    norm = np.where(total > 0, total, 1)
    o /= norm[..., None]
    if weights is not None:
        for j in range(n):
            k0 = (c0 + j) * P
            k1 = min(S, k0 + P)
            np.divide(e[j, :, :, : k1 - k0], norm[..., None], out=weights[:, :, k0:k1])
    return o, lse


def _hidden(p0: int, p1: int, P: int, S: int, t: np.ndarray, upper: int | None, lower: int | None) -> np.ndarray:
    """Which keys of pages p0 .. p1 - 1 each row may not see: (p1 - p0, 1, rows, P), or (.., 1, P)."""
    pos = np.arange(p0 * P, p1 * P).reshape(p1 - p0, 1, 1, P)
    hidden = pos >= S
    if upper is not None:
        hidden = hidden | (pos > t + upper)
    if lower is not None:
        hidden = hidden | (pos < t + lower)
    return hidden


def _merge(out: np.ndarray, lse: np.ndarray, o_c: np.ndarray, lse_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two partial results over disjoint keys merged by their lse (FlashInfer's merge_states)."""
    lowest = np.finfo(lse.dtype).min
    top = np.maximum(lse, lse_c)
    a, b = np.exp(lse - top), np.exp(lse_c - top)
    total = a + b
    merged = np.where(top > lowest, top + np.log(total), lowest).astype(lse.dtype, copy=False)
    out = (out * a[..., None] + o_c * b[..., None]) / total[..., None]
    return out, merged
