"""One request on several cores: whether a computation is split across threads, and the pool it
is split on.

A worker computes with one BLAS thread (deploy/gunicorn.conf.py): under load, requests x 1 thread
fill the cores, and splitting one request would only take a core from another. A request alone
on an idle server leaves the other cores idle, so a large one is computed on ATTN_SPLIT_THREADS
threads: the numeric core's blocks shared between the request's thread and this worker's pool
(service.core.attention's threads; the same blocks, so the same bits). Small requests are not
split: below MIN_FLOPS the split costs more than it saves.
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor

from flask import Flask, current_app

from schemas import Work

from . import metrics

# The least work worth splitting, in flops as the cost model counts them (Work.flops: the scores
# the core computes): 5e8 is T=512 with weights (537 MFLOP, ~8 ms on one thread here) or T~700
# without, B=1 H=8 d=64 causal float32. Measured with `python -m bench.one_request --only
# threshold` (bench/README.md) on the 2-core machine: idle, the split gains from ~7e7 (T=256:
# 1.2x; T=512: 1.5x; T=1024: 1.6-2x); while other work held the cores it ranged 0.8-1.4x above
# 5e8 and lost up to 5-8x below it (T=128-256: 1-3 ms became 3-17 ms: the caller waits for a
# pool thread that the OS preempted mid-block). 5e8 gives up ~0.5 ms at T=256 to stay safe there.
MIN_FLOPS = 500_000_000


def threads_for(work: Work, computing: int, max_threads: int, min_flops: int = MIN_FLOPS) -> int:
    """How many threads to compute work on: max_threads (at most its blocks) when it is the only
    request computing (computing counts it too, so 1) and has at least min_flops; else 1."""
    if max_threads <= 1 or computing > 1 or work.flops < min_flops:
        return 1
    return max(1, min(max_threads, work.blocks))


def computing() -> int:
    """Requests being computed now, this one included: the server's admitted requests, in every
    worker (past the gate and not yet answered; those waiting for a slot or still being validated
    count too, as they are about to compute). Two requests on two workers see each other, so
    neither splits: the cores are already both in use."""
    return current_app.extensions["attention.gate"].server_admitted()


def planned(work: Work, computing: int) -> int:
    """The threads a job is to be computed on while computing requests (computing(), itself
    included) are in the server, by the policy above: admission predicts its time by it, and
    threads() computes it so."""
    return threads_for(work, computing, current_app.extensions["attention.settings"].split_threads, MIN_FLOPS)


def threads(work: Work) -> int:
    """The threads for this request's computation, by the policy above; counted when split."""
    n = planned(work, computing())
    if n > 1:
        metrics.SPLITS.inc()
    return n


def pool() -> Executor | None:
    """This worker's pool of ATTN_SPLIT_THREADS - 1 threads (None when splitting is off)."""
    return current_app.extensions["attention.pool"]


def install(app: Flask) -> None:
    """Give the app its pool. Its threads start at the first split, so in the worker after the fork."""
    n = app.extensions["attention.settings"].split_threads
    app.extensions["attention.pool"] = ThreadPoolExecutor(n - 1, thread_name_prefix="attention-split") if n > 1 else None
