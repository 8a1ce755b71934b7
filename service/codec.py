"""Wire formats <-> numpy. JSON bytes <-> Python (strict), and the three tensor encodings:

  nested  [[1, 0], [0, 1]]                                  rectangular, row-major
  flat    {"shape": [2, 2], "data": [1, 0, 0, 1], "dtype"?}  data row-major
  b64     {"shape": [2], "dtype": "float32", "b64": "..."}   raw little-endian row-major bytes

Decoding converts once and checks the whole array; it never loops over elements in Python.
Knows nothing of HTTP or of which field a tensor is: errors are TensorError(code, message).

The fast path (measured in bench/): a request body's tensors never become Python objects.
loads() cuts each b64 payload out of the body and decodes it with SIMD base64 straight from the
body's bytes, parses the rest with simdjson, and copies each nested array of numbers from
simdjson's tape into numpy in C, after checking that it is exactly rectangular. Whatever that
path cannot vouch for is parsed again by orjson, as before, so the answer (and every error) is
the same either way. Responses are written once: b64 payloads are encoded while they are sent.
"""

from __future__ import annotations

import binascii
import itertools
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import orjson
import pybase64
import simdjson

ENCODINGS = ("nested", "flat", "b64")
WIRE_DTYPES = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("?"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
MAX_ELEMENTS = 2**40  # any shape past this is refused before anything is allocated
FAST_MIN_ELEMENTS = 64  # smaller arrays stay Python lists: nothing to gain, and messages show them as sent
# A simdjson parser keeps its buffers between documents; a fresh one costs ~20 ms of allocation
# and page faults for a 17 MB body (measured: parse 46 ms fresh, 26 ms reused). One per process
# is reused for bodies up to this size, so an idle worker holds at most a few times this much.
PARSER_REUSE_MAX_BYTES = 32 * 2**20
B64_CHUNK = 3 * 2**20
NESTED_CHUNK_ELEMENTS = (
    2**18
)  # numbers per block of a streamed nested array (~2.5 MB of float32 text)  # raw bytes per streamed b64 chunk (4 MiB of text): a multiple of 3, so chunks join


class TensorError(ValueError):
    """A tensor value that cannot be decoded: code is one of the contract's 422 codes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Payload:
    """The decoded bytes of a request's "b64" string: loads() puts one where the text was."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes):
        self.raw = raw

    def __repr__(self) -> str:
        return f"<{len(self.raw)} bytes of base64>"


class B64Text:
    """A response tensor's base64 text, encoded only when it is written (see dump_chunks)."""

    __slots__ = ("arr",)

    def __init__(self, arr: np.ndarray):
        self.arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))  # (...), little-endian

    def __len__(self) -> int:
        return 4 * math.ceil(self.arr.nbytes / 3)

    def chunks(self):
        raw = memoryview(self.arr.reshape(-1)).cast("B")
        for start in range(0, len(raw), B64_CHUNK):
            yield pybase64.b64encode(raw[start : start + B64_CHUNK])

    def text(self) -> str:
        return pybase64.b64encode(memoryview(self.arr.reshape(-1)).cast("B")).decode("ascii")


# --- JSON documents -------------------------------------------------------------------------


def loads(body: bytes | bytearray):
    """Strict JSON: NaN, Infinity and numbers past float64 are errors (orjson.JSONDecodeError).

    An object's tensors come back decoded (see the module docstring): a top-level array of at
    least FAST_MIN_ELEMENTS numbers, or the "data" of a top-level object, as np.ndarray (int64 if
    every number is an integer, else float64, as np.array would give); a "b64" string of a
    top-level object as a Payload. Everything else is exactly what orjson.loads gives."""
    try:
        doc = _fast_loads(body)
    except Exception:  # noqa: BLE001 - anything the fast path trips on, orjson judges
        doc = None
    return orjson.loads(body) if doc is None else doc


