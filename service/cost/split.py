"""The split policy: whether one computation is split across threads.

A worker computes with one BLAS thread (deploy/gunicorn.conf.py): under load, requests x 1 thread
fill the cores, and splitting one request would only take a core from another. A request alone
on an idle server leaves the other cores idle, so a large one is computed on several threads (the
numeric core's blocks shared between threads; the same blocks, so the same bits). Small requests
are not split: below MIN_FLOPS the split costs more than it saves.
"""

from __future__ import annotations

from .features import Work

# The least work worth splitting, in flops as the cost model counts them (Work.flops: the scores
# the core computes), chosen by timing one thread against two over T = 64 .. 1024
# (git log -- bench/one_request.py):
# idle, a split gains well below it; while other work holds the cores, a split below it can lose
# several times over (the caller waits for a pool thread that the OS preempted mid-block), so it
# gives up a little of the idle gain to stay safe there.
MIN_FLOPS = 500_000_000


def threads_for(work: Work, computing: int, max_threads: int, min_flops: int | None = None) -> int:
    """How many threads to compute work on: max_threads (at most its blocks) when it is the only
    request computing (computing counts it too, so 1) and has at least min_flops (MIN_FLOPS as it
    is when called); else 1."""
    if max_threads <= 1 or computing > 1 or work.flops < (MIN_FLOPS if min_flops is None else min_flops):
        return 1
    return max(1, min(max_threads, work.blocks))
