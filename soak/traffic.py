"""The soak's requests. One Traffic per client thread draws each next request: valid ones across
T (16..512) and encodings (b64, nested, flat, /mha, /v2 binary), every answer checked against the
in-process numeric core; everyday invalid ones (each with its exact status and code); and clients
that abandon an upload or a download midway. Those two write raw bytes to a socket on purpose: no
HTTP client sends half a body and leaves, or resets a connection while reading (the valid and
invalid requests go through requests.Session, as users send them). The hostile cases live in
tests/test_attacks.py; the soak is about what steady traffic does to the server over time.
"""

from __future__ import annotations

import base64
import json
import socket
from dataclasses import dataclass

import numpy as np
import requests

T_CHOICES = (16, 32, 64, 128, 256, 512)
HEADS, D = 2, 32  # q, k, v are (1, HEADS, T, D)
MHA_D, MHA_HEADS = 64, 4
JSON = {"Content-Type": "application/json"}
RTOL, ATOL = 2e-4, 2e-5  # float32, the same core on both sides; BLAS blocking may differ


def numeric_core():
    """The in-process numeric core (attention, mha), imported when the first answer is checked."""
    from service import core

    return core


@dataclass
class Outcome:
    """What one request came to. status: the HTTP status, or "abandoned" / "no-answer"."""

    kind: str
    status: int | str
    ok: bool
    detail: str = ""


