"""Fields that raise the contract's error codes. Each knows its name, so every error names its
field: a type error is bad_type, a failed validator bad_option, an absent required field
missing_field. Messages call the field by its label, which the schema sets (the name itself, or
the front door's term for it, say "input q"). The Tensor field decodes once with wire.decode
and checks the whole array.

Only marshmallow's public interface is used: a field's `deserialize` (wrapped, to turn its
refusals into coded errors and to answer an absent field at once), its `_deserialize` (the
documented method a custom field implements) and `error_messages`."""

from __future__ import annotations

import math

import numpy as np
from marshmallow import ValidationError, fields, missing, validate

from service import wire
from service.wire import show  # a client's value as a message shows it, cut if long

from .errors import RequestError

Messages = dict[str, str | list | dict]  # marshmallow's type of a field's error_messages


class Coded(fields.Field):
    """Put before a marshmallow field class (class Bool(Coded, fields.Boolean)): its
    ValidationErrors become RequestErrors with a code and the field's name (or `error_field`, when
    a front door names another)."""

    default_error_messages: Messages = {"required": "{label} is required.", "null": "{label} may not be null."}
    _label: str | None = None
    error_field: str | None = None
    typed_null = False  # null refused by _deserialize, as any other value of the wrong type (a front door's choice)

    @property
    def label(self) -> str:
        """What messages call the field: set by the schema when it binds it, else its name."""
        return self._label or self.name or ""

    @label.setter
    def label(self, text: str) -> None:
        self._label = text

    def _error(self, code: str, text: str) -> RequestError:
        return RequestError(code, text, self.error_field or self.name)

    def deserialize(self, value, attr=None, data=None, **kwargs):
        """marshmallow's (Field.deserialize: the default of an absent field, null, _deserialize, the
        validators; these fields take no field-level pre_load or post_load functions), with coded
        errors: an absent required field is missing_field, null bad_type, a failed validator bad_option."""
        if value is missing:
            if self.required:
                raise self._error("missing_field", str(self.error_messages["required"]).format(label=self.label))
            default = self.load_default
            return default() if callable(default) else default
        if value is None:
            if self.allow_none:
                return None
            if not self.typed_null:
                raise self._error("bad_type", str(self.error_messages["null"]).format(label=self.label))
        output = self._deserialize(value, attr, data, **kwargs)
        for validator in self.validators:
            try:
                validator(output)
            except ValidationError as exc:  # _deserialize turns its own into bad_type: this is a validator's
                raise self._error("bad_option", f"{self.label}: {_text(exc)} Got {show(value)}.") from None
        return output

    def _deserialize(self, value, attr, data, **kwargs):
        try:
            return super()._deserialize(value, attr, data, **kwargs)
        except ValidationError as exc:
            raise self._error("bad_type", f"{self.label}: {_text(exc)} Got {show(value)}.") from None


def _text(exc: ValidationError) -> str:
    msgs = exc.messages if isinstance(exc.messages, list) else [str(exc.messages)]
    return " ".join(str(m) for m in msgs)


class Bool(Coded, fields.Boolean):
    """Strictly true or false: no "yes", no 1."""

    def __init__(self, **kwargs):
        super().__init__(truthy={True}, falsy={False}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):  # 1 in {True} and 0 in {False}: the sets alone let numbers through
            raise self._error("bad_type", f"{self.label} must be true or false, not {show(value)}.")
        return value


class Choice(Coded, fields.Raw):
    """One of a fixed set of JSON values (compared by type and value, so 1 is not true)."""

    def __init__(self, choices, **kwargs):
        self.choices = tuple(choices)
        metadata = {"enum": list(self.choices), **kwargs.pop("metadata", {})}  # the document's enum
        super().__init__(metadata=metadata, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if not any(type(value) is type(c) and value == c for c in self.choices):
            raise self._error("bad_option", f"{self.label} must be one of {_choices(self.choices)}, not {show(value)}.")
        return value


def _choices(choices) -> str:
    return ", ".join(repr(c).replace("True", "true").replace("False", "false").replace("'", '"') for c in choices)


class PositiveFloat(Coded, fields.Float):
    """A finite number > 0 (booleans are not numbers here)."""

    def __init__(self, **kwargs):
        super().__init__(allow_nan=False, validate=validate.Range(min=0, min_inclusive=False), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._error("bad_type", f"{self.label} must be a number, not {show(value)}.")
        if not math.isfinite(value):
            raise self._error("non_finite", f"{self.label} must be finite.")
        return float(value)


class Int(Coded, fields.Integer):
    """An integer >= minimum (booleans are not integers here)."""

    def __init__(self, minimum: int = 0, **kwargs):
        super().__init__(strict=True, validate=validate.Range(min=minimum), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool):
            raise self._error("bad_type", f"{self.label} must be an integer, not {show(value)}.")
        return super()._deserialize(value, attr, data, **kwargs)


class PositiveInt(Int):
    """An integer >= 1 (a count, a width)."""

    def __init__(self, **kwargs):
        super().__init__(minimum=1, **kwargs)


class NonNegativeInt(Int):
    """An integer >= 0 (a length, a position)."""

    def __init__(self, **kwargs):
        super().__init__(minimum=0, **kwargs)


class Tensor(Coded, fields.Field):
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
            arr = self._as_kind(wire.decode(value))
        except wire.TensorError as exc:
            raise self._error(exc.code, f"{self.label} {exc}.") from None
        lo, hi = self.ranks
        if not lo <= arr.ndim <= hi:
            raise self._error("bad_rank", f"{self.label} has rank {arr.ndim} (shape {list(arr.shape)}); it must have rank {lo} to {hi}.")
        return arr

    def _as_kind(self, arr: np.ndarray) -> np.ndarray:
        if self.kind == "mask":
            return wire.as_mask(arr)
        if arr.dtype.kind == "b":
            raise wire.TensorError("bad_type", f"must hold {self.KIND_DOC[self.kind]}, not booleans")
        if self.kind == "int":
            if arr.dtype.kind == "f":
                raise wire.TensorError("bad_type", "must hold integers")
            # uint64 past 2**63 would wrap negative: a value out of any option's range (bad_option)
            return wire.narrow(arr, np.dtype(np.int64), code="bad_option")
        return arr


class Window(Coded, fields.Field):
    """[left, right], integers >= -1 (FlashAttention's window_size; -1 leaves that side open) -> a tuple."""

    def __init__(self, **kwargs):
        metadata = {
            "description": "[left, right] integers >= -1 (FlashAttention's window_size): query t sees keys "
            "t + S - T - left <= s <= t + S - T + right; -1 leaves that side unbounded",
            **kwargs.pop("metadata", {}),
        }
        super().__init__(metadata=metadata, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs) -> tuple[int, int]:
        if not (isinstance(value, list) and len(value) == 2 and all(type(n) is int for n in value)):
            raise self._error("bad_type", f"{self.label} must be [left, right], two integers, not {show(value)}.")
        if min(value) < -1:
            raise self._error("bad_option", f"{self.label} values must be integers >= -1 (-1: unbounded), not {show(value)}.")
        return value[0], value[1]
