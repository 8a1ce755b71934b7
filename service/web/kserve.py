"""Blueprint for the Open Inference Protocol (KServe v2 REST, as Triton speaks it): /v2/...

One computation, two front doors. An infer request is translated into the very dict that the
native endpoint's schema loads -- each input becomes its tensor field, each request parameter its
option -- so the same validation, limits, error codes, timing phases and numeric core apply; only
the envelope differs:

  JSON input    {"name": "q", "datatype": "FP32", "shape": [2, 3], "data": [flat or nested]}
                  -> {"shape": [2, 3], "dtype": "float32", "data": [flat] or NestedData([nested])}
  binary input  {"name": "q", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}
                plus 24 raw little-endian bytes after the JSON header (Inference-Header-Content-Length)
                  -> {"shape": [2, 3], "dtype": "float32", "b64": Payload(the 24 bytes)}, as
                     service.wire's loads() gives a b64 value: the bytes are never re-encoded

Outputs are `out`, `weights` and (attention, with parameter return_lse) `lse`, as JSON `data` (flat, row-major) or, per output
(`parameters.binary_data`) or request-wide (`parameters.binary_data_output`), as raw bytes after
the JSON header. Errors are {"error": "message"} (error_body, which errors.py uses for this
blueprint), with the native status; the schemas are built with labels, so their messages say
"input q ..." or "parameter causal ..." in the protocol's terms.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, Response, request

from schemas import AttentionRequest, MhaRequest, RequestError
from schemas.fields import show
from schemas.jobs import AttentionJob, MhaJob, SessionStepJob
from schemas.sessions import SequenceStepRequest, step_job
from service import sessions, wire
from service.config import VERSION, Settings

from . import held, shared_memory
from .compute import cost, run, validate, validate_only
from .context import services
from .http import check_media_type, json_response, parse_json, phase, phases_ms, read_body

bp = Blueprint("kserve", __name__, url_prefix="/v2")

SERVER_NAME = "attention-service"
MODEL_VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]  # and system_shared_memory where allowed
PLATFORM = "numpy"  # the metadata's platform, and the configuration's platform and backend

DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "BOOL": "bool", "INT32": "int32", "INT64": "int64"}  # -> wire dtypes
FLOAT = ("FP32", "FP64", "FP16")  # FP16 inputs are computed in parameters.dtype, as float16 b64 in the native JSON
OUTPUT_DATATYPES = {wire.WIRE_DTYPES[DATATYPES[datatype]]: datatype for datatype in FLOAT}  # FP16: weights_dtype float16
OUTPUT_DATATYPE = FLOAT[0]  # the outputs' advertised datatype: FP64 or FP16 as the request's parameters say
# Scheduling hints Triton's client may send (TRITON_RESERVED_REQUEST_PARAMS); this server has no
# batcher or sequence scheduler to give them to, so they are accepted and have no effect.
IGNORED_PARAMETERS = frozenset({"priority", "timeout"})
REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
INPUT_KEYS = ("name", "datatype", "shape", "parameters", "data")  # the protocol's input tensor object
OUTPUT_KEYS = ("name", "parameters")  # ... and its requested output object


@dataclass(frozen=True)
class Model:
    """One served computation as the protocol describes it. inputs: name -> (accepted datatypes,
    metadata shape with -1 for a variable axis, description); the first datatype is advertised."""

    name: str
    schema: type
    inputs: dict[str, tuple[tuple[str, ...], list[int], str]]
    optional: frozenset[str]
    outputs: dict[str, tuple[list[int], str]]  # out and weights, then those sent only when asked for
    parameters: dict[str, str]  # the request parameters, named as the native JSON fields -> what each takes

    @property
    def options(self) -> tuple[str, ...]:
        """The request parameters' names."""
        return tuple(self.parameters)

    def labels(self) -> dict[str, str]:
        """What the schema's messages call each field: the protocol's input or parameter."""
        return {**{n: f"input {n}" for n in self.inputs}, **{o: f"parameter {o}" for o in self.options}}


