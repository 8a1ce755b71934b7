"""The domain's one error: a request the service refuses, as a machine-readable code, one
actionable sentence and the field it concerns. No HTTP here: the web layer maps codes to
statuses (service/web/errors.py) and shapes the body for its front door."""

from __future__ import annotations


class RequestError(Exception):
    """code: one of the contract's codes (bad_type, shape_mismatch, too_large, ...); field: the
    request field concerned, None when it is about the request as a whole."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field