def dumps(obj) -> bytes:
    """JSON bytes; numpy arrays are written straight from their buffers."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=_default)


def dump_chunks(obj) -> tuple[bytes | Iterator[bytes], int | None]:
    """JSON for a response and its length in bytes. Where obj holds B64Text or NestedArray, the
    JSON comes as an iterator of chunks that encodes each tensor as it is sent, so the text is
    never whole in memory and the client reads while the rest is written; otherwise it is the
    bytes. The length is None where a NestedArray's text cannot be known before it is written."""
    lazy: list[B64Text | NestedArray] = []
    nonce = os.urandom(8).hex()

    def marker(o):
        if isinstance(o, (B64Text, NestedArray)):
            lazy.append(o)
            return f"lazy:{nonce}:{len(lazy) - 1}"
        return _default(o)

    skeleton = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=marker)
    if not lazy:
        return skeleton, len(skeleton)
    parts, pos, length = [], 0, len(skeleton)
    for i, value in enumerate(lazy):
        mark = f"lazy:{nonce}:{i}".encode()
        at = skeleton.index(mark, pos)
        if isinstance(value, B64Text):  # the text goes between the marker's quotes
            parts += [(skeleton[pos:at],), value.chunks()]
            pos = at + len(mark)
            length -= len(mark) - len(value)
        else:  # an array replaces the marker and its quotes
            parts += [(skeleton[pos : at - 1],), value.chunks()]
            pos = at + len(mark) + 1
            length = None
    parts.append((skeleton[pos:],))
    return itertools.chain.from_iterable(parts), length


class NestedArray:
    """A large response tensor as a nested JSON array, written by orjson in blocks of about
    NESTED_CHUNK_ELEMENTS as it is sent: the same bytes as orjson.dumps(arr), but the client
    reads the first blocks while the server writes the rest (orjson writes ~24 ns a float32)."""

    __slots__ = ("arr",)

    def __init__(self, arr: np.ndarray):
        self.arr = np.ascontiguousarray(arr)

    def chunks(self, arr: np.ndarray | None = None) -> Iterator[bytes]:
        arr = self.arr if arr is None else arr
        if arr.size <= NESTED_CHUNK_ELEMENTS or arr.ndim == 1:
            yield dumps(arr)
            return
        n, per_item = arr.shape[0], arr[0].size
        yield b"["
        if per_item > NESTED_CHUNK_ELEMENTS:  # one item is too big: split it in turn
            for i in range(n):
                if i:
                    yield b","
                yield from self.chunks(arr[i])
        else:  # several items a block: dumps of a slice is "[a,b,...]"; its inside joins with ","
            step = NESTED_CHUNK_ELEMENTS // per_item
            for i in range(0, n, step):
                if i:
                    yield b","
                yield dumps(arr[i : i + step])[1:-1]
        yield b"]"


