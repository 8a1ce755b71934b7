"""The OpenAPI 3 document, generated from the marshmallow request schemas with apispec's
MarshmallowPlugin and served at GET /openapi.json; a Swagger UI page at GET /docs whose assets
come from the swagger-ui-bundle package and are served by this service (no CDN: it works
offline); and a small landing page at GET /.

The document is built once per app from the routes actually registered, so an endpoint appears
in it exactly when the service serves it: the native API, the operations endpoints and, under its
own tag, the Open Inference Protocol (/v2), whose schemas are named as in the protocol's own
OpenAPI document (open_inference_rest.yaml) and derived from kserve.py's model table."""

from __future__ import annotations

import copy
import re
from dataclasses import fields as dataclass_fields
from typing import Any

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint, Flask, Response, current_app, send_from_directory
from marshmallow import Schema, fields, validate
from swagger_ui_bundle import swagger_ui_path

from schemas import AttentionRequest, MhaRequest, RequestError
from schemas.fields import Tensor, Window
from schemas.sessions import (
    SequenceStepRequest,
    SessionAppendRequest,
    SessionBatchRequest,
    SessionCreateRequest,
    SessionLengthRequest,
    SessionStepRequest,
)
from service.config import VERSION, Settings
from service.cost import FORMULA
from service.wire import WIRE_DTYPES

from . import kserve, triton_ext
from .context import services
from .http import MAX_REQUEST_ID, html_policy, json_response

bp = Blueprint("openapi", __name__)

DOCS_ASSETS = frozenset(
    {"swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "favicon-16x16.png", "favicon-32x32.png"}
)

_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 1}, "description": "the tensor's shape; every axis at least 1"}
_ALL_DTYPES = list(WIRE_DTYPES)
_NUMBER_DTYPES = [name for name, dtype in WIRE_DTYPES.items() if dtype.kind in "iuf"]
_INT_DTYPES = [name for name, dtype in WIRE_DTYPES.items() if dtype.kind in "iu"]
MAX_NESTING = 6  # the highest rank any tensor field takes
# Per Tensor kind: its component's name, what it holds, the element types it accepts (one type per
# tensor: a mask mixing booleans with numbers is refused), the dtypes it accepts (b64 and flat),
# and whether a bare scalar is a tensor (rank 0, as key_lengths may be).
_KINDS: dict[str, tuple[str, str, list[dict], list[str], bool]] = {
    "float": ("Tensor", "numbers", [{"type": "number"}], _NUMBER_DTYPES, False),
    "mask": (
        "MaskTensor",
        "booleans, or the numbers 0 and 1",
        [{"type": "boolean"}, {"type": "number", "enum": [0, 1]}],
        _ALL_DTYPES,
        False,
    ),
    "int": ("IntTensor", "integers", [{"type": "integer"}], _INT_DTYPES, True),
}


def _nested(element: dict, rank: int) -> dict:
    """A rank-`rank` nested array of element (rectangularity is beyond JSON Schema)."""
    return element if rank == 0 else {"type": "array", "minItems": 1, "items": _nested(element, rank - 1)}


def _one_of(options: list[dict]) -> dict:
    return options[0] if len(options) == 1 else {"oneOf": options}


def _tensor_schema(kind: str) -> dict:
    """A tensor in each of its three encodings, holding the values a Tensor field of this kind accepts."""
    _, what, elements, dtypes, scalar = _KINDS[kind]
    nested = {"title": "nested", **_one_of([_nested(e, rank) for e in elements for rank in range(1, MAX_NESTING + 1)])}
    flat = {
        "title": "flat",
        "type": "object",
        "required": ["shape", "data"],
        "additionalProperties": False,
        "properties": {
            "shape": _SHAPE,
            "data": {**_one_of([_nested(e, 1) for e in elements]), "description": "prod(shape) values, row-major"},
            "dtype": {
                "type": "string",
                "enum": [*dtypes, None],
                "nullable": True,
                "description": "how to read data; null or absent: as JSON gives",
            },
        },
    }
    b64 = {
        "title": "b64",
        "type": "object",
        "required": ["shape", "dtype", "b64"],
        "additionalProperties": False,
        "properties": {
            "shape": _SHAPE,
            "dtype": {"type": "string", "enum": dtypes},
            "b64": {"type": "string", "format": "byte", "description": "prod(shape) * itemsize bytes, base64"},
        },
    }
    return {
        "description": f"A tensor of {what} in one of three encodings: a nested array (row-major, rectangular); "
        "{shape, data[, dtype]} with data flat and row-major; or {shape, dtype, b64} with the base64 of the raw "
        "little-endian row-major bytes. Responses use the request's encoding unless response_encoding says otherwise.",
        "oneOf": [*([{"title": "scalar", **_one_of(elements)}] if scalar else []), nested, flat, b64],
    }


# --- the response bodies, as marshmallow schemas (documentation only: responses are built by the views) ---


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


def _tensor_property(self, field, ret, **kwargs) -> dict:
    """MarshmallowPlugin attribute function: a Tensor field is a reference to its kind's schema.
    OpenAPI 3.0 ignores siblings of $ref, so the reference sits in allOf beside the description."""
    if not isinstance(field, Tensor):
        return {}
    ret.pop("type", None)
    return {"allOf": [{"$ref": f"#/components/schemas/{_KINDS[field.kind][0]}"}]}


