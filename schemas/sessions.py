"""The request bodies of the sessions resource (contract 1.3, "Sessions"): creating one, appending
to it, a step on one or on many, fork and truncate. What a body is checked against the session it
names (its heads and widths, its length) is checked by tokens() and step_job() once the session is
known; the pool (service.sessions) holds the rest."""

from __future__ import annotations

import numpy as np
from marshmallow import fields, validates_schema

from service import wire

from .errors import RequestError
from .fields import Bool, Choice, Coded, NonNegativeInt, PositiveFloat, PositiveInt, Tensor, Window
from .jobs import COMPUTE_DTYPES, SessionStepJob
from .requests import CAUSAL, ComputeRequest, StrictSchema


class SessionCreateRequest(StrictSchema):
    heads = PositiveInt(required=True, metadata={"description": "query heads H"})
    kv_heads = PositiveInt(load_default=None, metadata={"description": "key/value heads Hkv, dividing H (default H)"})
    head_dim = PositiveInt(required=True, metadata={"description": "d, the width of a query and a key"})
    value_dim = PositiveInt(load_default=None, metadata={"description": "dv, the width of a value (default d)"})
    dtype = Choice(COMPUTE_DTYPES, load_default="float32", metadata={"description": "the session's keys, values and compute precision"})
    max_tokens = PositiveInt(load_default=None, metadata={"description": "tokens it may hold (default ATTN_SESSION_MAX_TOKENS)"})

    @validates_schema
    def _sizes(self, data, **kwargs):
        s = self.settings
        heads, kv_heads = data["heads"], data["kv_heads"] or data["heads"]
        if heads % kv_heads:
            raise RequestError("bad_option", f"kv_heads={kv_heads} does not divide heads={heads}.", "kv_heads")
        self._check_width("head_dim", data["head_dim"])
        self._check_width("value_dim", data["value_dim"] or data["head_dim"])
        if heads > s.max_d:
            raise RequestError("too_large", f"heads={heads} is over the maximum of {s.max_d} (ATTN_MAX_D).", "heads")
        if data["max_tokens"] is not None and data["max_tokens"] > s.session_max_tokens:
            raise RequestError(
                "too_long",
                f"max_tokens={data['max_tokens']} is over the server's maximum of {s.session_max_tokens} (ATTN_SESSION_MAX_TOKENS).",
                "max_tokens",
            )

    def load(self, *args, **kwargs) -> dict:  # a plain dict: the pool makes the session
        data = super().load(*args, **kwargs)
        data["kv_heads"] = data["kv_heads"] or data["heads"]
        data["value_dim"] = data["value_dim"] or data["head_dim"]
        data["max_tokens"] = data["max_tokens"] or self.settings.session_max_tokens
        return data


class SessionAppendRequest(StrictSchema):
    k = Tensor(ranks=(3, 3), required=True, metadata={"description": "the new tokens' keys (Hkv, t, d)"})
    v = Tensor(ranks=(3, 3), required=True, metadata={"description": "their values (Hkv, t, dv)"})
    at = NonNegativeInt(load_default=None, metadata={"description": "append only if the session's length is this (else 409)"})


class SessionLengthRequest(StrictSchema):
    """fork's and truncate's body: a length (fork's default: all)."""

    length = NonNegativeInt(load_default=None, metadata={"description": "tokens kept (default: all)"})


class _Step(ComputeRequest):
    """The options of a step (POST /attention's that make sense on one; dtype is the session's)."""

    class Meta(ComputeRequest.Meta):
        exclude: tuple[str, ...] = ("dtype",)

    return_weights = Bool(load_default=False, metadata={"description": "return the weights (H, t, S)"})
    causal = Choice(
        CAUSAL, load_default="bottom_right", metadata={"description": 'default "bottom_right": query i of t sees s <= S - t + i'}
    )
    scale = PositiveFloat(load_default=None, metadata={"description": "multiplies the scores; default 1/sqrt(d)"})
    window = Window(load_default=None)
    alibi_slopes = Tensor(ranks=(1, 1), load_default=None, metadata={"description": "ALiBi slopes, one a query head (H,)"})
    return_lse = Bool(load_default=False, metadata={"description": "also return lse (H, t)"})


