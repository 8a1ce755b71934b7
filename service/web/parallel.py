"""One request on several cores, the web side: the server's count of requests computing (the
shared census, through the gate) and this worker's pool. The policy, whether a computation is
split and on how many threads, is the cost package's (service.cost.split)."""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor

from service.config import Settings
from service.cost import Work, threads_for

from . import metrics
from .context import services


def computing() -> int:
    """Requests being computed now, this one included: the server's admitted requests, in every
    worker (past the gate and not yet answered; those waiting for a slot or still being validated
    count too, as they are about to compute). Two requests on two workers see each other, so
    neither splits: the cores are already both in use."""
    return services().gate.server_admitted()


def planned(work: Work, computing: int) -> int:
    """The threads a job is to be computed on while computing requests (computing(), itself
    included) are in the server, by the split policy: admission predicts its time by it, and
    threads() computes it so."""
    return threads_for(work, computing, services().settings.split_threads)


def threads(work: Work) -> int:
    """The threads for this request's computation, by the split policy; counted when split."""
    n = planned(work, computing())
    if n > 1:
        metrics.SPLITS.inc()
    return n


def make_pool(settings: Settings) -> Executor | None:
    """A worker's pool of ATTN_SPLIT_THREADS - 1 threads (None when splitting is off). Its threads
    start at the first split, so in the worker after the fork."""
    n = settings.split_threads
    return ThreadPoolExecutor(n - 1, thread_name_prefix="attention-split") if n > 1 else None
