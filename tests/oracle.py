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
            for s, e in zip(keys, exps):
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
