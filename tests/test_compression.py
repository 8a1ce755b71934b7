"""Content-Encoding both ways (service/web/compression.py): request bodies inflated within the body
limit, answers compressed as Accept-Encoding asks, at both front doors; then the attacks against a
real server (a gzip bomb, one inside a chunked body, nested codings, a trickle, corrupt and trailing
streams) and tritonclient's own compression options."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton

from schemas import RequestError
from service.admission import PARSE_FACTOR, Admission, Refused
from service.config import Settings
from service.web import compression
from service.web.app import create_app

from .helpers import WORKED, b64, raw_exchange, serving

SEED = json.dumps(WORKED).encode()
V2_SEED = {
    "inputs": [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": sum(WORKED[n], [])} for n in ("q", "k", "v")],
    "parameters": {"causal": True},
}
V2 = "/v2/models/attention/infer"
JSON = {"Content-Type": "application/json"}


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "raw-deflate": raw_deflate}


def bomb_chunks(inflated: int, coding: str = "gzip", step: int = 2**20):
    """A stream of `inflated` zero bytes, compressed piece by piece: its compressed form (about a
    thousandth of it) is built without ever holding the inflated bytes."""
    packer = zlib.compressobj(9, zlib.DEFLATED, compression.GZIP_WBITS if coding == "gzip" else compression.ZLIB_WBITS)
    zeros = bytes(step)
    for _ in range(inflated // step):
        if out := packer.compress(zeros):
            yield out
    yield packer.flush()


# --- request codings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("GZIP", "gzip"),
        ("x-gzip", "gzip"),
        (" deflate ", "deflate"),
        ("gzip, identity", "gzip"),
    ],
)
def test_request_coding(header, coding):
    assert compression.request_coding(header) == coding


@pytest.mark.parametrize(("header", "words"), [("br", "'br' is not accepted"), ("gzip, gzip", "2 codings"), ("deflate, gzip", "2 codings")])
def test_request_coding_refused(header, words):
    with pytest.raises(RequestError) as err:
        compression.request_coding(header)
    assert err.value.code == "unsupported_media_type" and words in err.value.message


@pytest.mark.parametrize("coding", ENCODERS)
def test_inflate_round_trips(coding):
    data = np.random.default_rng(0).integers(0, 4, 300_000, dtype=np.uint8).tobytes()  # several steps of input and output
    assert compression.inflate(ENCODERS[coding](data), coding.removeprefix("raw-"), len(data)) == data


def test_inflate_is_refused_one_byte_past_the_limit():
    body = gzip.compress(bytes(5000))
    assert len(compression.inflate(body, "gzip", 5000)) == 5000
    with pytest.raises(RequestError) as err:
        compression.inflate(body, "gzip", 4999)
    assert err.value.code == "body_too_large" and "4999 bytes" in err.value.message


def test_a_bomb_is_stopped_at_the_limit_and_charged_as_it_inflates():
    """1 GiB of zeros: inflation stops one byte past the limit, never further, and each step is
    charged with the bytes inflated so far."""
    charged = []
    with pytest.raises(RequestError) as err:
        compression.inflate(b"".join(bomb_chunks(2**30)), "gzip", 3 * compression.STEP, charged.append)
    assert err.value.code == "body_too_large"
    assert charged == sorted(charged) and charged[-1] <= 3 * compression.STEP and len(charged) <= 4


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (gzip.compress(SEED)[:-5], "ends before the stream does"),
        (gzip.compress(SEED) + b"junk", "bytes follow the end"),
        (gzip.compress(SEED) * 2, "bytes follow the end"),  # a second member: one at most
        (b"\x1f\x8b" + bytes(30), "Error"),
        (SEED, "incorrect header check"),
        (b"", "ends before the stream does"),
    ],
    ids=["truncated", "trailing-garbage", "two-members", "corrupt-header", "not-compressed", "empty"],
)
def test_inflate_refuses_a_bad_stream(body, why):
    with pytest.raises(RequestError) as err:
        compression.inflate(body, "gzip", 2**20)
    assert err.value.code == "bad_compression" and why in err.value.message


def test_a_corrupt_deflate_block_is_bad_compression():
    body = bytearray(zlib.compress(SEED))
    body[5] ^= 0xFF
    with pytest.raises(RequestError) as err:
        compression.inflate(bytes(body), "deflate", 2**20)
    assert err.value.code == "bad_compression"


def test_an_inflating_body_is_charged_to_its_ticket():
    """The admission ticket grows with the inflated body and its parse, and a body that inflates
    past what the worker holds (beside another request's bytes) is 503."""
    gate = Admission(Settings(max_inflight=2, max_queue=4, max_inflight_bytes=10_000_000), lambda *_: 0.0)
    other = gate.enter(1000)
    ticket = gate.enter(100, 100 * PARSE_FACTOR)
    before = gate.bytes
    ticket.charge_body(50)  # below what its Content-Length was charged
    assert gate.bytes == before
    ticket.charge_body(1100)
    assert gate.bytes == before + 1000 * (1 + PARSE_FACTOR)
    with pytest.raises(Refused) as err:
        ticket.charge_body(10_000_000)
    assert err.value.code == "overloaded"
    for t in (ticket, other):
        t.end_compute()
        t.release()
    assert gate.bytes == 0


# --- answer codings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "coding", "identity"),
    [
        (None, None, "acceptable"),
        ("", None, "acceptable"),
        ("gzip", "gzip", "acceptable"),
        ("deflate", "deflate", "acceptable"),
        ("gzip, deflate", "gzip", "acceptable"),  # what requests sends: accepted, not preferred
        ("gzip, deflate, br", "gzip", "acceptable"),
        ("deflate, gzip", "gzip", "acceptable"),  # a tie: gzip
        ("gzip;q=0.5, deflate", "deflate", "acceptable"),
        ("gzip;q=0", None, "acceptable"),
        ("GZIP; Q=0.8", "gzip", "acceptable"),
        ("*", "gzip", "acceptable"),  # identity as good as any coding: no preference
        ("gzip, identity;q=0.5", "gzip", "below"),
        ("gzip;q=1, *;q=0.1", "gzip", "below"),  # identity unnamed takes *'s q
        ("*;q=0.3, deflate;q=0.5", "deflate", "below"),
        ("identity, gzip;q=0.5", None, "acceptable"),  # identity preferred
        ("gzip, identity", "gzip", "acceptable"),  # a tie
        ("identity;q=0", None, "refused"),
        ("identity;q=0, deflate", "deflate", "refused"),
        ("*;q=0", None, "refused"),
        ("*;q=0, identity", None, "acceptable"),
        ("br", None, "acceptable"),
        ("gzip;q=abc", None, "acceptable"),
        ("gzip;q=2", None, "acceptable"),
        ("gzip;q=nan", None, "acceptable"),
    ],
)
def test_answer_coding(header, coding, identity):
    assert compression.answer_coding(header) == (coding, identity)