def _window_property(self, field, ret, **kwargs) -> dict:
    """MarshmallowPlugin attribute function: a Window field is [left, right], integers >= -1."""
    if not isinstance(field, Window):
        return {}
    return {"type": "array", "items": {"type": "integer", "minimum": -1}, "minItems": 2, "maxItems": 2}


def _nullable_enum(self, field, ret, **kwargs) -> dict:
    """A field that accepts null and lists its values must list null too (OpenAPI 3.0.3)."""
    if ret.get("nullable") and "enum" in ret and None not in ret["enum"]:
        return {"enum": [*ret["enum"], None]}
    return {}


def _exclusive_minimum(self, field, ret, **kwargs) -> dict:
    """apispec drops Range(min_inclusive=False)'s exclusivity; OpenAPI 3.0 says it with a boolean."""
    if any(isinstance(v, validate.Range) and v.min is not None and not v.min_inclusive for v in field.validators):
        return {"exclusiveMinimum": True}
    return {}


# --- the document -----------------------------------------------------------------------------

ERROR_DESCRIPTIONS = {
    400: "body is not strict JSON or not an object (bad_json), or its Content-Encoding does not decode (bad_compression)",
    401: "no valid API key",
    413: "body, T, S or score elements over a limit",
    415: "not application/json, or a Content-Encoding other than identity, gzip or deflate",
    422: "JSON but not a valid request",
    503: "overloaded: retry after Retry-After seconds",
    504: "the X-Deadline-Ms deadline cannot be met",
}
TIMING_HEADERS = {
    "Server-Timing": {
        "required": True,
        "schema": {"type": "string"},
        "description": "W3C Server-Timing: decode, validate, compute, encode, total (ms)",
    },
    "X-Request-Id": {"required": True, "schema": {"type": "string"}, "description": "echoed if the client sent one"},
    "traceparent": {
        "required": True,
        "schema": {"type": "string"},
        "description": "W3C Trace Context: the caller's trace (or a new one) and this request's span id",
    },
}
# X-Deadline-Ms is described in words, not as a parameter: a deadline too short to meet is
# answered 504 by design, which a fuzzer sending tiny deadlines would report as a server error.
COMPUTE_PARAMETERS = [
    {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": f"echoed in the response's X-Request-Id if it is 1 to {MAX_REQUEST_ID} printable ASCII characters (else a fresh one is made)",
    },
    {
        "name": "traceparent",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "W3C Trace Context (version 00): the request's span continues this trace; a malformed one is ignored",
    },
]
DEADLINE_NOTE = (
    " Send X-Deadline-Ms (milliseconds, > 0) to have work that cannot finish in time refused with 504"
    " before computing; anything but a positive number there is 422 bad_option."
)


NATIVE_TAG, SESSIONS_TAG, OPS_TAG, V2_TAG = "Attention", "Sessions", "Operations", "Open Inference Protocol"
TAGS: list[dict[str, Any]] = [
    {
        "name": NATIVE_TAG,
        "description": "The native API: tensors in any of three encodings, errors as {error: {status, code, message, field}}",
    },
    {
        "name": SESSIONS_TAG,
        "description": "Attention state held by the server: a session keeps a sequence's keys and values, so that a decode "
        "step sends its new tokens and queries, not the whole cache",
    },
    {"name": OPS_TAG, "description": "Health, readiness, limits and metrics"},
    {
        "name": V2_TAG,
        "description": "The same computations under the Open Inference Protocol (KServe v2, as Triton speaks it): "
        "models attention and mha, inputs named as the native fields, options as request parameters, the binary "
        "tensor data extension, errors as {error: message}",
        "externalDocs": {"url": "https://github.com/kserve/open-inference-protocol"},
    },
]


def build(app: Flask) -> dict:
    """The OpenAPI 3.0 document of the routes registered on app."""
    settings: Settings = services(app).settings
    served = {rule.rule for rule in app.url_map.iter_rules()}
    spec = _spec(settings)
    _compute_paths(spec, settings, served)
    _session_paths(spec, settings, served)
    _ops_paths(spec, served)
    doc = spec.to_dict()
    schemas = doc["components"]["schemas"]
    for name in ("AttentionRequest", "MhaRequest", *SESSION_SCHEMAS):
        if name in schemas:
            schemas[name]["additionalProperties"] = False  # unknown fields are refused
    v2_rules = [rule for rule in app.url_map.iter_rules() if rule.endpoint.startswith(f"{kserve.bp.name}.")]
    if v2_rules:
        schemas.update(_v2_schemas(schemas))
        doc["paths"].update(_v2_paths(settings, v2_rules, app.view_functions))
    doc["tags"] = [tag for tag in TAGS if tag["name"] != V2_TAG or v2_rules]
    if settings.api_keys:
        doc["security"] = [{"bearer": []}]
    return doc


def _spec(settings: Settings) -> APISpec:
    """The document's frame: info, and every component schema (tensors, requests, responses)."""
    plugin = MarshmallowPlugin()
    spec = APISpec(
        title="Attention service",
        version=VERSION,
        openapi_version="3.0.3",
        plugins=[plugin],
        info={
            "description": "Scaled dot-product attention and multi-head attention over HTTP, natively and "
            "under the Open Inference Protocol (KServe v2) at /v2."
        },
    )
    assert plugin.converter is not None  # APISpec(plugins=[plugin]) made it
    plugin.converter.add_attribute_function(_tensor_property)
    plugin.converter.add_attribute_function(_window_property)
    plugin.converter.add_attribute_function(_nullable_enum)
    plugin.converter.add_attribute_function(_exclusive_minimum)
    for kind, (name, *_) in _KINDS.items():
        spec.components.schema(name, _tensor_schema(kind))
    spec.components.schema("Error", schema=Error)
    spec.components.schema("ComputeResponse", schema=ComputeResponse)
    spec.components.schema("AttentionRequest", schema=AttentionRequest(settings))
    spec.components.schema("MhaRequest", schema=MhaRequest(settings))
    for name, cls in SESSION_SCHEMAS.items():
        spec.components.schema(name, schema=cls(settings))
    spec.components.schema("Session", schema=SessionDescription)
    spec.components.schema("SessionStepResponse", schema=SessionStepResponse)
    spec.components.schema("Status", schema=Status)
    spec.components.schema("Limits", _limits_schema(settings))
    if settings.api_keys:
        spec.components.security_scheme("bearer", {"type": "http", "scheme": "bearer"})
    return spec