MODELS = {
    "attention": Model(
        name="attention",
        schema=AttentionRequest,
        inputs={
            "q": (FLOAT, [-1, -1, -1, -1], "queries (..., T, d): rank 2 to 6, any leading axes"),
            "k": (FLOAT, [-1, -1, -1, -1], "keys (..., S, d): q's leading axes"),
            "v": (FLOAT, [-1, -1, -1, -1], "values (..., S, dv): k's leading axes and S"),
            "mask": (("BOOL",), [-1, -1, -1, -1], "optional; true = may attend; broadcasts to (..., T, S)"),
            "key_lengths": (
                ("INT64", "INT32"),
                [-1, -1],
                "optional; key s allowed iff s < key_lengths[...]; broadcasts to the leading axes",
            ),
            "bias": (FLOAT, [-1, -1, -1, -1], "optional; added to the scaled scores (SDPA's float attn_mask); broadcasts to (..., T, S)"),
            "alibi_slopes": (
                FLOAT,
                [-1, -1],
                "optional; ALiBi slopes (FlashAttention's): -slope*|t + S - T - s|; broadcast to the leading axes",
            ),
        },
        optional=frozenset({"mask", "key_lengths", "bias", "alibi_slopes"}),
        outputs={
            "out": ([-1, -1, -1, -1], "(..., T, dv)"),
            "weights": ([-1, -1, -1, -1], "(..., T, S); (..., T, S) without axis -3 when averaged"),
            "lse": ([-1, -1, -1], "(..., T): the log-sum-exp of each row's scores; optional, sent when parameter return_lse is true"),
        },
        parameters={
            "causal": 'false, true, "top_left" or "bottom_right"',
            "scale": "number > 0; default 1/sqrt(d)",
            "return_weights": "bool; default true",
            "dtype": '"float32" or "float64"',
            "enable_gqa": "bool: k, v may have Hkv heads on axis -3 dividing q's H",
            "window": '"left,right" (or [left, right]), integers >= -1: FlashAttention\'s window_size',
            "average_weights": "bool: weights averaged over the heads axis -3",
            "weights_dtype": '"float16", "float32" or "float64": the weights output\'s datatype',
            "return_lse": "bool; default false: also the lse output (FlashAttention's softmax_lse)",
        },
    ),
    "attention_sequence": Model(
        name="attention_sequence",
        schema=SequenceStepRequest,
        inputs={
            "q": (FLOAT, [-1, -1, -1], "the new tokens' queries (H, t, d)"),
            "k": (FLOAT, [-1, -1, -1], "their keys (Hkv, t, d), appended to the sequence's"),
            "v": (FLOAT, [-1, -1, -1], "their values (Hkv, t, dv)"),
        },
        optional=frozenset(),
        outputs={
            "out": ([-1, -1, -1], "(H, t, dv): the new tokens' attention over the whole sequence"),
            "lse": ([-1, -1], "(H, t): optional, sent when parameter return_lse is true"),
        },
        parameters={
            "sequence_id": "the sequence (Triton's sequence extension): a number > 0 or a string",
            "sequence_start": "bool: this request starts the sequence, its shapes from q, k, v (and ends one of that id)",
            "sequence_end": "bool: the sequence ends with this request",
            "causal": 'default "bottom_right" (query i of t sees the keys up to its own); false sees all',
            "scale": "number > 0; default 1/sqrt(d)",
            "window": '"left,right" (or [left, right]), integers >= -1: FlashAttention\'s window_size',
            "return_lse": "bool; default false: also the lse output",
        },
    ),
    "mha": Model(
        name="mha",
        schema=MhaRequest,
        inputs={
            "x": (FLOAT, [-1, -1, -1], "input (n, d) or (B, n, d)"),
            "wq": (FLOAT, [-1, -1], "query projection (d, heads*dk)"),
            "wk": (FLOAT, [-1, -1], "key projection (d, kv_heads*dk)"),
            "wv": (FLOAT, [-1, -1], "value projection (d, kv_heads*dv)"),
            "wo": (FLOAT, [-1, -1], "optional; output projection (heads*dv, d_out); without it the heads are concatenated"),
        },
        optional=frozenset({"wo"}),
        outputs={"out": ([-1, -1, -1], "(n, d_out) or (B, n, d_out)"), "weights": ([-1, -1, -1, -1], "(h, n, n) or (B, h, n, n)")},
        parameters={
            "heads": "int: query heads, dividing wq's width",
            "causal": "bool; default true",
            "return_weights": "bool; default true",
            "dtype": '"float32" or "float64"',
            "scale": "number > 0; default 1/sqrt(dk)",
            "kv_heads": "int dividing heads: grouped-query attention; default heads",
            "window": '"left,right" (or [left, right]), integers >= -1: FlashAttention\'s window_size',
            "weights_dtype": '"float16", "float32" or "float64": the weights output\'s datatype',
        },
    ),
}


