"""What the numeric core does for a job, as the cost model counts it: its blocks and the scores
it computes. The one place the cost package asks the core (core.block_count, core.score_count,
core.causal_share), so that a change in how the core plans its blocks is followed here once."""

from __future__ import annotations

from schemas.jobs import AttentionJob, MhaJob
from service import core

Job = AttentionJob | MhaJob


def blocks(job: Job) -> int:
    """The blocks the core computes the job in (a request is at least one)."""
    return core.block_count(job.B, job.T, job.S, job.causal, window=job.window, groups=job.groups, itemsize=job.itemsize)


def window_scores(job: Job) -> int:
    """The scores the core computes under the job's window: its band and the block edges."""
    return core.score_count(job.B, job.T, job.S, job.causal, window=job.window, itemsize=job.itemsize)


def causal_share(job: Job) -> float:
    """The share of the (T, S) scores the job's causal mask allows (1 without one)."""
    return core.causal_share(job.T, job.S, job.causal)
