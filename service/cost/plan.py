"""What the numeric core does for a job, as the cost model counts it: the core's own plan of
blocks (core.plan, the one the computation runs). The one place the cost package asks the core, so
that a change in how the core plans its blocks is followed here once."""

from __future__ import annotations

from schemas.jobs import AttentionJob, MhaJob, SessionBatchJob, SessionStepJob
from service import core

Job = AttentionJob | MhaJob | SessionStepJob | SessionBatchJob


def of(job: Job) -> core.Plan:
    """The core's plan for the job: its blocks, their count, the scores computed, and whether it
    takes the reference path."""
    return core.plan(
        job.B,
        job.T,
        job.S,
        job.head_widths[1],
        causal=job.causal,
        window=job.window,
        groups=job.groups,
        itemsize=job.itemsize,
        return_weights=job.return_weights,
    )


def causal_share(job: Job) -> float:
    """The share of the (T, S) scores the job's causal mask allows (1 without one)."""
    return core.causal_share(job.T, job.S, job.causal)
