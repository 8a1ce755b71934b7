"""The numeric core: attention and the GPT block's multi-head attention, numpy only.

Read reference.py first: the textbook algorithm, every variant, in a page; attention() computes
exactly that, in blocks where a problem is large (kernels.py). Nothing here knows of HTTP, JSON
or schemas; every function is a pure function of arrays."""

from .kernels import Plan, attention, causal_mask, causal_share, mha, plan
from .paged import Page, paged_attention
from .reference import Result, ResultOverflow, ScoreOverflow, Stopped, causal_offset, reference

__all__ = [
    "Result",
    "Page",
    "Plan",
    "ResultOverflow",
    "ScoreOverflow",
    "Stopped",
    "attention",
    "causal_mask",
    "causal_offset",
    "causal_share",
    "mha",
    "paged_attention",
    "plan",
    "reference",
]
