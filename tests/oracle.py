"""The slow, obvious attention: Python loops over every leading index and query row, float64.
The numeric core is tested against it."""

from __future__ import annotations

import itertools
import math

import numpy as np


def allowed(T: int, S: int, t: int, s: int, causal) -> bool:
    if causal in (True, "top_left"):
        return s <= t
    if causal == "bottom_right":
        return s <= t + S - T
    return True


def attention(q, k, v, mask=None, *, causal=False, key_lengths=None, scale=None):
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *lead, T, d = q.shape
    S, dv = k.shape[-2], v.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    full_mask = np.ones((*lead, T, S), bool) if mask is None else np.broadcast_to(mask, (*lead, T, S))
    lengths = None if key_lengths is None else np.broadcast_to(key_lengths, tuple(lead))
    out = np.zeros((*lead, T, dv))
    weights = np.zeros((*lead, T, S))
    for idx in itertools.product(*(range(n) for n in lead)):
        for t in range(T):
            keys = [
                s for s in range(S) if full_mask[idx + (t, s)] and allowed(T, S, t, s, causal) and (lengths is None or s < lengths[idx])
            ]
            if not keys:
                continue
            scores = [scale * sum(q[idx + (t, i)] * k[idx + (s, i)] for i in range(d)) for s in keys]
            top = max(scores)
            exps = [math.exp(x - top) for x in scores]
            total = sum(exps)
            for s, e in zip(keys, exps, strict=True):
                weights[idx + (t, s)] = e / total
            out[idx + (t,)] = weights[idx + (t,)] @ v[idx]
    return out, weights


def mha(x, wq, wk, wv, wo, heads, causal=True):
    x = np.asarray(x, dtype=np.float64)
    *lead, n, d = x.shape
    hd = d // heads
    q, k, v = x @ wq, x @ wk, x @ wv
    heads_out = np.zeros((*lead, n, d))
    weights = np.zeros((*lead, heads, n, n))
    for h in range(heads):
        cols = slice(h * hd, (h + 1) * hd)
        o, w = attention(q[..., cols], k[..., cols], v[..., cols], causal=causal)
        heads_out[..., cols] = o
        weights[..., h, :, :] = w
    return heads_out @ wo, weights


def reference(
    q,
    k,
    v,
    mask=None,
    *,
    causal=False,
    window=None,
    bias=None,
    alibi_slopes=None,
    enable_gqa=False,
    scale=None,
    key_lengths=None,
    return_lse=False,
):
    """The published formulas with every (..., T, S) array materialised, in float64.

    PyTorch's SDPA: enable_gqa repeats each key/value head H / Hkv times on axis -3 (query head h
    reads h // (H / Hkv)); a float bias is added to the scaled scores. FlashAttention's
    window_size (left, right): query t sees keys t + S - T - left <= s <= t + S - T + right, -1
    unbounded; alibi_slopes adds -slope * |t + S - T - s| to the scaled scores. All ANDed (masks)
    or added (biases); a row that sees no key gets zero weights and output. return_lse: also
    lse (..., T) = log sum_s exp(score) over the allowed keys (FlashAttention's softmax_lse), -inf
    for a row that sees no key."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    *lead, T, d = q.shape
    S = k.shape[-2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]  # (T, 1), (1, S)
    scores = scale * (q @ np.swapaxes(k, -1, -2))  # (..., T, S)
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), tuple(lead))[..., None, None]
        scores = scores - slopes * np.abs(t + S - T - s)
    allowed = np.ones((*lead, T, S), bool)
    if mask is not None:
        allowed &= mask
    if key_lengths is not None:
        allowed &= s < np.broadcast_to(key_lengths, tuple(lead))[..., None, None]
    if causal in (True, "top_left"):
        allowed &= s <= t
    elif causal == "bottom_right":
        allowed &= s <= t + S - T
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= s >= t + S - T - left
        if right >= 0:
            allowed &= s <= t + S - T + right
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    top[~np.isfinite(top)] = 0
    e = np.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    if return_lse:
        with np.errstate(divide="ignore"):
            return weights @ v, weights, np.where(total > 0, top + np.log(total), -np.inf)[..., 0]
    return weights @ v, weights