# On every error answer of both doors (the /v2 protocol's body carries only a message).
ERROR_HEADERS = {
    "X-Error-Code": {
        "required": True,
        "schema": {"type": "string"},
        "description": "the error's code (in the native body too, as error.code; the /v2 body is only a message)",
    },
    "X-Error-Field": {
        "schema": {"type": "string"},
        "description": "the request field the error names, when it names one: percent-encoded (UTF-8) but for printable ASCII other than %, and left out past 256 characters",
    },
}


def _errors(*statuses: int, body: str = "Error", descriptions: dict[int, str] = ERROR_DESCRIPTIONS) -> dict:
    """The error responses of an operation, each with its door's body and the error headers."""
    out = {}
    for status in sorted(set(statuses)):
        headers = dict(ERROR_HEADERS)
        if status == 503:
            headers["Retry-After"] = {"required": True, "schema": {"type": "integer"}, "description": "seconds"}
        out[str(status)] = {
            "description": descriptions[status],
            "content": {"application/json": {"schema": _ref(body)}},
            "headers": headers,
        }
    return out


def _auth(settings: Settings) -> tuple[int, ...]:
    """401 too on a compute operation when API keys are in force."""
    return (401,) if settings.api_keys else ()


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _compute_paths(spec: APISpec, settings: Settings, served: set[str]) -> None:
    compute = {
        "/attention": (
            "attention",
            "AttentionRequest",
            "Scaled dot-product attention over any leading axes",
            "out = softmax(q kᵀ · scale, masked) v. Masked weights are exactly 0; a row with no allowed key gives zeros.",
            _attention_examples(),
        ),
        "/mha": (
            "mha",
            "MhaRequest",
            "Multi-head self-attention with projections (the GPT block)",
            "Q,K,V = x Wq, x Wk, x Wv, split into heads, attention scaled by 1/sqrt(d/h), heads concatenated, then @ Wo.",
            _mha_examples(),
        ),
    }
    for path, (op_id, request_schema, summary, description, examples) in compute.items():
        if path not in served:
            continue
        spec.path(
            path=path,
            operations={
                "post": {
                    "operationId": op_id,
                    "tags": [NATIVE_TAG],
                    "summary": summary,
                    "description": description + DEADLINE_NOTE,
                    "parameters": COMPUTE_PARAMETERS,
                    "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema, "examples": examples}}},
                    "responses": {
                        "200": {
                            "description": "the result",
                            "headers": TIMING_HEADERS,
                            "content": {"application/json": {"schema": "ComputeResponse"}},
                        },
                        **_errors(400, 413, 415, 422, 503, 504, *_auth(settings)),
                    },
                }
            },
        )


SESSION_SCHEMAS = {
    "SequenceStepRequest": SequenceStepRequest,  # /v2's attention_sequence
    "SessionCreateRequest": SessionCreateRequest,
    "SessionAppendRequest": SessionAppendRequest,
    "SessionLengthRequest": SessionLengthRequest,
    "SessionStepRequest": SessionStepRequest,
    "SessionBatchRequest": SessionBatchRequest,
}


class SessionDescription(Schema):
    id = fields.String(required=True)
    heads = fields.Integer(required=True)
    kv_heads = fields.Integer(required=True)
    head_dim = fields.Integer(required=True)
    value_dim = fields.Integer(required=True)
    dtype = fields.String(required=True)
    max_tokens = fields.Integer(required=True)
    length = fields.Integer(required=True, metadata={"description": "tokens held"})
    idle_expiry_s = fields.Integer(required=True, metadata={"description": "idle this long, it expires (ATTN_SESSION_IDLE_S)"})


class SessionStepResponse(Schema):
    out = Tensor(required=True, metadata={"description": "(H, t, dv); (B, H, t, dv) for a batch"})
    weights = Tensor(metadata={"description": "(H, t, S) when return_weights; a batch's (B, H, t, max S), 0 past each length"})
    lse = Tensor(metadata={"description": "(H, t) when return_lse; (B, H, t) for a batch"})
    length = fields.Integer(metadata={"description": "the session's length after the step"})
    lengths = fields.List(fields.Integer(), metadata={"description": "a batch: each session's length after the step"})
    cost = fields.Nested(Cost, required=True)
    timing_ms = fields.Dict(keys=fields.String(), values=fields.Float(), required=True)


