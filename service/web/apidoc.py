"""What the OpenAPI document says in words (service/web/openapi.py generates the rest): the tags,
the operations' summaries, the statuses, headers and notes of each door, and the requests shown
as examples (what /docs pre-fills; each is answered 200, as tests/test_openapi.py checks)."""

from __future__ import annotations

from typing import Any, NamedTuple

from schemas import kserve as protocol

from .http import MAX_REQUEST_ID

ERROR_DESCRIPTIONS = {
    400: "body is not strict JSON or not an object (bad_json), or its Content-Encoding does not decode (bad_compression)",
    401: "no valid API key",
    413: "body, T, S or score elements over a limit",
    415: "not application/json, or a Content-Encoding other than identity, gzip or deflate",
    422: "JSON but not a valid request",
    503: "overloaded: retry after Retry-After seconds",
    504: "the X-Deadline-Ms deadline cannot be met",
}


def header(description: str, required: bool = True, kind: str = "string") -> dict:
    return {"required": required, "schema": {"type": kind}, "description": description}


def parameter(name: str, where: str, description: str, schema: dict | None = None, required: bool = False) -> dict:
    return {"name": name, "in": where, "required": required, "schema": schema or {"type": "string"}, "description": description}


TIMING_HEADERS = {
    "Server-Timing": header("W3C Server-Timing: decode, validate, compute, encode, total (ms)"),
    "X-Request-Id": header("echoed if the client sent one"),
    "traceparent": header("W3C Trace Context: the caller's trace (or a new one) and this request's span id"),
}
# X-Deadline-Ms is described in words, not as a parameter: a deadline too short to meet is
# answered 504 by design, which a fuzzer sending tiny deadlines would report as a server error.
COMPUTE_PARAMETERS = [
    parameter(
        "X-Request-Id",
        "header",
        f"echoed in the response's X-Request-Id if it is 1 to {MAX_REQUEST_ID} printable ASCII characters (else a fresh one is made)",
    ),
    parameter(
        "traceparent", "header", "W3C Trace Context (version 00): the request's span continues this trace; a malformed one is ignored"
    ),
]
DEADLINE_NOTE = (
    " Send X-Deadline-Ms (milliseconds, > 0) to have work that cannot finish in time refused with 504"
    " before computing; anything but a positive number there is 422 bad_option."
)


INFO = {
    "description": "Scaled dot-product attention and multi-head attention over HTTP, natively and "
    "under the Open Inference Protocol (KServe v2) at /v2."
}
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
        "models attention, attention_sequence (Triton's sequence extension, on a session) and mha, inputs named as the "
        "native fields, options as request parameters, the binary tensor data extension, errors as {error: message}",
        "externalDocs": {"url": "https://github.com/kserve/open-inference-protocol"},
    },
]


# On every error answer of both doors (the /v2 protocol's body carries only a message).
ERROR_HEADERS = {
    "X-Error-Code": header("the error's code (in the native body too, as error.code; the /v2 body is only a message)"),
    "X-Error-Field": header(
        "the request field the error names, when it names one: percent-encoded (UTF-8) but for printable ASCII other than %, "
        "and left out past 256 characters",
        required=False,
    ),
}


V2_ERROR_DESCRIPTIONS = {
    **ERROR_DESCRIPTIONS,
    400: "not a valid infer request for this model, as the protocol answers it: the body (or its JSON header) not strict"
    " JSON, Inference-Header-Content-Length not the header's length, a Content-Encoding that does not decode, or any"
    " invalid input or parameter (the native door's 422); the code is in X-Error-Code",
    404: "no such model, or no such version of it",
    415: "a Content-Encoding other than identity, gzip or deflate (the Content-Type is not checked: the protocol's clients send none)",
}