def decoded(resp) -> bytes:
    coding = resp.headers.get("Content-Encoding")
    data = resp.get_data()
    return gzip.decompress(data) if coding == "gzip" else zlib.decompress(data) if coding == "deflate" else data


@pytest.fixture
def big_client():
    app = create_app(Settings(warmup=False, compress_min_bytes=2000))
    app.testing = True
    return app.test_client()


def attention_body(T: int, encoding: str) -> dict:
    rng = np.random.default_rng(T)
    q, k, v = (rng.standard_normal((T, 16), dtype=np.float32) for _ in range(3))
    if encoding == "b64":
        return {"q": b64(q), "k": b64(k), "v": b64(v), "response_encoding": "b64"}
    return {"q": q.tolist(), "k": k.tolist(), "v": v.tolist()}


PREFERS = {"gzip": "gzip, identity;q=0.5", "deflate": "deflate;q=1, identity;q=0.1"}


@pytest.mark.parametrize("encoding", ["b64", "nested"])
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_answers_are_compressed_where_preferred_and_equal_the_plain_ones(big_client, encoding, coding):
    body = attention_body(64, encoding)
    plain = big_client.post("/attention", json=body)
    packed = big_client.post("/attention", json=body, headers={"Accept-Encoding": PREFERS[coding]})
    assert packed.headers["Content-Encoding"] == coding and "Accept-Encoding" in packed.headers["Vary"]
    assert "Content-Encoding" not in plain.headers and "Accept-Encoding" in plain.headers["Vary"]
    assert len(packed.get_data()) < len(plain.get_data())
    want, got = json.loads(plain.get_data()), json.loads(decoded(packed))
    assert got["out"] == want["out"] and got["weights"] == want["weights"]


