"""The cost model, in one place: what a job's work is (features), what the numeric core's plan of
blocks counts (plan, the one place that asks the core), the fit that predicts compute time and
learns from measured computes (model), its start-up calibration, and the split policy (split).

The interface is CostModel.predict(work, busy, threads) and CostModel.observe(work, ms, ...),
with work_of(job) and threads_for(work, ...). Knows nothing of the web (an import-linter contract)."""

from .calibration import median_ms
from .features import EXTRA_COST, Work, work_of
from .model import FORMULA, MAX_PULL, CostModel, contention
from .split import MIN_FLOPS, threads_for

__all__ = [
    "EXTRA_COST",
    "FORMULA",
    "MAX_PULL",
    "MIN_FLOPS",
    "CostModel",
    "Work",
    "contention",
    "median_ms",
    "threads_for",
    "work_of",
]