class SessionStepRequest(_Step):
    q = Tensor(ranks=(3, 3), required=True, metadata={"description": "queries (H, t, d)"})
    k = Tensor(ranks=(3, 3), load_default=None, metadata={"description": "new tokens' keys (Hkv, t, d), appended first"})
    v = Tensor(ranks=(3, 3), load_default=None, metadata={"description": "their values (Hkv, t, dv)"})
    at = NonNegativeInt(load_default=None, metadata={"description": "append only if the session's length is this (else 409)"})

    @validates_schema
    def _pair(self, data, **kwargs):
        _paired(data)


class SequenceId(Coded, fields.Field):
    """Triton's sequence_id: a number > 0 or a non-empty string, the client's -> its text."""

    def __init__(self, **kwargs):
        kinds = [{"type": "integer", "minimum": 1}, {"type": "string", "minLength": 1}]  # the document's type
        super().__init__(metadata={"oneOf": kinds, **kwargs.pop("metadata", {})}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs) -> str:
        if type(value) is int and value > 0:
            return f"int:{value}"
        if isinstance(value, str) and value:
            return f"str:{value}"
        raise self._error("bad_type", f"{self.label} must be a number > 0 or a non-empty string, not {wire.show(value)}.")


class SequenceStepRequest(_Step):
    """A step of /v2's model attention_sequence (Triton's sequence extension): the new tokens' q,
    k, v, and the sequence's id, its start and its end."""

    class Meta(_Step.Meta):
        exclude = ("dtype", "alibi_slopes", "return_weights", "weights_dtype")

    q = Tensor(ranks=(3, 3), required=True, metadata={"description": "queries (H, t, d)"})
    k = Tensor(ranks=(3, 3), required=True, metadata={"description": "the new tokens' keys (Hkv, t, d)"})
    v = Tensor(ranks=(3, 3), required=True, metadata={"description": "their values (Hkv, t, dv)"})
    sequence_id = SequenceId(required=True, metadata={"description": "the sequence (Triton's sequence_id): a number > 0 or a string"})
    sequence_start = Bool(load_default=False, metadata={"description": "this request starts the sequence: its shapes from q, k, v"})
    sequence_end = Bool(load_default=False, metadata={"description": "the sequence ends with this request (its state is freed)"})

    def load(self, *args, **kwargs) -> dict:  # the options a step reads that this model does not take
        data = super().load(*args, **kwargs)
        data.update(alibi_slopes=None, return_weights=False, weights_dtype=None, at=None)
        return data


class SessionIds(Coded, fields.Field):
    """A non-empty list of distinct session ids."""

    def _deserialize(self, value, attr, data, **kwargs) -> list[str]:
        if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
            raise self._error("bad_type", f"{self.label} must be a non-empty list of session ids, not {wire.show(value)}.")
        if len(set(value)) != len(value):
            raise self._error("bad_option", f"{self.label} names a session twice; a step takes each session once.")
        return value


class Lengths(Coded, fields.Field):
    """A list of lengths, integers >= 0."""

    def _deserialize(self, value, attr, data, **kwargs) -> list[int]:
        if not (isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)):
            raise self._error("bad_type", f"{self.label} must be a list of integers >= 0, not {wire.show(value)}.")
        return value


class SessionBatchRequest(_Step):
    sessions = SessionIds(required=True, metadata={"description": "the B sessions stepped"})
    q = Tensor(ranks=(4, 4), required=True, metadata={"description": "queries (B, H, t, d)"})
    k = Tensor(ranks=(4, 4), load_default=None, metadata={"description": "new tokens' keys (B, Hkv, t, d), appended first"})
    v = Tensor(ranks=(4, 4), load_default=None, metadata={"description": "their values (B, Hkv, t, dv)"})
    at = Lengths(load_default=None, metadata={"description": "each session's length expected (else 409, nothing changes)"})

    @validates_schema
    def _batch(self, data, **kwargs):
        _paired(data)
        B = len(data["sessions"])
        for name in ("q", "k", "v"):
            if data[name] is not None and data[name].shape[0] != B:
                raise RequestError(
                    "shape_mismatch", f"{name} has shape {list(data[name].shape)}; its first axis must be the {B} sessions.", name
                )
        if data["at"] is not None and len(data["at"]) != B:
            raise RequestError("shape_mismatch", f"at has {len(data['at'])} lengths for {B} sessions.", "at")
        if data["at"] is not None and data["k"] is None:
            raise RequestError("bad_option", "at applies to the tokens appended: send k and v with it.", "at")