def b64(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"shape": list(a.shape), "dtype": a.dtype.name, "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def encode(a: np.ndarray, encoding: str):
    if encoding == "b64":
        return b64(a)
    if encoding == "flat":
        return {"shape": list(a.shape), "dtype": a.dtype.name, "data": a.ravel().tolist()}
    return a.tolist()


def decode(value) -> np.ndarray:
    """A response tensor in any of the three encodings."""
    if isinstance(value, dict) and "b64" in value:
        return np.frombuffer(base64.b64decode(value["b64"]), dtype=value["dtype"]).reshape(value["shape"])
    if isinstance(value, dict):
        return np.array(value["data"], dtype=value["dtype"]).reshape(value["shape"])
    return np.array(value, dtype=np.float32)


def _close(got: np.ndarray, want: np.ndarray | None) -> str:
    """ "" if got matches want, else why not."""
    if want is None:
        return ""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if not np.isfinite(got).all():
        return "non-finite values in a 200"
    if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
        return f"max abs error {np.max(np.abs(got - want)):.3g}"
    return ""


# Everyday mistakes: (name, path, body bytes, headers, status, native code or None for /v2).
def _invalid_catalogue() -> list[tuple]:
    seed = {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": True}
    dump = lambda d: json.dumps(d).encode()
    v2_missing_v = {"inputs": [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": sum(seed[n], [])} for n in ("q", "k")]}
    return [
        ("unknown-field", "/attention", dump({**seed, "casual": True}), JSON, 422, "unknown_field"),
        ("shape-mismatch", "/attention", dump({**seed, "k": [[1, 0, 0]] * 3}), JSON, 422, "shape_mismatch"),
        ("ragged", "/attention", dump({**seed, "q": [[1, 0], [0], [1, 1]]}), JSON, 422, "ragged"),
        ("nan-token", "/attention", dump(seed).replace(b"10", b"NaN"), JSON, 400, "bad_json"),
        ("truncated-json", "/attention", dump(seed)[:-7], JSON, 400, "bad_json"),
        (
            "b64-byte-count",
            "/attention",
            dump({**seed, "q": {**b64(np.zeros((3, 2), np.float32)), "shape": [3, 3]}}),
            JSON,
            422,
            "bad_shape",
        ),
        ("missing-v", "/attention", dump({k: v for k, v in seed.items() if k != "v"}), JSON, 422, "missing_field"),
        ("text-plain", "/attention", dump(seed), {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ("T-over-max", "/attention", dump({"q": b64(np.zeros((5000, 1), np.float32)), "k": [[0.0]], "v": [[0.0]]}), JSON, 413, "too_long"),
        (
            "mha-heads",
            "/mha",
            dump({"x": [[1.0, 0.0]], **{w: [[1.0, 0.0], [0.0, 1.0]] for w in ("wq", "wk", "wv", "wo")}, "heads": 3}),
            JSON,
            422,
            "bad_option",
        ),
        ("v2-missing-input", "/v2/models/attention/infer", dump(v2_missing_v), {}, 400, None),
        ("v2-bad-header-length", "/v2/models/attention/infer", dump(v2_missing_v), {"Inference-Header-Content-Length": "-3"}, 400, None),
    ]


class Traffic:
    """One client's stream of requests against url."""

    def __init__(self, url: str, seed: int, invalid_share: float = 0.2, abandon_share: float = 0.1):
        self.url, self.rng = url, np.random.default_rng(seed)
        self.invalid_share, self.abandon_share = invalid_share, abandon_share
        self.session = requests.Session()
        self.core = numeric_core()
        self.invalid = _invalid_catalogue()

    def close(self) -> None:
        self.session.close()

    def one(self) -> Outcome:
        """Send the next request and judge its answer."""
        x = self.rng.random()
        try:
            if x < self.invalid_share:
                return self.invalid_request()
            if x < self.invalid_share + self.abandon_share / 2:
                return self.abandon_upload()
            if x < self.invalid_share + self.abandon_share:
                return self.abandon_download()
            kind = self.rng.choice(
                ["attention-b64", "attention-nested", "attention-flat", "mha", "v2-binary"], p=[0.3, 0.2, 0.15, 0.15, 0.2]
            )
            return getattr(self, kind.replace("-", "_"))(kind)
        except (requests.RequestException, OSError) as exc:
            return Outcome("error", "no-answer", False, f"{type(exc).__name__}: {exc}"[:300])

    # --- valid ---------------------------------------------------------------------------------

    def _qkv(self, T: int) -> tuple[np.ndarray, ...]:
        return tuple((self.rng.standard_normal((1, HEADS, T, D)) * 0.5).astype(np.float32) for _ in range(3))

    def _attention(self, kind: str, encoding: str) -> Outcome:
        T = int(self.rng.choice(T_CHOICES))
        q, k, v = self._qkv(T)
        causal = bool(self.rng.integers(2))
        weights = bool(self.rng.integers(2)) and (encoding == "b64" or T <= 256)
        body = {"q": encode(q, encoding), "k": encode(k, encoding), "v": encode(v, encoding), "causal": causal, "return_weights": weights}
        resp = self.session.post(f"{self.url}/attention", data=json.dumps(body), headers=JSON, timeout=120)
        if resp.status_code != 200:
            return self._refused(f"{kind}-T{T}", resp)
        doc = resp.json()
        out, w = self.core.attention(q, k, v, causal=causal, return_weights=weights)
        why = _close(decode(doc["out"]), out) or (_close(decode(doc["weights"]), w) if weights else "")
        return Outcome(kind, 200, not why, why)

    def attention_b64(self, kind: str) -> Outcome:
        return self._attention(kind, "b64")

    def attention_nested(self, kind: str) -> Outcome:
        return self._attention(kind, "nested")

    def attention_flat(self, kind: str) -> Outcome:
        return self._attention(kind, "flat")

    def mha(self, kind: str) -> Outcome:
        n = int(self.rng.choice(T_CHOICES))
        x = self.rng.standard_normal((n, MHA_D)).astype(np.float32)
        ws = [(self.rng.standard_normal((MHA_D, MHA_D)) * 0.1).astype(np.float32) for _ in range(4)]
        encoding = str(self.rng.choice(["nested", "b64"]))
        weights = bool(self.rng.integers(2))
        body = {
            "x": encode(x, encoding),
            **{name: encode(w, encoding) for name, w in zip(("wq", "wk", "wv", "wo"), ws, strict=True)},
            "heads": MHA_HEADS,
            "return_weights": weights,
        }
        resp = self.session.post(f"{self.url}/mha", data=json.dumps(body), headers=JSON, timeout=120)
        if resp.status_code != 200:
            return self._refused(f"{kind}-n{n}", resp)
        doc = resp.json()
        out, w = self.core.mha(x, *ws, MHA_HEADS, causal=True, return_weights=weights)
        why = _close(decode(doc["out"]), out) or (_close(decode(doc["weights"]), w) if weights else "")
        return Outcome(kind, 200, not why, why)

    def v2_binary(self, kind: str) -> Outcome:
        T = int(self.rng.choice(T_CHOICES))
        q, k, v = self._qkv(T)
        arrays = {"q": q, "k": k, "v": v}
        inputs = [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}} for n, a in arrays.items()
        ]
        head = json.dumps(
            {"inputs": inputs, "parameters": {"causal": True, "binary_data_output": True}, "outputs": [{"name": "out"}]}
        ).encode()
        body = head + b"".join(a.tobytes() for a in arrays.values())
        resp = self.session.post(
            f"{self.url}/v2/models/attention/infer", data=body, headers={"Inference-Header-Content-Length": str(len(head))}, timeout=120
        )
        if resp.status_code != 200:
            return self._refused(f"{kind}-T{T}", resp)
        size = int(resp.headers["Inference-Header-Content-Length"])
        doc = json.loads(resp.content[:size])
        (spec,) = doc["outputs"]
        got = np.frombuffer(resp.content[size : size + spec["parameters"]["binary_data_size"]], dtype=np.float32).reshape(spec["shape"])
        out, _ = self.core.attention(q, k, v, causal=True, return_weights=False)
        why = _close(got, out)
        return Outcome(kind, 200, not why, why)

    def _refused(self, kind: str, resp: requests.Response) -> Outcome:
        """A valid request not answered 200: only 503 (overloaded) and 504 (deadline) are allowed."""
        return Outcome(kind, resp.status_code, resp.status_code in (503, 504), resp.text[:300])

    # --- invalid -------------------------------------------------------------------------------

    def invalid_request(self) -> Outcome:
        name, path, body, headers, status, code = self.invalid[int(self.rng.integers(len(self.invalid)))]
        resp = self.session.post(f"{self.url}{path}", data=body, headers=headers, timeout=60)
        kind = f"invalid-{name}"
        if resp.status_code in (503, 504):
            return Outcome(kind, resp.status_code, True)
        try:
            doc = resp.json()
        except ValueError:
            return Outcome(kind, resp.status_code, False, f"not JSON: {resp.text[:200]}")
        got = doc.get("error") if code is None else (doc.get("error") or {}).get("code")
        ok = resp.status_code == status and (isinstance(got, str) if code is None else got == code)
        return Outcome(kind, resp.status_code, ok, "" if ok else f"want {status} {code}, got {resp.text[:200]}")

    # --- abandoned -----------------------------------------------------------------------------

    def _raw(self, data: bytes, read: int) -> bytes:
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(data)
            got = b""
            while read and len(got) < read:
                chunk = sock.recv(read - len(got))
                if not chunk:
                    break
                got += chunk
            if self.rng.integers(2):  # half of them reset rather than close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return got

    def _request_bytes(self, body: bytes) -> bytes:
        head = f"POST /attention HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    def abandon_upload(self) -> Outcome:
        """Send the headers and part of a valid body, then leave."""
        q, k, v = self._qkv(int(self.rng.choice(T_CHOICES)))
        full = self._request_bytes(json.dumps({"q": b64(q), "k": b64(k), "v": b64(v)}).encode())
        self._raw(full[: int(len(full) * self.rng.uniform(0.05, 0.95))], 0)
        return Outcome("abandoned-upload", "abandoned", True)

    def abandon_download(self) -> Outcome:
        """Send a request with a large answer (T=512 with weights), read its first bytes, leave."""
        q, k, v = self._qkv(512)
        got = self._raw(self._request_bytes(json.dumps({"q": b64(q), "k": b64(k), "v": b64(v)}).encode()), 4096)
        status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else "no-answer"
        ok = status in (200, 503, 504)
        return Outcome("abandoned-download", "abandoned", ok, "" if ok else f"status {status}: {got[:200]!r}")
