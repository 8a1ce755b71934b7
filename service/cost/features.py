"""What the cost model reads of a job: its Work, the arithmetic the numeric core actually does,
and the factors for what the fit's features do not count (a bias, ALiBi, a mask, key_lengths).

A job (schemas.jobs) carries shapes only; work_of() turns them into the fit's features."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service import core

from . import plan
from .plan import Job

# What a bias, ALiBi or a mask multiply a plain request's time by, (with weights, without): the
# CPU time of each against a plain request of the same shape (git log --
# bench/cost_variants.py). Each adds passes over every score, and turns off the no-weights path's bounded
# scores (which skip two passes), more of its time the larger T. Several add up: 1 + the sum of
# (factor - 1).
EXTRA_COST = {"bias": (1.5, 2.5), "alibi_slopes": (2.5, 3.5), "mask": (1.8, 2.2)}
# With weights, the blocks write 0 to each weight they do not compute (outside a window's band,
# past the largest key_lengths) and check it: about half a computed score's time each.
ZEROED_WEIGHT_SHARE = 0.5
# The elements the fit's e counts beside the scores (Work.elements): each of q and out is scaled,
# divided, checked (a pass or two each, and the row's passes over its max and sum); each of k and v
# is read for its bounds and streamed by the matmuls, KEY_ELEMENT_WEIGHT of a q element's time: in
# a worker they arrive fresh from the decoder, read from memory, not the cache a repeated timing
# keeps them in. Negligible where S and T are alike and large; all of the time
# where one is tiny.
KEY_ELEMENT_WEIGHT = 0.3


@dataclass(frozen=True)
class Work:
    """What the cost model reads of a job: the arithmetic the numeric core actually does.

    cost_factor is what a bias, ALiBi or a mask multiply the plain work's time by (EXTRA_COST);
    fitted False marks work whose cost the features only estimate (those, and key_lengths), which
    the fit predicts but does not learn from."""

    flops: int
    score_elements: int
    dtype: str
    T: int  # query positions (n for /mha)
    blocks: int = 1  # the numeric core's blocks (its plan's count)
    cost_factor: float = 1.0  # the plain work's time x this (a bias, ALiBi, a mask)
    fitted: bool = True  # the fit may learn from its measured time
    query_elements: int = 0  # the elements of q and out
    key_elements: int = 0  # the elements of k and v (KEY_ELEMENT_WEIGHT of a q element each)
    narrow_outputs: int = 0  # the outputs of matmuls one term wide (d = 1: q kᵀ; one key: weights v)

    @property
    def elements(self) -> float:
        """What the fit's e multiplies: the elements of q and out, KEY_ELEMENT_WEIGHT of each of k
        and v's, and each output of a matmul one term wide. numpy computes such a matmul (a d of 1,
        a single key) element by element, several times a wide one's time per output, which its
        flops (2 an output) do not count; an output costs about what a q element's passes do."""
        return self.query_elements + KEY_ELEMENT_WEIGHT * self.key_elements + self.narrow_outputs

    def features(self) -> np.ndarray:
        """(GFLOP, M score elements, blocks, M elements) x cost_factor: what the fit's a, b, c, e
        multiply."""
        return np.array([self.flops / 1e9, self.score_elements / 1e6, float(self.blocks), self.elements / 1e6]) * self.cost_factor


def cost_factor(job: Job) -> float:
    """What a bias, ALiBi or a mask multiply the plain work's time by (EXTRA_COST; /mha has none)."""
    extra = (factors[0 if job.return_weights else 1] - 1 for name, factors in EXTRA_COST.items() if getattr(job, name, None) is not None)
    return 1.0 + sum(extra, 0.0)


def computed_share(job: Job, planned: core.Plan) -> float:
    """The share of the scores the core computes. The reference path computes the whole (T, S)
    whatever hides a key (a mask, causal, key_lengths), and all is counted. In blocks: without
    weights under a causal mask they skip the keys past each block's diagonal (about half), the
    weights path writes the whole (T, S) and all is counted; a window's band is what they compute
    either way (the plan's scores), and no key past the largest key_lengths."""
    if planned.reference:
        return 1.0
    if job.window is not None:
        share = planned.scores / job.score_elements
    else:
        share = 1.0 if job.return_weights else plan.causal_share(job)
    # The blocks compute no key at or past the largest key_lengths (key_lengths of 1: one key a
    # row): exact without a band (causal, window), the lesser count (an upper bound) with one.
    return min(share, job.key_end / job.S) if job.S else share


def work_of(job: Job) -> Work:
    """The job's work: the flops and scores the core computes, its blocks, and what the features
    miss (cost_factor; fitted False with a bias, ALiBi, a mask or key_lengths: their cost is
    estimated, not what calibration timed, and a stream of them fed to the fit would move every
    plain request's prediction)."""
    planned = plan.of(job)
    blocks = planned.count
    share = computed_share(job, planned)
    factor = cost_factor(job)
    attention_flops = job.flops - job.other_flops
    flops = job.other_flops + share * attention_flops
    scores = job.score_elements * share
    if job.return_weights:  # the weights outside a window's band or past the largest key_lengths: not computed, but written 0
        scores += ZEROED_WEIGHT_SHARE * (job.B * job.T * job.S - scores) / factor  # no bias on them
    fitted = factor == 1.0 and getattr(job, "key_lengths", None) is None
    d, dv = job.head_widths
    rows, keys = job.B * job.T * (d + dv), job.B // job.groups * job.S * (d + dv)  # q and out; k and v
    narrow = (int(job.score_elements * share) if d == 1 else 0) + (job.B * job.T * dv if job.S == 1 else 0)  # q kᵀ; weights v
    return Work(int(flops), int(scores), job.dtype, int(job.T), blocks, factor, fitted, rows, keys, narrow)
