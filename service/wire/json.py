"""Strict JSON documents: bytes -> Python (loads) and Python -> bytes (dumps).

The fast path of loads() (measured in bench/): a request body's tensors never become Python
objects. It cuts each b64 payload out of the body and decodes it with SIMD base64 straight from
the body's bytes (a Payload), parses the rest with simdjson, and copies each nested array of
numbers from simdjson's tape into numpy in C, after checking that it is exactly rectangular.
Whatever that path cannot vouch for is parsed again by orjson, so the answer (and every error)
is the same either way.
"""

from __future__ import annotations

import binascii
import math
import mmap
import os
import threading
from contextlib import contextmanager
from typing import cast

import numpy as np
import orjson
import pybase64
import simdjson

from .stream import default

FAST_MIN_ELEMENTS = 64  # smaller arrays stay Python lists: nothing to gain, and messages show them as sent
# A simdjson parser keeps its buffers between documents: reusing one saves allocation and page
# faults, but it keeps the capacity of the largest document it parsed (a hostile 32 MiB body left
# a worker holding 290-513 MiB after its 422, `python -m bench worker_peak`; a 4 MiB one about
# 10 MiB, a step the short soak saw as growth). One per process is reused for bodies up to this
# size, so an idle worker holds a few MiB at most; a larger body gets a fresh parser, freed with it:
# no measurable cost at 2-4 MiB (nested 3.9 MiB: 14.8 ms fresh, 15.0 ms reused), 15-20% more at
# 15.5 MiB (55 ms against 45 ms; in-process, medians of 7-15).
PARSER_REUSE_MAX_BYTES = 2**20
# Bounds on the fast path's Python work, past any valid request (a few fields, at most a dozen
# tensors): a body beyond them is parsed by orjson alone, in time linear in its bytes.
MAX_FAST_KEYS = 64  # keys of one object looked up through simdjson (each lookup scans the keys)
MAX_PAYLOADS = 64  # "b64" payloads cut out of one body (each costs Python)
SHORT_ROW = 3  # rows shorter than this are checked on the text (_nests_as), not row by row


class Payload:
    """The decoded bytes of a request's "b64" string: loads() puts one where the text was."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes | memoryview):
        self.raw = raw

    def __repr__(self) -> str:
        return f"<{len(self.raw)} bytes of base64>"


def loads(body: bytes | bytearray | mmap.mmap):
    """Strict JSON: NaN, Infinity and numbers past float64 are errors (orjson.JSONDecodeError).
    body may be the anonymous mapping the worker read a large body into (service.transport.worker).

    An object's tensors come back decoded (see the module docstring): a top-level array of at
    least FAST_MIN_ELEMENTS numbers, or the "data" of a top-level object or of an object in a
    top-level array of objects (the Open Inference Protocol's "inputs"), as np.ndarray (int64 if
    every number is an integer, else float64, as np.array would give); a "b64" string of a
    top-level object as a Payload. Everything else is exactly what orjson.loads gives."""
    try:
        doc = _fast_loads(body)
    except Exception:  # noqa: BLE001 - anything the fast path trips on, orjson judges
        doc = None
    if doc is None:
        return orjson.loads(memoryview(body) if isinstance(body, mmap.mmap) else body)
    return doc


def dumps(obj) -> bytes:
    """JSON bytes; numpy arrays are written straight from their buffers (lazy tensors eagerly)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=default)


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


def _fast_loads(body: bytes | bytearray | mmap.mmap) -> dict | None:
    """The fast path of loads(), or None where it cannot vouch for the answer."""
    if not isinstance(body, (bytes, bytearray, mmap.mmap)) or body[:3] == b"\xef\xbb\xbf":  # simdjson allows a BOM, JSON does not
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


def _decode_parsed(parsed, skeleton: bytes | bytearray | mmap.mmap, payloads: dict) -> dict | None:
    """The document as loads() returns it, from simdjson's parse of the skeleton. Every proxy into
    the parse is a local here, so all are gone when this returns and the parser may be reused."""
    if not isinstance(parsed, simdjson.Object):
        return None
    doc, arrays, found = {}, 0, 0  # arrays: those decoded to ndarray, counted as the text counts them
    for key, value in _items(parsed):
        if isinstance(value, simdjson.Array) and _of_objects(value):  # the Open Inference Protocol's "inputs"
            items = [_tensor_object(cast(simdjson.Object, item), {}) for item in value]  # a payload in one is left for orjson
            value = [item for item, _, _ in items]
            arrays += sum(n for _, n, _ in items)
        elif isinstance(value, simdjson.Array):
            value, n = _array(value)
            arrays += n
        elif isinstance(value, simdjson.Object):
            value, n, f = _tensor_object(value, payloads)
            arrays, found = arrays + n, found + f
        doc[key] = value
    del parsed
    if found != len(payloads):  # a payload that is not the value of a "b64" key: let orjson judge
        return None
    if arrays and (skeleton.find(b"\\") >= 0 or _count(skeleton, ord("[")) != arrays + _brackets(doc)):
        return None  # an array hidden where a number should be (say [1, [2]]): not rectangular
    return doc


def _of_objects(arr: simdjson.Array) -> bool:
    """Whether arr is a short array of objects only (a few tensor objects, as /v2's "inputs")."""
    return 0 < len(arr) <= MAX_FAST_KEYS and all(isinstance(item, simdjson.Object) for item in arr)