@pytest.mark.parametrize("header", ["gzip, deflate", "gzip", "deflate", "*", "gzip, identity"])
@pytest.mark.parametrize("encoding", ["b64", "nested"])
def test_an_answer_merely_accepted_compressed_goes_as_identity(big_client, header, encoding):
    """requests' default `gzip, deflate` (and any Accept-Encoding that leaves identity as good as
    a coding) gets identity: compressing costs the client time (bench/README.md, Compression)."""
    resp = big_client.post("/attention", json=attention_body(64, encoding), headers={"Accept-Encoding": header})
    assert resp.status_code == 200 and "Content-Encoding" not in resp.headers and "Accept-Encoding" in resp.headers["Vary"]


def test_a_small_answer_goes_uncompressed_unless_identity_is_refused(big_client):
    small = big_client.post("/attention", json=WORKED, headers={"Accept-Encoding": PREFERS["gzip"]})
    assert "Content-Encoding" not in small.headers and small.headers["Vary"] == "Accept-Encoding"
    refused = big_client.post("/attention", json=WORKED, headers={"Accept-Encoding": "gzip, identity;q=0"})
    assert refused.headers["Content-Encoding"] == "gzip" and json.loads(decoded(refused))["out"] == small.get_json()["out"]
    nothing = big_client.post("/attention", json=WORKED, headers={"Accept-Encoding": "br, identity;q=0"})
    assert nothing.status_code == 200 and "Content-Encoding" not in nothing.headers  # sent as it is, never 406


@pytest.mark.parametrize("encoding", ["b64", "nested"])
def test_accepted_answers_compressed_up_to_the_most_when_the_operator_says(encoding):
    """ATTN_COMPRESS_ANSWERS=accepted: an answer merely accepted compressed is compressed too, up
    to ATTN_COMPRESS_MAX_BYTES (0 sets no most); past it identity, unless the client refuses it or
    prefers the coding."""
    body = attention_body(512, encoding)  # with its weights: about 1.4 MB of b64, 3.5 MB nested
    capped = create_app(Settings(warmup=False, compress_answers="accepted", compress_max_bytes=100_000)).test_client()
    plain = capped.post("/attention", json=body, headers={"Accept-Encoding": "gzip, deflate"})  # what requests sends
    assert plain.status_code == 200 and "Content-Encoding" not in plain.headers and "Accept-Encoding" in plain.headers["Vary"]
    for header in ("gzip, identity;q=0", PREFERS["gzip"]):
        asked = capped.post("/attention", json=body, headers={"Accept-Encoding": header})
        assert asked.headers["Content-Encoding"] == "gzip"
        assert json.loads(decoded(asked))["out"] == json.loads(plain.get_data())["out"]
    small = capped.post("/attention", json=attention_body(16, encoding), headers={"Accept-Encoding": "gzip, deflate"})
    assert small.headers["Content-Encoding"] == "gzip"
    uncapped = create_app(Settings(warmup=False, compress_answers="accepted", compress_max_bytes=0)).test_client()
    packed = uncapped.post("/attention", json=body, headers={"Accept-Encoding": "gzip"})
    assert packed.headers["Content-Encoding"] == "gzip" and len(packed.get_data()) < len(plain.get_data())


def test_an_error_is_compressed_like_any_answer():
    app = create_app(Settings(warmup=False, compress_min_bytes=0))
    resp = app.test_client().post("/attention", json={**WORKED, "casual": True}, headers={"Accept-Encoding": PREFERS["gzip"]})
    assert resp.status_code == 422 and resp.headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(resp.get_data()))["error"]["code"] == "unknown_field"


@pytest.mark.parametrize("coding", ENCODERS)
@pytest.mark.parametrize("door", ["native", "v2"])
def test_compressed_bodies_are_answered_as_plain_ones(client, coding, door):
    path, raw = ("/attention", SEED) if door == "native" else (V2, json.dumps(V2_SEED).encode())
    plain = client.post(path, data=raw, headers=JSON)
    packed = client.post(path, data=ENCODERS[coding](raw), headers={**JSON, "Content-Encoding": coding.removeprefix("raw-")})
    assert plain.status_code == packed.status_code == 200, packed.get_data()[:300]
    key = "out" if door == "native" else "outputs"
    assert packed.get_json()[key] == plain.get_json()[key]