def _session_paths(spec: APISpec, settings: Settings, served: set[str]) -> None:
    """The sessions resource (contract 1.3, "Sessions")."""
    sid: list[dict[str, Any]] = [
        {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}, "description": "the session's id"}
    ]
    described: dict[str, Any] = {"content": {"application/json": {"schema": "Session"}}}
    created = {
        "description": "created",
        "headers": {"Location": {"schema": {"type": "string"}, "description": "/sessions/{id}"}},
        **described,
    }
    stepped = {"description": "the step", "headers": TIMING_HEADERS, "content": {"application/json": {"schema": "SessionStepResponse"}}}
    length = {
        "description": "the length",
        "content": {"application/json": {"schema": {"type": "object", "properties": {"length": {"type": "integer"}}}}},
    }
    auth = _auth(settings)
    errors = dict(ERROR_DESCRIPTIONS)
    errors.update(
        {
            404: "session_not_found: unknown, expired, deleted, or another API key's",
            409: "length_conflict: the session's length is not at (or the length asked); error.length is its length",
            413: "too_long: past the session's max_tokens",
            503: "overloaded: the sessions' memory or table is full (no live session is evicted); retry after Retry-After",
        }
    )

    def body(schema: str) -> dict:
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    routes = {
        ("/sessions", "post"): ("createSession", "Create a session", body("SessionCreateRequest"), {"201": created}, (413, 422, 503)),
        ("/sessions/{sid}", "get"): (
            "getSession",
            "A session's description and length",
            None,
            {"200": {"description": "the session", **described}},
            (404,),
        ),
        ("/sessions/{sid}", "delete"): ("deleteSession", "Delete a session", None, {"204": {"description": "deleted"}}, (404,)),
        ("/sessions/{sid}/append", "post"): (
            "appendSession",
            "Append tokens (k, v); with at, only if the length is at",
            body("SessionAppendRequest"),
            {"200": length},
            (404, 409, 413, 422, 503),
        ),
        ("/sessions/{sid}/attention", "post"): (
            "stepSession",
            "A step: new tokens appended (atomically), then q attends to all the session's keys",
            body("SessionStepRequest"),
            {"200": stepped},
            (404, 409, 413, 422, 503, 504),
        ),
        ("/sessions/attention", "post"): (
            "stepSessions",
            "One step for several sessions at once (their lengths may differ)",
            body("SessionBatchRequest"),
            {"200": stepped},
            (404, 409, 413, 422, 503, 504),
        ),
        ("/sessions/{sid}/fork", "post"): (
            "forkSession",
            "A new session sharing this one's first length tokens",
            body("SessionLengthRequest"),
            {"201": created},
            (404, 409, 422, 503),
        ),
        ("/sessions/{sid}/truncate", "post"): (
            "truncateSession",
            "Drop the tokens after length",
            body("SessionLengthRequest"),
            {"200": length},
            (404, 409, 422),
        ),
    }
    paths: dict[str, dict] = {}
    for (path, method), (op_id, summary, request_body, responses, statuses) in routes.items():
        if path.replace("{sid}", "<sid:sid>") not in served:
            continue
        op: dict[str, Any] = {"operationId": op_id, "tags": [SESSIONS_TAG], "summary": summary, "responses": {**responses}}
        if "{sid}" in path:
            op["parameters"] = sid
        if request_body is not None:
            op["requestBody"] = request_body
            statuses = (*statuses, 400, 415)
        op["responses"].update(_errors(*statuses, *auth, descriptions=errors))
        paths.setdefault(path, {})[method] = op
    for path, operations in paths.items():
        spec.path(path=path, operations=operations)


def _ops_paths(spec: APISpec, served: set[str]) -> None:
    ops = {
        "/healthz": ("healthz", "Liveness: 200 while the process lives", {"200": _json("alive", "Status")}),
        "/readyz": (
            "readyz",
            "Readiness: 200 when it can serve, 503 while starting or draining",
            {"200": _json("ready", "Status"), "503": _json("starting or draining", "Status")},
        ),
        "/limits": (
            "limits",
            "The limits in force, the default dtype, the cost model and the version",
            {"200": _json("the limits", "Limits")},
        ),
        "/metrics": (
            "metrics",
            "Prometheus metrics",
            {"200": {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}},
        ),
    }
    for path, (op_id, summary, responses) in ops.items():
        if path in served:
            spec.path(path=path, operations={"get": {"operationId": op_id, "tags": [OPS_TAG], "summary": summary, "responses": responses}})


def _json(description: str, schema: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _limits_schema(settings: Settings) -> dict:
    kinds = {int: "integer", "int": "integer", str: "string", "str": "string", bool: "boolean", "bool": "boolean"}
    props = {f.name: {"type": kinds.get(f.type, "string")} for f in dataclass_fields(settings) if f.name in settings.limits()}
    props["server_slots"] = {
        "type": "integer",
        "description": "compute requests the whole server holds at once, a safety cap: (max_inflight + max_queue) x the workers running; past it, 503",
    }
    props["admission"] = {
        "type": "object",
        "description": "the admission policy: by predicted time until the answer is sent, the queue order, the wait bound, the slots, memory and parse charges",
    }
    props["cost_model"] = {"type": "object", "description": FORMULA}
    props["version"] = {"type": "string"}
    return {"type": "object", "required": sorted(props), "properties": props}


# The worked example: three tokens, d = 2; query 0 sees only key 0 under causal, query 2 all three.
WORKED_Q = [[1, 0], [0, 1], [1, 1]]
WORKED_V = [[1, 0], [0, 10], [5, 5]]
MHA_X = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]
EYE4 = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def _attention_examples() -> dict:
    worked = {"q": WORKED_Q, "k": WORKED_Q, "v": WORKED_V, "causal": True}
    return {
        "worked_example": {"summary": "the worked example, causal", "value": worked},
        "flat_batched": {
            "summary": "flat encoding, batch of 2, key padding",
            "value": {
                "q": {"shape": [2, 2, 2], "data": [1, 0, 0, 1, 1, 1, 0, 1]},
                "k": {"shape": [2, 3, 2], "data": [1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]},
                "v": {"shape": [2, 3, 1], "data": [1, 2, 3, 4, 5, 6]},
                "key_lengths": [3, 2],
                "return_weights": False,
            },
        },
        "b64": {
            "summary": "b64 encoding, bottom-right causal, float64",
            "value": {
                "q": {"shape": [1, 2], "dtype": "float32", "b64": "AACAPwAAAAA="},
                "k": {"shape": [2, 2], "dtype": "float32", "b64": "AACAPwAAAAAAAAAAAACAPw=="},
                "v": {"shape": [2, 1], "dtype": "float32", "b64": "AACAPwAAAEA="},
                "causal": "bottom_right",
                "dtype": "float64",
            },
        },
    }


