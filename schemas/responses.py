"""The native door's answers as the OpenAPI document shows them (service/web/openapi.py draws
them with apispec). Documentation only: the views build the answers."""

from __future__ import annotations

from marshmallow import Schema, fields

from .fields import Tensor


class ErrorDetail(Schema):
    status = fields.Integer(required=True, metadata={"description": "the HTTP status"})
    code = fields.String(
        required=True, metadata={"description": "machine-readable: bad_json, missing_field, shape_mismatch, too_large, ..."}
    )
    message = fields.String(required=True, metadata={"description": "one sentence naming the field and the shapes or limit involved"})
    field = fields.String(required=True, allow_none=True, metadata={"description": "the request field concerned, or null"})


class Error(Schema):
    error = fields.Nested(ErrorDetail, required=True)


class Cost(Schema):
    flops = fields.Integer(required=True)
    score_elements = fields.Integer(required=True, metadata={"description": "B*T*S (times heads for /mha)"})
    predicted_ms = fields.Float(required=True, metadata={"description": "the cost model's prediction"})


class ComputeResponse(Schema):
    out = Tensor(required=True, metadata={"description": "(..., T, dv) for /attention; (n, d_out) or (B, n, d_out) for /mha"})
    weights = Tensor(
        metadata={
            "description": "(..., T, S) for /attention (without the heads axis -3 under average_weights); (h, n, n) or "
            "(B, h, n, n) for /mha; only when return_weights; in weights_dtype if given"
        }
    )
    lse = Tensor(
        metadata={
            "description": "(..., T) for /attention, only when return_lse: the log-sum-exp of each row's scores, in the compute dtype; "
            "the dtype's lowest finite value for a row with no allowed key"
        }
    )
    cost = fields.Nested(Cost, required=True)
    timing_ms = fields.Dict(
        keys=fields.String(),
        values=fields.Float(),
        required=True,
        metadata={"description": "milliseconds per phase so far: decode, validate, compute"},
    )


class Status(Schema):
    status = fields.String(required=True)