SESSION_ERROR_DESCRIPTIONS = {
    **ERROR_DESCRIPTIONS,
    404: "session_not_found: unknown, expired, deleted, or another API key's",
    409: "length_conflict: the session's length is not at (or the length asked); error.length is its length",
    413: "too_long: past the session's max_tokens (or max_tokens over the server's); too_large: heads over ATTN_MAX_D, or a page of the session larger than the sessions' memory",
    503: "overloaded: the sessions' memory or table is full (no live session is evicted); retry after Retry-After",
}
# The protocol's summary of each view of kserve.bp: a /v2 route added without one fails the build.
V2_SUMMARIES = {
    "server_metadata": "Server Metadata",
    "live": "Server Live",
    "ready": "Server Ready",
    "model_metadata": "Model Metadata",
    "model_config": "Model Configuration (Triton's extension)",
    "model_ready": "Model Ready",
    "infer": "Inference",
    "model_stats": "Model Statistics (Triton's extension)",
    "shm_status": "System Shared Memory Status (Triton's extension)",
    "shm_register": "System Shared Memory Register (Triton's extension)",
    "shm_unregister": "System Shared Memory Unregister (Triton's extension)",
    "cuda_shm_status": "CUDA Shared Memory Status (Triton's extension; always empty: no GPU)",
    "cuda_shm_register": "CUDA Shared Memory Register (Triton's extension; always 400: no GPU)",
    "cuda_shm_unregister": "CUDA Shared Memory Unregister (Triton's extension; nothing to unregister)",
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
SHM_NOTE = (
    " Off unless the server runs with ATTN_ALLOW_CLIENT_SHM=true (400 otherwise). An infer input or requested output "
    "whose parameters give shared_memory_region and shared_memory_byte_size (and optionally shared_memory_offset) is "
    "read from, or written to, that registered region instead of the body."
)


PATH_PARAMETERS = {  # by name, wherever a path has it
    "sid": parameter("sid", "path", "the session's id", required=True),
    "name": parameter("name", "path", "the model", {"type": "string", "enum": list(protocol.MODELS)}, required=True),
    "version": parameter("version", "path", "the only version of each model", {"type": "string", "enum": [protocol.MODEL_VERSION]}, True),
    "region": parameter(
        "region", "path", "a system shared-memory region's name, the client's choice", {"type": "string", "example": "input0"}, True
    ),
}
INFERENCE_HEADER_PARAMETER = parameter(
    "Inference-Header-Content-Length",
    "header",
    "binary tensor data extension: the byte length of the JSON header, the inputs' bytes after it",
    {"type": "integer", "minimum": 0},
)


# The worked example: three tokens, d = 2; query 0 sees only key 0 under causal, query 2 all three.
WORKED_Q = [[1, 0], [0, 1], [1, 1]]
WORKED_V = [[1, 0], [0, 10], [5, 5]]
MHA_X = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]
EYE4 = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]

