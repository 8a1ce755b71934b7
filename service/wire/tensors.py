"""The three tensor encodings <-> numpy:

  nested  [[1, 0], [0, 1]]                                  rectangular, row-major
  flat    {"shape": [2, 2], "data": [1, 0, 0, 1], "dtype"?}  data row-major
  b64     {"shape": [2], "dtype": "float32", "b64": "..."}   raw little-endian row-major bytes

Decoding converts once and checks the whole array; it never loops over elements in Python.
Knows nothing of HTTP or of which field a tensor is: errors are TensorError(code, message).
"""

from __future__ import annotations

import binascii
import itertools
import math
from collections.abc import Iterable

import numpy as np
import pybase64

from .json import Payload
from .stream import NESTED_CHUNK_ELEMENTS, B64Text, NestedArray

ENCODINGS = ("nested", "flat", "b64")
WIRE_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("?"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
MAX_ELEMENTS = 2**40  # any shape past this is refused before anything is allocated
# numpy refuses arrays past its own rank limit (32 in numpy 1, 64 in 2) with a ValueError; any
# declared shape longer than this is refused first, as bad_rank, whatever numpy is installed.
# Far above the schemas' ATTN_MAX_RANK, which gives the contract's message for ranks in between.
MAX_RANK = 32


class TensorError(ValueError):
    """A tensor value that cannot be decoded: code is one of the contract's 422 codes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class NestedData:
    """The "data" of a flat value given nested as its shape (KServe's JSON inputs may be): the
    native JSON never holds one, since only a door that declares the shape builds it."""

    __slots__ = ("rows",)

    def __init__(self, rows: list | np.ndarray):
        self.rows = rows


def wire_encoding(value) -> str:
    """Which of the three encodings a (valid) tensor value uses."""
    if isinstance(value, dict):
        return "b64" if "b64" in value else "flat"
    return "nested"


def decode(value) -> np.ndarray:
    """Any encoding -> ndarray of the dtype the wire implies (bool, int64 or float64 for JSON
    numbers; the declared dtype for flat and b64)."""
    if isinstance(value, dict):
        if "b64" in value:
            return _decode_b64(value)
        if "data" in value:
            return _decode_flat(value)
        raise TensorError("bad_encoding", "must be a nested array, {shape, data} or {shape, dtype, b64}")
    return _decode_nested(value)


def encode(arr: np.ndarray, encoding: str, *, lazy: bool = False, dtype: str | None = None):
    """ndarray -> a JSON-ready value in the given encoding (arrays are left for orjson to write).

    lazy: a b64 value's text is a B64Text, and a large nested array a NestedArray, encoded by
    dumps() or, chunk by chunk as they are sent, by dump_chunks(); otherwise a str and an ndarray.
    dtype: the precision to send arr in (a lazy b64 text casts chunk by chunk as it is sent)."""
    arr = np.ascontiguousarray(arr)
    wire_dtype = np.dtype(dtype or arr.dtype)
    if encoding == "b64":
        text = B64Text(arr, wire_dtype)
        return {"shape": list(arr.shape), "dtype": wire_dtype.name, "b64": text if lazy else text.text()}
    arr = arr.astype(wire_dtype, copy=False)
    if encoding == "nested":
        return NestedArray(arr) if lazy and arr.size > NESTED_CHUNK_ELEMENTS else arr
    return {"shape": list(arr.shape), "dtype": arr.dtype.name, "data": arr.reshape(-1)}


def _decode_nested(value) -> np.ndarray:
    if isinstance(value, np.ndarray):  # decoded by loads(), rectangular and numeric
        return _checked_kind(value)
    if isinstance(value, (str, dict)) or value is None:
        raise TensorError("bad_type", "must be an array of numbers")
    try:
        arr = np.array(value)
    except (ValueError, OverflowError):
        raise TensorError("ragged", "is not rectangular: every row of an axis must have the same length") from None
    if arr.dtype.kind in "iuf" and arr.ndim > 0 and _holds_bool(value, arr.ndim):
        raise TensorError("bad_type", "mixes booleans with numbers")
    return _checked_kind(arr)


def _holds_bool(value: list, ndim: int) -> bool:
    """numpy turns [1.5, true] into floats; find a boolean hidden among numbers (C-speed scan)."""
    flat: Iterable = value
    for _ in range(ndim - 1):
        flat = itertools.chain.from_iterable(flat)
    return bool in set(map(type, flat))


def _checked_kind(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind not in "biuf":
        raise TensorError("bad_type", "must hold numbers (or booleans for a mask), not strings, objects or nulls")
    if arr.size == 0:
        raise TensorError("bad_shape", f"has shape {list(arr.shape)}; every axis must be at least 1")
    return arr


def _shape(value: dict) -> tuple[int, ...]:
    shape = value.get("shape")
    if not isinstance(shape, list):
        raise TensorError("bad_shape", 'needs "shape": a list of integers')
    if len(shape) > MAX_RANK:  # before the entries are looked at: numpy cannot hold it at all
        raise TensorError("bad_rank", f"has a shape of {len(shape)} axes; at most {MAX_RANK} are accepted")
    if not all(type(n) is int for n in shape):
        raise TensorError("bad_shape", 'needs "shape": a list of integers')
    if any(n < 1 for n in shape):
        raise TensorError("bad_shape", f"has shape {shape}; every axis must be at least 1")
    if math.prod(shape) > MAX_ELEMENTS:
        raise TensorError("bad_shape", f"has shape {shape}, whose element count overflows")
    return tuple(shape)


SHOWN = 40  # characters of a client's value in a message


def show(value) -> str:
    """A client's value (or field name) as a message shows it: its repr, cut if long (a 1 MB key
    is not echoed). An array loads() decoded (in it, or it) shows as the list it was sent as, so
    the message is the same whichever way the body was parsed."""
    text = repr(_as_sent(value))
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


class _Sent:
    """An ndarray whose repr is the start of the list it was sent as: [[0.5, 1.25, ... rather
    than numpy's array([[0.5, ...; at most SHOWN characters of it are made, never the list."""

    __slots__ = ("arr",)

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def __repr__(self) -> str:
        out: list[str] = []
        size = 0

        def walk(a: np.ndarray) -> None:
            nonlocal size
            out.append("[")
            size += 1
            for i, x in enumerate(a):
                if size > SHOWN:  # the rest is cut: the text so far is the start of the list's repr
                    return
                if i:
                    out.append(", ")
                    size += 2
                if a.ndim > 1:
                    walk(x)
                else:
                    out.append(repr(x.item()))
                    size += len(out[-1])
            out.append("]")
            size += 1

        walk(self.arr)
        return "".join(out)


def _as_sent(value, depth: int = 2):
    """value with the ndarrays loads() decoded (at its top or in its dicts and lists, two levels
    down) shown as sent."""
    if isinstance(value, np.ndarray):
        return _Sent(value) if value.ndim else value.item()  # a 0-d array: its number, as sent
    if depth and isinstance(value, dict) and any(isinstance(v, (np.ndarray, dict, list)) for v in value.values()):
        return {k: _as_sent(v, depth - 1) for k, v in value.items()}
    if depth and isinstance(value, list) and value and any(isinstance(v, (np.ndarray, dict)) for v in value):
        return [_as_sent(v, depth - 1) for v in value]
    return value


def show_names(names: list) -> str:
    """The first few names, in the order given, each shown cut: a message (and the log line that
    holds it) never grows with the body."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return "[" + ", ".join(show(n) for n in names[:3]) + "]" + more


def _dtype(value: dict, default: str | None) -> np.dtype | None:
    """The dtype a tensor object names (or default); None when neither names one."""
    name = value.get("dtype", default)
    if name is None:
        return None
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise TensorError("bad_type", f"has dtype {show(name)}; use one of {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def _no_extra_keys(value: dict, allowed: set[str]) -> None:
    extra = [key for key in value if key not in allowed]
    if extra:
        raise TensorError("bad_encoding", f"has unexpected keys {show_names(extra)}; allowed: {sorted(allowed)}")


def _decode_flat(value: dict) -> np.ndarray:
    _no_extra_keys(value, {"shape", "data", "dtype"})
    shape = _shape(value)
    dtype = _dtype(value, None)
    data = value["data"]
    if isinstance(data, NestedData):
        arr = _decode_as_shape(data.rows, shape)
    else:
        arr = _decode_flat_data(data, shape)
    if dtype is not None:
        if dtype.kind != "b" and arr.dtype.kind == "b":
            raise TensorError("bad_type", f"declares dtype {dtype.name} but holds booleans")
        if dtype.kind in "iu" and arr.dtype.kind == "f":
            raise TensorError("bad_type", f"declares dtype {dtype.name} but holds fractional numbers")
        arr = as_mask(arr) if dtype.kind == "b" else narrow(arr, dtype, f"declares dtype {dtype.name} but holds")
    return arr.reshape(shape)


def _decode_flat_data(data, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(data, (list, np.ndarray)):
        raise TensorError("bad_type", 'needs "data": a flat list of numbers')
    if len(data) != math.prod(shape):
        raise TensorError("bad_shape", f"has {len(data)} data values but shape {list(shape)} needs {math.prod(shape)}")
    arr = _decode_nested(data)
    if arr.ndim != 1:
        raise TensorError("bad_shape", 'needs "data" flat (one level of list), row-major')
    return arr


def _decode_as_shape(rows: list | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Data nested as the declared shape (the KServe JSON form) -> the array, flattened."""
    try:
        arr = _decode_nested(rows)
    except TensorError as exc:
        if exc.code == "ragged":
            raise TensorError("ragged", "has data that is not rectangular: every row of an axis must have the same length") from None
        raise
    if arr.shape != shape:
        raise TensorError(
            "bad_shape", f"has data nested as {list(arr.shape)} but shape {list(shape)}; nest it as the shape, or send it flat"
        )
    return arr.reshape(-1)


def _decode_b64(value: dict) -> np.ndarray:
    _no_extra_keys(value, {"shape", "dtype", "b64"})
    shape = _shape(value)
    if value.get("dtype") is None:  # absent or null: the bytes cannot be read without it
        raise TensorError("bad_type", 'needs "dtype" with "b64": float16, float32, float64, bool, int32 or int64')
    dtype = _dtype(value, None)
    assert dtype is not None  # "dtype" is present: checked above
    text = value["b64"]
    if isinstance(text, Payload):  # decoded by loads() straight from the body
        raw = text.raw
    elif not isinstance(text, str):
        raise TensorError("bad_encoding", 'needs "b64": a base64 string')
    else:
        try:
            raw = pybase64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise TensorError("bad_encoding", 'has "b64" that is not valid base64') from None
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise TensorError("bad_shape", f"has {len(raw)} bytes but shape {list(shape)} of {dtype.name} needs {need}")
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if not arr.flags.aligned:  # a /v2 binary input at an odd offset of the body: numpy would take
        arr = arr.copy()  # its unaligned loops, whose last bits differ from the other doors' answer
    if dtype.kind == "b" and arr.view(np.uint8).max() > 1:
        raise TensorError("bad_type", "has bool bytes other than 0 and 1")
    return arr


def as_mask(arr: np.ndarray) -> np.ndarray:
    """A decoded mask -> bool: booleans, or numbers that are all 0 or 1."""
    if arr.dtype.kind == "b":
        return arr
    if not ((arr == 0) | (arr == 1)).all():
        raise TensorError("bad_type", "must hold booleans or 0/1 numbers")
    return arr.astype(bool)


def narrow(arr: np.ndarray, dtype: np.dtype, what: str = "holds", code: str = "bad_type") -> np.ndarray:
    """arr as dtype, refusing integers that dtype cannot hold (astype would wrap them silently:
    4294967297 as int32 is 1). Floats are cast as they are; their overflow is inf, which the
    schema refuses as non_finite. Raises TensorError(code)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu" and arr.dtype != dtype and arr.size:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:  # numpy compares int64, uint64 and float exactly enough here
            bad = lo if lo < info.min else hi
            raise TensorError(code, f"{what} {bad}, outside {dtype.name}'s range {info.min}..{info.max}")
    with np.errstate(over="ignore"):  # a float past the dtype's range becomes inf, refused as non_finite: no warning
        return arr.astype(dtype, copy=False)