def build_schemas(settings: Settings) -> dict[str, AttentionRequest | MhaRequest | SequenceStepRequest]:
    """Each model's schema, the native one with the protocol's labels."""
    return {name: model.schema(settings, labels=model.labels()) for name, model in MODELS.items()}


def error_body(err: RequestError, status: int) -> dict:
    """The protocol's error shape: {"error": "message"}."""
    return {"error": err.message}


# --- health and metadata -----------------------------------------------------------------------


@bp.before_request
def _known_model() -> None:
    """OPTIONS on a model's routes: 404 for a model or version not served, as its GET and POST
    answer (Flask answers OPTIONS itself, before any view would look the model up)."""
    if request.method == "OPTIONS" and request.view_args and "name" in request.view_args:
        _model(request.view_args["name"], request.view_args.get("version"))


@bp.get("")
def server_metadata():
    """The server's name, version and protocol extensions."""
    extensions = EXTENSIONS + (["system_shared_memory"] if services().shm is not None else [])
    return json_response({"name": SERVER_NAME, "version": VERSION, "extensions": extensions})


@bp.get("/health/live")
def live():
    """200 while the process lives."""
    return json_response({"live": True})


@bp.get("/health/ready")
def ready():
    """200 when this worker can serve, 503 while starting or draining."""
    ok = _ready()
    return json_response({"ready": ok}, status=200 if ok else 503)


@bp.get("/models/<name>")
@bp.get("/models/<name>/versions/<version>")
def model_metadata(name: str, version: str | None = None):
    """Inputs, outputs, datatypes and shapes (-1: any length) of a model."""
    model = _model(name, version)
    return json_response(
        {
            "name": model.name,
            "versions": [MODEL_VERSION],
            "platform": PLATFORM,
            "inputs": [
                {
                    "name": n,
                    "datatype": types[0],
                    "shape": shape,
                    "parameters": {"datatypes": ",".join(types), "optional": n in model.optional, "description": doc},
                }
                for n, (types, shape, doc) in model.inputs.items()
            ],
            "outputs": [
                {
                    "name": n,
                    "datatype": OUTPUT_DATATYPE,
                    "shape": shape,
                    "parameters": {
                        "datatypes": "FP32,FP64,FP16",
                        "description": f"{doc}; FP64 when parameters.dtype is float64; weights FP16 when parameters.weights_dtype is float16",
                    },
                }
                for n, (shape, doc) in model.outputs.items()
            ],
            "parameters": dict(model.parameters),  # the request parameters this model takes (beyond the protocol's own)
        }
    )


@bp.get("/models/<name>/config")
@bp.get("/models/<name>/versions/<version>/config")
def model_config(name: str, version: str | None = None):
    """Triton's model configuration extension: the model as model_config.proto's JSON, read by
    Triton's tools (perf_analyzer) beside the metadata. The same table as the metadata: each
    datatype as TYPE_<datatype>, each shape as dims (-1: any length), the optional inputs marked.
    No batching or scheduling (max_batch_size 0, no dynamic_batching): each request is one call."""
    model = _model(name, version)
    return json_response(
        {
            "name": model.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "version_policy": {"specific": {"versions": [int(MODEL_VERSION)]}},
            "max_batch_size": 0,
            "input": [
                {
                    "name": n,
                    "data_type": f"TYPE_{types[0]}",
                    "format": "FORMAT_NONE",
                    "dims": shape,
                    "is_shape_tensor": False,
                    "allow_ragged_batch": False,
                    "optional": n in model.optional,
                }
                for n, (types, shape, _) in model.inputs.items()
            ],
            "output": [
                {"name": n, "data_type": f"TYPE_{OUTPUT_DATATYPE}", "dims": shape, "label_filename": "", "is_shape_tensor": False}
                for n, (shape, _) in model.outputs.items()
            ],
            **(_sequence_batching() if model.schema is SequenceStepRequest else {}),
        }
    )


