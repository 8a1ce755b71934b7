"""The request bodies of POST /attention and POST /mha (and of the KServe door, which builds the
same dict). Fields check themselves; the one @validates_schema per request checks the rules
across fields (d, S, dv agree, the mask broadcasts, the limits hold), and @post_load casts to the
compute dtype and builds the job. Every refusal is a RequestError naming its field by its label."""

from __future__ import annotations

import math

import numpy as np
from marshmallow import RAISE, Schema, ValidationError, post_load, pre_load, validates_schema

from service import wire
from service.config import Settings

from .errors import RequestError
from .fields import Bool, Choice, PositiveFloat, PositiveInt, Tensor
from .jobs import COMPUTE_DTYPES, AttentionJob, MhaJob

CAUSAL = (False, True, "top_left", "bottom_right")


class _Request(Schema):
    """Options every compute request shares, the limits in force, and one error per request."""

    class Meta:
        unknown = RAISE

    return_weights = Bool(load_default=True, metadata={"description": "return the attention weights"})
    dtype = Choice(COMPUTE_DTYPES, load_default=None, metadata={"description": "compute and output precision (default float32)"})
    response_encoding = Choice(
        wire.ENCODINGS, load_default=None, metadata={"description": "encoding of the response tensors; default: as the input was encoded"}
    )

    def __init__(self, settings: Settings | None = None, *, labels: dict[str, str] | None = None, **kwargs):
        """labels: what messages call a field (default its name); a front door with its own
        terms passes them, e.g. {"q": "input q", "causal": "parameter causal"}."""
        self.labels = labels or {}
        super().__init__(**kwargs)
        self.settings = settings or Settings()

    def on_bind_field(self, field_name: str, field_obj) -> None:
        field_obj.label = self._label(field_name)

    def _label(self, name: str) -> str:
        return self.labels.get(name, name)

    @pre_load
    def _known_fields(self, data, **kwargs):
        """Refuse the first unknown field (in the order sent) before any field is read: a pass that
        stops there, where marshmallow would read every field and then collect every unknown key."""
        if isinstance(data, dict):
            for name in data:
                if name not in self.fields:
                    self._unknown(name)
        return data

    def _unknown(self, name: str):
        known = ", ".join(sorted(self.fields))
        raise RequestError("unknown_field", f"{_show_name(name)} is not a field of this request; the fields are: {known}.", name[:60])

    def handle_error(self, error: ValidationError, data, *, many: bool, **kwargs):
        """Only marshmallow's own checks reach here (our fields raise RequestError): unknown fields."""
        messages = error.messages if isinstance(error.messages, dict) else {"_schema": error.messages}
        name = next(iter(messages))
        if name not in self.fields:
            self._unknown(name)
        raise RequestError("bad_type", f"{self._label(name)}: {messages[name]}", name)

    def _dtype(self, data) -> np.dtype:
        return np.dtype(data.get("dtype") or self.settings.default_dtype)

    def _check_scores(self, score_elements: int, return_weights: bool, what: str) -> None:
        s = self.settings
        if score_elements > s.max_score_elements:
            raise RequestError(
                "too_large",
                f"{what} is {score_elements} score elements, over the limit of {s.max_score_elements} (ATTN_MAX_SCORE_ELEMENTS); split the batch or shorten the sequence.",
            )
        if return_weights and score_elements > s.max_weights_elements:
            raise RequestError(
                "too_large",
                f'{what} would return {score_elements} weights, over the limit of {s.max_weights_elements} (ATTN_MAX_WEIGHTS_ELEMENTS); send "return_weights": false.',
                "return_weights",
            )

    def _check_output(self, output_elements: int, what: str) -> None:
        limit = self.settings.max_output_elements
        if output_elements > limit:
            raise RequestError(
                "too_large",
                f"{what} would return {output_elements} output elements, over the limit of {limit} (ATTN_MAX_OUTPUT_ELEMENTS); split the batch or shorten the sequence.",
            )

    def _check_length(self, field: str, axis: str, n: int, limit: int, env: str) -> None:
        if n > limit:
            raise RequestError(
                "too_long", f"{self._label(field)} has {axis}={n}, over the maximum of {limit} ({env}); attention costs O(T*S).", field
            )

    def _check_width(self, field: str, d: int) -> None:
        if d > self.settings.max_d:
            raise RequestError(
                "too_large", f"{self._label(field)} has width {d}, over the maximum of {self.settings.max_d} (ATTN_MAX_D).", field
            )

    def _cast(self, name: str, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
        with np.errstate(over="ignore"):  # overflow becomes inf, refused just below
            out = arr.astype(dtype, copy=False)
        if not np.isfinite(out).all():
            hint = '; send "dtype": "float64" or smaller values' if dtype == np.float32 else ""
            raise RequestError("non_finite", f"{self._label(name)} has values that are not finite in {dtype.name}{hint}.", name)
        return out

    def _encoding(self, data, original, field: str) -> str:
        return data.get("response_encoding") or wire.wire_encoding(original.get(field))


class AttentionRequest(_Request):
    q = Tensor(required=True, metadata={"description": "queries (..., T, d)"})
    k = Tensor(required=True, metadata={"description": "keys (..., S, d): the same leading axes as q"})
    v = Tensor(required=True, metadata={"description": "values (..., S, dv): the same leading axes and S as k"})
    mask = Tensor(kind="mask", ranks=(1, 6), load_default=None, metadata={"description": "true = may attend; broadcasts to (..., T, S)"})
    causal = Choice(CAUSAL, load_default=False, metadata={"description": 'true = "top_left" (s <= t); "bottom_right": s <= t + S - T'})
    key_lengths = Tensor(
        kind="int",
        ranks=(0, 5),
        load_default=None,
        metadata={"description": "key s allowed iff s < key_lengths[...]; broadcasts to the leading axes"},
    )
    scale = PositiveFloat(load_default=None, metadata={"description": "multiplies the scores; default 1/sqrt(d)"})

    @validates_schema
    def _shapes(self, data, **kwargs):
        q, k, v, s, L = data["q"], data["k"], data["v"], self.settings, self._label
        if q.ndim > s.max_rank:
            raise RequestError("bad_rank", f"{L('q')} has rank {q.ndim}, over the maximum of {s.max_rank} (ATTN_MAX_RANK).", "q")
        lead, (T, d) = q.shape[:-2], q.shape[-2:]
        if k.shape[:-2] != lead:
            raise RequestError(
                "shape_mismatch", f"{L('k')} has shape {list(k.shape)}; it needs q's leading axes {list(lead)} then (S, d).", "k"
            )
        S = k.shape[-2]
        if k.shape[-1] != d:
            raise RequestError("shape_mismatch", f"{L('k')} has d={k.shape[-1]} but q has d={d}.", "k")
        if v.shape[:-1] != k.shape[:-1]:
            raise RequestError(
                "shape_mismatch",
                f"{L('v')} has shape {list(v.shape)}; it needs k's leading axes and S, {list(k.shape[:-1])}, then dv.",
                "v",
            )
        self._check_length("q", "T", T, s.max_t, "ATTN_MAX_T")
        self._check_length("k", "S", S, s.max_s, "ATTN_MAX_S")
        self._check_width("q", d)
        self._check_width("v", v.shape[-1])
        self._check_scores(math.prod(lead) * T * S, data["return_weights"], f"{L('q')} {list(q.shape)} against {L('k')} {list(k.shape)}")
        self._check_output(math.prod(lead) * T * v.shape[-1], f"{L('q')} {list(q.shape)} with {L('v')} {list(v.shape)}")
        mask = data["mask"]
        if mask is not None and not _broadcasts(mask.shape, (*lead, T, S)):
            raise RequestError(
                "mask_not_broadcastable",
                f"{L('mask')} has shape {list(mask.shape)}, which does not broadcast to (..., T, S) = {list((*lead, T, S))}.",
                "mask",
            )
        lengths = data["key_lengths"]
        if lengths is not None:
            if not _broadcasts(lengths.shape, lead):
                raise RequestError(
                    "shape_mismatch",
                    f"{L('key_lengths')} has shape {list(lengths.shape)}, which does not broadcast to the leading axes {list(lead)}.",
                    "key_lengths",
                )
            if lengths.min() < 0 or lengths.max() > S:
                raise RequestError(
                    "bad_option",
                    f"{L('key_lengths')} must lie in 0..S = 0..{S}; got {int(lengths.min())}..{int(lengths.max())}.",
                    "key_lengths",
                )
        scale = data["scale"]
        if scale is not None and not np.isfinite(self._dtype(data).type(scale)):
            raise RequestError("non_finite", f"{L('scale')}={scale} is not finite in {self._dtype(data).name}.", "scale")

    @post_load(pass_original=True)
    def _job(self, data, original, **kwargs) -> AttentionJob:
        dtype = self._dtype(data)
        causal = data["causal"]
        return AttentionJob(
            q=self._cast("q", data["q"], dtype),
            k=self._cast("k", data["k"], dtype),
            v=self._cast("v", data["v"], dtype),
            mask=data["mask"],
            causal="top_left" if causal is True else causal,
            key_lengths=data["key_lengths"],
            scale=data["scale"],
            return_weights=data["return_weights"],
            encoding=self._encoding(data, original, "q"),
        )


class MhaRequest(_Request):
    x = Tensor(ranks=(2, 3), required=True, metadata={"description": "input (n, d) or (B, n, d)"})
    wq = Tensor(ranks=(2, 2), required=True, metadata={"description": "query projection (d, d)"})
    wk = Tensor(ranks=(2, 2), required=True, metadata={"description": "key projection (d, d)"})
    wv = Tensor(ranks=(2, 2), required=True, metadata={"description": "value projection (d, d)"})
    wo = Tensor(ranks=(2, 2), required=True, metadata={"description": "output projection (d, d)"})
    heads = PositiveInt(required=True, metadata={"description": "number of heads h; d % h == 0"})
    causal = Bool(load_default=True, metadata={"description": "mask the future (the GPT block)"})

    @validates_schema
    def _shapes(self, data, **kwargs):
        x, s, L = data["x"], self.settings, self._label
        n, d = x.shape[-2:]
        for name in ("wq", "wk", "wv", "wo"):
            if data[name].shape != (d, d):
                raise RequestError(
                    "shape_mismatch",
                    f"{L(name)} has shape {list(data[name].shape)}; it must be (d, d) = {[d, d]} for x of width d={d}.",
                    name,
                )
        heads = data["heads"]
        if d % heads:
            raise RequestError("bad_option", f"{L('heads')}={heads} does not divide the width d={d}.", "heads")
        self._check_length("x", "n", n, s.max_t, "ATTN_MAX_T")
        self._check_width("x", d)
        self._check_scores(math.prod(x.shape[:-2]) * heads * n * n, data["return_weights"], f"{L('x')} {list(x.shape)} with {heads} heads")
        self._check_output(x.size, f"{L('x')} {list(x.shape)}")  # out (..., n, d): wo is (d, d)

    @post_load(pass_original=True)
    def _job(self, data, original, **kwargs) -> MhaJob:
        dtype = self._dtype(data)
        arrays = {name: self._cast(name, data[name], dtype) for name in ("x", "wq", "wk", "wv", "wo")}
        return MhaJob(
            **arrays,
            heads=data["heads"],
            causal=data["causal"],
            return_weights=data["return_weights"],
            encoding=self._encoding(data, original, "x"),
        )


def _show_name(name: str, limit: int = 40) -> str:
    """A client's field name as a message shows it: quoted, and cut if long (names are unbounded)."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if an array of shape broadcasts to exactly target (never growing it)."""
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False
