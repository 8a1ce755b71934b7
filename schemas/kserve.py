"""The Open Inference Protocol's /v2 door (KServe v2 REST, as Triton speaks it), described once.

The model table (MODELS) says what each served model takes and gives: its inputs (the native
request's tensor fields, with the protocol's datatypes and metadata shapes), its outputs and its
request parameters (the native request's options). The marshmallow schemas of the infer request's
envelope are built from it: per model (`envelope(model)`), they validate a request and load it
into an `Envelope` (the native request dict, which the native schema then checks under the
protocol's labels, "input q", "parameter causal"; the inputs whose bytes follow the JSON header;
the outputs wanted); over every model, they are what the OpenAPI document shows, beside the
responses' schemas (COMPONENTS, drawn by apispec in service/web/openapi.py). No HTTP here:
splitting the body and taking the inputs' bytes are the web layer's."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from marshmallow import EXCLUDE, INCLUDE, RAISE, Schema, fields, missing, post_load, pre_load, validate

from service import wire

from .errors import RequestError
from .fields import Bool, Coded, Int, Messages, show
from .requests import AttentionRequest, MhaRequest
from .responses import Cost
from .sessions import SequenceStepRequest

MODEL_VERSION = "1"
PLATFORM = "numpy"  # the metadata's platform, and the configuration's platform and backend
DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "BOOL": "bool", "INT32": "int32", "INT64": "int64"}  # -> wire dtypes
FLOAT = ("FP32", "FP64", "FP16")  # FP16 inputs are computed in parameters.dtype, as float16 b64 in the native JSON
OUTPUT_DATATYPES = {wire.WIRE_DTYPES[DATATYPES[datatype]]: datatype for datatype in FLOAT}  # FP16: weights_dtype float16
OUTPUT_DATATYPE = FLOAT[0]  # the outputs' advertised datatype: FP64 or FP16 as the request's parameters say
# Scheduling hints Triton's client may send (TRITON_RESERVED_REQUEST_PARAMS); this server has no
# batcher or sequence scheduler to give them to, so they are accepted and have no effect.
IGNORED_PARAMETERS = ("priority", "timeout")
SHM_CODE = "bad_shared_memory"  # a shared-memory parameter's refusals (400)
FIELD_CHARS = 60  # of a name the client sent, as an error's field (logged, and sent as X-Error-Field)


@dataclass(frozen=True)
class Model:
    """One served computation as the protocol describes it. inputs: name -> (accepted datatypes,
    metadata shape with -1 for a variable axis, description); the first datatype is advertised."""

    name: str
    schema: type[AttentionRequest] | type[MhaRequest] | type[SequenceStepRequest]
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
INPUT_NAMES = list(dict.fromkeys(n for m in MODELS.values() for n in m.inputs))
OUTPUT_NAMES = list(dict.fromkeys(n for m in MODELS.values() for n in m.outputs))


class BinaryInput(NamedTuple):
    """An input whose bytes follow the JSON header (binary_data_size), in input order."""

    shape: Any
    dtype: str
    size: int


class Shared(NamedTuple):
    """Where a tensor lies in a client's shared-memory region (Triton's system shared-memory
    extension): byte_size bytes at offset in the region registered under that name."""

    region: str
    offset: int
    byte_size: int


class SharedInput(NamedTuple):
    """An input whose bytes the web layer reads out of a shared-memory region."""

    shape: Any
    dtype: str
    where: Shared


@dataclass(frozen=True)
class Envelope:
    """An infer request as the native door takes it. native: the native request dict, a
    BinaryInput standing for each tensor whose bytes the web layer takes; requested: the outputs
    wanted in order, None for the default; binary: {output name or None (the default): as bytes,
    or the shared-memory region it is written to}."""

    id: str | None
    native: dict[str, Any]
    requested: list[str] | None
    binary: dict[str | None, bool | Shared]


# --- the envelope's fields ---------------------------------------------------------------------


class Text(Coded, fields.String):
    """A string; anything else is bad_type, "{label} must be a string."."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, str):
            raise self._error("bad_type", f"{self.label} must be a string.")
        return value


