"""The numeric core: causal masks, scaled dot-product attention and the GPT block's multi-head
attention. numpy only: no Flask, no I/O. Pure functions of arrays; the dtype is the caller's.

Shape legend: ... leading (batch, heads) axes, B their product, T queries, S keys, d query/key
width, dv value width, n sequence length, h heads; a block is (nb batch items, tn query rows).

attention() works in blocks of query rows, so that every pass of the softmax runs over a
buffer that stays in the core's cache: the scores of a block are written by one matmul (into the
weights when they are returned, else into a small scratch buffer), masked, exponentiated and
summed in place, and multiplied by v. Under a causal mask a block only computes the keys up to
its last row's diagonal, which skips about half the work. Without weights the memory beyond the
inputs and the output is O(block), not O(T * S), and the output is normalised instead of the
weights (T * dv divisions, not T * S).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")

# Score elements per block: 2**18 float32 scores are 1 MiB, about one core's L2 cache here.
# Measured on the 2-core benchmark machine (bench/): 2**17..2**19 are within noise of each other;
# 2**16 pays for Python per block at T=4096, 2**21 and up spill to memory and run ~1.3x slower.
BLOCK_ELEMENTS = 2**18
MIN_ROWS = 16  # fewer query rows per matmul than this and BLAS runs far below its peak
CAUSAL_BLOCKS = 16  # under a causal mask, at least this many row blocks: each skips the keys past its diagonal
# Scores within +-EXP_SAFE need no max subtracted: exp stays normal and finite, and a row of up to
# 2**20 keys sums below the dtype's maximum (float32: e**64 * 2**20 < 3.4e38 and e**-64 > 1.2e-38).
EXP_SAFE = {np.float16: 0.0, np.float32: 64.0, np.float64: 640.0}


class ScoreOverflow(ArithmeticError):
    """q kᵀ · scale left the dtype's finite range, so the softmax would be meaningless."""

    def __init__(self, dtype: np.dtype):
        super().__init__(f"q kᵀ · scale overflows {dtype}")
        self.dtype = dtype


@lru_cache(maxsize=8)
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


def _offset(T: int, S: int, causal: bool | str) -> int | None:
    """Query t may see key s iff s <= t + offset; None when there is no causal mask."""
    if not causal:
        return None
    align = "top_left" if causal is True else causal
    if align not in ALIGNMENTS:
        raise ValueError(f"causal must be False, True or one of {ALIGNMENTS}, not {causal!r}")
    return 0 if align == "top_left" else S - T


@lru_cache(maxsize=64)
def _band(rows: int, cols: int, shift: int) -> np.ndarray:
    """Boolean (rows, cols), True where column c lies past row r's diagonal: c > r + shift.
    The causal mask of one block's partly visible keys; a handful of shapes per request size."""
    band = np.arange(cols)[None, :] > np.arange(rows)[:, None] + shift  # (rows, cols)
    band.flags.writeable = False
    return band


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
    *lead, T, d = q.shape
    S, dv = k.shape[-2], v.shape[-1]
    B = math.prod(lead)
    dtype = np.result_type(q, k, v, np.float16)  # float32 stays float32; integers become float64
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    offset = _offset(T, S, causal)

    qs = np.multiply(q, dtype.type(scale), dtype=dtype).reshape(B, T, d)  # scale folded into q
    kt = np.swapaxes(np.asarray(k, dtype).reshape(B, S, d), -1, -2)  # (B, d, S), a view
    masks = _Masks(lead, T, S, mask, key_lengths, offset)
    vb = np.empty((B, S, dv + 1), dtype)  # v and a column of ones (for the row sums)
    vb[..., :dv] = v.reshape(B, S, dv)
    vb[..., dv] = 1

    out = np.empty((B, T, dv), dtype)
    weights = np.empty((B, T, S), dtype) if return_weights else None
    tn, nb = _plan(B, T, S, offset)
    scratch = None if return_weights else np.empty(nb * tn * (min(S, masks.key_end) + dv + 1), dtype)

    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected per block, not warned about
        bound = _small_scores(qs, kt, offset)  # (B, T, 1)
        for b0 in range(0, B, nb):
            b1 = min(B, b0 + nb)
            for t0 in range(0, T, tn):
                t1 = min(T, t0 + tn)
                _block(qs, kt, vb, out, weights, scratch, masks, bound, b0, b1, t0, t1)
    out = out.reshape(*lead, T, dv)
    return out, (weights.reshape(*lead, T, S) if return_weights else None)


