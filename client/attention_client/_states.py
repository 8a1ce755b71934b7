"""Attention states: the (out, lse) of attention over a segment of the keys, and their exact merge.

Attention over keys split into segments i merges exactly (FlashInfer's merge_states, vLLM's
merge_attn_states): with L = logsumexp_i(lse_i), out = sum_i exp(lse_i - L) out_i, the weights of
segment i are w_i exp(lse_i - L) at its keys, and lse = L. A row that sees no key of a segment has
out_i 0 and lse_i the dtype's lowest finite value, so exp(lse_i - L) is exactly 0 wherever another
segment has a key, and a row that sees no key at all keeps out 0 and lse the lowest finite value.

Shape legend: ... leading axes, T queries, dv value width, S_i the keys of segment i."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def merge_states(
    outs: Sequence[np.ndarray], lses: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge the states of attention over disjoint key segments, in the order of their keys.

    outs[i] (..., T, dv), lses[i] (..., T), weights[i] (..., T, S_i) optional. Returns (out, lse),
    or (out, lse, weights (..., T, sum S_i)) with each segment's weights rescaled and placed at its
    keys, in the inputs' dtype (computed in float64)."""
    if not outs or len(outs) != len(lses) or (weights is not None and len(weights) != len(outs)):
        raise ValueError("merge_states needs one lse (and one weights, if any) for each of at least one out")
    dtype = np.result_type(*outs, *lses)
    lse = np.stack([np.asarray(x, np.float64) for x in lses])  # (n, ..., T)
    total = _finite_lse(np.logaddexp.reduce(lse, axis=0), dtype)  # (..., T)
    factors = np.exp(lse - total)  # (n, ..., T): exactly 0 for a segment the row does not see
    out = sum(f[..., None] * np.asarray(o, np.float64) for f, o in zip(factors, outs, strict=True))
    result = (np.asarray(out, dtype), total.astype(dtype))
    if weights is None:
        return result
    merged = np.concatenate([np.asarray(w, np.float64) * f[..., None] for w, f in zip(weights, factors, strict=True)], axis=-1)
    return (*result, merged.astype(np.result_type(*weights)))


def _finite_lse(lse: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A merged lse, in float64, with the lowest finite value of dtype where no segment saw a key
    (logaddexp of lowest values: lowest + log n, rounded back to it in dtype, or -inf)."""
    lowest = float(np.finfo(dtype).min)
    return np.where(lse <= lowest / 2, lowest, lse)


class Merger:
    """The merge of many blocks, one at a time, each as it arrives: (leading items b0:b1, query rows
    t0:t1, keys s0:s1) of out, lse and (optionally) weights, into one (B, T, dv) out, (B, T) lse
    and (B, T, S) weights (None if no block had any: with weights asked for and every block ruled
    out, the caller's zeros). Memory O(out) beside the weights: out and lse accumulate in float64
    (the running L and sum exp(lse_i - L) out_i); the weights are written as they come and
    rescaled once every block is in (finish)."""

    def __init__(self, B: int, T: int, S: int, dv: int, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.out = np.zeros((B, T, dv))
        self.lse = np.full((B, T), -np.inf)
        self.weights: np.ndarray | None = None  # (B, T, S) in the first weights' dtype, made when they come
        self._shape = (B, T, S)
        self._parts: list[tuple[tuple[slice, slice, slice], np.ndarray]] = []  # each weights block and its lse

    def add(self, b0: int, b1: int, t0: int, t1: int, s0: int, s1: int, out: np.ndarray, lse: np.ndarray, weights=None) -> None:
        """One block: out (nb, tb, dv), lse (nb, tb), weights (nb, tb, sb) or None."""
        rows = (slice(b0, b1), slice(t0, t1))
        lse64 = np.asarray(lse, np.float64)
        acc = self.lse[rows]
        total = np.logaddexp(acc, lse64)  # (nb, tb)
        old, new = np.exp(acc - total), np.exp(lse64 - total)  # 0 where the accumulator saw nothing (-inf)
        self.out[rows] = old[..., None] * self.out[rows] + new[..., None] * out
        self.lse[rows] = total
        if weights is not None:
            if self.weights is None:
                self.weights = np.zeros(self._shape, weights.dtype)  # keys no block sent: weight 0
            self.weights[(*rows, slice(s0, s1))] = weights
            self._parts.append(((*rows, slice(s0, s1)), lse64))

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(out (B, T, dv), lse (B, T), weights (B, T, S) or None) in the blocks' dtypes; a row no
        block covered (every key hidden from it) has out 0 and lse the lowest finite value."""
        lse = _finite_lse(self.lse, self.dtype)
        if self.weights is not None:
            for (b, t, s), part_lse in self._parts:
                factor = np.exp(part_lse - lse[b, t])  # (nb, tb)
                if not (factor == 1).all():  # a row's only segment: left as the server sent it
                    self.weights[b, t, s] *= factor[..., None].astype(self.weights.dtype)
        return self.out.astype(self.dtype), lse.astype(self.dtype), self.weights