def _mha_examples() -> dict:
    return {
        "identity_projections": {
            "summary": "identity projections, 2 heads",
            "value": {"x": MHA_X, "wq": EYE4, "wk": EYE4, "wv": EYE4, "wo": EYE4, "heads": 2},
        }
    }


# --- the Open Inference Protocol (/v2) ------------------------------------------------------------
# Schema names as in the protocol's own document (open_inference_rest.yaml) where it has one; what
# they hold comes from kserve.py's model table, so the document says what the views answer.

V2_ERROR_DESCRIPTIONS = {
    **ERROR_DESCRIPTIONS,
    400: "not a valid infer request for this model, as the protocol answers it: the body (or its JSON header) not strict"
    " JSON, Inference-Header-Content-Length not the header's length, a Content-Encoding that does not decode, or any"
    " invalid input or parameter (the native door's 422); the code is in X-Error-Code",
    404: "no such model, or no such version of it",
    415: "a Content-Encoding other than identity, gzip or deflate (the Content-Type is not checked: the protocol's clients send none)",
}


def _v2_output_names() -> list[str]:
    """Every output some model has (out, weights, lse), in the models' order."""
    return list(dict.fromkeys(name for model in kserve.MODELS.values() for name in model.outputs))


# The protocol's summary of each view of kserve.bp: a /v2 route added without one fails the build.
V2_SUMMARIES = {
    "server_metadata": "Server Metadata",
    "live": "Server Live",
    "ready": "Server Ready",
    "model_metadata": "Model Metadata",
    "model_config": "Model Configuration (Triton's extension)",
    "model_ready": "Model Ready",
    "infer": "Inference",
    **{endpoint: summary for endpoint, (summary, *_) in triton_ext.OPERATIONS.items()},
}
BINARY_NOTE = (
    " The binary tensor data extension: an input may carry parameters.binary_data_size (bytes) instead of data; "
    "its raw little-endian row-major bytes then follow the JSON header, in input order, and the header "
    "Inference-Header-Content-Length gives the JSON header's length (any Content-Type; application/octet-stream is "
    "usual). Outputs come as raw bytes too with parameters.binary_data_output: true, or per output with "
    "outputs[].parameters.binary_data: the answer is then application/octet-stream, the JSON header (each binary "
    "output with parameters.binary_data_size in place of data) followed by the outputs' bytes in order, its length "
    "in Inference-Header-Content-Length."
)


def _v2_paths(settings: Settings, rules: list, views: dict) -> dict:
    """The /v2 operations, one per route of kserve.bp (Flask's <name> becomes OpenAPI's {name}),
    each view's unversioned route before its versioned one."""
    order = list(dict.fromkeys(rule.endpoint for rule in rules))
    paths: dict[str, dict] = {}
    for rule in sorted(rules, key=lambda r: (order.index(r.endpoint), "version" in r.arguments)):
        endpoint = rule.endpoint.removeprefix(f"{kserve.bp.name}.")
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        versioned = "version" in rule.arguments
        op: dict[str, Any] = {
            "operationId": f"v2_{endpoint}{'_version' if versioned else ''}",
            "tags": [V2_TAG],
            "summary": V2_SUMMARIES[endpoint],
            "description": " ".join((views[rule.endpoint].__doc__ or "").split()),  # the view's docstring: said once
            "responses": _v2_responses(settings, endpoint),
        }
        params = [_V2_PATH_PARAMETERS[name] for name in re.findall(r"{([^}]+)}", path)]
        if endpoint == "model_metadata":
            op["description"] += " " + _models_summary()
        if endpoint == "infer":
            op["description"] += BINARY_NOTE + DEADLINE_NOTE
            params += [*COMPUTE_PARAMETERS, INFERENCE_HEADER_PARAMETER]
            op["requestBody"] = {
                "required": True,
                "description": "JSON; or, with binary inputs, the JSON header and then the inputs' bytes (any Content-Type)",
                "content": {
                    "application/json": {"schema": _ref("inference_request"), "examples": _v2_infer_examples()},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                },
            }
        if "shm_" in endpoint:
            op["description"] += triton_ext.SHM_NOTE
        if endpoint.endswith("shm_register"):
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref("system_shared_memory_register_request")}},
            }
        if params:
            op["parameters"] = params
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = op
    return paths


