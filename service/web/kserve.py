"""Blueprint for the Open Inference Protocol (KServe v2 REST, as Triton speaks it): /v2/...

One computation, two front doors. An infer request is read by its model's envelope schema
(schemas/kserve.py, built from the model table there, which is also the metadata, the
configuration and the OpenAPI document) into the very dict that the native endpoint's schema
loads -- each input becomes its tensor field, each request parameter its option -- so the same
validation, limits, error codes, timing phases and numeric core apply; only the envelope differs:

  JSON input    {"name": "q", "datatype": "FP32", "shape": [2, 3], "data": [flat or nested]}
                  -> {"shape": [2, 3], "dtype": "float32", "data": [flat] or NestedData([nested])}
  binary input  {"name": "q", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}
                plus 24 raw little-endian bytes after the JSON header (Inference-Header-Content-Length)
                  -> {"shape": [2, 3], "dtype": "float32", "b64": Payload(the 24 bytes)}, as
                     service.wire's loads() gives a b64 value: the bytes are never re-encoded
  shared memory {..., "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 24}}
                  -> the same, the bytes read out of that registered region (shared_memory.py;
                     an output so named is written there), where ATTN_ALLOW_CLIENT_SHM allows it

Outputs are `out`, `weights` and (attention, with parameter return_lse) `lse`, as JSON `data` (flat, row-major) or, per output
(`parameters.binary_data`) or request-wide (`parameters.binary_data_output`), as raw bytes after
the JSON header. Errors are {"error": "message"} (error_body, which errors.py uses for this
blueprint), with the native status; the schemas are built with labels, so their messages say
"input q ..." or "parameter causal ..." in the protocol's terms.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, Response, request

from schemas import AttentionRequest, MhaRequest, RequestError
from schemas.jobs import AttentionJob, MhaJob, SessionStepJob
from schemas.kserve import (
    DATATYPES,
    IGNORED_PARAMETERS,
    MODEL_VERSION,
    MODELS,
    OUTPUT_DATATYPE,
    OUTPUT_DATATYPES,
    PLATFORM,
    BinaryInput,
    Envelope,
    Model,
    Shared,
    SharedInput,
    envelope,
)
from schemas.sessions import SequenceStepRequest, step_job
from service import sessions, wire
from service.admission import parse_charge
from service.config import VERSION, Settings

from . import held, shared_memory
from .compute import cost, run, validate, validate_only
from .context import services
from .http import check_media_type, json_response, parse_json, phase, phases_ms, read_body

__all__ = ["DATATYPES", "IGNORED_PARAMETERS", "MODELS", "MODEL_VERSION", "PLATFORM", "Model", "bp", "build_schemas", "error_body"]

bp = Blueprint("kserve", __name__, url_prefix="/v2")

SERVER_NAME = "attention-service"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]  # and system_shared_memory where allowed
ENVELOPES = {name: envelope(model) for name, model in MODELS.items()}  # each model's infer request (schemas/kserve.py)


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
    env, native = _read(model)
    schema = services().kserve_schemas[model.name]
    data = validate_only(schema, native)
    outputs = _outputs(env, weights=False, lse=data["return_lse"])
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
    return respond_infer(model, InferRequest(job=job, id=env.id, outputs=outputs), {"out": out, "lse": lse[0] if lse else None})


@dataclass(frozen=True)
class InferRequest:
    job: AttentionJob | MhaJob | SessionStepJob
    id: str | None
    outputs: list[tuple[str, bool | shared_memory.Place]]  # (name, as binary, or the region it goes to) in response order


def load_infer(model: Model) -> InferRequest:
    """Read the envelope (decode), then validate it with the native schema (validate)."""
    env, native = _read(model)
    job = validate(services().kserve_schemas[model.name], native)
    return InferRequest(job=job, id=env.id, outputs=_outputs(env, weights=job.return_weights, lse=getattr(job, "return_lse", False)))


def _read(model: Model) -> tuple[Envelope, dict[str, Any]]:
    """The decode phase: the envelope read by its model's schema, into the native request with
    the binary inputs' bytes in place."""
    check_media_type(require_json=False)  # the official client sends no Content-Type
    with phase("decode"):
        header, data = _split_body(read_body())
        env = ENVELOPES[model.name].read(parse_json(header))
        blobs = _Blobs(data)
        native = {name: _take(blobs, name, value) for name, value in env.native.items()}
        blobs.check_consumed()
    return env, native


