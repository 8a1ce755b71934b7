"""The numeric core: causal masks, scaled dot-product attention and the GPT block's multi-head
attention. numpy only: no Flask, no I/O. Pure functions of arrays; the dtype is the caller's.

Shape legend: ... leading (batch, heads) axes, B their product, T queries, S keys, d query/key
width, dv value width, n sequence length, h heads; g query heads per key/value head (1 unless
enable_gqa), Bkv = B / g key/value items; a block is (nb key/value items, their g query heads,
tn query rows) over the keys lo:hi some row of it may see.

attention() works in blocks of query rows, so that every pass of the softmax runs over a
buffer that stays in the core's cache: the scores of a block are written by one matmul (into the
weights when they are returned, else into a small scratch buffer), masked, exponentiated and
summed in place, and multiplied by v. Under a causal mask a block only computes the keys up to
its last row's diagonal, which skips about half the work; under a sliding window it also skips the
keys before its first row's window, so a window of W keys costs O(T * W), not O(T * S). Without
weights the memory beyond the inputs and the output is O(block), not O(T * S), and the output is
normalised instead of the weights (T * dv divisions, not T * S). A small problem (at most
2**19 scores, e.g. T=64-256 over 8 heads) is one block of every item and row: numpy's cost per
call, not its arithmetic, is then what a request pays, so it runs the fewest calls, every row
exponentiated unshifted and checked after (_small_block).

The blocks write disjoint parts of the outputs, so one computation can be shared between threads
(threads=, pool=; numpy releases the GIL in its matmuls and ufuncs): each thread takes the next
block from one queue and computes it exactly as one thread would, so the result is the same to
the bit. The caller decides when that pays (the web layer: a large request alone on the server).

The variants of PyTorch's SDPA (enable_gqa, a float bias) and of FlashAttention (window_size,
alibi_slopes) are computed per block too, with those references' semantics exactly: grouped query
heads share their key/value head through a broadcast matmul (no repeat), and no (..., T, S) mask
or bias is ever built.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import lru_cache

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")

# Score elements per block: 2**19 float32 scores are 2 MiB, one core's L2 cache here. Measured on
# the 2-core benchmark machine (bench/core_speed.py and its README section): at T=4096 (causal)
# larger blocks have more rows (2**18: 64, 2**19: 128, 2**20: 256), whose matmuls run nearer BLAS's
# peak: ~0.89x and ~0.84x 2**18's time; T=1024 and 2048 are within noise. 2**19 keeps a thread's
# scratch within schemas.jobs.SCRATCH_BYTES (4 MiB) in float32; 2**16 pays for Python per block.
BLOCK_ELEMENTS = 2**19
MIN_ROWS = 16  # fewer query rows per matmul than this and BLAS runs far below its peak
CAUSAL_BLOCKS = 16  # under a causal mask, at least this many row blocks: each skips the keys past its diagonal
# A problem of at most BLOCK_ELEMENTS // SMALL_SHARE scores is one block: all its items and rows in a
# few batched numpy calls (_small_block), the same whatever the threads. Below this size numpy's
# cost per call outweighs the keys a causal mask lets the blocks skip: 8 heads causal, float32, one
# block against 16-row blocks, ~0.6x the time at T=128 and ~0.6-0.9x at T=256 (2**19 scores; in
# float64 bytes count: 2**18 scores); was 8 (2**16 scores, T=64) before the one block ran unshifted.
# Not under a window's left edge: there the blocks keep its O(T * W) (and the admission's count).
SMALL_SHARE = 1
LOG2_E = 1 / math.log(2)  # exp(x) = exp2(x * LOG2_E)
# Scores within +-EXP_SAFE need no max subtracted: exp stays normal and finite, and a row of up to
# 2**20 keys sums below the dtype's maximum (float32: e**64 * 2**20 < 3.4e38 and e**-64 > 1.2e-38).
EXP_SAFE = {np.float16: 0.0, np.float32: 64.0, np.float64: 640.0}
COPY_KEYS = 64  # up to this many keys, a small problem's q kᵀ reads a scaled copy of kᵀ (NN): see _small_block
# A small problem's rows are exponentiated unshifted, then checked: a row whose sum of exp lies in
# [floor, finite) and whose output is finite keeps that result. Above the floor the terms that
# underflowed (each off by at most the dtype's smallest normal) move the sum of up to 2**20 keys
# by under 2**-20 of an ulp. float16 (no room at all) keeps the blocks' path.
SUM_FLOOR = {np.float32: np.finfo(np.float32).tiny * 2.0**40, np.float64: np.finfo(np.float64).tiny * 2.0**40}
# A row summing below this also has its exp(s) v checked (_faint): unshifted, those products lie
# below v by the sum's factor, so values of ~1e-25 underflowed before the division (out 0 where the
# textbook gives v). Above it, a product can underflow only where |v| is below ~1e-24 (float32;
# float64: ~1e-290), and then by under 2**-30 of v (its relative error: S * the smallest
# denormal / (sum * max |v|)). Not 1: a causal row 0 sums below 1 about half the time, and the
# check cost ~5-15% of a T=64 problem there; rows summing below 2**-20 (all scores under ~-14) are rare.
FAINT_SUM = 2.0**-20


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


def _check_finite(what: str, arr: np.ndarray | None) -> None:
    """Raise ResultOverflow unless every value of arr is finite (one pass, no copy kept)."""
    if arr is not None and arr.size and not np.isfinite(arr).all():
        raise ResultOverflow(what, arr.dtype)


@lru_cache(maxsize=8)
def _causal_mask(T: int, S: int, align: str) -> np.ndarray:
    offset = causal_offset(T, S, align)
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


def causal_offset(T: int, S: int, causal: bool | str) -> int | None:
    """Query t may see key s iff s <= t + offset; None when there is no causal mask.

    causal False | True ("top_left": offset 0) | "bottom_right" (offset S - T)."""
    if not causal:
        return None
    align = "top_left" if causal is True else causal
    if align not in ALIGNMENTS:
        raise ValueError(f"causal must be False, True or one of {ALIGNMENTS}, not {causal!r}")
    return 0 if align == "top_left" else S - T


def causal_share(T: int, S: int, causal: bool | str) -> float:
    """The share of the (T, S) scores a causal mask allows: 1 without one, ~1/2 for T = S."""
    offset = causal_offset(T, S, causal)
    if offset is None:
        return 1.0
    # Row t sees min(max(t + offset + 1, 0), S) keys; summed in closed form (no arrays: this runs
    # for every request, and numpy's clip over T rows cost ~20 us of a small one).
    return (_clamped_sum(offset + T, S) - _clamped_sum(offset, S)) / (T * S)


def _clamped_sum(n: int, S: int) -> int:
    """sum(min(x, S) for x in 1..n), 0 for n <= 0."""
    if n <= 0:
        return 0
    m = min(n, S)
    return m * (m + 1) // 2 + (n - m) * S


def _window(window) -> tuple[int, int]:
    """(left, right) as ints >= -1 (FlashAttention's window_size; -1 leaves that side open)."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), not {window!r}") from None
    if any(isinstance(n, bool) or int(n) != n or n < -1 for n in (left, right)):
        raise ValueError(f"window values must be integers >= -1, not {window!r}")
    return int(left), int(right)


def _bounds(T: int, S: int, causal: bool | str, window) -> tuple[int | None, int | None]:
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


def _groups(q_shape: tuple, k_shape: tuple, v_shape: tuple, enable_gqa: bool) -> int:
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


@lru_cache(maxsize=64)
def _band(rows: int, cols: int, shift: int, below: bool = False, key_major: bool = False) -> np.ndarray:
    """Boolean (rows, cols), True where column c lies past row r's diagonal: c > r + shift (or,
    below, before it: c < r + shift). The causal mask or window edge of one block's partly
    visible keys; a handful of shapes per request size. key_major: stored (cols, rows), the layout
    of key-major scores (np.copyto runs ~1.5x faster when the mask's layout is the scores')."""
    c, r = np.arange(cols)[None, :], np.arange(rows)[:, None] + shift
    band = c < r if below else c > r  # (rows, cols)
    if key_major:
        band = np.ascontiguousarray(band.T).T  # (rows, cols), a view of (cols, rows)
    band.flags.writeable = False
    return band


@lru_cache(maxsize=16)
def _keep(rows: int, cols: int, shift: int, dtype: np.dtype) -> np.ndarray:
    """(rows, cols) in dtype: 0 where column c lies past row r's diagonal (c > r + shift), +inf
    elsewhere. np.fmin(e, keep) sets the masked entries of exp'd scores to exactly 0, whatever
    they held (inf and NaN included), and keeps the others: one contiguous pass over whole rows,
    ~0.4-0.9x the time of np.copyto with the boolean band (T=64-256, float32 and float64). A whole
    small problem's (T, S), at most 2 MiB: fewer cached than the blocks' bands."""
    keep = np.where(np.arange(cols)[None, :] > np.arange(rows)[:, None] + shift, 0, np.inf).astype(dtype)
    keep.flags.writeable = False
    return keep


@lru_cache(maxsize=8)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    """(n,) ones, read-only: ones @ x, x (..., n, m), is x summed over axis -2, (..., m). Cached
    per request size (slice it for fewer)."""
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


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
    threads: int = 1,
    pool: Executor | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
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
    are exactly 0; a row with no allowed key has all-zero weights and output. Raises ScoreOverflow
    when a score leaves the dtype's range, ResultOverflow when out or weights would not be finite.
    threads > 1 computes the blocks on that many threads (pool's, plus the caller's; a pool of
    threads - 1 made for the call without one): the same blocks as one thread, so the same bits.
    """
    *lead, T, d = q.shape
    S, dv = k.shape[-2], v.shape[-1]
    B = math.prod(lead)
    g = _groups(q.shape, k.shape, v.shape, enable_gqa)
    if average_weights and q.ndim < 3:
        raise ValueError("average_weights needs q of rank >= 3 (the heads axis -3)")
    dtype = np.result_type(q, k, v, np.float16)  # float32 stays float32; integers become float64
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    upper, lower = _bounds(T, S, causal, window)

    qd = np.asarray(q, dtype).reshape(B // g, g, T, d)  # (Bkv, g, T, d), q itself where it is in dtype
    kt = np.swapaxes(np.asarray(k, dtype).reshape(B // g, 1, S, d), -1, -2)  # (Bkv, 1, d, S), a view
    masks = _Masks(lead, g, T, S, mask, key_lengths, upper, lower, bias, alibi_slopes, dtype)
    vd = np.ascontiguousarray(v, dtype).reshape(B // g, 1, S, dv)  # (Bkv, 1, S, dv): v itself where it is contiguous

    out = np.empty((B // g, g, T, dv), dtype)
    weights = np.empty((B // g, g, T, S), dtype) if return_weights else None
    tn, nb = _plan(
        B // g, T, S, upper, lower, g, 0 if return_weights else dv, dtype.itemsize
    )  # without weights a row also makes dv outputs
    if tn == T and nb == B // g and B * T and dtype.type in SUM_FLOOR:  # a small problem: one block, tried unshifted
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # what overflows is found per row
            _block(qd, kt, vd, out, weights, None, masks, None, None, None, dtype.type(scale), 0, B // g, 0, T)
        return _shaped(out, weights, lead, average_weights)
    blocks = [(b0, min(B // g, b0 + nb), t0, min(T, t0 + tn)) for b0 in range(0, B // g, nb) for t0 in range(0, T, tn)]
    one = len(blocks) == 1  # a small float16 problem: its scores are in the scratch, key-major, even with weights
    # A block row's scores (with weights and several blocks: in the weights instead) and, without weights, its sum.
    scratch_size = nb * g * tn * ((masks.widest(tn) if one or not return_weights else 0) + (0 if return_weights else 1))

    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected per block, not warned about
        # Each row's largest |v_s| over the keys it may see (the causal band, the window), bounded by
        # |v_s| (the 2-norm: max |v_s| <= |v_s| <= sqrt(dv) max |v_s|): what a row's choices below depend
        # on, so that values past its diagonal change none of its bits. A norm by einsum, as k's: a max
        # along v's short last axis ran ~15x slower (T=512: 1.25 ms). inf where v_s · v_s overflows.
        v3 = vd[:, 0]  # (Bkv, S, dv)
        v_key = np.sqrt(np.einsum("bsd,bsd->bs", v3, v3))  # (Bkv, S)
        v_reach = _reach(v_key, T, upper, lower)  # (Bkv, T)
        # One block (a small float16 problem): every row subtracts its maximum; bounding the scores would
        # cost more numpy calls than the two passes over the block it can save.
        bound = None if one else _small_scores(qd, kt, upper, lower, masks, v_reach / math.sqrt(max(dv, 1)), v_reach, scale)
        # Beyond this, S * max|v| may overflow: such a row's exp(s - max) must be normalised before the sum.
        big_v = (v_reach * S > np.finfo(dtype).max / 4)[:, None, :, None]  # (Bkv, 1, T, 1)
    # The blocks take exp2, the same softmax in base 2 (numpy's exp2 runs ~0.6x exp's time, float32
    # and float64 alike, as exact): a row whose scores are provably small carries log2(e) in its
    # scale; any other row keeps its scores, ScoreOverflow included, and scales s - max (<= 0) by
    # log2(e) in its block. Each row's choice is its own (the past keeps its bits whatever the
    # future holds). One block, a bias or ALiBi, or float16 (no row is ever bounded): exp, as the textbook.
    exp = np.exp if bound is None or masks.biased or not EXP_SAFE.get(dtype.type) else np.exp2
    # The scale is folded into each block's rows of q as the block starts (no (B, T, d) copy in the
    # setup, which runs before the threads share the blocks): a scalar, or (Bkv, g, T, 1) where
    # the rows differ.
    row_scale = dtype.type(scale)
    if exp is np.exp2 and bound.all():
        row_scale = dtype.type(scale * LOG2_E)
    elif exp is np.exp2 and bound.any():
        row_scale = np.where(bound, scale * LOG2_E, scale).astype(dtype)

    def compute(todo) -> None:  # the blocks todo yields, with this thread's own scratch
        scratch = np.empty(scratch_size, dtype) if scratch_size else None
        with np.errstate(over="ignore", invalid="ignore"):  # per thread: numpy's error state is not inherited
            for b0, b1, t0, t1 in todo:
                _block(qd, kt, vd, out, weights, scratch, masks, bound, big_v, exp, row_scale, b0, b1, t0, t1)
                # Checked while the block is in the cache: one pass over all the weights afterwards
                # took ~15% of T=1024's compute, on one thread however many computed the blocks.
                _check_finite("out", out[b0:b1, :, t0:t1])
                _check_finite("weights", None if weights is None else weights[b0:b1, :, t0:t1])

    _share(compute, blocks, threads, pool)
    return _shaped(out, weights, lead, average_weights)


def _shaped(out: np.ndarray, weights: np.ndarray | None, lead: list, average_weights: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """out (Bkv, g, T, dv) and weights (Bkv, g, T, S) as (..., T, dv) and (..., T, S), or the
    weights' mean over the heads axis -3 when average_weights."""
    out = out.reshape(*lead, *out.shape[-2:])
    if weights is None:
        return out, None
    weights = weights.reshape(*lead, *weights.shape[-2:])
    return out, (weights.mean(axis=-3) if average_weights else weights)


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
    lock, queue, errors = threading.Lock(), iter(blocks), []

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

    own = pool is None
    pool = ThreadPoolExecutor(threads - 1) if own else pool
    try:
        tasks = [pool.submit(task) for _ in range(threads - 1)]
        task()
        for t in tasks:
            if not t.cancel():  # one still queued behind another caller's work has nothing left to do
                t.result()
    finally:
        if own:
            pool.shutdown()
    if errors:
        raise errors[0]


def _plan(
    Bkv: int, T: int, S: int, upper: int | None, lower: int | None = None, g: int = 1, dv: int = 0, itemsize: int = 4
) -> tuple[int, int]:
    """(tn, nb): the query rows and key/value items (of g query heads each) of one block.

    The rows do not shrink with g: g matmuls of tn rows each run faster than 4x as many of tn / 4
    rows (measured at T=4096, g=4: 0.8x the time), even when the block then outgrows the cache.
    dv (the no-weights path only): a block's row also makes dv outputs and a sum, so where v is
    wider than k is long the rows are counted by dv + 1, and a block's outputs stay O(block) too
    (S=1, dv=2048: sized by S alone, one block was the whole (B, T, dv) output). A small problem
    is one block while its scores fit in BLOCK_ELEMENTS float32s' bytes (itemsize, the dtype's):
    float64 at T=256 over 8 heads (4 MiB, past the L2 cache) ran ~1.2x slower as one block than
    as 16-row blocks without weights."""
    row_out = dv + 1 if dv else 0  # a row's outputs and its sum
    if lower is None and Bkv * g * T * max(S, row_out) * max(itemsize, 4) <= 4 * BLOCK_ELEMENTS // SMALL_SHARE:
        return T, Bkv  # small: one block
    tn = BLOCK_ELEMENTS // max(S, row_out)
    if upper is not None or lower is not None:
        tn = min(tn, T // CAUSAL_BLOCKS)
    if upper is not None and lower is not None:
        tn = min(tn, (upper - lower + 1) // 4)  # a band: a block computes at most ~1.25x the keys its rows see
    tn = min(T, max(MIN_ROWS, tn))  # query rows per block
    width = S if upper is None or lower is None else min(S, max(1, tn + upper - lower))  # keys per block, at most
    nb = min(Bkv, max(1, BLOCK_ELEMENTS // (tn * g * max(width, row_out))))  # key/value items per block
    return tn, nb


def block_count(
    B: int, T: int, S: int, causal: bool | str = False, *, window: tuple[int, int] | None = None, groups: int = 1, itemsize: int = 4
) -> int:
    """How many blocks attention() computes for B batch items (the product of the leading axes),
    groups query heads per key/value head: each costs a few numpy calls beyond its arithmetic,
    which the cost model counts. (Counted for the weights path: without weights and with v wider
    than S, the core runs more, smaller blocks; the cost model was fitted with this count.)
    itemsize: the compute dtype's (float64: 8), which bounds a small problem's one block."""
    upper, lower = _bounds(T, S, causal, window)
    tn, nb = _plan(B // groups, T, S, upper, lower, groups, itemsize=itemsize)
    return math.ceil(B // groups / nb) * math.ceil(T / tn)


def score_count(B: int, T: int, S: int, causal: bool | str = False, *, window: tuple[int, int] | None = None, itemsize: int = 4) -> int:
    """How many scores attention() computes (and exponentiates) for B batch items: B * T * S
    without a mask, about half under a causal mask, about B * T * min(S, left + right + 1) under
    a window (plus the block edges). The work the cost model can count. itemsize as in block_count."""
    upper, lower = _bounds(T, S, causal, window)
    tn, _ = _plan(B, T, S, upper, lower, itemsize=itemsize)
    total = 0
    for t0 in range(0, T, tn):
        t1 = min(T, t0 + tn)
        lo, hi = _key_range(t0, t1, S, upper, lower)
        total += (t1 - t0) * (hi - lo)
    return B * total


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
        seen_max = np.maximum.accumulate(x, axis=-1)  # (Bkv, S): max x over s' <= s
        return seen_max[:, np.clip(t + upper, 0, S - 1)]  # over the keys up to the last row t may see
    if upper is None:
        seen_max = np.maximum.accumulate(x[:, ::-1], axis=-1)[:, ::-1]  # max x over s' >= s
        return seen_max[:, np.clip(t + lower, 0, S - 1)]
    return _range_max(x, t + lower, upper - lower + 1)  # over row t's window


def _small_scores(
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
    exp(-limit) max|v| must stay above the dtype's smallest normal times 2**40 (as SUM_FLOOR), or
    the products exp(s) v underflow before the division (values of 1e-25 under scores of -50:
    out 0). v_least <= max |v| <= v_most, (Bkv, T), over the keys row t may see (None: 1).
    q (Bkv, g, T, d) unscaled: |q_t · scale| is |q_t| |scale|."""
    Bkv, g, T, d = q.shape
    if masks is not None and masks.biased:
        return np.zeros((Bkv, g, T, 1), bool)
    S = kt.shape[-1]
    info = np.finfo(q.dtype)
    most = np.ones((Bkv, T)) if v_most is None else v_most.astype(np.float64)  # (Bkv, T)
    least = np.ones((Bkv, T)) if v_least is None else v_least.astype(np.float64)
    room = math.log(float(info.max)) - 1.0 - np.log(max(S, 1) * np.maximum(most, 1.0))
    floor = math.log(float(info.tiny) * 2.0**40)
    room_below = np.log(np.maximum(least, np.finfo(np.float64).tiny)) - floor  # v of 0: ~-700, never small
    limit = np.minimum(EXP_SAFE.get(q.dtype.type, 0.0), np.minimum(room, room_below))[:, None]  # (Bkv, 1, T); negative: never small
    q3 = q.reshape(Bkv * g, T, d)
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
            if start < hi and fill == 0 and scores.dtype.kind == "f" and not key_major:  # exp'd scores (the small path)
                np.fmin(scores, _keep(rows, hi - lo, t0 + self.upper - lo, scores.dtype), out=scores)  # whole rows: one contiguous pass
            elif start < hi:
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
        return allowed.any(axis=-1, keepdims=True)


def _block(q, kt, v, out, weights, scratch, masks: _Masks, bound, big_v, exp, row_scale, b0, b1, t0, t1) -> None:
    """Attention for key/value items b0:b1 (all their g query heads) and query rows t0:t1,
    written into out (and weights). q (Bkv, g, T, d) unscaled, kt (Bkv, 1, d, S), v (Bkv, 1, S, dv);
    big_v (Bkv, 1, T, 1) True where S * max |v| may overflow (then that row's exp(s) is normalised before the matmul);
    exp np.exp, or np.exp2 where row_scale (a scalar or (Bkv, g, T, 1)) carries log2(e); or None
    for a small problem's one block (all items and rows; row_scale the scale): _small_block. Every
    block, that one too, is one call of this function (the cost model counts them: block_count)."""
    if exp is None:  # a small problem's one block: attention() passes the scale as row_scale
        _small_block(q, kt, v, out, weights, masks, row_scale)
        return
    S = kt.shape[-1]
    lo, hi = masks.keys(t0, t1, S)
    o = out[b0:b1, :, t0:t1]  # (nb, g, tn, dv), a view
    if hi == lo:  # no row of this block may see any key
        o[...] = 0
        if weights is not None:
            weights[b0:b1, :, t0:t1] = 0
        return
    nb, g, tn = b1 - b0, q.shape[1], t1 - t0
    qs = q[b0:b1, :, t0:t1] * (row_scale if np.ndim(row_scale) == 0 else row_scale[b0:b1, :, t0:t1])  # (nb, g, tn, d) scaled
    if weights is not None:
        weights[b0:b1, :, t0:t1, :lo] = 0
        weights[b0:b1, :, t0:t1, hi:] = 0
    if bound is None or weights is None:  # the scores in the scratch are stored key-major, (nb, g, keys, tn)
        # One block (float16; float32 and 64 take _small_block): numpy's max (and sum) along a short axis runs ~3x slower than
        # across rows (T=64: ~60 us of the block's ~250); stored transposed, the max of a row is a
        # reduction across rows. Large blocks: OpenBLAS computes k qᵀ, (keys, tn), ~0.85x the time
        # of q kᵀ (tn, keys), and reads the transposed operands in place (bench/README.md).
        st = scratch[: nb * g * tn * (hi - lo)].reshape(nb, g, hi - lo, tn)
        np.matmul(np.swapaxes(kt[b0:b1, :, :, lo:hi], -1, -2), np.swapaxes(qs, -1, -2), out=st)
        s = np.swapaxes(st, -1, -2)  # (nb, g, tn, keys) scaled scores, a view
    else:
        s = weights[b0:b1, :, t0:t1, lo:hi]  # (nb, g, tn, keys): the weights' own memory is the buffer
        np.matmul(qs, kt[b0:b1, :, :, lo:hi], out=s)  # (nb, g, tn, keys) scaled scores; g shares k
    masks.add(s, b0, b1, t0, t1, lo, hi)  # bias and ALiBi, if any
    masks.apply(s, b0, b1, t0, t1, lo, hi)
    shift = _shift(s, None if bound is None else bound[b0:b1, :, t0:t1], masks, b0, b1, t0, t1)
    if shift is not None:
        np.subtract(s, shift, out=s)
        if exp is np.exp2:  # the shifted rows to base 2; a bounded row is already (times 1, exact)
            np.multiply(s, np.where(bound[b0:b1, :, t0:t1], 1, LOG2_E).astype(s.dtype), out=s)
    exp(s, out=s)  # exp(-inf) = exp2(-inf) = 0 exactly: masked weights are 0
    if weights is not None:  # normalise first: sum_s w_s v_s <= max |v| stays finite
        total = s.sum(axis=-1, keepdims=True)  # (nb, g, tn, 1), pairwise: rows sum to 1 within an ulp or two
        total[total == 0] = 1  # a row with no allowed key: its weights and output stay exactly 0
        w = s if weights is None else weights[b0:b1, :, t0:t1, lo:hi]  # the same memory but for one block
        np.divide(s, total, out=w)
        np.matmul(w, v[b0:b1, :, lo:hi], out=o)
    else:  # exp(s) v into out, then each row divided by its sum
        # A column of ones beside v gave the sums in the same matmul, but BLAS runs dv + 1 = 65
        # columns ~10-15% slower than 64: the sums as 1 @ exp(sᵀ) (a GEMV) cost less, and v needs no copy.
        total = scratch[-nb * g * tn :].reshape(nb, g, tn)
        np.matmul(_ones(S, s.dtype)[: hi - lo], st, out=total)  # (nb, g, tn) row sums of the key-major scores
        total = total[..., None]  # (nb, g, tn, 1)
        total[total == 0] = 1
        big = big_v[b0:b1, :, t0:t1]  # (nb, 1, tn, 1): rows whose S * max |v| may overflow
        if big.any():  # those rows normalised first (sum_s w_s v_s <= max |v| stays finite), each row its own way
            np.divide(s, np.where(big, total, 1), out=s)
            np.matmul(s, v[b0:b1, :, lo:hi], out=o)
            np.divide(o, np.where(big, 1, total), out=o)
            return
        np.matmul(s, v[b0:b1, :, lo:hi], out=o)  # (nb, g, tn, dv)
        np.divide(o, total, out=o)


def _small_block(q, kt, v, out, weights, masks: _Masks, scale) -> None:
    """A small problem's one block: every item and row of q (Bkv, g, T, d), kt (Bkv, 1, d, S),
    v (Bkv, 1, S, dv) into out (Bkv, g, T, dv) and weights (Bkv, g, T, S) or None, in the fewest
    numpy calls (the caller's errstate ignores over, invalid and divide).

    Every row is first exponentiated unshifted (numpy's cost per call, not arithmetic, is what a
    small problem pays; the max and its subtraction were two of its passes): scores row-major,
    q kᵀ (k qᵀ key-major made p v a TN product, ~2x slower at 64x64), over a scaled copy of kᵀ up to
    COPY_KEYS keys (OpenBLAS's NN product, ~0.8x the NT one at 64 keys, more than pays for the copy;
    from 128 keys on, not), else over q's scaled copy; base 2 with log2(e) folded into q's scale (exp2 runs ~0.6x exp's time; a bias or ALiBi keeps
    base e); the mask applied after exp as exact zeros (exp of -inf runs ~3-5x slower than of a
    finite score); the row sums by a GEMV. A row keeps that result when its sum lies in
    [SUM_FLOOR, finite), its output is finite and, where the sum is below FAINT_SUM, its exp(s) v
    (out times the sum) is above SUM_FLOOR at its largest: then no term overflowed and the terms (and
    products exp(s) v) that underflowed cannot matter. Any other row (scores too large or too small, values that
    overflow, no key at all) is computed again as the textbook does, in _small_shifted; the
    choice depends on the row's own inputs only, so a row keeps its bits whatever the others hold."""
    Bkv, g, T, _ = q.shape
    lo, hi = masks.keys(0, T, kt.shape[-1])  # lo is 0: a small problem has no window left edge
    if weights is not None:
        weights[..., :lo] = 0
        weights[..., hi:] = 0
    if hi == lo:  # no row may see any key
        out[...] = 0
        return
    dtype = q.dtype
    c = scale if masks.biased else dtype.type(scale * LOG2_E)
    s = np.empty((Bkv, g, T, hi - lo), dtype) if weights is None else weights[..., lo:hi]
    overflows = None  # (Bkv, g, T, 1): rows whose q · scale overflows, where the textbook (scaling q first) raises
    if hi - lo <= min(T, COPY_KEYS):  # k's scaled copy, no larger than q's, and an NN product
        np.matmul(q, np.multiply(kt[..., lo:hi], c, out=np.empty(kt[..., lo:hi].shape, dtype)), out=s)
        if abs(scale) > 1:  # (never with scale <= 1)
            overflows = ~np.isfinite(q * scale).all(axis=-1, keepdims=True)
    else:
        np.matmul(q * c, kt[..., lo:hi], out=s)  # (Bkv, g, T, keys) scaled scores; g shares k
    masks.add(s, 0, Bkv, 0, T, lo, hi)  # bias and ALiBi, if any
    (np.exp if masks.biased else np.exp2)(s, out=s)
    masks.apply(s, 0, Bkv, 0, T, lo, hi, fill=0)  # masked weights exactly 0, whatever their score was
    total = np.matmul(s, _ones(hi - lo, dtype))[..., None]  # (Bkv, g, T, 1) row sums
    # exp(s) v before the division, also with weights: a row whose sum of exp(s) |v| would overflow
    # (values near the dtype's limit) is then found here and takes the textbook path below
    np.matmul(s, v[..., lo:hi, :], out=out)
    np.divide(out, total, out=out)
    if weights is not None:
        np.divide(s, total, out=s)
    floor = SUM_FLOOR[dtype.type]
    least = total.min()  # NaN where some row's is: NaN fails every test
    # Below FAINT_SUM, exp(s) v lies far below v: products of tiny values (1e-25) may have underflowed
    faint = _faint(out, total, floor) if least < FAINT_SUM else None  # (Bkv, g, T, 1) or None
    if least >= floor and total.max() < np.inf and np.isfinite(out).all() and faint is None and (overflows is None or not overflows.any()):
        return
    bad = ~((total >= floor) & (total < np.inf) & np.isfinite(out).all(axis=-1, keepdims=True))  # (Bkv, g, T, 1)
    for more in (faint, overflows):  # the textbook's pass raises ScoreOverflow for a row of overflows that sees a key
        if more is not None:
            bad |= more
    _small_shifted(q, kt, v, out, weights, masks, scale, bad, None if weights is not None else s, lo, hi)


def _faint(out: np.ndarray, total: np.ndarray, floor) -> np.ndarray | None:
    """Boolean (Bkv, g, T, 1), or None for none: the rows summing below FAINT_SUM whose exp(s) v,
    out (Bkv, g, T, dv) times total (Bkv, g, T, 1), is below floor at its largest: there its
    products may have underflowed (all to 0 at worst). Reads those rows only (a few, often none):
    a pass over all of out along its short axis cost ~40% of a T=64 problem. The row's own result
    alone decides."""
    low = np.flatnonzero(total < FAINT_SUM)  # flat rows
    rows = out.reshape(total.size, out.shape[-1])[low]  # (len(low), dv), a copy of those rows (dv may be 0)
    faint = low[np.abs(rows).max(axis=-1, initial=0) * total.reshape(-1)[low] < floor]
    if not faint.size:
        return None
    marked = np.zeros(total.shape, bool)
    marked.reshape(-1)[faint] = True
    return marked


def _small_shifted(q, kt, v, out, weights, masks: _Masks, scale, bad, scratch, lo, hi) -> None:
    """The rows of a small problem that bad (Bkv, g, T, 1) marks, computed again as the textbook
    softmax (scale, mask, subtract the row maximum, exp, normalise, then p v) and written over
    their first result; scratch (or None) is a buffer to reuse. Raises ScoreOverflow and
    ResultOverflow as the blocks do."""
    Bkv, g, T, _ = q.shape
    s = np.empty((Bkv, g, T, hi - lo), q.dtype) if scratch is None else scratch
    np.matmul(q * scale, kt[..., lo:hi], out=s)
    masks.add(s, 0, Bkv, 0, T, lo, hi)
    masks.apply(s, 0, Bkv, 0, T, lo, hi)
    row_max = s.max(axis=-1, keepdims=True)  # (Bkv, g, T, 1); -inf where a row sees no key
    if not np.isfinite(row_max).all():
        _check_overflow(row_max, masks.has_key(0, Bkv, 0, T))
        row_max[np.isneginf(row_max)] = 0
    np.subtract(s, row_max, out=s)
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0] = 1  # a row with no allowed key: its weights and output stay exactly 0
    np.divide(s, total, out=s)  # normalised first: sum_s w_s v_s <= max |v| stays finite
    np.copyto(out, np.matmul(s, v[..., lo:hi, :]), where=bad)
    if weights is not None:
        np.copyto(weights[..., lo:hi], s, where=bad)
    _check_finite("out", out)
    _check_finite("weights", weights)


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
) -> tuple[np.ndarray, np.ndarray | None]:
    """Multi-head self-attention: the GPT block's, and grouped-query (Llama's layout).

    x (..., n, d); wq (d, h * dk), wk (d, hkv * dk), wv (d, hkv * dv) with hkv = kv_heads (default
    heads, dividing it); wo (h * dv, d_out) or None. Returns out (..., n, d_out), or the heads
    concatenated (..., n, h * dv) without wo, and weights (..., h, n, n) (None unless
    return_weights); scores are scaled by scale, default 1/sqrt(dk). window, threads and pool as
    in attention() (the projections run on the caller's thread).
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
    )
    out = np.swapaxes(out, -2, -3).reshape(*x.shape[:-1], heads * dv)  # (..., h, n, dv) -> (..., n, h * dv)
    if wo is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            out = out @ wo
        _check_finite("out", out)  # the output projection can overflow where attention did not
    return out, weights
