"""Fields that raise the contract's error codes. Each knows its name, so every error names its
field: a type error is bad_type, a failed validator bad_option, an absent required field
missing_field. The Tensor field converts once with numpy and checks the whole array."""

from __future__ import annotations

import math

import numpy as np
from marshmallow import ValidationError, fields, validate

from service import codec
from service.errors import invalid


class _Coded:
    """Mixin: marshmallow's ValidationErrors become ApiErrors with a code and the field's name."""

    def _validate_missing(self, value):
        try:
            super()._validate_missing(value)
        except ValidationError:
            if value is None:
                raise invalid("bad_type", f"{self.name} may not be null.", self.name) from None
            raise invalid("missing_field", f"{self.name} is required.", self.name) from None

    def _deserialize(self, value, attr, data, **kwargs):
        try:
            return super()._deserialize(value, attr, data, **kwargs)
        except ValidationError as exc:
            raise invalid("bad_type", f"{self.name}: {_text(exc)} Got {_show(value)}.", self.name) from None

    def _validate(self, value):
        try:
            super()._validate(value)
        except ValidationError as exc:
            raise invalid("bad_option", f"{self.name}: {_text(exc)} Got {_show(value)}.", self.name) from None


def _text(exc: ValidationError) -> str:
    msgs = exc.messages if isinstance(exc.messages, list) else [str(exc.messages)]
    return " ".join(str(m) for m in msgs)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Bool(_Coded, fields.Boolean):
    """Strictly true or false: no "yes", no 1."""

    def __init__(self, **kwargs):
        super().__init__(truthy={True}, falsy={False}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):  # 1 in {True} and 0 in {False}: the sets alone let numbers through
            raise invalid("bad_type", f"{self.name} must be true or false, not {_show(value)}.", self.name)
        return value


class Str(_Coded, fields.String):
    pass


class Choice(_Coded, fields.Raw):
    """One of a fixed set of JSON values (compared by type and value, so 1 is not true)."""

    def __init__(self, choices, **kwargs):
        self.choices = tuple(choices)
        super().__init__(validate=validate.OneOf(self.choices), **kwargs)  # the validator documents the enum

    def _validate(self, value):
        if not any(type(value) is type(c) and value == c for c in self.choices):
            raise invalid("bad_option", f"{self.name} must be one of {_choices(self.choices)}, not {_show(value)}.", self.name)


def _choices(choices) -> str:
    return ", ".join(repr(c).replace("True", "true").replace("False", "false").replace("'", '"') for c in choices)


class PositiveFloat(_Coded, fields.Float):
    """A finite number > 0 (booleans are not numbers here)."""

    def __init__(self, **kwargs):
        super().__init__(allow_nan=False, validate=validate.Range(min=0, min_inclusive=False), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid("bad_type", f"{self.name} must be a number, not {_show(value)}.", self.name)
        if not math.isfinite(value):
            raise invalid("non_finite", f"{self.name} must be finite.", self.name)
        return float(value)


class PositiveInt(_Coded, fields.Integer):
    def __init__(self, **kwargs):
        super().__init__(strict=True, validate=validate.Range(min=1), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool):
            raise invalid("bad_type", f"{self.name} must be an integer, not {_show(value)}.", self.name)
        return super()._deserialize(value, attr, data, **kwargs)


class Tensor(_Coded, fields.Field):
    """A tensor in any wire encoding -> a checked np.ndarray.

    kind: "float" (numbers; booleans refused), "mask" (booleans or 0/1 numbers -> bool), or
    "int" (integers -> int64). Checks rank bounds here; shapes across fields are the schema's."""

    KIND_DOC = {"float": "numbers", "mask": "booleans (or 0/1)", "int": "integers"}

    def __init__(self, kind: str = "float", ranks: tuple[int, int] = (2, 6), **kwargs):
        self.kind, self.ranks = kind, ranks
        metadata = {
            "description": f"tensor of {self.KIND_DOC[kind]}, rank {ranks[0]}..{ranks[1]}: a nested array, "
            "{shape, data[, dtype]} or {shape, dtype, b64}",
            **kwargs.pop("metadata", {}),
        }
        super().__init__(metadata=metadata, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs) -> np.ndarray:
        try:
            arr = codec.decode(value)
            arr = self._as_kind(arr)
        except codec.TensorError as exc:
            raise invalid(exc.code, f"{self.name} {exc}.", self.name) from None
        lo, hi = self.ranks
        if not lo <= arr.ndim <= hi:
            raise invalid(
                "bad_rank", f"{self.name} has rank {arr.ndim} (shape {list(arr.shape)}); it must have rank {lo} to {hi}.", self.name
            )
        return arr

    def _as_kind(self, arr: np.ndarray) -> np.ndarray:
        if self.kind == "mask":
            return codec.as_mask(arr)
        if arr.dtype.kind == "b":
            raise codec.TensorError("bad_type", f"must hold {self.KIND_DOC[self.kind]}, not booleans")
        if self.kind == "int":
            if arr.dtype.kind == "f":
                raise codec.TensorError("bad_type", "must hold integers")
            return arr.astype(np.int64, copy=False)
        return arr