def _plan(B: int, T: int, S: int, offset: int | None) -> tuple[int, int]:
    """(tn, nb): the query rows and batch items of one block."""
    tn = BLOCK_ELEMENTS // S if offset is None else min(BLOCK_ELEMENTS // S, T // CAUSAL_BLOCKS)
    tn = min(T, max(MIN_ROWS, tn))  # query rows per block
    nb = min(B, max(1, BLOCK_ELEMENTS // (tn * S)))  # batch items per block
    return tn, nb


def block_count(B: int, T: int, S: int, causal: bool | str = False) -> int:
    """How many blocks attention() computes for B batch items (the product of the leading axes):
    each costs a few numpy calls beyond its arithmetic, which the cost model counts."""
    tn, nb = _plan(B, T, S, _offset(T, S, causal))
    return math.ceil(B / nb) * math.ceil(T / tn)


def _small_scores(qs: np.ndarray, kt: np.ndarray, offset: int | None) -> np.ndarray:
    """Boolean (B, T, 1): True where every score row t may see is within +-EXP_SAFE, by
    Cauchy-Schwarz, |q_t . k_s| <= |q_t| |k_s|. Under a causal mask only the keys row t may
    see count, so the bound (like the output) does not depend on the future."""
    limit = EXP_SAFE.get(qs.dtype.type, 0.0)
    q_norm = np.sqrt(np.einsum("btd,btd->bt", qs, qs))  # (B, T), inf if it overflows: no shortcut
    k_norm = np.sqrt(np.einsum("bds,bds->bs", kt, kt))  # (B, S)
    if offset is None:
        return (q_norm * k_norm.max(axis=-1, keepdims=True) < limit)[..., None]
    T, S = qs.shape[1], kt.shape[2]
    seen_max = np.maximum.accumulate(k_norm, axis=-1)  # (B, S): max |k_s| over s' <= s
    last = np.clip(np.arange(T) + offset, 0, S - 1)  # (T,) the last key row t may see
    return (q_norm * seen_max[:, last] < limit)[..., None]


class _Masks:
    """The three masks in the form the blocks use: mask as (B|1, T|1, S|1), the causal offset,
    key_lengths as (B,), and key_end, past which no row of any batch item may look."""

    def __init__(self, lead, T, S, mask, key_lengths, offset):
        B = math.prod(lead)
        self.offset = offset
        self.mask = None
        if mask is not None:
            mask = np.asarray(mask, bool)
            if mask.ndim < 2:
                mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)  # (1|T, 1|S)
            mlead = mask.shape[:-2]
            if all(n == 1 for n in mlead):
                self.mask = mask.reshape(1, *mask.shape[-2:])  # one mask for every batch item
            else:
                self.mask = np.broadcast_to(mask, (*lead, *mask.shape[-2:])).reshape(B, *mask.shape[-2:])
        self.lengths = None
        self.key_end = S
        if key_lengths is not None:
            self.lengths = np.broadcast_to(np.asarray(key_lengths), tuple(lead)).reshape(B)  # (B,)
            self.key_end = int(self.lengths.max()) if B else 0

    def keys(self, t0: int, t1: int, S: int) -> tuple[int, int]:
        """Keys [0, lo) are causally visible to every row of t0..t1, keys [hi, S) to none."""
        hi = min(S, self.key_end)
        if self.offset is None:
            return hi, hi
        hi = max(0, min(hi, t1 + self.offset))  # row t1 - 1 sees keys up to t1 - 1 + offset
        lo = max(0, min(hi, t0 + self.offset + 1))
        return lo, hi

    def apply(self, scores: np.ndarray, b0: int, b1: int, t0: int, t1: int, lo: int, hi: int, fill=-np.inf) -> None:
        """Set the masked entries of block (b0:b1, t0:t1, 0:hi) to fill (-inf for scores), in place."""
        if lo < hi:  # the causal diagonal crosses this block
            np.copyto(scores[..., lo:hi], fill, where=_band(t1 - t0, hi - lo, t0 + self.offset - lo))
        if self.mask is not None:
            m = self.mask
            m = m[b0:b1] if m.shape[0] > 1 else m
            m = m[:, t0:t1] if m.shape[1] > 1 else m
            m = m[..., :hi] if m.shape[2] > 1 else m
            np.copyto(scores, fill, where=np.logical_not(m))
        if self.lengths is not None and self.lengths[b0:b1].min() < hi:
            np.copyto(scores, fill, where=np.arange(hi) >= self.lengths[b0:b1, None, None])  # (nb, 1, hi)

    def has_key(self, b0: int, b1: int, t0: int, t1: int, S: int) -> np.ndarray:
        """Boolean (nb, tn, 1): whether each row of the block may see any key at all."""
        lo, hi = self.keys(t0, t1, S)
        allowed = np.ones((b1 - b0, t1 - t0, hi), bool)  # keys from hi on are masked for every row
        self.apply(allowed, b0, b1, t0, t1, lo, hi, fill=False)
        return allowed.any(axis=-1, keepdims=True)


def _block(qs, kt, vb, out, weights, scratch, masks: _Masks, bound, b0, b1, t0, t1) -> None:
    """Attention for batch items b0:b1 and query rows t0:t1, written into out (and weights)."""
    S = kt.shape[-1]
    lo, hi = masks.keys(t0, t1, S)
    o = out[b0:b1, t0:t1]  # (nb, tn, dv), a view
    if hi == 0:  # no row of this block may see any key
        o[...] = 0
        if weights is not None:
            weights[b0:b1, t0:t1] = 0
        return
    nb, tn = b1 - b0, t1 - t0
    if weights is not None:
        s = weights[b0:b1, t0:t1, :hi]  # (nb, tn, hi): the weights' own memory is the buffer
        weights[b0:b1, t0:t1, hi:] = 0
    else:
        s = scratch[: nb * tn * hi].reshape(nb, tn, hi)
    np.matmul(qs[b0:b1, t0:t1], kt[b0:b1, :, :hi], out=s)  # (nb, tn, hi) scaled scores
    masks.apply(s, b0, b1, t0, t1, lo, hi)
    shift = _shift(s, bound[b0:b1, t0:t1], masks, b0, b1, t0, t1)
    if shift is not None:
        np.subtract(s, shift, out=s)
    np.exp(s, out=s)  # exp(-inf) = 0 exactly: masked weights are 0
    if weights is not None:
        total = s.sum(axis=-1, keepdims=True)  # (nb, tn, 1), pairwise: rows sum to 1 within an ulp or two
        total[total == 0] = 1  # a row with no allowed key: its weights and output stay exactly 0
        np.divide(s, total, out=s)
        np.matmul(s, vb[b0:b1, :hi, :-1], out=o)
    else:  # v carries a last column of ones, so one matmul gives both exp(s) v and the row sums
        ov = scratch[-nb * tn * vb.shape[-1] :].reshape(nb, tn, vb.shape[-1])
        np.matmul(s, vb[b0:b1, :hi], out=ov)  # (nb, tn, dv + 1)
        total = ov[..., -1:]
        total[total == 0] = 1
        np.divide(ov[..., :-1], total, out=o)


def _shift(s, bound, masks: _Masks, b0, b1, t0, t1) -> np.ndarray | None:
    """What to subtract from each row of scores before exp, or None for nothing.

    A row whose scores are provably small (|q_t| * max |k_s| * scale under EXP_SAFE, over the keys
    it may see) needs no shift: exp neither overflows nor underflows to all zeros, and it skips
    two passes over the block. Any other row subtracts its maximum, as the textbook softmax does.
    The choice is made per row from that row's own inputs, so no row depends on another."""
    if bound.all():
        return None
    row_max = s.max(axis=-1, keepdims=True)  # (nb, tn, 1); -inf where a row sees no key
    if not np.isfinite(row_max).all():
        _check_overflow(row_max, masks.has_key(b0, b1, t0, t1, s.shape[-1]))
        row_max[np.isneginf(row_max)] = 0
    row_max[bound] = 0
    return row_max


def _check_overflow(row_max: np.ndarray, has_key: np.ndarray) -> None:
    """A row maximum of +inf or NaN, or -inf in a row that has an allowed key, means overflow."""
    if (np.isnan(row_max) | np.isposinf(row_max) | (np.isneginf(row_max) & has_key)).any():
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
