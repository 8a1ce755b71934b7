"""Blueprint for the compute endpoints, POST /attention and POST /mha. Thin: load, compute, dump.

run() and cost() are shared with the KServe door: one computation, two envelopes."""

from __future__ import annotations

import time

import numpy as np
from flask import Blueprint, Response, current_app, g

from schemas import AttentionRequest, MhaRequest
from schemas.jobs import AttentionJob, MhaJob
from service import wire

from . import metrics, parallel
from .admission import admit
from .http import json_response, phase, phases_ms, read_json

bp = Blueprint("api", __name__)

Job = AttentionJob | MhaJob


@bp.post("/attention")
def attention():
    """Scaled dot-product attention over any leading axes."""
    job = load_job(AttentionRequest)
    return respond_job(job, *run(job))


@bp.post("/mha")
def mha():
    """Causal multi-head self-attention with projections (the GPT block)."""
    job = load_job(MhaRequest)
    return respond_job(job, *run(job))


def load_job(schema_cls: type) -> Job:
    """Read, decode and validate the body into a job, then admit it: 4xx on anything malformed."""
    doc = read_json()
    with phase("validate"):
        job = current_app.extensions["attention.schemas"][schema_cls].load(doc)
    admit(job)  # 504 if it cannot meet its deadline, 503 if it does not fit; waits for a compute slot
    return job


def run(job: Job) -> tuple[np.ndarray, np.ndarray | None]:
    """Compute an admitted job, timed as the compute phase; the measured time refines the cost
    model (with the thread's CPU time, its alone-time, and g.busy, the requests busy in the server
    when it was admitted) and is counted against admit()'s prediction. Both front doors compute
    through here."""
    work = job.work()
    model = current_app.extensions["attention.cost"]
    threads = parallel.threads(work)  # more than one only for a large job alone on the server
    cpu_start = time.thread_time()
    with phase("compute") as timer:
        result = job.compute(threads, parallel.pool())
    cpu_ms = (time.thread_time() - cpu_start) * 1000
    metrics.observe_compute(work, timer.ms, g.predicted_ms)
    if threads == 1:  # the model predicts one thread's time, what a job gets under load
        model.observe(work, timer.ms, cpu_ms, g.get("busy", 1))  # learns the alone-time (CPU time) and the slowdown seen
    else:  # and, apart, what a split takes of that time
        model.observe_split(work, timer.ms, threads)
    return result


def cost(job: Job) -> dict:
    """The cost summary of a response: what the job is, and what the cost model predicted for it
    when admitting it."""
    return {"flops": job.flops, "score_elements": job.score_elements, "predicted_ms": round(g.predicted_ms, 3)}


def respond_job(job: Job, out: np.ndarray, weights: np.ndarray | None) -> Response:
    """The 200 body: tensors in the job's encoding, the cost and the phases so far."""
    timing = phases_ms()
    with phase("encode"):
        body = {"out": wire.encode(out, job.encoding, lazy=True)}
        if weights is not None:
            body["weights"] = wire.encode(weights, job.encoding, lazy=True, dtype=job.weights_dtype)
        body["cost"] = cost(job)
        body["timing_ms"] = timing
        return json_response(body)
