"""The request bodies of POST /attention and POST /mha (and of the KServe door, which builds the
same dict). Fields check themselves; the one @validates_schema per request checks the rules
across fields (d, S, dv agree, the mask broadcasts, the limits hold), and @post_load casts to the
compute dtype and builds the job. Every refusal is a RequestError naming its field by its label."""

from __future__ import annotations

import math

import numpy as np
from marshmallow import RAISE, Schema, ValidationError, post_load, pre_load, validates_schema

from service import core, wire
from service.config import Settings

from .errors import RequestError
from .fields import Bool, Choice, PositiveFloat, PositiveInt, Tensor, Window, show
from .jobs import COMPUTE_DTYPES, WEIGHTS_DTYPES, AttentionJob, MhaJob

CAUSAL = (False, True, "top_left", "bottom_right")


class StrictSchema(Schema):
    """What every request body shares: unknown fields refused, fields named by their labels, one
    error per request, the limits in force."""

    class Meta:
        unknown = RAISE

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
        raise RequestError("unknown_field", f"{show(name)} is not a field of this request; the fields are: {known}.", name[:60])

    def handle_error(self, error: ValidationError, data, *, many: bool, **kwargs):
        """Only marshmallow's own checks reach here (our fields raise RequestError): unknown fields."""
        messages = error.messages if isinstance(error.messages, dict) else {"_schema": error.messages}
        name = next(iter(messages))
        if name not in self.fields:
            self._unknown(name)
        raise RequestError("bad_type", f"{self._label(name)}: {messages[name]}", name)

    def _dtype(self, data) -> np.dtype:
        return np.dtype(data.get("dtype") or self.settings.default_dtype)

    def check_scores(self, score_elements: int, return_weights: bool, what: str, weights_elements: int | None = None) -> None:
        """Refuse (413 too_large) a job over the score or returned-weights limits in force.

        score_elements: the scores the core computes; weights_elements: those returned (default
        the same), checked only when return_weights; what: how the message names the request's
        shapes. Shared by every compute request, the sessions' steps included."""
        s = self.settings
        weights_elements = score_elements if weights_elements is None else weights_elements
        if score_elements > s.max_score_elements:
            raise RequestError(
                "too_large",
                f"{what} is {score_elements} score elements, over the limit of {s.max_score_elements} (ATTN_MAX_SCORE_ELEMENTS); split the batch or shorten the sequence.",
            )
        if return_weights and weights_elements > s.max_weights_elements:
            raise RequestError(
                "too_large",
                f'{what} would return {weights_elements} weights, over the limit of {s.max_weights_elements} (ATTN_MAX_WEIGHTS_ELEMENTS); send "return_weights": false.',
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

    def _check_scale(self, data) -> None:
        scale, dtype = data["scale"], self._dtype(data)
        if scale is not None and not np.isfinite(dtype.type(scale)):
            raise RequestError("non_finite", f"{self._label('scale')}={scale} is not finite in {dtype.name}.", "scale")

    def _check_broadcast(self, data, field: str, target: tuple[int, ...], code: str, what: str, hint: str = "") -> None:
        """field (if sent) must broadcast to target, which the message calls what."""
        arr = data[field]
        if arr is not None and not _broadcasts(arr.shape, target):
            raise RequestError(
                code, f"{self._label(field)} has shape {list(arr.shape)}, which does not broadcast to {what} {list(target)}{hint}.", field
            )

    def cast(self, name: str, arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """arr, the field name's tensor, in the compute dtype (no copy if already in it); values not
        finite as sent, or past dtype's range once cast, are refused (422 non_finite naming the
        field, with a hint to send float64 when this request has a dtype field)."""
        with np.errstate(over="ignore"):  # overflow becomes inf, refused just below
            out = arr.astype(dtype, copy=False)
        if not np.isfinite(out).all():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():  # NaN or infinity as sent: no dtype helps
                raise RequestError(
                    "non_finite",
                    f"{self._label(name)} has values that are not finite in {arr.dtype.name} as sent (NaN, infinity, or past its range); "
                    "send finite numbers.",
                    name,
                )
            hint = (
                ('; send "dtype": "float64" or smaller values' if "dtype" in self.fields else "; send smaller values")
                if dtype == np.float32
                else ""
            )
            raise RequestError("non_finite", f"{self._label(name)} has values that are not finite in {dtype.name}{hint}.", name)
        return out

    def _encoding(self, data, original, field: str) -> str:
        return data.get("response_encoding") or wire.wire_encoding(original.get(field))


class ComputeRequest(StrictSchema):
    """Options every compute request shares."""

    return_weights = Bool(load_default=True, metadata={"description": "return the attention weights"})
    dtype = Choice(COMPUTE_DTYPES, load_default=None, metadata={"description": "compute and output precision (default float32)"})
    response_encoding = Choice(
        wire.ENCODINGS, load_default=None, metadata={"description": "encoding of the response tensors; default: as the input was encoded"}
    )
    weights_dtype = Choice(
        WEIGHTS_DTYPES,
        load_default=None,
        metadata={"description": 'precision of the returned weights; default the compute dtype ("float16" halves their bytes)'},
    )


class AttentionRequest(ComputeRequest):
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
    enable_gqa = Bool(
        load_default=False,
        metadata={"description": "grouped-query attention (PyTorch's enable_gqa): k, v may have Hkv heads on axis -3 dividing q's H"},
    )
    window = Window(load_default=None)
    bias = Tensor(
        ranks=(1, 6),
        load_default=None,
        metadata={"description": "added to the scaled scores before the softmax (SDPA's float attn_mask); broadcasts to (..., T, S)"},
    )
    alibi_slopes = Tensor(
        ranks=(1, 5),
        load_default=None,
        metadata={"description": "ALiBi (FlashAttention's alibi_slopes): adds -slope*|t + S - T - s|; broadcasts to the leading axes"},
    )
    average_weights = Bool(
        load_default=False, metadata={"description": "return the weights averaged over the heads axis -3: (..., T, S). Rank >= 3"}
    )
    return_lse = Bool(
        load_default=False,
        metadata={
            "description": "also return lse (..., T), the log-sum-exp of each row's scores (FlashAttention's softmax_lse), in the compute dtype"
        },
    )

    @validates_schema
    def _shapes(self, data, **kwargs):
        q, k, v, s, L = data["q"], data["k"], data["v"], self.settings, self._label
        if q.ndim > s.max_rank:
            raise RequestError("bad_rank", f"{L('q')} has rank {q.ndim}, over the maximum of {s.max_rank} (ATTN_MAX_RANK).", "q")
        lead, (T, d) = q.shape[:-2], q.shape[-2:]
        self._heads(q, k, data["enable_gqa"])
        if data["average_weights"] and q.ndim < 3:
            raise RequestError(
                "bad_option",
                f"{L('average_weights')} averages over the heads axis -3; {L('q')} has rank {q.ndim} (shape {list(q.shape)}), it needs rank >= 3.",
                "average_weights",
            )
        S = k.shape[-2]
        if k.shape[-1] != d:
            raise RequestError("shape_mismatch", f"{L('k')} has d={k.shape[-1]} but q has d={d}.", "k")
        if v.shape[:-1] != k.shape[:-1]:  # k's, not q's: under enable_gqa k and v have the key/value heads
            raise RequestError(
                "shape_mismatch",
                f"{L('v')} has shape {list(v.shape)}; it needs k's leading axes and S, {list(k.shape[:-1])}, then dv.",
                "v",
            )
        self._check_length("q", "T", T, s.max_t, "ATTN_MAX_T")
        self._check_length("k", "S", S, s.max_s, "ATTN_MAX_S")
        self._check_width("q", d)
        self._check_width("v", v.shape[-1])
        B, window = math.prod(lead), data["window"]
        scores = B * T * S if window is None else core.plan(B, T, S, v.shape[-1], causal=data["causal"], window=window).scores
        weights = B * T * S // (q.shape[-3] if data["average_weights"] else 1)
        self.check_scores(scores, data["return_weights"], f"{L('q')} {list(q.shape)} against {L('k')} {list(k.shape)}", weights)
        self._check_output(B * T * v.shape[-1], f"{L('q')} {list(q.shape)} with {L('v')} {list(v.shape)}")
        self._check_broadcast(data, "bias", (*lead, T, S), "shape_mismatch", "(..., T, S) =")
        self._check_broadcast(data, "alibi_slopes", lead, "shape_mismatch", "the leading axes", " (one slope per head: (H,) or (B, H))")
        self._check_broadcast(data, "mask", (*lead, T, S), "mask_not_broadcastable", "(..., T, S) =")
        self._check_broadcast(data, "key_lengths", lead, "shape_mismatch", "the leading axes")
        lengths = data["key_lengths"]
        if lengths is not None and (lengths.min() < 0 or lengths.max() > S):
            raise RequestError(
                "bad_option",
                f"{L('key_lengths')} must lie in 0..S = 0..{S}; got {int(lengths.min())}..{int(lengths.max())}.",
                "key_lengths",
            )
        self._check_scale(data)

    def _heads(self, q: np.ndarray, k: np.ndarray, enable_gqa: bool) -> None:
        """k's leading axes are q's; under enable_gqa but for the heads axis -3, whose count divides q's."""
        L, lead = self._label, q.shape[:-2]
        if enable_gqa:
            if q.ndim < 3:
                raise RequestError(
                    "bad_option", f"{L('enable_gqa')} needs a heads axis -3: {L('q')} has rank {q.ndim}, it needs rank >= 3.", "enable_gqa"
                )
            if k.ndim != q.ndim or k.shape[:-3] != q.shape[:-3]:
                raise RequestError(
                    "shape_mismatch",
                    f"{L('k')} has shape {list(k.shape)}; under enable_gqa it needs q's leading axes {list(q.shape[:-3])}, Hkv heads, then (S, d).",
                    "k",
                )
            H, Hkv = q.shape[-3], k.shape[-3]
            if H % Hkv:
                raise RequestError(
                    "shape_mismatch",
                    f"{L('k')} has {Hkv} key/value heads, which do not divide {L('q')}'s {H} query heads (enable_gqa needs H % Hkv == 0).",
                    "k",
                )
            return
        if k.shape[:-2] != lead:
            hint = ""
            if q.ndim >= 3 and k.ndim == q.ndim and k.shape[:-3] == q.shape[:-3] and q.shape[-3] % k.shape[-3] == 0:
                hint = f' For {k.shape[-3]} key/value heads shared by {q.shape[-3]} query heads, send "enable_gqa": true.'
            raise RequestError(
                "shape_mismatch", f"{L('k')} has shape {list(k.shape)}; it needs q's leading axes {list(lead)} then (S, d).{hint}", "k"
            )

    @post_load(pass_original=True)
    def _job(self, data, original, **kwargs) -> AttentionJob:
        dtype = self._dtype(data)
        causal = data["causal"]
        bias, slopes = data["bias"], data["alibi_slopes"]
        return AttentionJob(
            q=self.cast("q", data["q"], dtype),
            k=self.cast("k", data["k"], dtype),
            v=self.cast("v", data["v"], dtype),
            mask=data["mask"],
            causal="top_left" if causal is True else causal,
            key_lengths=data["key_lengths"],
            scale=data["scale"],
            return_weights=data["return_weights"],
            encoding=self._encoding(data, original, "q"),
            enable_gqa=data["enable_gqa"],
            window=data["window"],
            bias=None if bias is None else self.cast("bias", bias, dtype),
            alibi_slopes=None if slopes is None else self.cast("alibi_slopes", slopes, dtype),
            average_weights=data["average_weights"],
            weights_dtype=data["weights_dtype"],
            return_lse=data["return_lse"],
        )


class MhaRequest(ComputeRequest):
    x = Tensor(ranks=(2, 3), required=True, metadata={"description": "input (n, d) or (B, n, d)"})
    wq = Tensor(ranks=(2, 2), required=True, metadata={"description": "query projection (d, heads*dk); the GPT block's (d, d)"})
    wk = Tensor(ranks=(2, 2), required=True, metadata={"description": "key projection (d, kv_heads*dk); the GPT block's (d, d)"})
    wv = Tensor(ranks=(2, 2), required=True, metadata={"description": "value projection (d, kv_heads*dv); the GPT block's (d, d)"})
    wo = Tensor(
        ranks=(2, 2),
        load_default=None,
        metadata={"description": "output projection (heads*dv, d_out); omitted: the output is the heads concatenated (n, heads*dv)"},
    )
    heads = PositiveInt(required=True, metadata={"description": "number of query heads h; dividing wq's width"})
    causal = Bool(load_default=True, metadata={"description": "mask the future (the GPT block)"})
    scale = PositiveFloat(load_default=None, metadata={"description": "multiplies the scores; default 1/sqrt(dk)"})
    kv_heads = PositiveInt(
        load_default=None,
        metadata={"description": "key/value heads (grouped-query attention, Llama's layout), dividing heads; default heads"},
    )
    window = Window(load_default=None)

    @validates_schema
    def _shapes(self, data, **kwargs):
        x, s, L = data["x"], self.settings, self._label
        n, d = x.shape[-2:]
        for name in ("wq", "wk", "wv"):
            if data[name].shape[0] != d:
                raise RequestError(
                    "shape_mismatch",
                    f"{L(name)} has shape {list(data[name].shape)}; it needs d={d} rows for x of width d={d}.",
                    name,
                )
        heads, kv_heads = data["heads"], data["kv_heads"] or data["heads"]
        width = data["wq"].shape[1]
        if width % heads:
            raise RequestError("bad_option", f"{L('heads')}={heads} does not divide the width {width} of {L('wq')} (heads*dk).", "heads")
        if heads % kv_heads:
            raise RequestError("bad_option", f"{L('kv_heads')}={kv_heads} does not divide {L('heads')}={heads}.", "kv_heads")
        dk = width // heads
        if data["wk"].shape[1] != kv_heads * dk:
            raise RequestError(
                "shape_mismatch",
                f"{L('wk')} has shape {list(data['wk'].shape)}; it must be (d, kv_heads*dk) = {[d, kv_heads * dk]} "
                f"({kv_heads} key/value heads of dk={dk}, from {L('wq')}'s width {width} over {heads} heads).",
                "wk",
            )
        if data["wv"].shape[1] % kv_heads:
            raise RequestError(
                "shape_mismatch",
                f"{L('wv')} has width {data['wv'].shape[1]}, which {kv_heads} key/value heads do not divide (it must be kv_heads*dv).",
                "wv",
            )
        dv = data["wv"].shape[1] // kv_heads
        wo = data["wo"]
        if wo is not None and wo.shape[0] != heads * dv:
            raise RequestError(
                "shape_mismatch",
                f"{L('wo')} has shape {list(wo.shape)}; it needs heads*dv = {heads * dv} rows ({heads} heads of dv={dv}).",
                "wo",
            )
        self._check_length("x", "n", n, s.max_t, "ATTN_MAX_T")
        self._check_width("x", d)
        B, window = math.prod(x.shape[:-2]) * heads, data["window"]
        scores = B * n * n if window is None else core.plan(B, n, n, dv, causal=data["causal"], window=window).scores
        self.check_scores(scores, data["return_weights"], f"{L('x')} {list(x.shape)} with {heads} heads", B * n * n)
        d_out = heads * dv if wo is None else wo.shape[-1]
        self._check_output(math.prod(x.shape[:-1]) * d_out, f"{L('x')} {list(x.shape)}")  # out (..., n, d_out)
        self._check_scale(data)

    @post_load(pass_original=True)
    def _job(self, data, original, **kwargs) -> MhaJob:
        dtype = self._dtype(data)
        names = ("x", "wq", "wk", "wv") if data["wo"] is None else ("x", "wq", "wk", "wv", "wo")
        arrays = {name: self.cast(name, data[name], dtype) for name in names}
        return MhaJob(
            arrays["x"],
            arrays["wq"],
            arrays["wk"],
            arrays["wv"],
            arrays.get("wo"),
            heads=data["heads"],
            causal=data["causal"],
            return_weights=data["return_weights"],
            encoding=self._encoding(data, original, "x"),
            scale=data["scale"],
            kv_heads=data["kv_heads"],
            window=data["window"],
            weights_dtype=data["weights_dtype"],
        )


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if an array of shape broadcasts to exactly target (never growing it)."""
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False
