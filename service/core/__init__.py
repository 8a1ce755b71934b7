"""The numeric core: attention and the GPT block's multi-head attention, numpy only.

Nothing here knows of HTTP, JSON or schemas; every function is a pure function of arrays."""

from .kernels import ResultOverflow, ScoreOverflow, attention, block_count, causal_mask, causal_offset, causal_share, mha, score_count

__all__ = [
    "ResultOverflow",
    "ScoreOverflow",
    "attention",
    "block_count",
    "causal_mask",
    "causal_offset",
    "causal_share",
    "mha",
    "score_count",
]
