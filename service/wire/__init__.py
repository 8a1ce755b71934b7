"""The wire: bytes <-> arrays. Strict JSON (json), the tensor encodings (tensors) and streamed
responses (stream). numpy, orjson, simdjson and pybase64 only: no Flask, no marshmallow."""

from .json import Payload, depth, dumps, loads
from .stream import B64_CHUNK, NESTED_CHUNK_ELEMENTS, B64Text, NestedArray, binary_chunks, dump_chunks
from .tensors import ENCODINGS, WIRE_DTYPES, NestedData, TensorError, as_mask, decode, encode, narrow, show, show_names, wire_encoding

__all__ = [
    "B64_CHUNK",
    "ENCODINGS",
    "NESTED_CHUNK_ELEMENTS",
    "WIRE_DTYPES",
    "B64Text",
    "NestedArray",
    "NestedData",
    "Payload",
    "TensorError",
    "as_mask",
    "binary_chunks",
    "decode",
    "depth",
    "dump_chunks",
    "dumps",
    "encode",
    "loads",
    "narrow",
    "show",
    "show_names",
    "wire_encoding",
]
