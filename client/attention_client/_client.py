"""AttentionClient: the service's endpoints as numpy functions, over pooled keep-alive connections.

Wires (_wire): "binary" (default) sends the tensors as raw bytes to the Open Inference Protocol's
/v2/models/{attention,mha}/infer and views the outputs' bytes in place; "json" posts to the native
/attention and /mha (b64, flat or nested). Both reach the same schema, limits and core on the
server, so the results are the same; the binary wire costs no encoding on either side.

Shape legend: ... leading axes (batch, heads), T queries, S keys, d width, dv value width."""

from __future__ import annotations

import email.utils
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from urllib.parse import unquote

import numpy as np
import requests
from requests.structures import CaseInsensitiveDict

from . import __version__, _split, _wire
from ._http import Answer, Pool, TransportError
from ._split import Block

ENCODINGS = ("b64", "flat", "nested")
WIRES = ("binary", "json")
BODY_SLACK = 4096  # bytes of JSON around the tensors, kept free under max_body_bytes
MAX_TIMEOUT_S = 86_400.0  # a day: the longest timeout (or wait) the client takes
# The /v2 door's error body is the protocol's {"error": message}; the code and the field it names
# come in the X-Error-Code and X-Error-Field headers, which this service puts on every error answer.


class AttentionError(Exception):
    """Anything the service (or the way to it) refused. status is the HTTP status (None when no
    answer came) as the native door gives it (the /v2 door answers an invalid request 400, which
    the binary wire reports as the 422 it stands for; response.status_code is what came), code the service's error code (e.g. "shape_mismatch", "too_large",
    "connection_error"), message its sentence, field the request field it names (or None),
    response the answer as a requests.Response if there was one."""

    def __init__(self, status: int | None, code: str, message: str, response: requests.Response | None = None, field: str | None = None):
        super().__init__(f"{status or 'no response'} {code}: {message}")
        self.status, self.code, self.message, self.response, self.field = status, code, message, response, field