_V2_PATH_PARAMETERS = {
    "name": {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "enum": list(kserve.MODELS)}},
    "version": {
        "name": "version",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "enum": [kserve.MODEL_VERSION]},
        "description": "the only version of each model",
    },
    "region": {
        "name": "region",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "example": "input0"},
        "description": "a system shared-memory region's name, the client's choice",
    },
}
INFERENCE_HEADER_PARAMETER = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "schema": {"type": "integer", "minimum": 0},
    "description": "binary tensor data extension: the byte length of the JSON header, the inputs' bytes after it",
}


def _v2_responses(settings: Settings, endpoint: str) -> dict:
    errors: dict[str, Any] = {"body": "inference_error_response", "descriptions": V2_ERROR_DESCRIPTIONS}
    if endpoint in triton_ext.OPERATIONS:
        _, body, statuses = triton_ext.OPERATIONS[endpoint]
        guarded = _auth(settings) if endpoint.endswith(("shm_register", "shm_unregister")) else ()  # auth.COMPUTE_PATH
        return {"200": _json("OK", body), **_errors(*statuses, *guarded, **errors)}
    model = (404,) if endpoint.startswith("model_") else ()
    if endpoint in ("ready", "model_ready"):
        body = "server_ready_response" if endpoint == "ready" else "model_ready_response"
        return {"200": _json("ready", body), "503": _json("starting or draining", body), **_errors(*model, **errors)}
    if endpoint == "infer":
        binary_header = {
            "Inference-Header-Content-Length": {
                "schema": {"type": "integer"},
                "description": "on an application/octet-stream answer: the JSON header's byte length",
            }
        }
        return {
            "200": {
                "description": "the outputs: JSON, or the JSON header and the outputs' bytes (binary tensor data extension)",
                "headers": {**TIMING_HEADERS, **binary_header},
                "content": {
                    "application/json": {"schema": _ref("inference_response")},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                },
            },
            **_errors(400, 404, 413, 415, 503, 504, *_auth(settings), **errors),
        }
    bodies = {
        "server_metadata": "metadata_server_response",
        "live": "server_live_response",
        "model_metadata": "metadata_model_response",
        "model_config": "model_config_response",
    }
    body = bodies[endpoint]
    return {"200": _json("OK", body), **_errors(*model, **errors)}


def _models_summary() -> str:
    """Each model's inputs, outputs and parameters, from the model table."""
    parts = []
    for model in kserve.MODELS.values():
        inputs = ", ".join(f"{n} (optional)" if n in model.optional else n for n in model.inputs)
        parts.append(f"{model.name}: inputs {inputs}; outputs {', '.join(model.outputs)}; parameters {', '.join(model.parameters)}.")
    return "The models: " + " ".join(parts)


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """An object of these properties, all of them required unless `required` says which."""
    required = list(properties) if required is None else required
    return {"type": "object", **({"required": required} if required else {}), "properties": properties, **extra}


def _any_of(options: list[dict]) -> dict:
    return options[0] if len(options) == 1 else {"anyOf": options}


