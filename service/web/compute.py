"""The one computation behind both front doors (the native API, api.py, and the Open Inference
Protocol, kserve.py): a body validated into a job and admitted, the job computed and measured,
and the cost summary of its answer. The doors differ only in their envelopes."""

from __future__ import annotations

import time
from typing import Any

from schemas import AttentionJob, AttentionRequest, MhaJob, MhaRequest, SessionBatchJob, SessionStepJob
from service import core
from service.cost import work_of

from . import metrics, parallel
from .admission import admit, late, start_sending, stopper
from .context import context, services
from .http import phase

Job = AttentionJob | MhaJob
AnyJob = Job | SessionStepJob | SessionBatchJob  # a session's step too (sessions.py)


def validate(schema: AttentionRequest | MhaRequest, doc: dict) -> Job:
    """The decoded body validated into a job (the validate phase; 422 on anything invalid), then
    admitted: 504 if it cannot meet its deadline, 503 if it does not fit; waits for a compute slot."""
    job = validate_only(schema, doc)
    admit(job)
    return job


def validate_only(schema, doc: dict) -> Any:
    """The decoded body loaded by schema (the validate phase; 422 on anything invalid)."""
    with phase("validate"):
        return schema.load(doc)


def run(job: AnyJob) -> core.Result:
    """Admit a job that is not yet (a session's step: admitted once its session is locked and its
    keys known), then compute it, timed as the compute phase; the measured time (with the thread's
    CPU time, the requests busy in the server when it was admitted, and the threads it took)
    teaches the cost model and is counted against admit()'s prediction. (out, weights or None),
    and lse when the job asks for it. Under X-Deadline-Ms the core is stopped between blocks once
    the answer could no longer be sent in time, and an answer that could not be sent in time beside
    those the worker is sending is refused as well (admission.start_sending): 504 deadline either
    way, never a late 200 as far as the worker's pipe of answers can tell."""
    ctx = context()
    if ctx.job is None:
        admit(job)
    work = ctx.work or work_of(job)
    threads = parallel.threads(work)  # more than one only for a large job alone on the server
    stop = stopper()
    cpu_start = time.thread_time()
    try:
        with phase("compute") as timer:
            result = job.compute(threads, services().pool, stop)
    except core.Stopped:
        raise late() from None
    cpu_ms = (time.thread_time() - cpu_start) * 1000
    metrics.observe_compute(work, timer.ms, ctx.predicted_ms or 0.0)
    services().cost.observe(work, timer.ms, cpu_ms, ctx.busy, threads)
    start_sending()
    return result


def cost(job: AnyJob) -> dict:
    """The cost summary of a response: what the job is, and what the cost model predicted for it
    when admitting it."""
    return {"flops": job.flops, "score_elements": job.score_elements, "predicted_ms": round(context().predicted_ms or 0.0, 3)}
