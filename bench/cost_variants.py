"""The cost model against the request kinds its features may not express (~1 min).

For each kind (a bias, ALiBi, a mask, key_lengths, a window, GQA, one key, one query, d=1, T/8
items of 8 rows, averaged weights, float64, /mha) at B=1, H=8, d=64, T in (256, 1024), with and
without weights: the computing thread's CPU time (median, one BLAS thread, as in a worker) over
the calibrated model's prediction. A ratio far from the plain requests' says the features miss
that kind's cost; fed to the fit, such requests move the coefficients that plain requests are
predicted with.

    python -m bench.cost_variants

The second table, how far a stream of one kind moves plain requests' predictions, is what the fit
learns from; to see the model before a change, copy this file into a checkout of it and run it
there (bench/README.md).
"""

from __future__ import annotations

import argparse
import base64
import copy
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from schemas import AttentionRequest, MhaRequest
from service.config import Settings
from service.cost import CostModel, median_ms, work_of


def b64(arr, dtype: str = "float32") -> dict:
    arr = np.ascontiguousarray(arr, dtype=dtype)
    return {"shape": list(arr.shape), "dtype": dtype, "b64": base64.b64encode(arr.tobytes()).decode()}


def kinds(rng, T: int, weights: bool) -> dict[str, tuple[type, dict]]:
    """name -> (schema, request document) at B=1, H=8, d=64."""
    H, d = 8, 64
    q, k, v = (rng.standard_normal((1, H, T, d)) for _ in range(3))
    base = {"q": b64(q), "k": b64(k), "v": b64(v), "return_weights": weights}
    kv2 = {"k": b64(k[:, :2]), "v": b64(v[:, :2]), "enable_gqa": True}
    x = rng.standard_normal((T, 512))
    w = {f"w{n}": b64(rng.standard_normal((512, 512)) / 20) for n in "qkvo"}
    return {
        "plain": (AttentionRequest, base),
        "causal": (AttentionRequest, {**base, "causal": True}),
        "float64": (AttentionRequest, {**base, "dtype": "float64"}),
        "bias": (AttentionRequest, {**base, "bias": b64(rng.standard_normal((1, H, T, T)))}),
        "bias (T, S)": (AttentionRequest, {**base, "bias": b64(rng.standard_normal((T, T)))}),
        "alibi": (AttentionRequest, {**base, "alibi_slopes": b64(2.0 ** -np.arange(1, H + 1))}),
        "causal alibi": (AttentionRequest, {**base, "causal": True, "alibi_slopes": b64(2.0 ** -np.arange(1, H + 1))}),
        "mask": (AttentionRequest, {**base, "mask": b64(rng.random((1, H, T, T)) < 0.9, "bool")}),
        "mask (T, S)": (AttentionRequest, {**base, "mask": b64(rng.random((T, T)) < 0.9, "bool")}),
        "key_lengths=1": (AttentionRequest, {**base, "key_lengths": [1] * H}),
        "key_lengths=S/2": (AttentionRequest, {**base, "key_lengths": [T // 2] * H}),
        "window (64, 0)": (AttentionRequest, {**base, "window": [64, 0]}),
        "gqa 8/2": (AttentionRequest, {**base, **kv2}),
        "one key (S=1)": (AttentionRequest, {**base, "k": b64(k[:, :, :1]), "v": b64(v[:, :, :1])}),
        "one query (T=1)": (AttentionRequest, {**base, "q": b64(q[:, :, :1])}),
        "d=1": (AttentionRequest, {**base, **{name: b64(a[..., :1]) for name, a in zip("qkv", (q, k, v), strict=True)}}),
        "T/8 items of T=8": (
            AttentionRequest,
            {**base, **{name: b64(a.reshape(T // 8, H, 8, d)) for name, a in zip("qkv", (q, k, v), strict=True)}},
        ),
        "averaged weights": (AttentionRequest, {**base, "average_weights": True}) if weights else None,
        "mha (T, 512), 8 heads": (MhaRequest, {"x": b64(x), **w, "heads": 8, "return_weights": weights}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    settings = Settings()
    schemas = {cls: cls(settings) for cls in (AttentionRequest, MhaRequest)}
    rng = np.random.default_rng(0)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with threadpool_limits(limits=1, user_api="blas"):
        model = CostModel()
        model.calibrate(1.5)
        print(f"calibrated: a={model.a:.3f} b={model.b:.3f} c={model.c:.4f} e={model.e:.3f}\n")
        print("| T | weights | kind | predicted ms | CPU ms | CPU / predicted | / plain's |")
        print("|---|---|---|---|---|---|---|")
        for T in args.t:
            for weights in (True, False):
                plain_ratio = None
                for name, kind in kinds(rng, T, weights).items():
                    if kind is None:
                        continue
                    cls, doc = kind
                    job = schemas[cls].load(doc)
                    job.compute()
                    ms = median_ms(job.compute, min_runs=5, min_ms=150, clock=time.thread_time)
                    predicted = model.predict(work_of(job))
                    ratio = ms / predicted
                    plain_ratio = plain_ratio or ratio
                    print(
                        f"| {T} | {'yes' if weights else 'no'} | {name} | {predicted:.2f} | {ms:.2f} | {ratio:.2f} | {ratio / plain_ratio:.2f} |"
                    )
        print(stream(model, schemas, rng))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


PLAIN = [(T, weights) for T in (64, 256, 1024) for weights in (True, False)]
STREAMS = (
    "plain",
    "causal",
    "alibi",
    "bias",
    "mask",
    "key_lengths=1",
    "window (64, 0)",
    "gqa 8/2",
    "one key (S=1)",
    "one query (T=1)",
    "d=1",
    "T/8 items of T=8",
    "mha (T, 512), 8 heads",
)


def stream(model: CostModel, schemas: dict, rng, counts=(12, 100)) -> str:
    """A client's stream of one kind (T=256, one key T=1024; with weights and without,
    alternating), each observed at its measured CPU time as run() does: how far it moves the prediction of plain
    requests (T=64..1024, with and without weights), as the least and largest ratio after /
    before. A stream of plain requests is the control: calibration is not exact, so honest
    traffic moves predictions too (towards the truth)."""
    plain = [work_of(schemas[AttentionRequest].load(kinds(rng, T, w)["plain"][1])) for T, w in PLAIN]
    saved = copy.deepcopy(model._fits)
    before = [model.predict(w) for w in plain]
    lines = ["", "| stream of | requests | plain predicted after / before: min | max |", "|---|---|---|---|"]
    for name in STREAMS:
        works = []
        for weights in (True, False):
            cls, doc = kinds(rng, 1024 if name == "one key (S=1)" else 256, weights)[name]
            job = schemas[cls].load(doc)
            job.compute()
            works.append((work_of(job), median_ms(job.compute, min_runs=5, min_ms=100, clock=time.thread_time)))
        for n in counts:
            model._fits = copy.deepcopy(saved)
            for i in range(n):
                model.observe(*works[i % 2])
            ratios = [model.predict(w) / b for w, b in zip(plain, before, strict=True)]
            lines.append(f"| {name} | {n} | {min(ratios):.2f} | {max(ratios):.2f} |")
    model._fits = saved
    return "\n".join(lines)


if __name__ == "__main__":
    main()
