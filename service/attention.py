"""The numeric core: causal masks, scaled dot-product attention and the GPT block's multi-head
attention. numpy only: no Flask, no I/O. Pure functions of arrays; the dtype is the caller's.

Shape legend: ... leading (batch, heads) axes, T queries, S keys, d query/key width, dv value width,
n sequence length, h heads.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")


class ScoreOverflow(ArithmeticError):
    """q kᵀ · scale left the dtype's finite range, so the softmax would be meaningless."""

    def __init__(self, dtype: np.dtype):
        super().__init__(f"q kᵀ · scale overflows {dtype}")
        self.dtype = dtype


@lru_cache(maxsize=64)
def _causal_mask(T: int, S: int, align: str) -> np.ndarray:
    offset = 0 if align == "top_left" else S - T
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


def allowed_keys(
    T: int, S: int, mask: np.ndarray | None = None, *, causal: bool | str = False, key_lengths: np.ndarray | None = None
) -> np.ndarray | None:
    """The one boolean mask that broadcasts to (..., T, S): mask AND causal AND key padding.

    key_lengths broadcasts to the leading axes; key s is allowed iff s < key_lengths[...].
    None when every key is allowed."""
    parts = []
    if mask is not None:
        parts.append(mask)
    if causal:
        parts.append(causal_mask(T, S, "top_left" if causal is True else causal))
    if key_lengths is not None:
        lengths = np.asarray(key_lengths)[..., None, None]  # (..., 1, 1)
        parts.append(np.arange(S) < lengths)  # (..., 1, S)
    if not parts:
        return None
    combined = parts[0]
    for part in parts[1:]:
        combined = np.logical_and(combined, part)
    return combined


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
) -> tuple[np.ndarray, np.ndarray | None]:
    """softmax(q kᵀ · scale, masked) v over any leading axes.

    q (..., T, d), k (..., S, d), v (..., S, dv); mask broadcasts to (..., T, S), True = attend;
    causal False | True ("top_left") | "bottom_right"; key_lengths broadcasts to (...).
    Returns out (..., T, dv) and weights (..., T, S) (None unless return_weights). Masked weights
    are exactly 0; a row with no allowed key has all-zero weights and output. Raises ScoreOverflow
    when a score leaves the dtype's range.
    """
    T, d = q.shape[-2:]
    S = k.shape[-2]
    dtype = np.result_type(q, k, v)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    allowed = allowed_keys(T, S, mask, causal=causal, key_lengths=key_lengths)  # (..., T, S) or None

    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected below, not warned about
        weights = (q * dtype.type(scale)) @ np.swapaxes(k, -1, -2)  # (..., T, S), scale folded into q
    if allowed is not None:
        np.copyto(weights, -np.inf, where=np.logical_not(allowed))
    row_max = weights.max(axis=-1, keepdims=True)  # (..., T, 1); -inf for a row with no allowed key
    _check_finite(row_max, allowed)
    row_max[np.isneginf(row_max)] = 0
    np.subtract(weights, row_max, out=weights)
    np.exp(weights, out=weights)  # exp(-inf) = 0 exactly
    total = weights.sum(axis=-1, keepdims=True)  # (..., T, 1); 0 only for a fully masked row
    np.divide(weights, total, out=weights, where=total > 0)
    out = weights @ v  # (..., T, dv)
    return out, (weights if return_weights else None)


def _check_finite(row_max: np.ndarray, allowed: np.ndarray | None) -> None:
    """A row maximum of +inf or NaN, or -inf in a row that has an allowed key, means overflow."""
    if np.isfinite(row_max).all():
        return
    if allowed is not None:
        has_key = np.broadcast_to(allowed.any(axis=-1, keepdims=True), row_max.shape)  # (..., T, 1)
        if not (np.isnan(row_max) | np.isposinf(row_max) | (np.isneginf(row_max) & has_key)).any():
            return
    raise ScoreOverflow(row_max.dtype)


def mha(
    x: np.ndarray,
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    wo: np.ndarray,
    heads: int,
    *,
    causal: bool = True,
    return_weights: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The GPT block's multi-head self-attention.

    x (..., n, d), wq/wk/wv/wo (d, d), d % heads == 0. Returns out (..., n, d) and weights
    (..., h, n, n) (None unless return_weights); scores are scaled by 1/sqrt(d/h).
    """
    n, d = x.shape[-2:]
    hd = d // heads

    def split(t: np.ndarray) -> np.ndarray:
        return np.swapaxes(t.reshape(*t.shape[:-1], heads, hd), -2, -3)  # (..., n, d) -> (..., h, n, hd)

    q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)  # (..., h, n, hd)
    out, weights = attention(q, k, v, causal=causal, scale=1.0 / np.sqrt(hd), return_weights=return_weights)
    out = np.swapaxes(out, -2, -3).reshape(*x.shape[:-1], d)  # (..., h, n, hd) -> (..., n, d)
    return out @ wo, weights