class AttentionClient:
    """numpy in, numpy out. Tensors travel as raw bytes both ways by default (wire="binary": the
    /v2 door's binary tensors); wire="json" posts to the native endpoints in `encoding` (b64 by
    default, "flat" or "nested"). Giving an encoding without a wire means wire="json" (the
    client's behaviour before the binary wire existed).

    Retries: connection failures and 503 are retried up to `retries` times, waiting Retry-After
    when the server gives one (capped at max_retry_after), else an exponential backoff with jitter;
    attention is idempotent, so a retry is safe. Requests over the server's /limits are split and
    sent concurrently on up to `max_workers` connections (see _split)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60.0,
        retries: int = 3,
        api_key: str | None = None,
        encoding: str | None = None,
        max_workers: int = 4,
        backoff: float = 0.1,
        max_retry_after: float = 30.0,
        split: bool = True,
        wire: str | None = None,
    ):
        _check_settings(timeout=timeout, retries=retries, backoff=backoff, max_retry_after=max_retry_after, max_workers=max_workers)
        if encoding is not None and encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        wire = wire or ("binary" if encoding is None else "json")
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, not {wire!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.encoding, self.wire = timeout, retries, encoding or "b64", wire
        self.max_workers, self.backoff, self.max_retry_after, self.split = max_workers, backoff, max_retry_after, split
        headers = {"Accept": "application/json", "User-Agent": f"attention-client/{__version__}"}
        if api_key:
            if not (isinstance(api_key, str) and api_key.isascii() and api_key.isprintable()):  # the key itself is not repeated
                raise ValueError("api_key must be printable ASCII: no CR, LF, other control or non-ASCII character")
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = Pool(self.base_url, timeout, max(1, max_workers), headers)
        self._limits: dict | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._sleep = time.sleep  # replaced in tests

    # --- lifecycle ---

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._http.close()

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- endpoints ---

    def ready(self) -> bool:
        """True when the server answers /readyz with 200 (no retries)."""
        try:
            return self._http.request("GET", "/readyz").status == 200
        except TransportError:
            return False

    def limits(self, refresh: bool = False) -> dict:
        """The server's /limits (cached; refresh=True fetches again)."""
        if self._limits is None or refresh:
            self._limits = self._call("GET", "/limits")
        return self._limits

    def attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        mask: np.ndarray | None = None,
        causal: bool | str = False,
        *,
        key_lengths: np.ndarray | None = None,
        scale: float | None = None,
        return_weights: bool = True,
        dtype: str | None = None,
        enable_gqa: bool = False,
        window: tuple[int, int] | None = None,
        bias: np.ndarray | None = None,
        alibi_slopes: np.ndarray | None = None,
        average_weights: bool = False,
        weights_dtype: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """softmax(q kᵀ · scale + bias + alibi, masked) v over any leading axes, on the server.

        q (..., T, d), k (..., S, d), v (..., S, dv); mask bool broadcasting to (..., T, S), True =
        attend; causal False | True (= "top_left") | "bottom_right"; key_lengths ints broadcasting
        to (...). dtype "float32" | "float64" | None: float64 if q, k or v is float64, else the
        server's default. The variants (the contract's "Attention variants"): enable_gqa (k, v
        with Hkv heads on axis -3 dividing q's H), window (left, right) as FlashAttention's
        window_size, bias broadcasting to (..., T, S), alibi_slopes broadcasting to (...),
        average_weights (weights averaged over axis -3), weights_dtype "float16" | "float32" |
        "float64" (the weights' precision on the wire). Returns out (..., T, dv) and weights
        (..., T, S) ((..., T, S) without axis -3 when averaged; None unless return_weights).

        Splitting (a request over the server's limits): enable_gqa and average_weights are never
        split (a block of flattened leading indices would cut the heads a key/value head or an
        average spans); a window or ALiBi slopes split only along the leading axes (their
        positions t + S - T move when rows do). What cannot be split is sent whole, and the
        server says why it refuses it."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        mask = None if mask is None else np.asarray(mask)
        key_lengths = None if key_lengths is None else np.asarray(key_lengths)
        bias = None if bias is None else np.asarray(bias)
        alibi_slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        causal = "top_left" if causal is True else causal
        dtype = dtype or _float64_if_any(q, k, v)
        options = {
            "return_weights": return_weights,
            **({"scale": scale} if scale is not None else {}),
            **({"dtype": dtype} if dtype is not None else {}),
            **({"enable_gqa": True} if enable_gqa else {}),
            **({"window": [int(n) for n in window]} if window is not None else {}),
            **({"average_weights": True} if average_weights else {}),
            **({"weights_dtype": weights_dtype} if weights_dtype is not None else {}),
        }

        def send(q, k, v, mask, key_lengths, causal, bias=bias, alibi_slopes=alibi_slopes):
            body = {"q": q, "k": k, "v": v, **options}
            for name, value in (("mask", mask), ("key_lengths", key_lengths), ("bias", bias), ("alibi_slopes", alibi_slopes)):
                if value is not None:
                    body[name] = value
            if causal:
                body["causal"] = causal
            out, weights = self._compute("/attention", body)
            return _checked(out, weights, (*q.shape[:-2], q.shape[-2], v.shape[-1]), (q.shape[-2], k.shape[-2]))

        splittable = self.split and not enable_gqa and not average_weights
        blocks = self._attention_plan(q, k, v, mask, key_lengths, causal, return_weights, bias, alibi_slopes) if splittable else None
        if blocks is not None and (window is not None or alibi_slopes is not None) and any(b.t1 - b.t0 < q.shape[-2] for b in blocks):
            blocks = None  # rows would move the window's and ALiBi's t + S - T: sent whole
        if blocks is None:
            return send(q, k, v, mask, key_lengths, causal)

        lead, (T, d), S, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
        B = math.prod(lead)
        q3, k3, v3 = q.reshape(B, T, d), k.reshape(B, S, d), v.reshape(B, S, dv)  # (B, T|S, d|dv)
        m3 = None if mask is None else _flat_mask(mask, lead)  # (B or 1, T or 1, S or 1)
        b3 = None if bias is None else _flat_mask(bias, lead)  # the same broadcast, of floats
        kl = None if key_lengths is None else np.broadcast_to(key_lengths, lead).reshape(B)  # (B,)
        sl = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, lead).reshape(B)  # (B,)

        def part(a3, b, t):
            return None if a3 is None else a3[b if a3.shape[0] > 1 else slice(None), t if a3.shape[1] > 1 else slice(None)]

        def run(block: Block):
            b, t = slice(block.b0, block.b1), slice(block.t0, block.t1)
            m = part(m3, b, t)
            flag = causal
            if causal and (block.t0, block.t1) != (0, T):  # rows moved: send the causal rows explicitly
                rows = _split.causal_rows(T, S, causal, block.t0, block.t1)  # (t, S)
                m = rows if m is None else np.logical_and(m, rows)
                flag = False
            slopes = None if sl is None else sl[b]
            return send(q3[b, t], k3[b], v3[b], m, None if kl is None else kl[b], flag, part(b3, b, t), slopes)

        results = self._map(run, blocks)
        out = _assemble([r[0] for r in results], blocks, (B, T, dv))
        weights = _assemble([r[1] for r in results], blocks, (B, T, S)) if return_weights else None
        return out.reshape(*lead, T, dv), (None if weights is None else weights.reshape(*lead, T, S))

    def mha(
        self,
        x: np.ndarray,
        wq: np.ndarray,
        wk: np.ndarray,
        wv: np.ndarray,
        wo: np.ndarray | None,
        heads: int,
        *,
        causal: bool = True,
        return_weights: bool = True,
        dtype: str | None = None,
        scale: float | None = None,
        kv_heads: int | None = None,
        window: tuple[int, int] | None = None,
        weights_dtype: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Multi-head self-attention on the server: the GPT block's, or grouped-query (kv_heads).

        x (n, d) or (B, n, d); wq (d, heads*dk), wk (d, kv_heads*dk), wv (d, kv_heads*dv), wo
        (heads*dv, d_out) or None (the heads concatenated); the GPT block's are all (d, d). scale
        default 1/sqrt(dk); window (left, right) as in attention(). Returns out (..., n, d_out)
        and weights (h, n, n) or (B, h, n, n) (None unless return_weights). dtype as for
        attention. A batch over the limits is split along B (exact for every option)."""
        x = np.asarray(x)
        ws = {"wq": np.asarray(wq), "wk": np.asarray(wk), "wv": np.asarray(wv), **({} if wo is None else {"wo": np.asarray(wo)})}
        dtype = dtype or _float64_if_any(x, *ws.values())
        options = {
            "heads": heads,
            "causal": causal,
            "return_weights": return_weights,
            **({"dtype": dtype} if dtype is not None else {}),
            **({"scale": scale} if scale is not None else {}),
            **({"kv_heads": kv_heads} if kv_heads is not None else {}),
            **({"window": [int(n) for n in window]} if window is not None else {}),
            **({"weights_dtype": weights_dtype} if weights_dtype is not None else {}),
        }

        def send(x):
            out, weights = self._compute("/mha", {"x": x, **ws, **options})
            return _checked(out, weights, (*x.shape[:-1], None), x.shape[-2:-1] * 2)

        blocks, lim = None, self._known_limits() if self.split and x.ndim == 3 else None
        if lim is not None and isinstance(heads, int) and heads > 0:
            n, d = x.shape[-2:]
            wbytes = sum(w.size for w in ws.values()) * _wire_itemsize(x)

            def fits(b, _rows):
                return self._fits(
                    lim,
                    rows=n,
                    keys=n,
                    scores=b * heads * n * n,
                    return_weights=return_weights,
                    nbytes=b * n * d * _wire_itemsize(x) + wbytes,
                )

            blocks = _split.plan(x.shape[0], 1, fits)
        if blocks is None or len(blocks) == 1:
            return send(x)
        results = self._map(lambda block: send(x[block.b0 : block.b1]), blocks)
        out = np.concatenate([r[0] for r in results])
        weights = np.concatenate([r[1] for r in results]) if return_weights else None
        return out, weights

    # --- splitting ---

    def _attention_plan(self, q, k, v, mask, key_lengths, causal, return_weights, bias=None, alibi_slopes=None) -> list[Block] | None:
        """Blocks when the request is over the limits and splits exactly; None to send it whole
        (within the limits, or malformed or unsplittable: then the server says why)."""
        lim = self._known_limits()
        if lim is None or q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
            return None
        lead, (T, d), S, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
        if k.shape[:-2] != lead or k.shape[-1] != d or v.shape[:-1] != k.shape[:-1]:
            return None
        if mask is not None and not _split.broadcasts(mask.shape, (*lead, T, S)):
            return None
        if key_lengths is not None and not _split.broadcasts(key_lengths.shape, lead):
            return None
        if bias is not None and (bias.ndim < 1 or not _split.broadcasts(bias.shape, (*lead, T, S))):
            return None
        if alibi_slopes is not None and not _split.broadcasts(alibi_slopes.shape, lead):
            return None
        itemsize = _wire_itemsize(q)

        def fits(b, t):
            mask_bytes = 0 if mask is None else min(mask.size, b * t * S) * mask.itemsize
            if causal and t < T:
                mask_bytes = b * t * S  # the causal rows travel as an explicit mask
            bias_bytes = 0 if bias is None else min(bias.size, b * t * S) * _wire_itemsize(bias)
            nbytes = (b * t * d + b * S * d + b * S * dv) * itemsize + mask_bytes + bias_bytes + b * 16
            return self._fits(lim, rows=t, keys=S, scores=b * t * S, return_weights=return_weights, nbytes=nbytes)

        blocks = _split.plan(math.prod(lead), T, fits)
        return None if blocks is None or len(blocks) == 1 else blocks

    def _known_limits(self) -> dict | None:
        """/limits, or None when the server does not say (then nothing is split)."""
        try:
            lim = self.limits()
        except AttentionError:
            return None
        needed = ("max_t", "max_s", "max_score_elements", "max_weights_elements", "max_body_bytes")
        return lim if all(isinstance(lim.get(key), int) for key in needed) else None

    def _fits(self, lim: dict, *, rows: int, keys: int, scores: int, return_weights: bool, nbytes: int) -> bool:
        """Would a request of this size pass the server's limits? nbytes: raw tensor bytes."""
        if self.wire == "binary":
            wire = nbytes
        else:
            wire = _split.b64_len(nbytes) if self.encoding == "b64" else nbytes * 6  # flat/nested: ~24 JSON chars per float32
        return (
            rows <= lim["max_t"]
            and keys <= lim["max_s"]
            and scores <= lim["max_score_elements"]
            and (not return_weights or scores <= lim["max_weights_elements"])
            and wire + BODY_SLACK <= lim["max_body_bytes"]
        )

    def _map(self, fn, blocks: list[Block]) -> list:
        """fn over the blocks, concurrently; the first failure is raised."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="attention-client")
        futures = [self._pool.submit(fn, block) for block in blocks]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    # --- the wire ---

    def _compute(self, path: str, body: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """One request: path "/attention" or "/mha", body its native fields (arrays and options)."""
        arrays = {key: _wire_array(key, value) for key, value in body.items() if isinstance(value, np.ndarray)}
        if self.wire == "binary":
            binary = _binary_arrays(arrays)
            if binary is not None:
                return self._compute_binary(path, body, binary)
        return self._compute_json(path, body, arrays)

    def _compute_binary(self, path: str, body: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """At /v2/models/{model}/infer: tensors as raw bytes both ways, outputs viewed in place."""
        options = {key: _wire.v2_parameter(value) for key, value in body.items() if key not in arrays}
        outputs = ["out", "weights"] if body.get("return_weights", True) else ["out"]
        parts = _wire.v2_request(arrays, options, outputs)
        headers = {_wire.HEAD_LENGTH: str(len(parts[0])), "Content-Type": "application/octet-stream"}
        answer = self._send("POST", f"/v2/models/{_wire.V2_MODELS[path]}/infer", parts, headers, align_at=_wire.v2_head_length)
        if answer.status != 200:
            code = answer.headers.get("X-Error-Code") or "http_error"
            field = answer.headers.get("X-Error-Field")
            status = _wire.native_status(answer.status, code)  # the same error whichever wire took it
            raise AttentionError(status, code, _v2_message(answer), _response(answer), field and unquote(field))
        try:
            results = _wire.v2_outputs(answer.body, int(answer.headers.get(_wire.HEAD_LENGTH) or 0))
            return results["out"], results.get("weights")
        except (ValueError, KeyError, TypeError) as exc:
            raise AttentionError(
                answer.status, "bad_response", f"the server's infer response is malformed: {exc!r}", _response(answer)
            ) from None

    def _compute_json(self, path: str, body: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """At the native endpoint, tensors in self.encoding (b64 by pybase64, spliced into orjson's text)."""
        doc = self._call("POST", path, _wire.json_request({**body, **arrays, "response_encoding": self.encoding}, self.encoding))
        try:
            out, weights = doc["out"], doc.get("weights")
            out, weights = _wire.decode_tensor(out), (None if weights is None else _wire.decode_tensor(weights))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not the response's shape: [], {}, a shape its data lacks
            raise AttentionError(200, "bad_response", f"the server's response is malformed: {exc!r}", None) from None
        if out.ndim < 2 or (weights is not None and weights.ndim < 2):  # out (..., T, dv), weights (..., T, S)
            raise AttentionError(200, "bad_response", f"the server's out has shape {out.shape}, not (..., T, dv)", None)
        return out, weights

    def _call(self, method: str, path: str, parts: list[bytes] | None = None) -> dict:
        """One call with retries; the parsed JSON of a 200, else AttentionError."""
        headers = {"Content-Type": "application/json"} if parts is not None else {}
        answer = self._send(method, path, parts or (), headers)
        if answer.status != 200:
            raise _error(answer)
        try:
            return _wire.loads(answer.body)
        except ValueError as exc:
            raise AttentionError(answer.status, "bad_response", f"the server's answer is not JSON: {exc}", _response(answer)) from None

    def _send(self, method: str, path: str, parts, headers: dict, align_at=None) -> Answer:
        """The answer, after retrying connection failures (backoff) and 503 (Retry-After)."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                answer = self._http.request(method, path, parts, headers, align_at)
            except TransportError as exc:
                if exc.kind != "connection_error":  # a timeout, or an answer that cannot be read (bad_response)
                    raise AttentionError(None, exc.kind, str(exc)) from exc
                if last:
                    raise AttentionError(
                        None, "connection_error", f"{method} {self.base_url}{path} failed after {attempt + 1} attempts: {exc}"
                    ) from exc
                self._sleep(self._backoff(attempt))
                continue
            if answer.status != 503 or last:
                return answer
            self._sleep(self._retry_after(answer, attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        return self.backoff * 2**attempt * (0.5 + random.random() / 2)

    def _retry_after(self, resp: Answer, attempt: int) -> float:
        """Retry-After in seconds (a number or an HTTP date), capped; else the backoff."""
        raw = resp.headers.get("Retry-After")
        if raw is None:
            return self._backoff(attempt)
        try:
            seconds = float(raw)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(raw)
            except (TypeError, ValueError):
                return self._backoff(attempt)
            seconds = (when - datetime.now(UTC)).total_seconds()
        if math.isnan(seconds):  # "nan" reads as a float, which time.sleep refuses (ValueError)
            return self._backoff(attempt)
        return min(max(seconds, 0.0), self.max_retry_after)


# --- helpers ---------------------------------------------------------------------------------------


def _check_settings(*, timeout, retries, backoff, max_retry_after, max_workers) -> None:
    """ValueError unless each setting can work: a NaN, infinite, negative or 1e308 s timeout, or a
    negative count, was taken and failed at the first request or retry, out of socket or time."""

    def real(value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    if not (real(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, not {timeout!r}")
    for name, value in (("backoff", backoff), ("max_retry_after", max_retry_after)):
        if not (real(value) and 0 <= value <= MAX_TIMEOUT_S):
            raise ValueError(f"{name} must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, not {value!r}")
    for name, value, least in (("retries", retries, 0), ("max_workers", max_workers, 1)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ValueError(f"{name} must be an integer of at least {least}, not {value!r}")


def _float64_if_any(*arrays: np.ndarray) -> str | None:
    """numpy in, numpy out: float64 inputs are computed, and answered, in float64."""
    return "float64" if any(a.dtype == np.float64 for a in arrays) else None


def _wire_itemsize(a: np.ndarray) -> int:
    return {np.dtype(np.float64): 8, np.dtype(np.float16): 2}.get(a.dtype, 4)


def _wire_array(name: str, a: np.ndarray) -> np.ndarray:
    """The array as it travels: float64 stays, other numbers go as float32 (what the server computes
    in by default), float16 stays too (half the bytes; computed in dtype); a mask stays bool (or
    0/1 numbers); key lengths go as int64."""
    if name == "key_lengths":
        return a.astype(np.int64, copy=False)
    if name == "mask" and a.dtype.kind in "biu":
        return a if a.dtype == np.bool_ else a.astype(np.int64)
    return a if a.dtype in (np.float64, np.float16) else a.astype(np.float32, copy=False)


def _binary_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The arrays as the /v2 door takes them, or None if one can only go as JSON: a mask of
    numbers that are not all 0 and 1 (the native door says why it refuses it)."""
    mask = arrays.get("mask")
    if mask is None or mask.dtype == np.bool_:
        return arrays
    if not np.isin(mask, (0, 1)).all():
        return None
    return {**arrays, "mask": mask != 0}


def _flat_mask(mask: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """A mask broadcasting to (*lead, T, S) -> (B or 1, T or 1, S or 1), B the product of lead."""
    m = mask.reshape((1,) * (len(lead) + 2 - mask.ndim) + mask.shape)  # (..., Tm, Sm), rank of q
    if all(n == 1 for n in m.shape[:-2]):
        return m.reshape(1, *m.shape[-2:])
    return np.broadcast_to(m, (*lead, *m.shape[-2:])).reshape(-1, *m.shape[-2:])


def _assemble(parts: list[np.ndarray], blocks: list[Block], shape: tuple[int, ...]) -> np.ndarray:
    """Blocks' results -> one (B, T, ...) array."""
    full = np.empty(shape, dtype=parts[0].dtype)
    for part, block in zip(parts, blocks, strict=True):
        full[block.b0 : block.b1, block.t0 : block.t1] = part
    return full


def _checked(out: np.ndarray, weights: np.ndarray | None, out_shape: tuple, weights_tail: tuple) -> tuple[np.ndarray, np.ndarray | None]:
    """out and weights if they have the shapes the request asks for: out out_shape (None: any
    length on that axis), weights ending in weights_tail (T, S); else AttentionError bad_response.
    A server's out of another shape was returned as is, or broadcast silently into a split result."""
    shape_ok = len(out.shape) == len(out_shape) and all(w is None or n == w for n, w in zip(out.shape, out_shape, strict=True))
    if not shape_ok or (weights is not None and weights.shape[-2:] != tuple(weights_tail)):
        got = f"out {out.shape}" + ("" if weights is None else f", weights {weights.shape}")
        raise AttentionError(
            200, "bad_response", f"the server answered {got} to a request for out {out_shape}, weights (..., {weights_tail})", None
        )
    return out, weights


def _response(answer: Answer) -> requests.Response:
    """The answer as a requests.Response (AttentionError.response's documented type), built the
    way requests' own adapter builds one."""
    resp = requests.Response()
    resp.status_code, resp.reason, resp.url, resp.encoding = answer.status, answer.reason, answer.url, "utf-8"
    resp.headers = CaseInsensitiveDict(answer.headers.items())
    resp._content = bytes(answer.body)
    return resp


def _v2_message(answer: Answer) -> str:
    """The /v2 door's {"error": message}, or the body's text."""
    try:
        message = _wire.loads(answer.body)["error"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return bytes(answer.body[:200]).decode("utf-8", "replace").strip() or answer.reason or "no body"


def _error(answer: Answer) -> AttentionError:
    """The native door's {"error": {status, code, message, field}} (or anything else) -> AttentionError."""
    resp = _response(answer)
    try:
        err = _wire.loads(answer.body)["error"]
        if isinstance(err, dict):
            return AttentionError(answer.status, err.get("code", "http_error"), err.get("message", ""), resp, err.get("field"))
        return AttentionError(answer.status, "http_error", str(err), resp)
    except (ValueError, KeyError, TypeError):
        text = resp.text.strip().replace("\n", " ")[:200]
        return AttentionError(answer.status, "http_error", text or answer.reason or "no body", resp)
