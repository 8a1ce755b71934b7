"""Blueprint for the compute endpoints, POST /attention and POST /mha. Thin: load, compute, dump."""

from __future__ import annotations

import numpy as np
from flask import Blueprint, current_app

from schemas import AttentionJob, AttentionRequest, MhaJob, MhaRequest

from . import attention as core
from . import codec
from .admission import admit
from .http import json_response, phase, phases_ms, read_json

bp = Blueprint("api", __name__)


@bp.post("/attention")
def attention():
    """Scaled dot-product attention over any leading axes."""
    job = load(AttentionRequest)
    return respond(job, *compute(job))


@bp.post("/mha")
def mha():
    """Causal multi-head self-attention with projections (the GPT block)."""
    job = load(MhaRequest)
    return respond(job, *compute(job))


def compute(job: AttentionJob | MhaJob) -> tuple[np.ndarray, np.ndarray | None]:
    """Run a validated job on the numeric core, timed as the compute phase. Both front doors
    (this blueprint and the Open Inference Protocol's) compute through here."""
    with phase("compute"):
        if isinstance(job, MhaJob):
            return core.mha(job.x, job.wq, job.wk, job.wv, job.wo, job.heads, causal=job.causal, return_weights=job.return_weights)
        return core.attention(
            job.q,
            job.k,
            job.v,
            job.mask,
            causal=job.causal,
            key_lengths=job.key_lengths,
            scale=job.scale,
            return_weights=job.return_weights,
        )


def load(schema_cls):
    """Read, decode and validate the body into a job: 4xx on anything malformed."""
    doc = read_json()
    with phase("validate"):
        job = current_app.extensions["attention.schemas"][schema_cls].load(doc)
    admit(job)  # 504 if it cannot meet its deadline, 503 if it does not fit; waits for a compute slot
    return job


def cost(job) -> dict:
    model = current_app.extensions["attention.cost"]
    return {"flops": job.flops, "score_elements": job.score_elements, "predicted_ms": round(model.predict_job(job), 3)}


def respond(job, out, weights):
    """The 200 body: tensors in the job's encoding, the cost and the phases so far."""
    timing = phases_ms()
    with phase("encode"):
        body = {"out": codec.encode(out, job.encoding, lazy=True)}
        if weights is not None:
            body["weights"] = codec.encode(weights, job.encoding, lazy=True)
        body["cost"] = cost(job)
        body["timing_ms"] = timing
        return json_response(body)
