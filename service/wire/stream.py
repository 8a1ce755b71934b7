"""Response tensors written as they are sent: a b64 value's text (B64Text) and a large nested
array (NestedArray) are encoded chunk by chunk by dump_chunks(), and a binary answer's tensors
copied piece by piece by binary_chunks(), so the text (or a copy of the tensors) is never whole
in memory and the client reads while the rest is written.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator

import numpy as np
import orjson
import pybase64

B64_CHUNK = 3 * 2**20  # raw bytes per streamed b64 chunk (4 MiB of text): a multiple of 3, so chunks join
NESTED_CHUNK_ELEMENTS = 2**18  # numbers per block of a streamed nested array (~2.5 MB of float32 text)
# A response of known length up to this is joined into one buffer: one write to the socket rather
# than one per piece (each a system call, and a turn of the GIL among the worker's threads), for
# one copy of at most this many bytes. A T=64 b64 answer (B=1, H=8, d=64) is 175 KB.
JOIN_MAX_BYTES = 2**20
RAW_CHUNK = 4 * 2**20  # bytes per piece of a binary answer's tensor data (the Open Inference Protocol's)


class B64Text:
    """A response tensor's base64 text, encoded only when it is written (see dump_chunks).

    dtype: the precision on the wire, when narrower than the array's (weights_dtype float16):
    each chunk is cast as it is encoded, so the cast overlaps the sending and no whole copy is made."""

    __slots__ = ("arr", "dtype")

    def __init__(self, arr: np.ndarray, dtype: np.dtype | None = None):
        self.arr = np.ascontiguousarray(arr)  # (...)
        self.dtype = np.dtype(dtype or arr.dtype).newbyteorder("<")  # little-endian on the wire

    def __len__(self) -> int:
        return 4 * math.ceil(self.arr.size * self.dtype.itemsize / 3)

    def chunks(self):
        flat = self.arr.reshape(-1)
        step = max(3, B64_CHUNK // self.dtype.itemsize // 3 * 3)  # elements: a multiple of 3, so the chunks' bytes join
        for start in range(0, flat.size, step):
            part = flat[start : start + step].astype(self.dtype, copy=False)
            yield pybase64.b64encode(memoryview(part).cast("B"))

    def text(self) -> str:
        """The whole text at once: the chunks joined (each is whole base64 quanta)."""
        return b"".join(self.chunks()).decode("ascii")


def dump_chunks(obj) -> tuple[bytes | Iterator[bytes], int | None]:
    """JSON for a response and its length in bytes. Where obj holds B64Text or NestedArray, the
    JSON comes as an iterator of chunks that encodes each tensor as it is sent, so the text is
    never whole in memory and the client reads while the rest is written; otherwise, or when it
    is at most JOIN_MAX_BYTES long, it is the bytes. The length is None where a NestedArray's
    text cannot be known before it is written."""
    lazy: list[B64Text | NestedArray] = []
    nonce = os.urandom(8).hex()

    def marker(o):
        if isinstance(o, (B64Text, NestedArray)):
            lazy.append(o)
            return f"lazy:{nonce}:{len(lazy) - 1}"
        return default(o)

    skeleton = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=marker)
    if not lazy:
        return skeleton, len(skeleton)
    parts: list = []
    pos = 0
    length: int | None = len(skeleton)  # None once an array's text, of unknown length, is in
    for i, value in enumerate(lazy):
        mark = f"lazy:{nonce}:{i}".encode()
        at = skeleton.index(mark, pos)
        if isinstance(value, B64Text):  # the text goes between the marker's quotes
            parts += [(skeleton[pos:at],), value.chunks()]
            pos = at + len(mark)
            length = None if length is None else length - (len(mark) - len(value))
        else:  # an array replaces the marker and its quotes
            parts += [(skeleton[pos : at - 1],), value.chunks()]
            pos = at + len(mark) + 1
            length = None
    parts.append((skeleton[pos:],))
    if length is not None and length <= JOIN_MAX_BYTES:
        return b"".join(itertools.chain.from_iterable(parts)), length
    return itertools.chain.from_iterable(parts), length


def binary_chunks(head: bytes, blobs: list[memoryview]) -> tuple[bytes | Iterator[bytes], int]:
    """A binary answer (a JSON header, then each tensor's raw bytes) and its length in bytes: the
    bytes joined when at most JOIN_MAX_BYTES, else pieces of at most RAW_CHUNK copied as they are
    sent (the server writes bytes only), so no second whole copy of the tensors is ever made."""
    length = len(head) + sum(len(blob) for blob in blobs)
    if length <= JOIN_MAX_BYTES:
        return b"".join([head, *blobs]), length

    def pieces() -> Iterator[bytes]:
        yield head
        for blob in blobs:
            for start in range(0, len(blob), RAW_CHUNK):
                yield bytes(blob[start : start + RAW_CHUNK])

    return pieces(), length


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
            yield _dumps(arr)
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
                yield _dumps(arr[i : i + step])[1:-1]
        yield b"]"


def _dumps(arr: np.ndarray) -> bytes:
    return orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)


def default(obj):
    """orjson's default=: lazy tensors written eagerly; anything else is not JSON."""
    if isinstance(obj, B64Text):
        return obj.text()
    if isinstance(obj, NestedArray):
        return orjson.Fragment(b"".join(obj.chunks()))
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")