ATTENTION_EXAMPLES = {
    "worked_example": {"summary": "the worked example, causal", "value": {"q": WORKED_Q, "k": WORKED_Q, "v": WORKED_V, "causal": True}},
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
MHA_EXAMPLES = {
    "identity_projections": {
        "summary": "identity projections, 2 heads",
        "value": {"x": MHA_X, "wq": EYE4, "wk": EYE4, "wv": EYE4, "wo": EYE4, "heads": 2},
    }
}


def _v2_input(name: str, data: list, datatype: str = "FP32") -> dict:
    shape = [len(data), len(data[0])] if isinstance(data[0], list) else [len(data)]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


_WORKED = [_v2_input("q", WORKED_Q), _v2_input("k", WORKED_Q), _v2_input("v", WORKED_V)]
# Keyed <model>_..., so that each is sent to its model (the longest model name the key starts with).
V2_INFER_EXAMPLES = {
    "attention_worked_example": {
        "summary": "attention: the worked example, causal",
        "value": {"inputs": _WORKED, "parameters": {"causal": True}},
    },
    "attention_flat_out_only": {
        "summary": "attention: flat data, float64, only the out output",
        "value": {
            "id": "flat-1",
            "inputs": [{**i, "data": [x for row in i["data"] for x in row]} for i in _WORKED],
            "outputs": [{"name": "out"}],
            "parameters": {"causal": True, "dtype": "float64"},
        },
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
        "value": {
            "inputs": [_v2_input(n, m) for n, m in (("x", MHA_X), ("wq", EYE4), ("wk", EYE4), ("wv", EYE4), ("wo", EYE4))],
            "parameters": {"heads": 2},
        },
    },
}


Answer = tuple[str, str, str | None, dict | None]  # an operation's status, description, body's schema and headers


class Operation(NamedTuple):
    """A native operation as the document says it (its schemas, named, are drawn from schemas/)."""

    op_id: str
    tag: str
    summary: str
    request: str | None  # the request body's schema
    answer: Answer
    errors: tuple[int, ...]  # its error statuses (400 and 415 too with a request body)
    description: str = ""
    examples: dict | None = None
    parameters: tuple[dict, ...] = ()  # beyond those in its path (PATH_PARAMETERS)
    said: dict[int, str] = ERROR_DESCRIPTIONS  # what each error status means here


_COMPUTED: Answer = ("200", "the result", "ComputeResponse", TIMING_HEADERS)
_CREATED = ("201", "created", "Session", {"Location": header("/sessions/{id}", required=False)})
_STEPPED = ("200", "the step", "SessionStepResponse", TIMING_HEADERS)
_LENGTH = ("200", "the length", "SessionLength", None)


def _session(op_id: str, summary: str, request: str | None, answer: Answer, errors: tuple[int, ...]) -> Operation:
    return Operation(op_id, SESSIONS_TAG, summary, request, answer, errors, said=SESSION_ERROR_DESCRIPTIONS)


NATIVE: dict[tuple[str, str], Operation] = {  # (path, method): the operation
    ("/attention", "post"): Operation(
        "attention",
        NATIVE_TAG,
        "Scaled dot-product attention over any leading axes",
        "AttentionRequest",
        _COMPUTED,
        (413, 422, 503, 504),
        "out = softmax(q kᵀ · scale, masked) v. Masked weights are exactly 0; a row with no allowed key gives zeros." + DEADLINE_NOTE,
        ATTENTION_EXAMPLES,
        tuple(COMPUTE_PARAMETERS),
    ),
    ("/mha", "post"): Operation(
        "mha",
        NATIVE_TAG,
        "Multi-head self-attention with projections (the GPT block)",
        "MhaRequest",
        _COMPUTED,
        (413, 422, 503, 504),
        "Q,K,V = x Wq, x Wk, x Wv, split into heads, attention scaled by 1/sqrt(d/h), heads concatenated, then @ Wo." + DEADLINE_NOTE,
        MHA_EXAMPLES,
        tuple(COMPUTE_PARAMETERS),
    ),
    ("/sessions", "post"): _session("createSession", "Create a session", "SessionCreateRequest", _CREATED, (413, 422, 503)),
    ("/sessions/{sid}", "get"): _session(
        "getSession", "A session's description and length", None, ("200", "the session", "Session", None), (404,)
    ),
    ("/sessions/{sid}", "delete"): _session("deleteSession", "Delete a session", None, ("204", "deleted", None, None), (404,)),
    ("/sessions/{sid}/append", "post"): _session(
        "appendSession",
        "Append tokens (k, v); with at, only if the length is at",
        "SessionAppendRequest",
        _LENGTH,
        (404, 409, 413, 422, 503),
    ),
    ("/sessions/{sid}/attention", "post"): _session(
        "stepSession",
        "A step: new tokens appended (atomically), then q attends to all the session's keys",
        "SessionStepRequest",
        _STEPPED,
        (404, 409, 413, 422, 503, 504),
    ),
    ("/sessions/attention", "post"): _session(
        "stepSessions",
        "One step for several sessions at once (their lengths may differ)",
        "SessionBatchRequest",
        _STEPPED,
        (404, 409, 413, 422, 503, 504),
    ),
    ("/sessions/{sid}/fork", "post"): _session(
        "forkSession", "A new session sharing this one's first length tokens", "SessionLengthRequest", _CREATED, (404, 409, 422, 503)
    ),
    ("/sessions/{sid}/truncate", "post"): _session(
        "truncateSession", "Drop the tokens after length", "SessionLengthRequest", _LENGTH, (404, 409, 422)
    ),
}

# The operations endpoints: path -> (operationId, summary, {status: (description, body schema)}).
OPERATIONS: dict[str, tuple[str, str, dict[str, tuple[str, str | None]]]] = {
    "/healthz": ("healthz", "Liveness: 200 while the process lives", {"200": ("alive", "Status")}),
    "/readyz": (
        "readyz",
        "Readiness: 200 when it can serve, 503 while starting or draining",
        {"200": ("ready", "Status"), "503": ("starting or draining", "Status")},
    ),
    "/limits": ("limits", "The limits in force, the default dtype, the cost model and the version", {"200": ("the limits", "Limits")}),
    "/metrics": ("metrics", "Prometheus metrics", {"200": ("Prometheus text exposition", None)}),
}
METRICS_ANSWER = {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
LIMITS = {  # what /limits answers beyond the settings' limits
    "server_slots": {
        "type": "integer",
        "description": "compute requests the whole server holds at once, a safety cap: (max_inflight + max_queue) x the workers "
        "running; past it, 503",
    },
    "admission": {
        "type": "object",
        "description": "the admission policy: by predicted time until the answer starts, the wait bound, the "
        "slots, memory and parse charges",
    },
}
# Each /v2 view's answer (infer's is drawn with its headers), its error statuses, and those 401
# too when API keys are in force (auth.GUARDED_POST's).
V2_BODIES = {
    "server_metadata": "metadata_server_response",
    "live": "server_live_response",
    "ready": "server_ready_response",
    "model_ready": "model_ready_response",
    "model_metadata": "metadata_model_response",
    "model_config": "model_config_response",
    "model_stats": "stats_model_response",
    **dict.fromkeys(("shm_status", "cuda_shm_status"), "system_shared_memory_status_response"),
    **dict.fromkeys(("shm_register", "shm_unregister", "cuda_shm_register", "cuda_shm_unregister"), "system_shared_memory_response"),
}
V2_ERRORS = {
    **dict.fromkeys(("model_metadata", "model_config", "model_ready", "model_stats"), (404,)),  # no such model or version
    **dict.fromkeys(("shm_status", "shm_unregister", "cuda_shm_status", "cuda_shm_unregister"), (400,)),
    **dict.fromkeys(("shm_register", "cuda_shm_register"), (400, 415)),
}
V2_GUARDED = frozenset({"shm_register", "shm_unregister", "cuda_shm_register", "cuda_shm_unregister"})  # POSTs
V2_REQUESTS = dict.fromkeys(  # the operations' request bodies (infer's is drawn with its examples)
    ("shm_register", "cuda_shm_register"),
    {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/system_shared_memory_register_request"}}},
        }
    },
)
BINARY_ANSWER_HEADER = {
    "Inference-Header-Content-Length": header("on an application/octet-stream answer: the JSON header's byte length", False, "integer")
}


def models_summary() -> str:
    """Each model's inputs, outputs and parameters, from the model table."""
    parts = []
    for model in protocol.MODELS.values():
        inputs = ", ".join(f"{n} (optional)" if n in model.optional else n for n in model.inputs)
        parts.append(f"{model.name}: inputs {inputs}; outputs {', '.join(model.outputs)}; parameters {', '.join(model.parameters)}.")
    return "The models: " + " ".join(parts)


# What a /v2 view's description says beyond its docstring.
V2_NOTES = {
    "model_metadata": " " + models_summary(),
    "infer": BINARY_NOTE + DEADLINE_NOTE,
    **dict.fromkeys((f"{kind}shm_{op}" for kind in ("", "cuda_") for op in ("status", "register", "unregister")), SHM_NOTE),
}