def _v2_schemas(native: dict) -> dict:
    """The /v2 component schemas; native: the native components, whose option schemas the
    protocol's request parameters share (the same schema loads both)."""
    models = kserve.MODELS
    boolean, string = {"type": "boolean"}, {"type": "string"}
    model_name = {"type": "string", "enum": list(models)}
    version = {"type": "string", "enum": [kserve.MODEL_VERSION]}
    dims = {"type": "array", "items": {"type": "integer", "minimum": -1}, "description": "-1: any length"}
    tensor_names = list(dict.fromkeys([*(n for m in models.values() for n in m.inputs), *_v2_output_names()]))
    input_names = ", ".join(f"{m.name}: {', '.join(m.inputs)}" for m in models.values())
    datatypes = {n: ", ".join(types) for m in models.values() for n, (types, *_) in m.inputs.items()}
    element = {"oneOf": [{"type": "number"}, boolean]}
    return {
        "metadata_server_response": _obj(
            {
                "name": string,
                "version": string,
                "extensions": {"type": "array", "items": {"type": "string", "enum": [*kserve.EXTENSIONS, "system_shared_memory"]}},
            }
        ),
        **triton_ext.SCHEMAS,
        "server_live_response": _obj({"live": boolean}),
        "server_ready_response": _obj({"ready": boolean}),
        "model_ready_response": _obj({"name": model_name, "ready": boolean}),
        "metadata_tensor": _obj(
            {
                "name": {"type": "string", "enum": tensor_names},
                "datatype": {"type": "string", "enum": list(kserve.DATATYPES), "description": "the one advertised"},
                "shape": dims,
                "parameters": _obj(
                    {
                        "datatypes": {"type": "string", "description": "every datatype accepted, comma-separated"},
                        "optional": {**boolean, "description": "inputs only"},
                        "description": string,
                    },
                    ["datatypes", "description"],
                ),
            }
        ),
        "metadata_model_response": _obj(
            {
                "name": model_name,
                "versions": {"type": "array", "items": version},
                "platform": {"type": "string", "enum": [kserve.PLATFORM]},
                "inputs": {"type": "array", "items": _ref("metadata_tensor")},
                "outputs": {"type": "array", "items": _ref("metadata_tensor")},
                "parameters": {
                    "type": "object",
                    "additionalProperties": string,
                    "description": "the request parameters the model takes (beyond the protocol's own), each with what it takes",
                },
            }
        ),
        "model_config_response": _model_config_schema(model_name),
        "tensor_data": {  # recursive, as the protocol's own (unrolled to each rank, it is too deep for the fuzzer's generator)
            "description": "the values, flat or nested as the shape, row-major: numbers (booleans, or 0 and 1, for BOOL)",
            "type": "array",
            "items": {"oneOf": [*element["oneOf"], _ref("tensor_data")]},
        },
        "request_input": _obj(
            {
                "name": {
                    "type": "string",
                    "enum": list(dict.fromkeys(n for m in models.values() for n in m.inputs)),
                    "description": input_names,
                },
                "datatype": {
                    "type": "string",
                    "enum": list(kserve.DATATYPES),
                    "description": "; ".join(f"{n}: {types}" for n, types in datatypes.items()),
                },
                "shape": _SHAPE,
                "parameters": _obj(
                    {
                        "binary_data_size": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "binary tensor data extension: the tensor's bytes follow the JSON header (no data then)",
                        }
                    },
                    [],
                    additionalProperties=False,
                ),
                "data": _ref("tensor_data"),
            },
            ["name", "datatype", "shape"],
            additionalProperties=False,
        ),
        "request_output": _obj(
            {
                "name": {"type": "string", "enum": _v2_output_names()},
                "parameters": _obj(
                    {"binary_data": {**boolean, "description": "binary tensor data extension: this output as raw bytes"}},
                    [],
                    additionalProperties=False,
                ),
            },
            ["name"],
            additionalProperties=False,
        ),
        "request_parameters": _request_parameters(native),
        "inference_request": _obj(
            {
                "id": {**string, "description": "echoed in the response"},
                "parameters": _ref("request_parameters"),
                "inputs": {"type": "array", "minItems": 1, "items": _ref("request_input")},
                "outputs": {
                    "type": "array",
                    "minItems": 1,
                    "items": _ref("request_output"),
                    "description": "the outputs wanted, in order; default out, and weights unless return_weights is false",
                },
            },
            ["inputs"],
            additionalProperties=False,
        ),
        "response_output": _obj(
            {
                "name": {"type": "string", "enum": _v2_output_names()},
                "datatype": {"type": "string", "enum": list(dict.fromkeys(kserve.OUTPUT_DATATYPES.values()))},
                "shape": _SHAPE,
                "parameters": _obj({"binary_data_size": {"type": "integer", "minimum": 0}}, []),
                "data": {
                    "type": "array",
                    "items": {"type": "number"},
                    "description": "flat, row-major; absent when the output is sent as binary data",
                },
            },
            ["name", "datatype", "shape"],
        ),
        "inference_response": _obj(
            {
                "model_name": model_name,
                "model_version": version,
                "id": {**string, "description": "the request's id, when it gave one"},
                "parameters": _obj(
                    copy.deepcopy(native["Cost"]["properties"]),
                    list(native["Cost"]["required"]),
                    additionalProperties={"type": "number"},
                    description="the cost, and the milliseconds per phase so far: decode_ms, validate_ms, compute_ms",
                ),
                "outputs": {"type": "array", "items": _ref("response_output")},
            },
            ["model_name", "model_version", "parameters", "outputs"],
        ),
        "inference_error_response": _obj(
            {"error": {**string, "description": "one sentence naming the input or parameter and what is wrong"}}
        ),
    }


def _model_config_schema(model_name: dict) -> dict:
    """Triton's model_config.proto as JSON, as kserve.model_config writes it."""
    data_type = {"type": "string", "enum": [f"TYPE_{d}" for d in kserve.DATATYPES]}
    dims = {"type": "array", "items": {"type": "integer", "minimum": -1}, "description": "-1: any length"}
    boolean, string = {"type": "boolean"}, {"type": "string"}
    platform = {"type": "string", "enum": [kserve.PLATFORM]}
    versions = {"type": "array", "items": {"type": "integer"}}
    return _obj(
        {
            "name": model_name,
            "platform": platform,
            "backend": platform,
            "version_policy": _obj({"specific": _obj({"versions": versions})}),
            "max_batch_size": {"type": "integer", "description": "0: no batching, each request is one call"},
            "input": {
                "type": "array",
                "items": _obj(
                    {
                        "name": string,
                        "data_type": data_type,
                        "format": string,
                        "dims": dims,
                        "is_shape_tensor": boolean,
                        "allow_ragged_batch": boolean,
                        "optional": boolean,
                    }
                ),
            },
            "output": {
                "type": "array",
                "items": _obj({"name": string, "data_type": data_type, "dims": dims, "label_filename": string, "is_shape_tensor": boolean}),
            },
            "sequence_batching": _obj(
                {"max_sequence_idle_microseconds": {"type": "integer", "description": "a sequence idle this long is freed"}},
                description="a sequence model's only (attention_sequence): Triton's sequence batcher, its state held by the server",
            ),
        },
        ["name", "platform", "backend", "version_policy", "max_batch_size", "input", "output"],
    )


def _request_parameters(native: dict) -> dict:
    """The infer request's parameters: each model's options, typed as its native field (a window
    may also be the string "left,right"), and the protocol's own."""
    options: dict[str, tuple[list[dict], list[tuple[str, str]]]] = {}
    for model in kserve.MODELS.values():
        fields_ = native[model.schema.__name__]["properties"]
        for name, what in model.parameters.items():
            schema = {k: v for k, v in fields_[name].items() if k not in ("description", "default")}
            if name == "window":
                schema = {"oneOf": [schema, {"type": "string", "pattern": f"^{kserve.WINDOW_TEXT.pattern}$"}]}
            schemas, whats = options.setdefault(name, ([], []))
            if schema not in schemas:
                schemas.append(schema)
            whats.append((model.name, what))
    props = {name: {**_any_of(schemas), "description": _per_model(whats)} for name, (schemas, whats) in options.items()}
    props["binary_data_output"] = {
        "type": "boolean",
        "description": "binary tensor data extension: every output as raw bytes after the JSON header, unless the output says otherwise",
    }
    for name in sorted(kserve.IGNORED_PARAMETERS):
        props[name] = {
            "type": "integer",
            "minimum": 0,
            "description": "a scheduling hint Triton's client may send: accepted, no effect here",
        }
    return _obj(props, [], additionalProperties=False, description="the model's options (see its metadata) and the protocol's own")