def test_a_compressed_binary_body_splits_at_its_inflated_header_length(client):
    """Inference-Header-Content-Length is the JSON header's length in the inflated body (as
    tritonclient sends it)."""
    arrays = {n: np.asarray(WORKED[n], np.float32) for n in ("q", "k", "v")}
    head = json.dumps(
        {
            "inputs": [{"name": n, "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}} for n in arrays],
            "parameters": {"causal": True},
        }
    ).encode()
    body = head + b"".join(a.tobytes() for a in arrays.values())
    resp = client.post(
        V2, data=gzip.compress(body), headers={"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(head))}
    )
    assert resp.status_code == 200, resp.get_data()[:300]
    plain = client.post(V2, data=json.dumps(V2_SEED).encode())
    assert resp.get_json()["outputs"] == plain.get_json()["outputs"]


@pytest.mark.parametrize(
    ("door", "headers", "body", "status", "code"),
    [
        ("native", {"Content-Encoding": "gzip, gzip"}, gzip.compress(gzip.compress(SEED)), 415, "unsupported_media_type"),
        ("v2", {"Content-Encoding": "gzip, gzip"}, gzip.compress(gzip.compress(SEED)), 415, "unsupported_media_type"),
        ("native", {"Content-Encoding": "gzip"}, gzip.compress(SEED) + b"x", 400, "bad_compression"),
        ("v2", {"Content-Encoding": "deflate"}, b"\x78\x9c\xff\xff", 400, "bad_compression"),
        ("v2", {"Content-Encoding": "gzip"}, gzip.compress(bytes(300_000)), 413, "body_too_large"),  # the SMALL limit is 200 000
    ],
    ids=["native-nested", "v2-nested", "native-trailing", "v2-corrupt", "v2-inflates-past-the-limit"],
)
def test_refusals_of_compressed_bodies(client, door, headers, body, status, code):
    path = "/attention" if door == "native" else V2
    resp = client.post(path, data=body, headers={**JSON, **headers})
    assert resp.status_code == status and resp.headers["X-Error-Code"] == code, resp.get_data()[:300]
    doc = resp.get_json()
    assert (doc["error"]["code"] == code) if door == "native" else isinstance(doc["error"], str)


def test_the_compression_settings_are_ranged_and_listed(client, monkeypatch):
    limits = client.get("/limits").get_json()
    assert {"compress_answers", "compress_level", "compress_min_bytes", "compress_max_bytes"} <= set(limits)
    assert limits["compress_answers"] == "preferred"
    for variable, value in (
        ("ATTN_COMPRESS_ANSWERS", "always"),
        ("ATTN_COMPRESS_LEVEL", "0"),
        ("ATTN_COMPRESS_LEVEL", "10"),
        ("ATTN_COMPRESS_MIN_BYTES", "-1"),
        ("ATTN_COMPRESS_MAX_BYTES", "-1"),
    ):
        monkeypatch.setenv(variable, value)
        with pytest.raises(SystemExit, match=variable):
            Settings.from_env()
        monkeypatch.delenv(variable)
    monkeypatch.setenv("ATTN_COMPRESS_LEVEL", "9")
    monkeypatch.setenv("ATTN_COMPRESS_ANSWERS", "Accepted")
    assert Settings.from_env().compress_level == 9 and Settings.from_env().compress_answers == "accepted"


# --- attacks against a real server ---------------------------------------------------------------

BODY_LIMIT = 32 * 2**20


@pytest.fixture(scope="module")
def one_worker():
    """A real server with one worker (whose memory is measured), the default 32 MiB body limit
    pinned, and a short body deadline for the trickle."""
    env = {"WEB_CONCURRENCY": "1", "ATTN_MAX_BODY_BYTES": str(BODY_LIMIT), "ATTN_BODY_TIMEOUT_S": "2"}
    with serving(env) as server:
        server.worker = int(Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()[0])
        yield server


def status_kb(pid: int, key: str) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split(f"{key}:")[1].split()[0])


def request_head(path: str, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(pieces) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p] + [b"0\r\n\r\n"]


@pytest.mark.live
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/attention", V2])
def test_a_gzip_bomb_is_refused_with_bounded_memory(one_worker, framing, path):
    """1 GiB of zeros in about 1 MiB: 413 body_too_large once the inflated bytes pass the limit,
    the worker's peak resident memory up less than 50 MiB (its compressed body and the inflated
    bytes up to the limit), and the server serves on."""
    pid = one_worker.worker
    bomb = list(bomb_chunks(2**30))
    headers = {**JSON, "Content-Encoding": "gzip"}
    if framing == "chunked":
        data = [request_head(path, {**headers, "Transfer-Encoding": "chunked"}), *chunked(bomb)]
    else:
        data = [request_head(path, {**headers, "Content-Length": str(sum(map(len, bomb)))}), *bomb]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    rss_before = status_kb(pid, "VmRSS")
    [(status, headers, body)] = raw_exchange(one_worker.url, data, timeout=60)
    grown_mb = (status_kb(pid, "VmHWM") - rss_before) / 1024
    assert status == 413 and headers["x-error-code"] == "body_too_large", body[:300]
    assert grown_mb < 50, grown_mb
    # Served on: the refused body's charge (a chunked one is charged the whole limit) is given back
    # with its error answer, so the next request is served as if it had not come.
    assert requests.post(f"{one_worker.url}/attention", json=WORKED, timeout=30).status_code == 200


@pytest.mark.live
@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({"Content-Encoding": "gzip, gzip"}, gzip.compress(gzip.compress(SEED)), 415, "unsupported_media_type"),
        ({"Content-Encoding": "gzip, deflate"}, zlib.compress(gzip.compress(SEED)), 415, "unsupported_media_type"),
        ({"Content-Encoding": "gzip"}, gzip.compress(SEED)[:-6], 400, "bad_compression"),
        ({"Content-Encoding": "gzip"}, gzip.compress(SEED) + b"\x00" * 64, 400, "bad_compression"),
        ({"Content-Encoding": "deflate"}, b"\x78\x9c" + bytes(range(256)), 400, "bad_compression"),
        ({"Content-Encoding": "gzip"}, gzip.compress(SEED + b" " * BODY_LIMIT), 413, "body_too_large"),
        ({"Content-Encoding": "compress"}, SEED, 415, "unsupported_media_type"),
    ],
    ids=["nested-gzip", "nested-gzip-deflate", "truncated", "trailing-garbage", "corrupt-deflate", "just-past-the-limit", "lzw"],
)
@pytest.mark.parametrize("path", ["/attention", V2])
def test_compressed_attacks_are_refused(one_worker, path, headers, body, status, code):
    resp = requests.post(f"{one_worker.url}{path}", data=body, headers={**JSON, **headers}, timeout=30)
    assert resp.status_code == status and resp.headers["X-Error-Code"] == code, resp.text[:300]
    assert requests.post(f"{one_worker.url}/attention", json=WORKED, timeout=30).status_code == 200


