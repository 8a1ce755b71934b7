"""The native door's answers (and the sessions') as the OpenAPI document shows them (service/web/openapi.py draws
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
    length = fields.Integer(metadata={"description": "length_conflict (409) only: the session's current length"})


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


class Session(Schema):
    """A session's description."""

    id = fields.String(required=True)
    heads = fields.Integer(required=True)
    kv_heads = fields.Integer(required=True)
    head_dim = fields.Integer(required=True)
    value_dim = fields.Integer(required=True)
    dtype = fields.String(required=True)
    max_tokens = fields.Integer(required=True)
    length = fields.Integer(required=True, metadata={"description": "tokens held"})
    idle_expiry_s = fields.Integer(required=True, metadata={"description": "idle this long, it expires (ATTN_SESSION_IDLE_S)"})


class SessionLength(Schema):
    length = fields.Integer(required=True, metadata={"description": "the session's length"})


class SessionStepResponse(Schema):
    out = Tensor(required=True, metadata={"description": "(H, t, dv); (B, H, t, dv) for a batch"})
    weights = Tensor(metadata={"description": "(H, t, S) when return_weights; a batch's (B, H, t, max S), 0 past each length"})
    lse = Tensor(metadata={"description": "(H, t) when return_lse; (B, H, t) for a batch"})
    length = fields.Integer(metadata={"description": "the session's length after the step"})
    lengths = fields.List(fields.Integer(), metadata={"description": "a batch: each session's length after the step"})
    cost = fields.Nested(Cost, required=True)
    timing_ms = fields.Dict(keys=fields.String(), values=fields.Float(), required=True)