def _per_model(whats: list[tuple[str, str]]) -> str:
    """One text if every model says the same, else each model's."""
    if len({what for _, what in whats}) == 1:
        return whats[0][1]
    return "; ".join(f"{model}: {what}" for model, what in whats)


def _v2_input(name: str, data: list, datatype: str = "FP32") -> dict:
    shape = [len(data), len(data[0])] if isinstance(data[0], list) else [len(data)]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _v2_infer_examples() -> dict:
    """Keyed model_..., so that each is sent to its model."""
    worked = [_v2_input("q", WORKED_Q), _v2_input("k", WORKED_Q), _v2_input("v", WORKED_V)]
    flat = [{**i, "data": [x for row in i["data"] for x in row]} for i in worked]
    mha = [_v2_input(n, m) for n, m in (("x", MHA_X), ("wq", EYE4), ("wk", EYE4), ("wv", EYE4), ("wo", EYE4))]
    return {
        "attention_worked_example": {
            "summary": "attention: the worked example, causal",
            "value": {"inputs": worked, "parameters": {"causal": True}},
        },
        "attention_flat_out_only": {
            "summary": "attention: flat data, float64, only the out output",
            "value": {"id": "flat-1", "inputs": flat, "outputs": [{"name": "out"}], "parameters": {"causal": True, "dtype": "float64"}},
        },
        "attention_sequence_one_step": {
            "summary": "attention_sequence: a sequence of one step (started and ended by this request)",
            "value": {
                "inputs": [
                    {"name": "q", "datatype": "FP32", "shape": [2, 1, 2], "data": [1, 0, 0, 1]},
                    {"name": "k", "datatype": "FP32", "shape": [1, 1, 2], "data": [1, 0]},
                    {"name": "v", "datatype": "FP32", "shape": [1, 1, 2], "data": [1, 2]},
                ],
                "parameters": {"sequence_id": "example", "sequence_start": True, "sequence_end": True, "return_lse": True},
            },
        },
        "mha_identity_projections": {
            "summary": "mha: identity projections, 2 heads (name: mha)",
            "value": {"inputs": mha, "parameters": {"heads": 2}},
        },
    }


def document() -> dict:
    """This app's document, built on first use."""
    held = services()
    if held.openapi is None:
        held.openapi = build(current_app)
    return held.openapi


# --- routes ---------------------------------------------------------------------------------


@bp.get("/openapi.json")
def openapi_json():
    """The OpenAPI 3 document."""
    return json_response(copy.deepcopy(document()))


@bp.get("/docs")
def docs():
    """Swagger UI for the document; every asset is served from /docs/... by this service."""
    resp = Response(DOCS_HTML, mimetype="text/html")
    resp.headers["Content-Security-Policy"] = DOCS_POLICY
    return resp


@bp.get("/docs/<path:filename>")
def docs_asset(filename: str):
    """Swagger UI's files, from the swagger-ui-bundle package."""
    if filename not in DOCS_ASSETS:
        raise RequestError("not_found", f"There is no documentation asset {filename!r}.")
    return send_from_directory(str(swagger_ui_path), filename, max_age=3600)


@bp.get("/")
def landing():
    """A small HTML page pointing to the documentation."""
    return Response(LANDING_HTML.replace("{version}", VERSION), mimetype="text/html")


# Relative URLs, so the pages also work behind a path prefix (/docs -> docs/..., openapi.json).
DOCS_HTML = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>Attention service: API</title>
  <link rel="stylesheet" href="docs/swagger-ui.css">
  <link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="docs/swagger-ui-bundle.js"></script>
  <script src="docs/swagger-ui-standalone-preset.js"></script>
  <script>{script}</script>
</body>
</html>
"""
DOCS_SCRIPT = """
    window.ui = SwaggerUIBundle({
      url: "openapi.json",
      dom_id: "#swagger-ui",
      deepLinking: true,
      validatorUrl: null,
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
      layout: "StandaloneLayout"
    });
  """
DOCS_HTML = DOCS_HTML.replace("{script}", DOCS_SCRIPT)
DOCS_POLICY = html_policy(DOCS_SCRIPT)  # the inline script above, by its hash, and no other

LANDING_HTML = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Attention service</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 2em auto">
  <h1>Attention service <small>{version}</small></h1>
  <p>Scaled dot-product attention (<code>POST /attention</code>) and multi-head attention
  (<code>POST /mha</code>) over HTTP, with numpy-exact semantics.</p>
  <ul>
    <li><a href="playground">playground</a>: see the attention weights of a few cases, or of your own q, k, v</li>
    <li><a href="docs">docs</a>: try the API in the browser</li>
    <li><a href="openapi.json">openapi.json</a>: the OpenAPI 3 document</li>
    <li><a href="limits">limits</a>: the limits in force</li>
    <li><a href="v2">v2</a>: the Open Inference Protocol (KServe v2, Triton clients); models
      <a href="v2/models/attention">attention</a> and <a href="v2/models/mha">mha</a></li>
  </ul>
</body>
</html>
"""