def _paired(data: dict) -> None:
    if (data["k"] is None) != (data["v"] is None):
        missing = "v" if data["v"] is None else "k"
        raise RequestError("missing_field", f"{missing} is required with {'k' if missing == 'v' else 'v'}: new tokens need both.", missing)


def tokens(schema: StrictSchema, k: np.ndarray, v: np.ndarray, kv_heads: int, head_dim: int, value_dim: int, dtype: np.dtype) -> tuple:
    """k (Hkv, t, d) and v (Hkv, t, dv) checked against a session's shapes (422 shape_mismatch
    naming the field and both shapes) and cast to its dtype."""
    want_k, want_v = (kv_heads, k.shape[1], head_dim), (kv_heads, k.shape[1], value_dim)
    if k.shape != want_k:
        raise RequestError("shape_mismatch", f"k has shape {list(k.shape)}; the session takes keys (Hkv, t, d) = {list(want_k)}.", "k")
    if v.shape != want_v:
        raise RequestError("shape_mismatch", f"v has shape {list(v.shape)}; the session takes values (Hkv, t, dv) = {list(want_v)}.", "v")
    return schema.cast("k", k, dtype), schema.cast("v", v, dtype)


def step_job(schema: StrictSchema, data: dict, q: np.ndarray, shape, S: int, encoding: str, pages=()) -> SessionStepJob:
    """A step's job: q (H, t, d) checked against the session (heads, width; 422 naming both
    shapes), the options against it, the limits; S the keys it attends to (the new tokens
    included); shape the session's (service.sessions.Shape: heads, kv_heads, head_dim, value_dim, dtype)."""
    heads, dtype = shape.heads, shape.dtype
    want = (heads, q.shape[1], shape.head_dim)
    if q.shape != want:
        raise RequestError("shape_mismatch", f"q has shape {list(q.shape)}; the session takes queries (H, t, d) = {list(want)}.", "q")
    slopes = data["alibi_slopes"]
    if slopes is not None and slopes.shape != (heads,):
        raise RequestError(
            "shape_mismatch", f"alibi_slopes has shape {list(slopes.shape)}; it needs one slope a query head, [{heads}].", "alibi_slopes"
        )
    if q.shape[1] > schema.settings.max_t:
        raise RequestError("too_long", f"q has t={q.shape[1]}, over the maximum of {schema.settings.max_t} (ATTN_MAX_T).", "q")
    score_elements = heads * q.shape[1] * S
    schema.check_scores(score_elements, data["return_weights"], f"q {list(q.shape)} against the session's {S} tokens")
    with np.errstate(over="ignore"):  # a scale past the dtype's range: refused just below, not warned about in the log
        finite_scale = data["scale"] is None or np.isfinite(dtype.type(data["scale"]))
    if not finite_scale:
        raise RequestError("non_finite", f"scale={data['scale']} is not finite in {dtype.name}.", "scale")
    causal = data["causal"]
    return SessionStepJob(
        q=schema.cast("q", q, dtype),
        keys=S,
        pages=list(pages),
        kv_heads=shape.kv_heads,
        value_dim=shape.value_dim,
        causal="top_left" if causal is True else causal,
        scale=data["scale"],
        return_weights=data["return_weights"],
        encoding=encoding,
        window=data["window"],
        alibi_slopes=None if slopes is None else schema.cast("alibi_slopes", slopes, dtype),
        weights_dtype=data["weights_dtype"],
        return_lse=data["return_lse"],
    )
