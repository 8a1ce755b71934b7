"""The two wires a request can take, as bytes: the Open Inference Protocol's binary tensors at
/v2/models/{model}/infer (the default), and the native JSON endpoints (/attention, /mha).

Binary: a JSON head (orjson) naming each input's datatype, shape and binary_data_size, then the
inputs' raw little-endian bytes, sent as they lie in memory; the answer is a JSON head
(Inference-Header-Content-Length bytes) and the outputs' raw bytes, which numpy views in place.
JSON: tensors in one of the API's encodings (b64: pybase64, spliced into orjson's text as bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pybase64

b64encode, b64decode = pybase64.b64encode, pybase64.b64decode_as_bytearray  # SIMD base64: the standard library's output
loads = orjson.loads


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


# numpy dtype <-> the protocol's datatype, for every dtype the client sends or the server answers.
DATATYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "bool": "BOOL", "int64": "INT64", "int32": "INT32"}
NUMPY = {datatype: np.dtype(name) for name, datatype in DATATYPES.items()}
# The codes of a request that is JSON but not valid: the native door answers them 422, the /v2
# door 400 (the protocol's status for any invalid request), with the code in X-Error-Code.
INVALID_CODES = frozenset(
    ("missing_field", "unknown_field", "bad_type", "ragged", "non_finite", "bad_rank", "bad_shape", "bad_encoding")
    + ("shape_mismatch", "mask_not_broadcastable", "bad_option")
)


def native_status(status: int, code: str) -> int:
    """The status the native door gives what the /v2 door answered status with code."""
    return 422 if status == 400 and code in INVALID_CODES else status


V2_MODELS = {"/attention": "attention", "/mha": "mha"}
HEAD_LENGTH = "Inference-Header-Content-Length"


# --- binary: the Open Inference Protocol ---------------------------------------------------------


def v2_request(tensors: dict[str, np.ndarray], parameters: dict, outputs: list[str]) -> list:
    """The infer request as the parts of its body: [JSON head, each tensor's bytes]. Tensors are
    arrays of a dtype in DATATYPES; a contiguous little-endian one is sent without a copy."""
    arrays = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in tensors.items()}
    head = {
        "inputs": [
            {"name": name, "datatype": DATATYPES[a.dtype.name], "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
            for name, a in arrays.items()
        ],
        "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
        "parameters": parameters,
    }
    text = dumps(head)
    text += b" " * (-len(text) % 64)  # JSON may end in spaces: the tensors start 64-byte aligned in the server's buffer
    return [text, *(a.reshape(-1).view(np.uint8) for a in arrays.values())]


def v2_head_length(resp) -> int:
    """Where the outputs' bytes start in the body (0 when the whole body is JSON)."""
    return int(resp.getheader(HEAD_LENGTH) or 0)


def v2_outputs(body: memoryview, head_length: int) -> dict[str, np.ndarray]:
    """The infer response -> {output name: array}. Binary outputs are views of body (no copy;
    writable when body is); JSON outputs (data) are read as the datatype says."""
    head = loads(body[:head_length] if head_length else body)
    results, offset = {}, head_length
    for spec in head["outputs"]:
        dtype = NUMPY[spec["datatype"]].newbyteorder("<")
        params = spec.get("parameters") or {}
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if type(size) is not int or not 0 <= size <= len(body) - offset or size % dtype.itemsize:  # -4 read all the rest
                raise ValueError(
                    f"output {spec['name']!r} has binary_data_size {size!r}, not its bytes among the {len(body) - offset} left"
                )
            arr = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset).reshape(spec["shape"])
            offset += size
        else:
            arr = np.asarray(spec["data"], dtype=dtype).reshape(spec["shape"])
        results[spec["name"]] = arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))
    return results


def v2_parameter(value):
    """A request parameter as the protocol carries it (strings, numbers, booleans): a window
    (left, right) as "left,right"."""
    return f"{value[0]},{value[1]}" if isinstance(value, list | tuple) else value


# --- JSON: the native endpoints ------------------------------------------------------------------


def encode_tensor(a: np.ndarray, encoding: str = "b64"):
    """An array in one of the API's wire encodings (nested, flat or b64), ready for orjson (numpy
    arrays are left for it to write) or, after .tolist() of any array, for any JSON encoder."""
    a = np.ascontiguousarray(a)
    if encoding == "nested":
        return a
    if encoding == "flat":
        return {"shape": list(a.shape), "dtype": a.dtype.name, "data": a.reshape(-1)}
    little = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"shape": list(a.shape), "dtype": a.dtype.name, "b64": b64encode(little.reshape(-1).view(np.uint8).data).decode("ascii")}


def json_request(body: dict, encoding: str) -> list[bytes]:
    """The native request's body as parts. b64 tensors are spliced in as pybase64's bytes (no str
    of tens of MB for orjson to copy again); other values go through orjson."""
    plain = {key: value for key, value in body.items() if not isinstance(value, np.ndarray)}
    tensors = {key: value for key, value in body.items() if isinstance(value, np.ndarray)}
    if encoding != "b64":
        return [dumps({**{key: encode_tensor(a, encoding) for key, a in tensors.items()}, **plain})]
    fields = []
    for key, a in tensors.items():
        little = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        meta = dumps({"shape": list(a.shape), "dtype": a.dtype.name})[:-1]  # without its closing brace
        fields.append([dumps(key), b":", meta, b',"b64":"', b64encode(little.reshape(-1).view(np.uint8).data), b'"}'])
    if plain:
        fields.append([dumps(plain)[1:-1]])  # the options, without their braces
    parts = [b"{"]
    for i, field in enumerate(fields):
        parts += [b","] * (i > 0) + field
    return [*parts, b"}"]  # sent as they are: the b64 text is never joined into one more copy


def decode_tensor(value) -> np.ndarray:
    """A tensor of a native response -> a writable native-order array (nested: float64)."""
    if isinstance(value, dict):
        dtype = np.dtype(value["dtype"]).newbyteorder("<")
        if "b64" in value:
            arr = np.frombuffer(b64decode(value["b64"]), dtype=dtype)  # decoded into a bytearray: writable as it is
        else:
            arr = np.asarray(value["data"], dtype=dtype)
        return arr.reshape(value["shape"]).astype(dtype.newbyteorder("="), copy=False)
    return np.asarray(value, dtype=np.float64)
