"""The one computation behind both front doors (the native API, api.py, and the Open Inference
Protocol, kserve.py): a body validated into a job and admitted, the job computed and measured,
and the cost summary of its answer. The doors differ only in their envelopes."""

from __future__ import annotations

import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from schemas import AttentionJob, AttentionRequest, MhaJob, MhaRequest, SessionBatchJob, SessionStepJob
from service import core
from service.config import Settings
from service.cost import work_of

from . import metrics
from .context import context, services
from .http import phase, record

Job = AttentionJob | MhaJob
AnyJob = Job | SessionStepJob | SessionBatchJob  # a session's step too (sessions.py)


def validate(schema: AttentionRequest | MhaRequest, doc: dict) -> Job:
    """The decoded body validated into a job (the validate phase; 422 on anything invalid), then
    admitted (admit())."""
    job = validate_only(schema, doc)
    admit(job)
    return job


def validate_only(schema, doc: dict) -> Any:
    """The decoded body loaded by schema (the validate phase; 422 on anything invalid)."""
    with phase("validate"):
        return schema.load(doc)


def admit(job: AnyJob) -> None:
    """The job admitted by the request's ticket (service.admission.Ticket.admit: 504 if it cannot
    meet its deadline, 503 if it does not fit), after waiting for a compute slot (the queue phase,
    if it waited)."""
    ctx = context()
    ctx.job = job
    if (ticket := ctx.ticket) is not None:
        try:
            ticket.admit(work_of(job), job.working_bytes())
        finally:
            if ticket.waited_ms:
                record("queue", time.perf_counter() - ticket.waited_ms / 1000, ticket.waited_ms)


def run(job: AnyJob) -> core.Result:
    """Admit a job that is not yet (a session's step: admitted once its session is locked and its
    keys known), then compute it, timed as the compute phase, on the threads its ticket was given
    (more than one only for a large job alone on the server), stopped between the core's blocks
    once its deadline passes (504); the measured time (with the thread's CPU time, the requests
    busy in the server when it was admitted, and the threads it took) teaches the cost model and
    is counted against the prediction. (out, weights or None), and lse when the job asks for it."""
    ctx, held = context(), services()
    if ctx.job is None:
        admit(job)
    ticket = ctx.ticket
    work = ticket.work if ticket is not None and ticket.work is not None else work_of(job)
    threads = ticket.threads if ticket is not None else 1
    cpu_start = time.thread_time()
    try:
        with phase("compute") as timer:
            result = job.compute(threads, held.pool, ticket.stop if ticket is not None else None)
    except core.Stopped:
        assert ticket is not None  # only a ticket's deadline stops the core
        raise ticket.stopped() from None
    cpu_ms = (time.thread_time() - cpu_start) * 1000
    predicted = ticket.predicted_ms if ticket is not None else 0.0
    metrics.observe_compute(work, timer.ms, predicted)
    held.cost.observe(work, timer.ms, cpu_ms, ticket.busy if ticket is not None else 1, threads, predicted)
    return result


def cost(job: AnyJob) -> dict:
    """The cost summary of a response: what the job is, and what the cost model predicted for it
    when admitting it."""
    ticket = context().ticket
    return {
        "flops": job.flops,
        "score_elements": job.score_elements,
        "predicted_ms": round(ticket.predicted_ms if ticket is not None else 0.0, 3),
    }


def make_pool(settings: Settings) -> Executor | None:
    """A worker's pool of ATTN_SPLIT_THREADS - 1 threads (None when splitting is off). Its threads
    start at the first split, so in the worker after the fork."""
    n = settings.split_threads
    return ThreadPoolExecutor(n - 1, thread_name_prefix="attention-split") if n > 1 else None
