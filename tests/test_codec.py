"""The wire codec: every encoding round-trips exactly, every decode error has its code, and the
fast path of loads() (b64 cut from the body, simdjson tape to numpy) answers exactly as the plain
orjson path does, for valid bodies and for every malformed one."""

from __future__ import annotations

import base64
import itertools
import warnings

import numpy as np
import orjson
import pytest

from service import wire as codec
from service.wire import TensorError, stream
from service.wire import json as wire_json
from service.wire.tensors import MAX_RANK

DTYPES = [np.float32, np.float64, np.bool_]


def _body_bytes(data) -> bytes:
    return data if isinstance(data, bytes) else b"".join(data)


def roundtrip(arr: np.ndarray, encoding: str, lazy: bool) -> np.ndarray:
    """Encode into a response body, send it as a request body, decode it: the wire both ways."""
    data, length = codec.dump_chunks({"t": codec.encode(arr, encoding, lazy=lazy)})
    body = _body_bytes(data)
    assert len(body) == length
    value = codec.loads(body)["t"]
    if encoding != "b64" and arr.dtype != np.bool_:  # JSON numbers carry no dtype: the caller casts
        return codec.decode(value).astype(arr.dtype)
    return codec.decode(value)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "streamed"])
@pytest.mark.parametrize("encoding", codec.ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(3,), (2, 5), (1, 3, 70), (2, 2, 3, 40), (7, 1, 1, 2)], ids=str)
def test_every_encoding_roundtrips_exactly(rng, encoding, dtype, shape, lazy):
    if dtype == np.bool_:
        arr = rng.random(shape) < 0.5
    else:  # extreme and awkward values: shortest-repr printing must give back every bit
        arr = (rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape)).astype(dtype)
        arr.flat[0] = np.finfo(dtype).max
        arr.flat[-1] = np.finfo(dtype).smallest_subnormal
    got = roundtrip(arr, encoding, lazy)
    assert got.shape == arr.shape and got.dtype == arr.dtype
    np.testing.assert_array_equal(got, arr)
    assert np.array_equal(got.view(np.uint8), arr.view(np.uint8))  # bit for bit, signs of zero too


def test_b64_streams_in_chunks_that_join(monkeypatch, rng):
    monkeypatch.setattr(stream, "B64_CHUNK", 30)
    monkeypatch.setattr(stream, "JOIN_MAX_BYTES", 0)  # streamed, however small
    arr = rng.standard_normal((7, 11)).astype(np.float32)
    body = {"out": codec.encode(arr, "b64", lazy=True), "weights": codec.encode(arr[:2], "b64", lazy=True), "cost": {"flops": 1}}
    data, length = codec.dump_chunks(body)
    text = _body_bytes(data)
    assert len(text) == length
    assert orjson.loads(text) == orjson.loads(codec.dumps(body))  # dumps() encodes the same text eagerly