def _tensor_object(obj: simdjson.Object, payloads: dict) -> tuple[dict, int, int]:
    """An object of the document's top level (or of a top-level array of them), as loads() gives
    it: its "data" array decoded by _array, its "b64" marker replaced by the payload; with the
    arrays decoded to ndarray (counted as the text counts them) and the payloads found."""
    out, arrays, found = {}, 0, 0
    for k, v in _items(obj):
        if isinstance(v, simdjson.Array):
            v, n = _array(v) if k == "data" else (v.as_list(), 0)
            arrays += n
        elif isinstance(v, simdjson.Object):
            v = v.as_dict()
        elif k == "b64" and isinstance(v, str) and v in payloads:
            v = payloads[v]
            found += 1
        out[k] = v
    return out, arrays, found


def _count(text: bytes | bytearray | mmap.mmap, byte: int) -> int:
    """How many times byte occurs in text; a mapping has no count(): numpy counts it, 1 MiB at a time."""
    if not isinstance(text, mmap.mmap):
        return text.count(bytes((byte,)))
    view = np.frombuffer(text, np.uint8)
    return sum(int(np.count_nonzero(view[i : i + 2**20] == byte)) for i in range(0, view.size, 2**20))


def _items(obj: simdjson.Object) -> list:
    """(key, value) pairs with arrays and objects left as simdjson proxies (items() converts them
    all to Python). A repeated key raises: orjson keeps the last, simdjson's lookup the first."""
    keys = list(obj)
    if len(keys) > MAX_FAST_KEYS:  # obj[key] scans the keys: N lookups cost N**2 (200,000 keys: 30 s)
        raise ValueError("too many keys for the fast path")
    if len(set(keys)) != len(keys):
        raise ValueError("repeated key")
    return [(key, obj[key]) for key in keys]


def _cut_b64(body: bytes | bytearray | mmap.mmap) -> tuple[bytes | bytearray | mmap.mmap, dict[str, Payload]]:
    """Cut each "b64": "<base64>" payload out of body, decoded; the skeleton keeps a marker string
    in its place. A payload that is not clean base64 stays in the skeleton, for the slow path."""
    # One pass: each search for the next key starts after the payload before it (a search through
    # base64 text is slow, its letters defeat the search's skips; the search for a payload's
    # closing quote is memchr). Counting the keys first would be a second pass over the payloads.
    view, pos, keys = memoryview(body), 0, 0
    pieces: list[memoryview | bytes] = []
    payloads: dict[str, Payload] = {}
    nonce = os.urandom(8).hex()
    while (key := body.find(b'"b64"', pos)) >= 0:
        keys += 1
        if keys > MAX_PAYLOADS:  # more than any request holds: simdjson (and orjson) judge the text as it is
            return body, {}
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


def _array(arr: simdjson.Array) -> tuple[object, int]:
    """A parsed array as an ndarray if it is a rectangular array of numbers (with the number of
    arrays its text holds, for the caller's check), else as a list (and 0)."""
    shape, node = [], arr
    while isinstance(node, simdjson.Array):
        if len(node) == 0:
            return arr.as_list(), 0
        shape.append(len(node))
        node = node[0]
    count, rows = math.prod(shape), math.prod(shape[:-1])
    if type(node) not in (int, float) or count < FAST_MIN_ELEMENTS:
        return arr.as_list(), 0  # not numbers, or small
    if shape[-1] < SHORT_ROW and rows > 64:  # checking row by row would cost Python per row: check the text
        if not _nests_as(arr.mini, shape):
            return arr.as_list(), 0
    else:
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


def _nests_as(text: bytes, shape: list[int]) -> bool:
    """Whether the minified JSON text of an array nests exactly as shape, checked on its brackets
    and commas with numpy (no Python per row): at each depth L, prod(shape[:L]) arrays, each with
    shape[L] - 1 commas of its own, and nothing deeper. With the leaves counted by the caller
    (as_buffer gives prod(shape) numbers), that is a rectangular array of numbers: the leaves
    are numbers, whose text holds no bracket or comma. Transient memory: a few bytes per bracket
    or comma, and 8 per array at the deepest level (their starts)."""
    b = np.frombuffer(text, np.uint8)
    sym = b[(b == 0x5B) | (b == 0x5D) | (b == 0x2C)]  # "[", "]", ",": one byte each, in order
    del b
    opens = sym == 0x5B
    depth = np.cumsum(opens, dtype=np.int16)
    depth -= np.cumsum(sym == 0x5D, dtype=np.int16)  # depth after each; simdjson nests < 1024
    if depth.max(initial=0) != len(shape):
        return False
    commas = sym == 0x2C
    for level, n in enumerate(shape, start=1):
        at = depth == level
        starts = np.flatnonzero(opens & at)  # where each array at this depth opens
        if starts.size != math.prod(shape[: level - 1]):
            return False
        owner = np.searchsorted(starts, np.flatnonzero(commas & at), side="right") - 1  # whose comma
        if not (np.bincount(owner, minlength=starts.size) == n - 1).all():
            return False
    return True


def _brackets(obj) -> int:
    """How many "[" the JSON text of obj holds outside the arrays decoded to ndarray."""
    if isinstance(obj, dict):
        return sum(k.count("[") + _brackets(v) for k, v in obj.items())
    if isinstance(obj, list) and any(isinstance(item, dict) for item in obj):  # objects that may hold ndarrays
        return 1 + sum(_brackets(item) for item in obj)
    if isinstance(obj, list):
        return orjson.dumps(obj).count(b"[")
    if isinstance(obj, str):
        return obj.count("[")
    return 0
