"""marshmallow schemas: the request bodies, validated into checked numpy arrays."""

from .requests import AttentionJob, AttentionRequest, MhaJob, MhaRequest

__all__ = ["AttentionJob", "AttentionRequest", "MhaJob", "MhaRequest"]