def _default(obj):
    if isinstance(obj, B64Text):
        return obj.text()
    if isinstance(obj, NestedArray):
        return orjson.Fragment(b"".join(obj.chunks()))
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def depth(obj, limit: int) -> int:
    """Nesting depth of a parsed document, following each object's values and each array's first
    element (a deeper element elsewhere makes an array ragged, which decoding refuses). Stops
    counting past limit."""
    if limit < 0:
        return 0
    if isinstance(obj, dict):
        return 1 + max((depth(v, limit - 1) for v in obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + (depth(obj[0], limit - 1) if obj else 0)
    if isinstance(obj, np.ndarray):
        return obj.ndim
    return 0


def _fast_loads(body: bytes) -> dict | None:
    """The fast path of loads(), or None where it cannot vouch for the answer."""
    if not isinstance(body, (bytes, bytearray)) or body.startswith(b"\xef\xbb\xbf"):  # simdjson allows a BOM, JSON does not
        return None
    skeleton, payloads = _cut_b64(body)
    with _parser(len(skeleton)) as parser:
        return _decode_parsed(parser.parse(skeleton), skeleton, payloads)  # holds no proxy past the block


_shared_parser = simdjson.Parser()
_shared_parser_lock = threading.Lock()


@contextmanager
def _parser(size: int):
    """The process's reusable parser when it is free and the body is small enough, else a fresh one.
    Every value is converted before the block ends, so no document outlives its turn."""
    if size <= PARSER_REUSE_MAX_BYTES and _shared_parser_lock.acquire(blocking=False):
        try:
            yield _shared_parser
        finally:
            _shared_parser_lock.release()
    else:
        yield simdjson.Parser()


def _decode_parsed(parsed, skeleton: bytes | bytearray, payloads: dict) -> dict | None:
    """The document as loads() returns it, from simdjson's parse of the skeleton. Every proxy into
    the parse is a local here, so all are gone when this returns and the parser may be reused."""
    if not isinstance(parsed, simdjson.Object):
        return None
    doc, arrays, found = {}, 0, 0  # arrays: those decoded to ndarray, counted as the text counts them
    for key, value in _items(parsed):
        if isinstance(value, simdjson.Array):
            value, n = _array(value)
            arrays += n
        elif isinstance(value, simdjson.Object):
            inner = {}
            for k, v in _items(value):
                if isinstance(v, simdjson.Array):
                    v, n = _array(v) if k == "data" else (v.as_list(), 0)
                    arrays += n
                elif isinstance(v, simdjson.Object):
                    v = v.as_dict()
                elif k == "b64" and isinstance(v, str) and v in payloads:
                    v = payloads[v]
                    found += 1
                inner[k] = v
            value = inner
        doc[key] = value
    del parsed
    if found != len(payloads):  # a payload that is not the value of a "b64" key: let orjson judge
        return None
    if arrays and (b"\\" in skeleton or skeleton.count(b"[") != arrays + _brackets(doc)):
        return None  # an array hidden where a number should be (say [1, [2]]): not rectangular
    return doc


def _items(obj: "simdjson.Object") -> list:
    """(key, value) pairs with arrays and objects left as simdjson proxies (items() converts them
    all to Python). A repeated key raises: orjson keeps the last, simdjson's lookup the first."""
    keys = list(obj)
    if len(set(keys)) != len(keys):
        raise ValueError("repeated key")
    return [(key, obj[key]) for key in keys]


def _cut_b64(body: bytes | bytearray) -> tuple[bytes | bytearray, dict[str, Payload]]:
    """Cut each "b64": "<base64>" payload out of body, decoded; the skeleton keeps a marker string
    in its place. A payload that is not clean base64 stays in the skeleton, for the slow path."""
    if b'"b64"' not in body:
        return body, {}
    view, pieces, payloads, pos = memoryview(body), [], {}, 0
    nonce = os.urandom(8).hex()
    while (key := body.find(b'"b64"', pos)) >= 0:
        at = key + 5
        while body[at : at + 1] in (b" ", b"\t", b"\n", b"\r"):
            at += 1
        if body[at : at + 1] != b":":
            pos = at
            continue
        at += 1
        while body[at : at + 1] in (b" ", b"\t", b"\n", b"\r"):
            at += 1
        if body[at : at + 1] != b'"':
            pos = at
            continue
        end = body.find(b'"', at + 1)
        if end < 0:
            break
        try:
            raw = pybase64.b64decode(view[at + 1 : end], validate=True)
        except (binascii.Error, ValueError):
            pos = end
            continue
        marker = f"b64:{nonce}:{len(payloads)}"
        payloads[marker] = Payload(raw)
        pieces += [view[pos : at + 1], marker.encode()]
        pos = end
    if not payloads:
        return body, {}
    pieces.append(view[pos:])
    return b"".join(pieces), payloads


def _array(arr: "simdjson.Array") -> tuple[object, int]:
    """A parsed array as an ndarray if it is a rectangular array of numbers (with the number of
    arrays its text holds, for the caller's check), else as a list (and 0)."""
    shape, node = [], arr
    while isinstance(node, simdjson.Array):
        if len(node) == 0:
            return arr.as_list(), 0
        shape.append(len(node))
        node = node[0]
    count, rows = math.prod(shape), math.prod(shape[:-1])
    if type(node) not in (int, float) or count < FAST_MIN_ELEMENTS or (shape[-1] < 3 and rows > 64):
        return arr.as_list(), 0  # not numbers, small, or rows so short that checking each costs more
    nodes = [arr]  # every array down to the rows has the length the first path found
    for n in shape[1:-1]:
        nodes = [child for node in nodes for child in node]
        if not all(type(child) is simdjson.Array for child in nodes) or set(map(len, nodes)) != {n}:
            return arr.as_list(), 0
    if len(shape) > 1:
        try:
            if not all(set(map(len, node)) == {shape[-1]} for node in nodes):
                return arr.as_list(), 0
        except TypeError:  # a number where a row should be
            return arr.as_list(), 0
    for kind, dtype in (("i", np.int64), ("u", np.uint64), ("d", np.float64)) if type(node) is int else (("d", np.float64),):
        try:
            flat = np.frombuffer(arr.as_buffer(of_type=kind), dtype=dtype)
        except (TypeError, ValueError, RuntimeError):  # a boolean, string, null or object; or not int64
            continue
        if flat.size != count:
            return arr.as_list(), 0
        if kind == "u" and (flat < 2**63).any():  # as np.array: int64 and uint64 numbers make float64
            flat = flat.astype(np.float64)
        arrays = sum(math.prod(shape[:i]) for i in range(len(shape)))  # 1 + s0 + s0*s1 + ...
        return flat.reshape(shape), arrays
    return arr.as_list(), 0


def _brackets(obj) -> int:
    """How many "[" the JSON text of obj holds outside the arrays decoded to ndarray."""
    if isinstance(obj, dict):
        return sum(k.count("[") + _brackets(v) for k, v in obj.items())
    if isinstance(obj, list):
        return orjson.dumps(obj).count(b"[")
    if isinstance(obj, str):
        return obj.count("[")
    return 0


# --- tensors ------------------------------------------------------------------------------


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


def encode(arr: np.ndarray, encoding: str, *, lazy: bool = False):
    """ndarray -> a JSON-ready value in the given encoding (arrays are left for orjson to write).

    lazy: a b64 value's text is a B64Text, and a large nested array a NestedArray, encoded by
    dumps() or, chunk by chunk as they are sent, by dump_chunks(); otherwise a str and an ndarray."""
    arr = np.ascontiguousarray(arr)
    if encoding == "nested":
        return NestedArray(arr) if lazy and arr.size > NESTED_CHUNK_ELEMENTS else arr
    head = {"shape": list(arr.shape), "dtype": arr.dtype.name}
    if encoding == "flat":
        return {**head, "data": arr.reshape(-1)}
    text = B64Text(arr)
    return {**head, "b64": text if lazy else text.text()}


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
    flat = value
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
    if not isinstance(shape, list) or not all(type(n) is int for n in shape):
        raise TensorError("bad_shape", 'needs "shape": a list of integers')
    if any(n < 1 for n in shape):
        raise TensorError("bad_shape", f"has shape {shape}; every axis must be at least 1")
    if math.prod(shape) > MAX_ELEMENTS:
        raise TensorError("bad_shape", f"has shape {shape}, whose element count overflows")
    return tuple(shape)


def _dtype(value: dict, default: str | None) -> np.dtype | None:
    name = value.get("dtype", default)
    if name is None:
        return None
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise TensorError("bad_type", f"has dtype {name!r}; use one of {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def _no_extra_keys(value: dict, allowed: set[str]) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise TensorError("bad_encoding", f"has unexpected keys {extra}; allowed: {sorted(allowed)}")


def _decode_flat(value: dict) -> np.ndarray:
    _no_extra_keys(value, {"shape", "data", "dtype"})
    shape = _shape(value)
    dtype = _dtype(value, None)
    data = value["data"]
    if not isinstance(data, (list, np.ndarray)):
        raise TensorError("bad_type", 'needs "data": a flat list of numbers')
    if len(data) != math.prod(shape):
        raise TensorError("bad_shape", f"has {len(data)} data values but shape {list(shape)} needs {math.prod(shape)}")
    arr = _decode_nested(data)
    if arr.ndim != 1:
        raise TensorError("bad_shape", 'needs "data" flat (one level of list), row-major')
    if dtype is not None:
        if dtype.kind != "b" and arr.dtype.kind == "b":
            raise TensorError("bad_type", f"declares dtype {dtype.name} but holds booleans")
        if dtype.kind in "iu" and arr.dtype.kind == "f":
            raise TensorError("bad_type", f"declares dtype {dtype.name} but holds fractional numbers")
        arr = as_mask(arr) if dtype.kind == "b" else arr.astype(dtype)
    return arr.reshape(shape)


def _decode_b64(value: dict) -> np.ndarray:
    _no_extra_keys(value, {"shape", "dtype", "b64"})
    shape = _shape(value)
    if value.get("dtype") is None:  # absent or null: the bytes cannot be read without it
        raise TensorError("bad_type", 'needs "dtype" with "b64": float32, float64 or bool')
    dtype = _dtype(value, None)
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
