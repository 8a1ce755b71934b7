"""The OpenAPI 3 document, generated from the marshmallow request schemas with apispec's
MarshmallowPlugin and served at GET /openapi.json; a Swagger UI page at GET /docs whose assets
come from the swagger-ui-bundle package and are served by this service (no CDN: it works
offline); and a small landing page at GET /.

The document is built once per app from the routes actually registered, so an endpoint appears
in it exactly when the service serves it."""

from __future__ import annotations

import copy
from dataclasses import fields as dataclass_fields

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint, Flask, Response, current_app, send_from_directory
from marshmallow import Schema, fields, validate
from swagger_ui_bundle import swagger_ui_path

from schemas import AttentionRequest, MhaRequest, RequestError
from schemas.fields import Tensor, Window
from service.config import VERSION, Settings
from service.wire import WIRE_DTYPES

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
_KINDS = {
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
    400: "body is not strict JSON or not an object",
    401: "no valid API key",
    413: "body, T, S or score elements over a limit",
    415: "not application/json",
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


def build(app: Flask) -> dict:
    """The OpenAPI 3.0 document of the routes registered on app."""
    settings: Settings = services(app).settings
    served = {rule.rule for rule in app.url_map.iter_rules()}
    spec = _spec(settings)
    _compute_paths(spec, settings, served)
    _ops_paths(spec, served)
    doc = spec.to_dict()
    for name in ("AttentionRequest", "MhaRequest"):
        doc["components"]["schemas"][name]["additionalProperties"] = False  # unknown fields are refused
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
            "description": "Scaled dot-product attention and multi-head attention over HTTP. The same "
            "computations are served under the Open Inference Protocol (KServe v2) at /v2; see its own specification."
        },
    )
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
    spec.components.schema("Status", schema=Status)
    spec.components.schema("Limits", _limits_schema(settings))
    if settings.api_keys:
        spec.components.security_scheme("bearer", {"type": "http", "scheme": "bearer"})
    return spec


# On every error answer of both doors (the /v2 protocol's body carries only a message).
ERROR_HEADERS = {
    "X-Error-Code": {"required": True, "schema": {"type": "string"}, "description": "the error's code, as in the body's error.code"},
    "X-Error-Field": {
        "schema": {"type": "string"},
        "description": "the request field the error names, when it names one: percent-encoded (UTF-8) but for printable ASCII other than %, and left out past 256 characters",
    },
}


def _errors(settings: Settings, *statuses: int) -> dict:
    """The error responses of an operation (401 too when API keys are in force)."""
    if settings.api_keys:
        statuses = (*statuses, 401)
    out = {}
    for status in sorted(set(statuses)):
        headers = dict(ERROR_HEADERS)
        if status == 503:
            headers["Retry-After"] = {"required": True, "schema": {"type": "integer"}, "description": "seconds"}
        out[str(status)] = {
            "description": ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": "Error"}},
            "headers": headers,
        }
    return out


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
                        **_errors(settings, 400, 413, 415, 422, 503, 504),
                    },
                }
            },
        )


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
            spec.path(path=path, operations={"get": {"operationId": op_id, "summary": summary, "responses": responses}})


def _json(description: str, schema: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _limits_schema(settings: Settings) -> dict:
    kinds = {int: "integer", "int": "integer", str: "string", "str": "string"}
    props = {f.name: {"type": kinds.get(f.type, "string")} for f in dataclass_fields(settings) if f.name in settings.limits()}
    props["server_slots"] = {
        "type": "integer",
        "description": "compute requests the whole server holds at once, a safety cap: (max_inflight + max_queue) x the workers running; past it, 503",
    }
    props["admission"] = {
        "type": "object",
        "description": "the admission policy: by predicted time until the answer is sent, the queue order, the wait bound, the slots, memory and parse charges",
    }
    props["cost_model"] = {"type": "object", "description": "ms = a*GFLOP + b*M_score_elements + c*blocks"}
    props["version"] = {"type": "string"}
    return {"type": "object", "required": sorted(props), "properties": props}


def _attention_examples() -> dict:
    seed = {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": True}
    return {
        "worked_example": {"summary": "the seed's worked example, causal", "value": seed},
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
    eye = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    x = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]
    return {
        "identity_projections": {
            "summary": "identity projections, 2 heads",
            "value": {"x": x, "wq": eye, "wk": eye, "wv": eye, "wo": eye, "heads": 2},
        }
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
