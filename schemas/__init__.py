"""The domain: request schemas (marshmallow) that validate a decoded body into a job, the jobs
themselves, and RequestError. Imports service.core, service.wire and service.config only."""

from .errors import RequestError
from .jobs import COMPUTE_DTYPES, AttentionJob, MhaJob, SessionBatchJob, SessionStepJob
from .requests import AttentionRequest, MhaRequest

__all__ = [
    "COMPUTE_DTYPES",
    "AttentionJob",
    "AttentionRequest",
    "MhaJob",
    "MhaRequest",
    "RequestError",
    "SessionBatchJob",
    "SessionStepJob",
]