@pytest.mark.live
def test_a_slow_trickle_of_compressed_bytes(one_worker):
    """The worker reads a compressed body as any other, under the body deadline counted on the
    bytes on the wire: one that arrives in pieces within it is answered; one that stops is 408,
    and never reached a thread."""
    packed = gzip.compress(SEED)
    head = request_head("/attention", {**JSON, "Content-Encoding": "gzip", "Content-Length": str(len(packed)), "Connection": "close"})
    host, port = one_worker.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        for i in range(0, len(packed), 8):
            sock.sendall(packed[i : i + 8])
            time.sleep(0.05)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + packed[:10])
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # the server closes after its 408
    assert answer.startswith(b"HTTP/1.1 408") and b"timeout" in answer, answer[:300]


# --- tritonclient's own options ----------------------------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize(
    ("request_coding", "response_coding"),
    [("gzip", None), ("deflate", None), (None, "gzip"), (None, "deflate"), ("gzip", "gzip")],
)
def test_tritonclient_compression_answers_equal_the_plain_ones(live_server, request_coding, response_coding):
    rng = np.random.default_rng(7)
    arrays = {n: rng.standard_normal((2, 64, 16), dtype=np.float32) for n in ("q", "k", "v")}
    client = triton.InferenceServerClient(live_server.removeprefix("http://"), network_timeout=60)
    try:
        results = []
        for kwargs in ({}, {"request_compression_algorithm": request_coding, "response_compression_algorithm": response_coding}):
            inputs = []
            for name, arr in arrays.items():
                tensor = triton.InferInput(name, list(arr.shape), "FP32")
                tensor.set_data_from_numpy(arr, binary_data=True)
                inputs.append(tensor)
            outputs = [triton.InferRequestedOutput(n, binary_data=True) for n in ("out", "weights")]
            results.append(client.infer("attention", inputs, outputs=outputs, **kwargs))
    finally:
        client.close()
    plain, packed = results
    for name in ("out", "weights"):
        np.testing.assert_array_equal(packed.as_numpy(name), plain.as_numpy(name))