def test_binary_chunks_join_small_answers_and_piece_large_ones(monkeypatch, rng):
    """A binary answer up to JOIN_MAX_BYTES is one buffer; past it, the header then pieces of at
    most RAW_CHUNK, which join to the header and the tensors' bytes."""
    head, small = b'{"outputs":[]}', rng.standard_normal(1000).astype(np.float32)
    data, length = codec.binary_chunks(head, [memoryview(small).cast("B")])
    assert data == head + small.tobytes() and length == len(data)
    monkeypatch.setattr(stream, "RAW_CHUNK", 1000)
    large = [rng.standard_normal(n).astype(np.float32) for n in (stream.JOIN_MAX_BYTES // 4, 999)]
    data, length = codec.binary_chunks(head, [memoryview(a).cast("B") for a in large])
    pieces = list(data)
    assert pieces[0] == head and max(map(len, pieces[1:])) == 1000
    assert b"".join(pieces) == head + b"".join(a.tobytes() for a in large) and length == len(b"".join(pieces))


def test_dump_chunks_without_b64_is_one_buffer():
    data, length = codec.dump_chunks({"out": np.arange(3.0)})
    assert data == b'{"out":[0.0,1.0,2.0]}' and length == len(data)


def test_a_small_b64_response_is_one_buffer(rng):
    """Up to JOIN_MAX_BYTES a b64 response is joined (one write); past it, it streams."""
    small = rng.standard_normal((8, 64, 64)).astype(np.float32)  # 175 KB of text
    data, length = codec.dump_chunks({"out": codec.encode(small, "b64", lazy=True)})
    assert isinstance(data, bytes) and len(data) == length
    assert orjson.loads(data)["out"]["b64"] == base64.b64encode(small.tobytes()).decode()
    large = np.zeros(stream.JOIN_MAX_BYTES // 3, np.float32)  # 1.33 MiB of text
    data, length = codec.dump_chunks({"out": codec.encode(large, "b64", lazy=True)})
    assert not isinstance(data, bytes) and len(b"".join(data)) == length


# --- the fast path answers as orjson would -----------------------------------------------------


def plain(body: bytes):
    """What decoding gives on the plain path: orjson, then decode() of Python lists and strings."""
    return decode_all(orjson.loads(body))


def decode_all(doc):
    out = {}
    for key, value in doc.items():
        try:
            out[key] = codec.decode(value)
        except TensorError as exc:
            out[key] = exc.code
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert isinstance(b[key], np.ndarray) and a[key].dtype == b[key].dtype, key
            np.testing.assert_array_equal(a[key], b[key])
        else:
            assert a[key] == b[key], key


GRID = [[float(i * 8 + j) / 7 for j in range(8)] for i in range(12)]  # 96 numbers: the fast path takes it


def grid_with(path, value):
    g = [row[:] for row in GRID]
    target = g
    for i in path[:-1]:
        target = target[i]
    if path[-1] is None:
        target.append(value)
    else:
        target[path[-1]] = value
    return g


BODIES = {
    "rectangular": {"q": GRID},
    "rank 4": {"q": [[GRID, GRID], [GRID, GRID]]},
    "integers stay int64": {"q": [[i * 3 + j for j in range(3)] for i in range(30)]},
    "integers and floats": {"q": [[1, 2.5, 3]] * 30},
    "short row": {"q": grid_with((3, None), 1.0)[:3] + [GRID[3][:7]] + GRID[4:]},
    "long row": {"q": grid_with((3, None), 1.0)},
    "extra row element hidden in a list": {"q": grid_with((3, 2), [5.0])},
    "empty list in a row": {"q": grid_with((3, 2), [])},
    "number for a row, list in a row": {"q": grid_with((3,), 5.0)[:4] + [GRID[4][:7] + [[2.0, [3.0]]]] + GRID[5:]},
    "deeper first row": {"q": [[[x] for x in GRID[0]]] + GRID[1:]},
    "boolean among numbers": {"q": grid_with((5, 5), True)},
    "booleans only": {"mask": [[bool((i + j) % 2) for j in range(10)] for i in range(10)]},
    "0/1 numbers": {"mask": [[(i + j) % 2 for j in range(10)] for i in range(10)]},
    "string among numbers": {"q": grid_with((5, 5), "1.5")},
    "null among numbers": {"q": grid_with((5, 5), None)},
    "object among numbers": {"q": grid_with((5, 5), {"a": 1})},
    "empty rows": {"q": [[] for _ in range(70)]},
    "small array stays a list": {"q": [[1.0, 2.0], [3.0, 4.0]]},
    "rows of two": {"q": [[float(i), 1.0] for i in range(100)]},
    "rows of one": {"q": [[float(i)] for i in range(100)]},
    "rows of one, one of two": {"q": [[float(i)] for i in range(99)] + [[1.0, 2.0]]},
    "rows of one, one empty": {"q": [[float(i)] for i in range(99)] + [[]]},
    "rows of one, a list in one": {"q": [[float(i)] for i in range(99)] + [[[1.0]]]},
    "rows of one, a number for a row": {"q": [[float(i)] for i in range(99)] + [1.0]},
    "rows of two, one of one then one of three": {"q": [[float(i), 1.0] for i in range(98)] + [[1.0], [1.0, 2.0, 3.0]]},
    "rank 3 short rows": {"q": [[[float(i)], [1.0]] for i in range(100)]},
    "rank 3 short rows, a row moved": {"q": [[[float(i)], [1.0]] for i in range(98)] + [[[1.0]], [[1.0], [2.0], [3.0]]]},
    "rank 3 short rows, an item short": {"q": [[[float(i)], [1.0]] for i in range(99)] + [[[1.0]]]},
    "flat": {"q": {"shape": [12, 8], "data": list(itertools.chain(*GRID))}},
    "flat nested data": {"q": {"shape": [12, 8], "data": GRID}},
    "flat data ragged": {"q": {"shape": [96], "data": list(itertools.chain(*GRID))[:-1] + [[1.0]]}},
    "flat too short": {"q": {"shape": [12, 9], "data": list(itertools.chain(*GRID))}},
    "brackets in strings": {"q": GRID, "x[y": "[[", "z": [["["], "]"]},
    "b64": {"q": {"shape": [2, 2], "dtype": "float32", "b64": "AACAPwAAAEAAAEBAAACAQA=="}},
    "b64 bool": {"m": {"shape": [3], "dtype": "bool", "b64": "AAEB"}},
    "b64 bad bool bytes": {"m": {"shape": [3], "dtype": "bool", "b64": "AAEC"}},
    "b64 not base64": {"q": {"shape": [1], "dtype": "float32", "b64": "AAC!PwAA"}},
    "b64 wrong length": {"q": {"shape": [3], "dtype": "float32", "b64": "AACAPwAAAEA="}},
    "b64 no dtype": {"q": {"shape": [2], "b64": "AACAPwAAAEA="}},
    "b64 unknown dtype": {"q": {"shape": [2], "dtype": "float16", "b64": "AACAPw=="}},
    "b64 not a string": {"q": {"shape": [2], "dtype": "float32", "b64": 5}},
    "b64 extra key": {"q": {"shape": [2], "dtype": "float32", "b64": "AACAPwAAAEA=", "x": 1}},
    "b64 and data": {"q": {"shape": [2], "dtype": "float32", "b64": "AACAPwAAAEA=", "data": [1, 2]}},
    "b64 as a value elsewhere": {"note": "b64", "q": GRID, "k": ["b64", "AAAA"]},
    "b64 key deeper": {"q": {"shape": [2], "meta": {"b64": "AACAPwAAAEA="}, "data": [1.0, 2.0]}},
    "zero axis": {"q": {"shape": [0, 2], "data": []}},
    "negative axis": {"q": {"shape": [-1, 2], "data": [1, 2]}},
    "shape not ints": {"q": {"shape": [2.0], "data": [1, 2]}},
    "shape overflows": {"q": {"shape": [2**31, 2**31], "dtype": "float32", "b64": "AAAA"}},
    "neither data nor b64": {"q": {"shape": [2]}},
    "flat declares ints, holds fractions": {"q": {"shape": [2], "dtype": "int64", "data": [1.5, 2]}},
    "flat declares floats, holds booleans": {"q": {"shape": [2], "dtype": "float32", "data": [True, False]}},
    "string tensor": {"q": "1, 2"},
    "null tensor": {"q": None},
    "big integers": {"q": [[2**63 + 1] * 70]},
    "big and small integers": {"q": [[2**63 + 1, 1] * 35]},
    "more keys than the fast path looks up": {"q": GRID, **{f"f{i}": i for i in range(wire_json.MAX_FAST_KEYS + 1)}},
    "more keys in a tensor object": {"q": {"shape": [1], "data": [1.0], **{f"f{i}": i for i in range(wire_json.MAX_FAST_KEYS + 1)}}},
    "more payloads than the fast path cuts": {
        f"t{i}": {"shape": [1], "dtype": "float32", "b64": "AACAPw=="} for i in range(wire_json.MAX_PAYLOADS + 1)
    },
}


@pytest.mark.parametrize("doc", list(BODIES.values()), ids=list(BODIES))
def test_fast_path_equals_plain_path(doc):
    body = orjson.dumps(doc)
    same(decode_all(codec.loads(body)), plain(body))
    same(decode_all(codec.loads(bytearray(body))), plain(body))  # http.read_body() gives a bytearray


@pytest.mark.parametrize(
    "body",
    [
        b'{"q": ' + orjson.dumps(GRID) + b', "q": [1]}',  # repeated key: the last wins, as in orjson
        b'{"q": [1], "q": ' + orjson.dumps(GRID) + b"}",
        b'{"a\\"b": "x", "q": ' + orjson.dumps(grid_with((3, 2), [5.0])) + b"}",  # an escape anywhere: orjson judges
        b'{"q": {"shape": [1], "dtype": "float32", "b64": "AACA\\u0050w=="}}',  # escaped base64
        b'{"q": {"shape": [1], "dtype": "float32", "b64" : \n "AACAPw=="}}',
        b'{"q": {"shape": [2], "dtype": "float32", "b64": "AACAPw==", "b64": "AACAPwAAAEA="}}',
        b'{"x": "\\"b64\\": \\"AACAPw==\\"", "q": {"shape": [1], "dtype": "float32", "b64": "AACAPw=="}}',
        b'{"q": [1, 2, 3]}',
    ],
    ids=[
        "repeated key last",
        "repeated key first",
        "escape in a key",
        "escaped base64",
        "whitespace around colon",
        "repeated b64",
        "b64 text inside a string",
        "tiny",
    ],
)
def test_fast_path_equals_plain_path_on_awkward_text(body):
    same(decode_all(codec.loads(body)), plain(body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"q": [NaN]}',
        b'{"q": [Infinity]}',
        b'{"q": [1e999999]}',
        b'{"q": [1, 2,]}',
        b"\xef\xbb\xbf{}",
        b'{"q": "\xff"}',
        b'{"q": "\\ud800"}',
        b'{"q": 1} x',
        b"",
        b'{"q": [' + b"1," * 100 + b"]}",
    ],
)
def test_invalid_json_raises_as_orjson_does(body):
    with pytest.raises(orjson.JSONDecodeError):
        codec.loads(body)


def test_fast_path_is_taken():
    """The cases the fast path exists for do not fall back: arrays and payloads, not lists and str."""
    doc = codec.loads(
        orjson.dumps(
            {
                "q": GRID,
                "k": {"shape": [96], "data": list(itertools.chain(*GRID))},
                "v": {"shape": [1], "dtype": "float32", "b64": "AACAPw=="},
            }
        )
    )
    assert isinstance(doc["q"], np.ndarray) and isinstance(doc["k"]["data"], np.ndarray)
    assert isinstance(doc["v"]["b64"], codec.Payload)
    assert codec.depth(doc, 20) == 3  # as for the same lists: the object, then two axes


def test_short_rows_take_the_fast_path():
    """Rows of one or two numbers are checked on the text in C, not as Python lists."""
    for doc in ({"q": [[float(i)] for i in range(1000)]}, {"q": [[i, 2] for i in range(1000)]}):
        assert isinstance(codec.loads(orjson.dumps(doc))["q"], np.ndarray)


def test_non_objects_and_other_documents_are_plain():
    assert codec.loads(b"[1, 2]") == [1, 2]
    assert codec.loads(b'{"inputs": [{"data": [1, 2], "shape": [2]}]}') == {"inputs": [{"data": [1, 2], "shape": [2]}]}


# --- each decode error code ---------------------------------------------------------------------

ERRORS = [
    ([[1, 2], [3]], "ragged"),
    ([[1, 2], [3, [4]]], "ragged"),
    ([1.5, True], "bad_type"),
    ([[1, "2"]], "bad_type"),
    ([None, 1], "bad_type"),
    ("abc", "bad_type"),
    (None, "bad_type"),
    ([], "bad_shape"),
    ({"shape": [2]}, "bad_encoding"),
    ({"shape": [2], "data": [1, 2, 3]}, "bad_shape"),
    ({"shape": [0], "data": []}, "bad_shape"),
    ({"shape": "2", "data": [1, 2]}, "bad_shape"),
    ({"shape": [2], "data": "12"}, "bad_type"),
    ({"shape": [2], "data": [[1], [2]]}, "bad_shape"),
    ({"shape": [2], "dtype": "complex", "data": [1, 2]}, "bad_type"),
    ({"shape": [2], "data": [1, 2], "x": 0}, "bad_encoding"),
    ({"shape": [1], "dtype": "float32", "b64": "A!=="}, "bad_encoding"),
    ({"shape": [1], "dtype": "float32", "b64": 7}, "bad_encoding"),
    ({"shape": [1], "b64": "AACAPw=="}, "bad_type"),
    ({"shape": [2], "dtype": "float32", "b64": "AACAPw=="}, "bad_shape"),
    ({"shape": [1], "dtype": "bool", "b64": "Ag=="}, "bad_type"),
    # past any numpy's rank limit: refused from the shape's length, before anything is allocated
    ({"shape": [1] * (MAX_RANK + 1), "data": [1.0]}, "bad_rank"),
    ({"shape": [1] * 65, "dtype": "bool", "b64": "AQ=="}, "bad_rank"),
    ({"shape": ["x"] * 1000, "data": [1.0]}, "bad_rank"),
    ({"shape": [2**40, 2], "dtype": "float32", "b64": "AACAPw=="}, "bad_shape"),
]


def test_shape_entries_too_large_for_any_array_are_refused():
    for shape in ([10**400], [2**63, 2**63], [2**31] * 3):
        with pytest.raises(TensorError) as info:
            codec.decode({"shape": shape, "data": [1.0]})
        assert info.value.code == "bad_shape"


def test_max_rank_is_within_numpys_limit():
    """Any shape the codec lets through, numpy can hold: the rank check is what stands before it."""
    assert np.zeros((1,) * MAX_RANK).ndim == MAX_RANK
    assert codec.decode({"shape": [1] * MAX_RANK, "data": [1.0]}).ndim == MAX_RANK


@pytest.mark.parametrize("value, code", ERRORS, ids=[f"{c}:{orjson.dumps(v)[:40].decode()}" for v, c in ERRORS])
def test_decode_error_codes(value, code):
    for decoded in (value, codec.loads(orjson.dumps({"t": value}))["t"]):  # as a value, and through loads()
        with pytest.raises(TensorError) as info:
            codec.decode(decoded)
        assert info.value.code == code


def test_as_mask():
    np.testing.assert_array_equal(codec.as_mask(np.array([0, 1, 1])), [False, True, True])
    with pytest.raises(TensorError) as info:
        codec.as_mask(np.array([0, 2]))
    assert info.value.code == "bad_type"


def test_wire_encoding():
    assert codec.wire_encoding([[1]]) == "nested"
    assert codec.wire_encoding(np.ones((2, 2))) == "nested"
    assert codec.wire_encoding({"shape": [1], "data": [1]}) == "flat"
    assert codec.wire_encoding({"shape": [1], "dtype": "bool", "b64": codec.Payload(b"\x01")}) == "b64"


def test_concurrent_loads_share_the_parser_safely():
    """Threads (gthread workers) decoding at once: one borrows the process's parser, the others
    get fresh ones, and every document comes back whole and right."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    bodies = [orjson.dumps({"q": rng.standard_normal((4, 50, 8)), "causal": True}, option=orjson.OPT_SERIALIZE_NUMPY) for _ in range(8)]
    expected = [orjson.loads(b)["q"] for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            results = list(pool.map(codec.loads, bodies))
            for got, want in zip(results, expected, strict=True):
                assert isinstance(got["q"], np.ndarray)
                np.testing.assert_array_equal(got["q"], want)


@pytest.mark.parametrize(
    "shape",
    [(3,), (600_000,), (1, 8, 300, 300), (2, 3, 5, 70_000), (1000, 1000), (5, 300_000)],
    ids=["small", "long 1-d", "heads", "rows over a block", "matrix", "few long rows"],
)
def test_streamed_nested_arrays_are_orjsons_bytes(shape):
    """A large nested response tensor, written block by block as it is sent, is byte for byte what
    orjson writes for the whole array; small ones stay inline with a known length."""
    arr = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    body = {"out": codec.encode(arr, "nested", lazy=True), "cost": {"flops": 1}}
    data, length = codec.dump_chunks(body)
    got = data if isinstance(data, bytes) else b"".join(data)
    assert got == orjson.dumps({"out": arr, "cost": {"flops": 1}}, option=orjson.OPT_SERIALIZE_NUMPY)
    assert (length is None) == (arr.size > codec.NESTED_CHUNK_ELEMENTS)
    assert length is None or length == len(got)
    assert codec.dumps(body) == got  # the eager path writes the same


@pytest.mark.parametrize("chunk", [30, 3 * 2**20], ids=["small chunks", "default chunks"])
def test_b64_sent_in_a_narrower_dtype_is_cast_chunk_by_chunk(monkeypatch, rng, chunk):
    """weights_dtype: a float32 array sent as float16 is the bytes of arr.astype(float16), whatever the chunking."""
    monkeypatch.setattr(stream, "B64_CHUNK", chunk)
    monkeypatch.setattr(stream, "JOIN_MAX_BYTES", 0)  # streamed, however small
    arr = rng.standard_normal((5, 13)).astype(np.float32)
    value = codec.encode(arr, "b64", lazy=True, dtype="float16")
    data, length = codec.dump_chunks({"weights": value})
    text = _body_bytes(data)
    assert len(text) == length
    doc = orjson.loads(text)["weights"]
    assert doc["dtype"] == "float16" and doc["shape"] == [5, 13]
    got = np.frombuffer(base64.b64decode(doc["b64"]), dtype="<f2").reshape(5, 13)
    assert np.array_equal(got, arr.astype(np.float16))
    assert orjson.loads(codec.dumps({"weights": value})) == orjson.loads(text)  # eager and lazy agree
    for encoding in ("flat", "nested"):
        eager = codec.encode(arr, encoding, dtype="float16")
        assert np.asarray(eager["data"] if encoding == "flat" else eager).dtype == np.float16


# --- integers are range-checked before they are narrowed --------------------------------------


@pytest.mark.parametrize("dtype, value", [("int32", 4294967297), ("int32", -(2**31) - 1), ("int32", 2**31)])
def test_flat_integers_outside_the_declared_dtype_are_refused(dtype, value):
    with pytest.raises(TensorError) as err:
        codec.decode({"shape": [1], "dtype": dtype, "data": [value]})
    assert err.value.code == "bad_type"


def test_flat_integers_at_the_declared_dtype_edges_decode():
    arr = codec.decode({"shape": [2], "dtype": "int32", "data": [-(2**31), 2**31 - 1]})
    assert arr.dtype == np.int32 and arr.tolist() == [-(2**31), 2**31 - 1]


def test_narrow_refuses_uint64_past_int64():
    with pytest.raises(TensorError):
        codec.narrow(np.array([2**63 + 1], np.uint64), np.dtype(np.int64))


def test_narrow_makes_floats_past_the_dtype_inf_without_a_warning():
    """1e39 sent for a float32 input becomes inf, which the schema refuses as non_finite: numpy's
    overflow warning on the cast was only noise in the server's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isinf(codec.narrow(np.array([1e39, -1e39]), np.float32)).all()


@pytest.mark.parametrize(
    "value, shown",
    [
        (np.arange(70) / 4, "[0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5..."),
        (np.ones((30, 3), np.int64), "[[1, 1, 1], [1, 1, 1], [1, 1, 1], [1,..."),
        ({"data": np.arange(70)}, "{'data': [0, 1, 2, 3, 4, 5, 6, 7, 8, ..."),
        (np.array(2.5), "2.5"),  # a 0-d array: its number, not a failure to iterate it
        (np.zeros((2, 0)), "[[], []]"),
    ],
)
def test_show_gives_an_array_as_the_list_it_was_sent_as(value, shown):
    assert codec.show(value) == shown
    if isinstance(value, np.ndarray):
        assert codec.show(value) == codec.show(value.tolist())  # what the plain parse would show