class Datatype(Coded, fields.String):
    """One of the protocol's datatypes this tensor accepts (a server-wide enum in the document)."""

    default_error_messages: Messages = {"required": "{label} needs a datatype."}

    def __init__(self, accepted: tuple[str, ...] = tuple(DATATYPES), **kwargs):
        self.accepted = accepted
        super().__init__(metadata={"enum": list(accepted), **kwargs.pop("metadata", {})}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if value not in self.accepted or not isinstance(value, str):
            raise self._error("bad_type", f"{self.label} has datatype {show(value)}; it must be {' or '.join(self.accepted)}.")
        return value


class Shape(Coded, fields.List):
    """The tensor's shape, passed on as sent: wire.decode checks it (a list of positive integers)."""

    default_error_messages: Messages = {"required": "{label} needs a shape."}

    def __init__(self, **kwargs):
        super().__init__(fields.Integer(validate=validate.Range(min=1)), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        return value


class TensorData(Coded, fields.Raw):
    """An input's values, flat or nested as its shape (a list, or the array wire.loads made of a
    long one): the native Tensor field decodes and checks them."""

    def __init__(self, **kwargs):
        super().__init__(allow_none=True, **kwargs)  # null: the native field's to refuse


class ByteCount(Coded, fields.Integer):
    """binary_data_size (or a shared-memory parameter, its code bad_shared_memory): a byte count."""

    def __init__(self, code: str = "bad_type", **kwargs):
        self.code = code
        super().__init__(strict=True, metadata={"minimum": 0, **kwargs.pop("metadata", {})}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if type(value) is not int or value < 0:
            raise self._error(self.code, f"{self.label} has {self.name} {show(value)}; it must be a byte count.")
        return value


class RegionName(Coded, fields.String):
    """shared_memory_region: a registered region's name (whether it is one is the web layer's)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, str):
            raise self._error(SHM_CODE, f"{self.label} has {self.name} {show(value)}; it must be a region's name.")
        return value


class Object(Coded, fields.Nested):
    """A JSON object loaded by its schema; anything else is bad_type, "{label} must be a JSON object"."""

    def _deserialize(self, value, attr, data, partial=None, **kwargs):
        if not isinstance(value, dict):
            raise self._error("bad_type", f"{self.label} must be a JSON object, not {show(value)}.")
        return self.schema.read(value)


class Tensors(Coded, fields.List):
    """inputs or outputs: a non-empty list of objects, each loaded by the schema of the tensor it
    names (by_name: its model's), none twice -> {name: loaded, in the order sent}."""

    default_error_messages: Messages = {"required": "{label} must be a non-empty list."}

    def __init__(self, kind: str, item: type[Schema], by_name: Mapping[str, _Envelope] | None = None, model: str = "", **kwargs):
        self.kind, self.by_name, self.model = kind, by_name or {}, model
        super().__init__(fields.Nested(item), validate=validate.Length(min=1), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs) -> Any:  # {name: loaded}, not a list
        kind, field = self.kind, self.name
        if not isinstance(value, list) or not value:
            raise self._error("missing_field" if value is None else "bad_type", f"{self.label} must be a non-empty list.")
        out: dict[str, Any] = {}
        for spec in value:
            if not isinstance(spec, dict):
                raise self._error("bad_type", f"each of {field} must be a JSON object, not {show(spec)}.")
            name = spec.get("name")
            if not isinstance(name, str):  # checked before it is looked up: a list or an object is unhashable
                code = "bad_type" if name is not None else "missing_field"
                raise self._error(code, f"each of {field} needs a name (a string), not {show(name)}.")
            schema = self.by_name.get(name)
            if schema is None:
                names = ", ".join(self.by_name)
                raise RequestError(
                    "unknown_field",
                    f"{kind} {show(name)} is not an {kind} of model {self.model}; its {field} are: {names}.",
                    name[:FIELD_CHARS] if kind == "input" else field,
                )
            if name in out:
                twice = f"{kind} {name} is given twice." if kind == "input" else f"{kind} {name} is requested twice."
                raise RequestError("bad_option", twice, name if kind == "input" else field)
            out[name] = schema.read(spec)
        return out


class Option(Coded, fields.Raw):
    """A model's option as a request parameter, passed on to the native request, whose field checks
    it under its label ("parameter causal"); the document shows it as those fields (`native`: one
    per model that has it)."""

    def __init__(self, native: list[fields.Field], **kwargs):
        self.native = native
        super().__init__(allow_none=True, **kwargs)  # null: the native field's to refuse or take as its default


WINDOW_TEXT = re.compile(r"\s*(-?[0-9]+)\s*,\s*(-?[0-9]+)\s*")


class WindowOption(Option):
    """window, also as the protocol's string "left,right" (its parameters are strings, numbers or
    booleans); text that is not two integers in ASCII digits is left for the native field to refuse."""

    def _deserialize(self, value, attr, data, **kwargs):
        match = WINDOW_TEXT.fullmatch(value) if isinstance(value, str) else None
        return [int(match[1]), int(match[2])] if match else value


# --- the envelope's objects ---------------------------------------------------------------------


class _Envelope(Schema):
    """An object of the envelope. what: what messages call it ("input q"); field: what its errors
    name. Its first unknown key is refused (in the order sent) before any field is read."""

    class Meta:
        unknown = RAISE

    def __init__(self, what: str = "", field: str | None = None, **kwargs):
        self.what, self.field = what, field
        super().__init__(**kwargs)
        self.required = {name for name, field in self.fields.items() if field.required}

    def on_bind_field(self, field_name: str, field_obj) -> None:
        if isinstance(field_obj, Coded):
            field_obj.typed_null = True  # "must be a string, not None", as for any other value
            if self.what:
                field_obj.label = self._label(field_name)
                field_obj.error_field = self.field

    def _label(self, name: str) -> str:
        return self.what

    def read(self, data: dict) -> Any:
        """Load data, a JSON object, as `load` does but field by field in the order sent: its
        first unknown key refused, each field's public `deserialize`, an absent required field
        refused, then `finish`. On the hot path marshmallow's own load costs several times the
        whole envelope's checks in its hooks and bookkeeping, most of it for the fields absent
        (`python -m bench v2_ab`, bench/README.md)."""
        if not data.keys() <= self.fields.keys():
            self._known_keys(data)
        fields_, out = self.fields, {}
        for name, value in data.items():
            out[name] = fields_[name].deserialize(value, name, data)
        if not self.required <= out.keys():
            for name in [name for name in fields_ if name not in out]:
                fields_[name].deserialize(missing, name, data)  # missing_field, if required
        return self.finish(out)

    @pre_load
    def _known_keys(self, data, **kwargs):
        extra = [key for key in data if key not in self.fields]
        if extra:
            self._unknown(extra)
        return data

    @post_load
    def _finish(self, data, **kwargs):
        return self.finish(data)

    def finish(self, data: dict) -> Any:
        """The object as the door takes it, from its loaded fields."""
        return data

    def _unknown(self, keys: list[str]):
        raise RequestError(
            "unknown_field", f"{self.what} has keys {wire.show_names(keys)}; its keys are: {', '.join(self.fields)}.", self.field
        )

    def handle_error(self, error, data, *, many: bool, **kwargs):
        """Only a check of marshmallow's own reaches here (the fields raise RequestError)."""
        messages = error.messages if isinstance(error.messages, dict) else {"": error.messages}
        name, text = next(iter(messages.items()))
        raise RequestError("bad_type", f"{self.what} {name}: {text}".replace("  ", " "), self.field or name or None)


class SharedParameters(_Envelope):
    """The system shared-memory extension's parameters of a tensor (off unless the server allows it)."""

    shared_memory_region = RegionName(metadata={"description": "system shared-memory extension: the registered region the tensor is in"})
    shared_memory_offset = ByteCount(SHM_CODE, metadata={"description": "system shared-memory extension: where in the region; default 0"})
    shared_memory_byte_size = ByteCount(SHM_CODE, metadata={"description": "system shared-memory extension: the tensor's bytes"})

    def _unknown(self, keys):
        known = ", ".join(self.fields)
        raise RequestError("bad_option", f"{self.what} has parameters {wire.show_names(keys)}; those supported are {known}.", self.field)

    def finish(self, data: dict) -> dict:
        """The parameters, with `shared`: the region the tensor is in, when they name one."""
        given = data.keys() & {"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"}
        if given and not {"shared_memory_region", "shared_memory_byte_size"} <= given:
            raise RequestError(
                SHM_CODE,
                f"{self.what} needs both shared_memory_region and shared_memory_byte_size (and optionally shared_memory_offset).",
                self.field,
            )
        if given:
            data["shared"] = Shared(data["shared_memory_region"], data.get("shared_memory_offset", 0), data["shared_memory_byte_size"])
        return data


class InputParameters(SharedParameters):
    binary_data_size = ByteCount(
        metadata={"description": "binary tensor data extension: the tensor's bytes follow the JSON header (no data then)"}
    )


class RequestInput(_Envelope):
    name = Text(
        required=True, metadata={"enum": INPUT_NAMES, "description": "; ".join(f"{m.name}: {', '.join(m.inputs)}" for m in MODELS.values())}
    )
    datatype = Datatype(
        required=True,
        metadata={"description": "; ".join(f"{n}: {', '.join(t)}" for m in MODELS.values() for n, (t, *_) in m.inputs.items())},
    )
    shape = Shape(required=True, metadata={"description": "the tensor's shape; every axis at least 1"})
    parameters = Object(InputParameters)
    data = TensorData()

    def _label(self, name: str) -> str:
        return f"{self.what} parameters" if name == "parameters" else self.what

    def finish(self, data: dict):
        """The native Tensor field's value: flat or nested data, or a BinaryInput."""
        dtype, shape, what = DATATYPES[data["datatype"]], data["shape"], self.what
        size = data.get("parameters", {}).get("binary_data_size")
        if (where := data.get("parameters", {}).get("shared")) is not None:
            if "data" in data or size is not None:
                raise RequestError(
                    "bad_encoding", f"{what} is in shared memory and has data or binary_data_size too; send one.", self.field
                )
            return SharedInput(shape, dtype, where)
        if size is not None:
            if "data" in data:
                raise RequestError("bad_encoding", f"{what} has both data and binary_data_size; send one.", self.field)
            return BinaryInput(shape, dtype, size)
        if "data" not in data:
            raise RequestError("missing_field", f"{what} has neither data nor parameters.binary_data_size.", self.field)
        values = data["data"]
        if (isinstance(values, list) and values and isinstance(values[0], list)) or getattr(values, "ndim", 1) > 1:
            values = wire.NestedData(values)  # nested as the shape (lists, or an array wire.loads decoded): wire.decode checks that it is
        return {"shape": shape, "dtype": dtype, "data": values}


class OutputParameters(SharedParameters):
    binary_data = Bool(metadata={"description": "binary tensor data extension: this output as raw bytes"})

    def _label(self, name: str) -> str:
        return f"{self.what} parameter {name}" if name == "binary_data" else self.what


class RequestOutput(_Envelope):
    name = Text(required=True, metadata={"enum": OUTPUT_NAMES})
    parameters = Object(OutputParameters)

    def _label(self, name: str) -> str:
        return f"{self.what} parameters"

    def finish(self, data: dict) -> bool | Shared | None:
        """Whether this output is sent as bytes, or the shared-memory region it is written to;
        None: as the request's binary_data_output says."""
        params = data.get("parameters", {})
        return params.get("shared", params.get("binary_data"))


class RequestParameters(_Envelope):
    """The protocol's own parameters; a model's (its options) are added by envelope()."""

    binary_data_output = Bool(
        metadata={
            "description": "binary tensor data extension: every output as raw bytes after the JSON header, unless the output says otherwise"
        }
    )
    priority = Int(metadata={"description": "a scheduling hint Triton's client may send: accepted, no effect here"})
    timeout = Int(metadata={"description": "a scheduling hint Triton's client may send: accepted, no effect here"})

    def __init__(self, model: str = "", **kwargs):
        self.model = model
        super().__init__("parameters", None, **kwargs)

    def on_bind_field(self, field_name: str, field_obj) -> None:
        if isinstance(field_obj, Coded):
            field_obj.label, field_obj.typed_null = f"parameter {field_name}", True

    def _unknown(self, keys):
        key = keys[0]
        known = ", ".join((*(n for n, f in self.fields.items() if isinstance(f, Option)), "binary_data_output"))
        raise RequestError(
            "unknown_field",
            f"parameter {show(key)} is not a parameter of model {self.model}; its parameters are: {known}.",
            key[:FIELD_CHARS],
        )


class InferenceRequest(_Envelope):
    id = Text(metadata={"description": "echoed in the response"})
    inputs = Tensors("input", RequestInput, required=True)
    parameters = Object(RequestParameters, metadata={"description": "the model's options (see its metadata) and the protocol's own"})
    outputs = Tensors(
        "output",
        RequestOutput,
        metadata={"description": "the outputs wanted, in order; default out, and weights unless return_weights is false"},
    )

    def __init__(self, model: Model | None = None, **kwargs):
        self.model = model
        super().__init__("an infer request", None, **kwargs)

    def on_bind_field(self, field_name: str, field_obj) -> None:
        field_obj.label, field_obj.error_field, field_obj.typed_null = field_name, field_name, True

    def _unknown(self, keys):
        raise RequestError(
            "unknown_field",
            f"{show(keys[0])} is not a field of an infer request; the fields are: {', '.join(sorted(self.fields))}.",
            keys[0][:FIELD_CHARS],
        )

    def finish(self, data: dict) -> Envelope:
        model = self.model
        assert model is not None  # the document's instance describes; only a model's loads
        native: dict[str, Any] = data["inputs"]
        missing = [n for n in model.inputs if n not in native and n not in model.optional]
        if missing:
            raise RequestError("missing_field", f"input {missing[0]} is required by model {model.name}.", missing[0])
        params = data.get("parameters", {})
        native.update((key, params[key]) for key in model.options if key in params)
        binary: dict[str | None, bool | Shared] = {None: params.get("binary_data_output", False)}
        outputs = data.get("outputs")
        requested = None if outputs is None else list(outputs)
        if outputs is not None:
            binary.update((name, flag) for name, flag in outputs.items() if flag is not None)
            if "return_weights" in model.parameters:  # a model without a weights output has no such option
                native.setdefault("return_weights", "weights" in outputs)
            if "lse" in outputs:
                native.setdefault("return_lse", True)
        return Envelope(id=data.get("id"), native=native, requested=requested, binary=binary)


E = TypeVar("E", bound=Schema)


def _with(cls: type[E], name: str, **declared: fields.Field) -> type[E]:
    """cls with these fields in place of or beside its own (Schema.from_dict's subclass, typed)."""
    return cast(type[E], cls.from_dict(declared, name=name))


def _option(name: str, natives: list[fields.Field], **kwargs) -> Option:
    return (WindowOption if name == "window" else Option)(natives, **kwargs)


def envelope(model: Model) -> InferenceRequest:
    """The infer request's schema for one model: its inputs (each with its datatypes and labels),
    outputs and options."""
    natives = model.schema().fields
    parameters = _with(RequestParameters, f"{model.name}_parameters", **{name: _option(name, [natives[name]]) for name in model.options})
    inputs = {
        name: _with(
            RequestInput,
            f"{model.name}_{name}",
            datatype=Datatype(types, required=True),
            parameters=Object(InputParameters(f"input {name}", name)),
        )(f"input {name}", name)
        for name, (types, *_) in model.inputs.items()
    }
    outputs = {
        name: _with(RequestOutput, f"{model.name}_{name}", parameters=Object(OutputParameters(f"output {name}", "outputs")))(
            f"output {name}", "outputs"
        )
        for name in model.outputs
    }
    schema = _with(
        InferenceRequest,
        f"{model.name}_request",
        parameters=Object(parameters(model.name)),
        inputs=Tensors("input", RequestInput, inputs, model.name, required=True),
        outputs=Tensors("output", RequestOutput, outputs, model.name),
    )
    return schema(model)


def described_parameters() -> RequestParameters:
    """The request parameters as the document shows them: the protocol's own and every model's
    options, each typed as the native field of each model that has it."""
    options: dict[str, tuple[list[fields.Field], list[tuple[str, str]]]] = {}
    for model in MODELS.values():
        natives = model.schema().fields
        for name, what in model.parameters.items():
            kinds, whats = options.setdefault(name, ([], []))
            kinds.append(natives[name])
            whats.append((model.name, what))
    described = {name: _option(name, kinds, metadata={"description": _per_model(whats)}) for name, (kinds, whats) in options.items()}
    return _with(RequestParameters, "request_parameters", **described)()


def _per_model(whats: list[tuple[str, str]]) -> str:
    """One text if every model says the same, else each model's."""
    if len({what for _, what in whats}) == 1:
        return whats[0][1]
    return "; ".join(f"{model}: {what}" for model, what in whats)


# --- the answers, as the document shows them (the views build them from the model table) -------


def _one_of(values) -> validate.OneOf:
    return validate.OneOf(list(values))


def _model_name() -> fields.String:
    return fields.String(required=True, validate=_one_of(MODELS))


def _dims() -> fields.List:
    return fields.List(fields.Integer(validate=validate.Range(min=-1)), required=True, metadata={"description": "-1: any length"})


def _config_datatype() -> fields.String:
    return fields.String(required=True, validate=_one_of(f"TYPE_{d}" for d in DATATYPES))


class _Answer(Schema):
    """An answer as documented: a client should expect these fields, and may meet others."""

    class Meta:
        unknown = EXCLUDE


class ServerMetadata(_Answer):
    name = fields.String(required=True)
    version = fields.String(required=True)
    extensions = fields.List(fields.String(), required=True)


class ServerLive(_Answer):
    live = fields.Boolean(required=True)


class ServerReady(_Answer):
    ready = fields.Boolean(required=True)


class ModelReady(_Answer):
    name = _model_name()
    ready = fields.Boolean(required=True)


class TensorMetadataParameters(_Answer):
    datatypes = fields.String(required=True, metadata={"description": "every datatype accepted, comma-separated"})
    optional = fields.Boolean(metadata={"description": "inputs only"})
    description = fields.String(required=True)


class TensorMetadata(_Answer):
    name = fields.String(required=True, validate=_one_of(dict.fromkeys([*INPUT_NAMES, *OUTPUT_NAMES])))
    datatype = fields.String(required=True, validate=_one_of(DATATYPES), metadata={"description": "the one advertised"})
    shape = _dims()
    parameters = fields.Nested(TensorMetadataParameters, required=True)


class ModelMetadata(_Answer):
    name = _model_name()
    versions = fields.List(fields.String(validate=_one_of([MODEL_VERSION])), required=True)
    platform = fields.String(required=True, validate=_one_of([PLATFORM]))
    inputs = fields.List(fields.Nested(TensorMetadata), required=True)
    outputs = fields.List(fields.Nested(TensorMetadata), required=True)
    parameters = fields.Dict(
        keys=fields.String(),
        values=fields.String(),
        required=True,
        metadata={"description": "the request parameters the model takes (beyond the protocol's own), each with what it takes"},
    )


class ConfigInput(_Answer):
    name = fields.String(required=True)
    data_type = _config_datatype()
    format = fields.String(required=True)
    dims = _dims()
    is_shape_tensor = fields.Boolean(required=True)
    allow_ragged_batch = fields.Boolean(required=True)
    optional = fields.Boolean(required=True)


class ConfigOutput(_Answer):
    name = fields.String(required=True)
    data_type = _config_datatype()
    dims = _dims()
    label_filename = fields.String(required=True)
    is_shape_tensor = fields.Boolean(required=True)


class VersionPolicy(_Answer):
    specific = fields.Nested(_Answer.from_dict({"versions": fields.List(fields.Integer(), required=True)}), required=True)


class ModelConfig(_Answer):
    """Triton's model_config.proto as JSON."""

    name = _model_name()
    platform = fields.String(required=True, validate=_one_of([PLATFORM]))
    backend = fields.String(required=True, validate=_one_of([PLATFORM]))
    version_policy = fields.Nested(VersionPolicy, required=True)
    max_batch_size = fields.Integer(required=True, metadata={"description": "0: no batching, each request is one call"})
    input = fields.List(fields.Nested(ConfigInput), required=True)
    output = fields.List(fields.Nested(ConfigOutput), required=True)
    sequence_batching = fields.Nested(
        _Answer.from_dict(
            {
                "max_sequence_idle_microseconds": fields.Integer(
                    required=True, metadata={"description": "a sequence idle this long is freed"}
                )
            }
        ),
        metadata={"description": "a sequence model's only (attention_sequence): Triton's sequence batcher, its state held by the server"},
    )


class ResponseOutput(_Answer):
    name = fields.String(required=True, validate=_one_of(OUTPUT_NAMES))
    datatype = fields.String(required=True, validate=_one_of(dict.fromkeys(OUTPUT_DATATYPES.values())))
    shape = fields.List(fields.Integer(validate=validate.Range(min=1)), required=True)
    parameters = fields.Nested(_Answer.from_dict({"binary_data_size": fields.Integer(validate=validate.Range(min=0))}))
    data = fields.List(fields.Float(), metadata={"description": "flat, row-major; absent when the output is sent as binary data"})


class InferenceResponseParameters(_Answer, Cost):
    """The cost, and the milliseconds per phase so far (decode_ms, validate_ms, compute_ms, ...)."""

    class Meta:
        unknown = INCLUDE  # the phases


class InferenceResponse(_Answer):
    model_name = _model_name()
    model_version = fields.String(required=True, validate=_one_of([MODEL_VERSION]))
    id = fields.String(metadata={"description": "the request's id, when it gave one"})
    parameters = fields.Nested(InferenceResponseParameters, required=True)
    outputs = fields.List(fields.Nested(ResponseOutput), required=True)


class InferenceError(_Answer):
    error = fields.String(required=True, metadata={"description": "one sentence naming the input or parameter and what is wrong"})


# --- Triton's statistics and system shared-memory extensions (service/web/triton_ext.py) ----------


def _count(**kwargs) -> fields.Integer:
    return fields.Integer(required=True, validate=validate.Range(min=0), **kwargs)


class Duration(_Answer):
    count = _count()
    ns = _count(metadata={"description": "cumulative nanoseconds"})


PHASES = ("compute_input", "compute_infer", "compute_output")


def _durations(*names: str) -> dict[str, fields.Field]:
    return {name: fields.Nested(Duration, required=True) for name in names}


InferenceStats = _Answer.from_dict(_durations("success", "fail", "queue", *PHASES, "cache_hit", "cache_miss"), name="InferenceStats")
BatchStats = _Answer.from_dict({"batch_size": _count(), **_durations(*PHASES)}, name="BatchStats")


class ModelStat(_Answer):
    name = _model_name()
    version = fields.String(required=True, validate=_one_of([MODEL_VERSION]))
    last_inference = _count(metadata={"description": "ms since the epoch; 0 before the first"})
    inference_count = _count()
    execution_count = _count()
    inference_stats = fields.Nested(InferenceStats, required=True)
    batch_stats = fields.List(fields.Nested(BatchStats), required=True)


class ModelStats(_Answer):
    model_stats = fields.List(fields.Nested(ModelStat), required=True)


class RegionStatus(_Answer):
    name = fields.String(required=True)
    key = fields.String(required=True, metadata={"description": "the POSIX shared-memory object's name (shm_open's)"})
    offset = _count()
    byte_size = _count()


class RegisterRequest(Schema):
    """What POST .../region/{region}/register takes (triton_ext.py reads it)."""

    class Meta:
        unknown = RAISE

    key = fields.String(required=True, metadata={"description": "the POSIX shared-memory object's name (shm_open's)"})
    offset = fields.Integer(validate=validate.Range(min=0), metadata={"description": "default 0"})
    byte_size = fields.Integer(required=True, validate=validate.Range(min=1))


class Empty(Schema):
    class Meta:
        unknown = RAISE


def components() -> dict[str, Schema]:
    """The /v2 part of the document, named as in the protocol's own (open_inference_rest.yaml)
    where it has a name; a schema nested in another comes before it."""
    parameters = described_parameters()
    request = _with(
        InferenceRequest, "inference_request", parameters=Object(parameters, metadata=InferenceRequest().fields["parameters"].metadata)
    )()
    return {
        "metadata_server_response": ServerMetadata(),
        "server_live_response": ServerLive(),
        "server_ready_response": ServerReady(),
        "model_ready_response": ModelReady(),
        "metadata_tensor": TensorMetadata(),
        "metadata_model_response": ModelMetadata(),
        "model_config_response": ModelConfig(),
        "request_input": RequestInput(),
        "request_output": RequestOutput(),
        "request_parameters": parameters,
        "inference_request": request,
        "response_output": ResponseOutput(),
        "inference_response": InferenceResponse(),
        "inference_error_response": InferenceError(),
        "stats_model_response": ModelStats(),  # named as Triton's documents name them
        "system_shared_memory_status_response": RegionStatus(many=True),
        "system_shared_memory_register_request": RegisterRequest(),
        "system_shared_memory_response": Empty(),
    }