def _outputs(env: Envelope, weights: bool, lse: bool) -> list[tuple[str, bool | shared_memory.Place]]:
    """The outputs sent, in order, each as bytes or not, or the shared-memory region it is written
    to: those asked for (each one the job computes), else out, and weights and lse when the job
    computes them."""
    requested = env.requested
    if requested is None:
        requested = ["out", *(["weights"] if weights else []), *(["lse"] if lse else [])]
    elif "weights" in requested and not weights:
        raise RequestError(
            "bad_option", "parameter return_weights is false but the weights output was requested; drop one of them.", "return_weights"
        )
    elif "lse" in requested and not lse:
        raise RequestError("bad_option", "parameter return_lse is false but the lse output was requested; drop one of them.", "return_lse")
    sent = [(n, env.binary.get(n, env.binary[None])) for n in requested]
    return [(n, shared_memory.place(how, f"output {n}", "outputs") if isinstance(how, Shared) else bool(how)) for n, how in sent]


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


def _header_size(raw: str | None, n: int) -> int | None:
    """Inference-Header-Content-Length's JSON header size in a body of n bytes: None without the
    header, -1 if it is not a size of 0..n."""
    if raw is None:
        return None
    # ASCII digits only: int() also reads "3_53", "+353", " 353" and other scripts' digits.
    size = int(raw) if raw.isascii() and raw.isdigit() else -1
    return size if 0 <= size <= n else -1


def body_charge(body: bytes | bytearray | mmap.mmap) -> int:
    """What parsing body takes at this door (service.admission.charge): the JSON header the binary
    extension names as JSON, the binary tensors after it their own size; the whole body as JSON
    without the header, or with one this door refuses unparsed."""
    size = _header_size(request.headers.get("Inference-Header-Content-Length"), len(body))
    return parse_charge(body, None if size is None or size < 0 else size)


def _split_body(body: bytes | bytearray | mmap.mmap) -> tuple[bytes | bytearray | mmap.mmap, memoryview]:
    """(JSON header, binary data) per the Inference-Header-Content-Length header."""
    raw = request.headers.get("Inference-Header-Content-Length")
    size = _header_size(raw, len(body))
    if size is None:
        return body, memoryview(b"")
    if size < 0:
        raise RequestError(
            "bad_json",
            f"Inference-Header-Content-Length is {wire.show(raw)}; it must be the byte length of the JSON header, 0..{len(body)}.",
        )
    return body[:size], memoryview(body)[size:]


def _take(blobs: _Blobs, name: str, value: Any) -> Any:
    """A binary input's bytes, or a shared-memory input's, as service.wire's loads() gives a b64
    value: never re-encoded; any other value as it is."""
    if isinstance(value, BinaryInput):
        return {"shape": value.shape, "dtype": value.dtype, "b64": wire.Payload(blobs.take(name, value.size))}
    if isinstance(value, SharedInput):
        where = shared_memory.place(value.where, f"input {name}", name)
        return {"shape": value.shape, "dtype": value.dtype, "b64": wire.Payload(shared_memory.read_input(where, name))}
    return value


# --- small helpers ---------------------------------------------------------------------------------


def _model(name: str, version: str | None) -> Model:
    model = MODELS.get(name)
    if model is None:
        raise RequestError("not_found", f"Model {name!r} is not served here; the models are: {', '.join(MODELS)}.")
    if version is not None and version != MODEL_VERSION:
        raise RequestError("not_found", f"Model {name} has no version {version!r}; its only version is {MODEL_VERSION}.")
    return model


def _ready() -> bool:
    return services().readiness() == "ready"