def _sequence_batching() -> dict:
    """A sequence model's scheduling, as Triton's configuration declares it: a sequence idle past
    ATTN_SESSION_IDLE_S is freed (the server holds its state: a session)."""
    return {"sequence_batching": {"max_sequence_idle_microseconds": services().settings.session_idle_s * 1_000_000}}


@bp.get("/models/<name>/ready")
@bp.get("/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: str | None = None):
    """200 when the model can serve here, 503 while starting or draining."""
    model = _model(name, version)
    ok = _ready()
    return json_response({"name": model.name, "ready": ok}, status=200 if ok else 503)


# --- inference ---------------------------------------------------------------------------------


@bp.post("/models/<name>/infer")
@bp.post("/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None):
    """Run a model: the native schema, limits and core behind the protocol's envelope."""
    model = _model(name, version)
    if model.schema is SequenceStepRequest:
        return infer_sequence(model)
    req = load_infer(model)
    out, weights, *lse = run(req.job)
    return respond_infer(model, req, {"out": out, "weights": weights, "lse": lse[0] if lse else None})


def infer_sequence(model: Model) -> Response:
    """A step of a sequence (Triton's sequence extension) on the sessions' pool: sequence_start
    makes the session (its shapes from q, k, v; one of the same id is ended first), every request
    appends its k, v and attends, sequence_end frees it. The sequence is found by its id among the
    sessions of the request's API key."""
    check_media_type(require_json=False)
    with phase("decode"):
        header, blobs = _split_body(read_body())
        doc = parse_json(header)
        native, requested, binary_default = _translate(model, doc, _Blobs(blobs))
    native.pop("return_weights", None)  # _translate's, from the outputs asked for: this model has no weights output
    schema = services().kserve_schemas[model.name]
    data = validate_only(schema, native)
    if requested is None:
        requested = ["out", "lse"] if data["return_lse"] else ["out"]
    elif "lse" in requested and not data["return_lse"]:
        raise RequestError("bad_option", "parameter return_lse is false but the lse output was requested; drop one of them.", "return_lse")
    outputs = [(n, binary_default.get(n, binary_default[None])) for n in requested]
    q, k, v = data["q"], data["k"], data["v"]
    name, owner, pool = sessions.name_hash(data["sequence_id"]), held.owner(), held.pool()
    sid = pool.find(name, owner)
    if data["sequence_start"]:
        if sid is not None:  # a sequence of that id still held: ended, as a new one starts
            with held.session(sid) as old:
                old.delete()
        dtype = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
        heads, kv_heads = q.shape[0], k.shape[0]
        if kv_heads < 1 or heads % kv_heads:
            raise RequestError(
                "shape_mismatch", f"input k has {kv_heads} key/value heads, which do not divide input q's {heads} heads.", "k"
            )
        shape = sessions.Shape(heads, kv_heads, q.shape[2], v.shape[2], dtype)
        with held.refusals():
            sid = pool.create(shape, services().settings.session_max_tokens, owner, name=name)
    elif sid is None:
        raise RequestError(
            "session_not_found",
            f"Sequence {data['sequence_id'].partition(':')[2]} is not held: start it with parameter sequence_start, or it has ended or expired.",
            "sequence_id",
        )
    encoding = "b64"
    with held.session(sid) as s, held.refusals():
        S = held.append(s, schema, k, v, None)
        job = step_job(schema, data, q, s.shape, S, encoding, s.pages(S))
        out, _, *lse = run(job)
        s.commit(S)
        if data["sequence_end"]:
            s.delete()
    return respond_infer(model, InferRequest(job=job, id=doc.get("id"), outputs=outputs), {"out": out, "lse": lse[0] if lse else None})


@dataclass(frozen=True)
class InferRequest:
    job: AttentionJob | MhaJob | SessionStepJob
    id: str | None
    outputs: list[tuple[str, bool | shared_memory.Place]]  # (name, as binary, or the region it goes to) in response order


def load_infer(model: Model) -> InferRequest:
    """Read the envelope (decode), then validate it with the native schema (validate)."""
    check_media_type(require_json=False)  # the official client sends no Content-Type
    with phase("decode"):
        header, blobs = _split_body(read_body())
        doc = parse_json(header)
        native, requested, binary_default = _translate(model, doc, _Blobs(blobs))
    job = validate(services().kserve_schemas[model.name], native)
    return_lse = getattr(job, "return_lse", False)
    if requested is None:
        requested = ["out", "weights"] if job.return_weights else ["out"]
        requested += ["lse"] if return_lse else []
    elif "weights" in requested and not job.return_weights:
        raise RequestError(
            "bad_option", "parameter return_weights is false but the weights output was requested; drop one of them.", "return_weights"
        )
    elif "lse" in requested and not return_lse:
        raise RequestError("bad_option", "parameter return_lse is false but the lse output was requested; drop one of them.", "return_lse")
    outputs = [(n, binary_default.get(n, binary_default[None])) for n in requested]
    return InferRequest(job=job, id=doc.get("id"), outputs=outputs)


def respond_infer(model: Model, req: InferRequest, results: dict[str, np.ndarray | None]) -> Response:
    """The infer response: JSON outputs inline, binary outputs after the JSON header."""
    job = req.job
    timing = phases_ms()
    with phase("encode"):
        summary = cost(job)
        head: dict[str, Any] = {
            "model_name": model.name,
            "model_version": MODEL_VERSION,
            **({"id": req.id} if req.id is not None else {}),
            "parameters": {**summary, **{f"{k}_ms": v for k, v in timing.items()}},
            "outputs": [],
        }
        blobs: list[memoryview] = []
        for name, binary in req.outputs:
            arr = results[name]
            assert arr is not None  # only the outputs the job computed are requested
            dtype = np.dtype(job.weights_dtype or arr.dtype) if name == "weights" else arr.dtype  # weights_dtype: FP16 weights
            arr = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<"))
            entry: dict[str, Any] = {"name": name, "datatype": OUTPUT_DATATYPES[arr.dtype], "shape": list(arr.shape)}
            if isinstance(binary, shared_memory.Place):
                binary.write(arr, name)  # answered with neither data nor parameters, as Triton does (its C++ client requires so)
            elif binary:
                entry["parameters"] = {"binary_data_size": arr.nbytes}
                blobs.append(memoryview(arr).cast("B"))  # type: ignore[arg-type]  # an ndarray is a buffer
            else:
                entry["data"] = arr.reshape(-1)
            head["outputs"].append(entry)
        head_bytes = wire.dumps(head)
        if not blobs:
            return Response(head_bytes, mimetype="application/json")
        data, length = wire.binary_chunks(head_bytes, blobs)  # large tensors: copied piece by piece as they are sent
        resp = Response(data, mimetype="application/octet-stream")
        resp.headers["Content-Length"] = str(length)
        resp.headers["Inference-Header-Content-Length"] = str(len(head_bytes))
        return resp


# --- the envelope -> the native request -----------------------------------------------------------


class _Blobs:
    """The binary tensor data after the JSON header, taken in input order."""

    def __init__(self, data: memoryview):
        self.data, self.offset = data, 0

    def take(self, name: str, size: int) -> memoryview:
        if self.offset + size > len(self.data):
            left = len(self.data) - self.offset
            raise RequestError(
                "bad_shape",
                f"input {name} declares binary_data_size={size} but only {left} bytes of binary data are left after the JSON header.",
                name,
            )
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def check_consumed(self) -> None:
        if self.offset != len(self.data):
            raise RequestError(
                "bad_shape",
                f"{len(self.data)} bytes of binary data follow the JSON header but the inputs' binary_data_size add up to {self.offset}.",
            )


def _split_body(body: bytes | bytearray | mmap.mmap) -> tuple[bytes | bytearray | mmap.mmap, memoryview]:
    """(JSON header, binary data) per the Inference-Header-Content-Length header."""
    raw = request.headers.get("Inference-Header-Content-Length")
    if raw is None:
        return body, memoryview(b"")
    # ASCII digits only: int() also reads "3_53", "+353", " 353" and other scripts' digits.
    size = int(raw) if raw.isascii() and raw.isdigit() else -1
    if not 0 <= size <= len(body):
        raise RequestError(
            "bad_json",
            f"Inference-Header-Content-Length is {wire.show(raw)}; it must be the byte length of the JSON header, 0..{len(body)}.",
        )
    return body[:size], memoryview(body)[size:]


def _translate(model: Model, doc: dict, blobs: _Blobs) -> tuple[dict, list[str] | None, dict]:
    """The infer request -> (the native request dict, requested output names or None for all,
    {output name or None: send as binary})."""
    extra = sorted(set(doc) - REQUEST_KEYS)
    if extra:
        raise RequestError(
            "unknown_field",
            f"{show(extra[0])} is not a field of an infer request; the fields are: id, inputs, outputs, parameters.",
            extra[0][:FIELD_CHARS],
        )
    if "id" in doc and not isinstance(doc["id"], str):
        raise RequestError("bad_type", "id must be a string.", "id")
    params = _object(doc.get("parameters", {}), "parameters", "parameters")
    native = _inputs(model, doc.get("inputs"), blobs)

    for key, value in params.items():
        if key == "window" and isinstance(value, str):
            value = _window(value)  # the protocol's parameters are strings, numbers or booleans
        if key in model.options:
            native[key] = value
        elif key not in IGNORED_PARAMETERS and key != "binary_data_output":
            known = ", ".join((*model.options, "binary_data_output"))
            raise RequestError(
                "unknown_field",
                f"parameter {show(key)} is not a parameter of model {model.name}; its parameters are: {known}.",
                key[:FIELD_CHARS],
            )
    binary_default = {None: _bool(params.get("binary_data_output", False), "parameter binary_data_output", "binary_data_output")}

    requested = _outputs(model, doc["outputs"], binary_default) if "outputs" in doc else None
    if requested is not None and "return_weights" not in native:
        native["return_weights"] = "weights" in requested
    if requested is not None and "lse" in requested and "return_lse" not in native:
        native["return_lse"] = True
    return native, requested, binary_default


def _outputs(model: Model, specs, binary_default: dict) -> list[str]:
    """The requested output names, in order; each one's binary_data goes into binary_default."""
    requested = []
    for spec in _list(specs, "outputs"):
        spec = _object(spec, "each of outputs", "outputs")
        name = _name(spec, "each of outputs", "outputs")
        if name not in model.outputs:
            raise RequestError(
                "unknown_field",
                f"output {show(name)} is not an output of model {model.name}; its outputs are: {', '.join(model.outputs)}.",
                "outputs",
            )
        _known_keys(spec, OUTPUT_KEYS, f"output {name}", "outputs")
        if name in requested:
            raise RequestError("bad_option", f"output {name} is requested twice.", "outputs")
        out_params = _object(spec.get("parameters", {}), f"output {name} parameters", "outputs")
        unsupported = sorted(set(out_params) - {"binary_data"} - shared_memory.PARAMETERS)
        if unsupported:
            raise RequestError(
                "bad_option",
                f"output {name} has parameters {wire.show_names(unsupported)}; those supported are binary_data and "
                f"{', '.join(sorted(shared_memory.PARAMETERS))}.",
                "outputs",
            )
        if "binary_data" in out_params:
            binary_default[name] = _bool(out_params["binary_data"], f"output {name} parameter binary_data", "outputs")
        if (where := shared_memory.place(out_params, f"output {name}", "outputs")) is not None:
            binary_default[name] = where
        requested.append(name)
    return requested


def _inputs(model: Model, specs, blobs: _Blobs) -> dict:
    """The inputs -> {field: native tensor value}; every required input present, none twice."""
    native = {}
    for spec in _list(specs, "inputs"):
        spec = _object(spec, "each of inputs", "inputs")
        name = _name(spec, "each of inputs", "inputs")
        if name not in model.inputs:
            known = ", ".join(model.inputs)
            raise RequestError(
                "unknown_field", f"input {show(name)} is not an input of model {model.name}; its inputs are: {known}.", name[:FIELD_CHARS]
            )
        if name in native:
            raise RequestError("bad_option", f"input {name} is given twice.", name)
        native[name] = _tensor(model, name, spec, blobs)
    blobs.check_consumed()
    missing = [n for n in model.inputs if n not in native and n not in model.optional]
    if missing:
        raise RequestError("missing_field", f"input {missing[0]} is required by model {model.name}.", missing[0])
    return native


def _tensor(model: Model, name: str, spec: dict, blobs: _Blobs) -> dict:
    """One input tensor -> the flat or b64 value the native Tensor field decodes and checks."""
    _known_keys(spec, INPUT_KEYS, f"input {name}", name)
    accepted = model.inputs[name][0]
    datatype = spec.get("datatype")
    if datatype not in accepted:
        raise RequestError("bad_type", f"input {name} has datatype {show(datatype)}; it must be {' or '.join(accepted)}.", name)
    dtype = DATATYPES[datatype]
    shape = spec.get("shape")  # wire.decode checks it: a list of positive integers
    params = _object(spec.get("parameters", {}), f"input {name} parameters", name)
    unsupported = sorted(set(params) - {"binary_data_size"} - shared_memory.PARAMETERS)
    if unsupported:
        raise RequestError(
            "bad_option",
            f"input {name} has parameters {wire.show_names(unsupported)}; those supported are binary_data_size and "
            f"{', '.join(sorted(shared_memory.PARAMETERS))}.",
            name,
        )
    if (where := shared_memory.place(params, f"input {name}", name)) is not None:
        if "data" in spec or "binary_data_size" in params:
            raise RequestError("bad_encoding", f"input {name} is in shared memory and has data or binary_data_size too; send one.", name)
        return {"shape": shape, "dtype": dtype, "b64": wire.Payload(shared_memory.read_input(where, name))}
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if type(size) is not int or size < 0:
            raise RequestError("bad_type", f"input {name} has binary_data_size {show(size)}; it must be a byte count.", name)
        if "data" in spec:
            raise RequestError("bad_encoding", f"input {name} has both data and binary_data_size; send one.", name)
        return {"shape": shape, "dtype": dtype, "b64": wire.Payload(blobs.take(name, size))}
    if "data" not in spec:
        raise RequestError("missing_field", f"input {name} has neither data nor parameters.binary_data_size.", name)
    data = spec["data"]
    if (isinstance(data, list) and data and isinstance(data[0], list)) or (isinstance(data, np.ndarray) and data.ndim > 1):
        data = wire.NestedData(data)  # nested as the shape (lists, or an array wire.loads decoded): wire.decode checks that it is
    return {"shape": shape, "dtype": dtype, "data": data}


# --- small helpers ---------------------------------------------------------------------------------

FIELD_CHARS = 60  # of a name the client sent, as an error's field (logged, and sent as X-Error-Field)


def _known_keys(spec: dict, known: tuple[str, ...], what: str, field: str) -> None:
    """Refuse a key the protocol does not define (a typo such as "data_type" never passes silently)."""
    extra = [key for key in spec if key not in known]
    if extra:
        raise RequestError("unknown_field", f"{what} has keys {wire.show_names(extra)}; its keys are: {', '.join(known)}.", field)


def _model(name: str, version: str | None) -> Model:
    model = MODELS.get(name)
    if model is None:
        raise RequestError("not_found", f"Model {name!r} is not served here; the models are: {', '.join(MODELS)}.")
    if version is not None and version != MODEL_VERSION:
        raise RequestError("not_found", f"Model {name} has no version {version!r}; its only version is {MODEL_VERSION}.")
    return model


def _ready() -> bool:
    return services().readiness() == "ready"


def _name(spec: dict, what: str, field: str) -> str:
    """An input's or output's name, checked to be a string before it is looked up anywhere (a
    list or an object is unhashable: a dict lookup would raise TypeError, a 500)."""
    name = spec.get("name")
    if not isinstance(name, str):
        code = "bad_type" if name is not None else "missing_field"
        raise RequestError(code, f"{what} needs a name (a string), not {show(name)}.", field)
    return name


def _object(value, what: str, field: str) -> dict:
    """value if it is a JSON object; field: what the error names (the X-Error-Field header)."""
    if not isinstance(value, dict):
        raise RequestError("bad_type", f"{what} must be a JSON object, not {show(value)}.", field)
    return value


def _list(value, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise RequestError("missing_field" if value is None else "bad_type", f"{what} must be a non-empty list.", what)
    return value


WINDOW_TEXT = re.compile(r"\s*(-?[0-9]+)\s*,\s*(-?[0-9]+)\s*")


def _window(text: str):
    """ "256,0" -> [256, 0]; text that is not two integers (in ASCII digits: int() also reads
    "1_0" and other scripts' digits) is left for the schema to refuse."""
    match = WINDOW_TEXT.fullmatch(text)
    return [int(match[1]), int(match[2])] if match else text


def _bool(value, what: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError("bad_type", f"{what} must be true or false, not {show(value)}.", field)
    return value
