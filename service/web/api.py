"""Blueprint for the compute endpoints, POST /attention and POST /mha. Thin: load, compute, dump."""

from __future__ import annotations

import numpy as np
from flask import Blueprint, Response

from schemas import AttentionRequest, MhaRequest
from service import wire

from .compute import Job, cost, run, validate
from .context import services
from .http import json_response, phase, phases_ms, read_json

bp = Blueprint("api", __name__)


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
    """Read, decode and validate the body into an admitted job: 4xx on anything malformed."""
    doc = read_json()
    return validate(services().schemas[schema_cls], doc)


def respond_job(job: Job, out: np.ndarray, weights: np.ndarray | None, lse: np.ndarray | None = None) -> Response:
    """The 200 body: tensors in the job's encoding, the cost and the phases so far."""
    timing = phases_ms()
    with phase("encode"):
        body = {"out": wire.encode(out, job.encoding, lazy=True)}
        if weights is not None:
            body["weights"] = wire.encode(weights, job.encoding, lazy=True, dtype=job.weights_dtype)
        if lse is not None:
            body["lse"] = wire.encode(lse, job.encoding, lazy=True)
        body["cost"] = cost(job)
        body["timing_ms"] = timing
        return json_response(body)
