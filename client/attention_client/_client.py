"""AttentionClient: the service's endpoints as numpy functions, over pooled keep-alive connections.

Wires (_wire): "binary" (default) sends the tensors as raw bytes to the Open Inference Protocol's
/v2/models/{attention,mha}/infer and views the outputs' bytes in place; "json" posts to the native
/attention and /mha (b64, flat or nested). Both reach the same schema, limits and core on the
server, so the results are the same; the binary wire costs no encoding on either side.

Shape legend: ... leading axes (batch, heads), T queries, S keys, d width, dv value width."""

from __future__ import annotations

import email.utils
import io
import itertools
import math
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import numpy as np
import requests
from requests.structures import CaseInsensitiveDict

from . import __version__, _shm, _split, _wire
from ._http import Answer, Pool, TransportError
from ._split import Block
from ._states import Merger

if TYPE_CHECKING:
    from ._sessions import Session

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

    base_url: one URL, or a list of replicas' URLs (each a server of the same limits; in
    Kubernetes, one Service URL whose connections the Service spreads). Requests over the server's
    /limits, or of key_chunks, are split (see _split) and the blocks sent concurrently on up to
    `max_workers` connections per replica, each block to the next replica free.

    Retries: connection failures and 503 are retried up to `retries` times, on the next replica
    when there are several, waiting Retry-After when the server gives one (capped at
    max_retry_after), else an exponential backoff with jitter, once every replica has been tried;
    attention is idempotent, so a retry is safe.

    shared_memory=True (with the binary wire, for a server on this host that allows it:
    ATTN_ALLOW_CLIENT_SHM): the tensors go through POSIX shared-memory regions this client
    registers with the server, and the outputs come back as views of them (see _shm); where the
    server refuses, the binary wire."""

    def __init__(
        self,
        base_url: str | Sequence[str] = "http://127.0.0.1:8000",
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
        shared_memory: bool = False,
    ):
        _check_settings(timeout=timeout, retries=retries, backoff=backoff, max_retry_after=max_retry_after, max_workers=max_workers)
        if encoding is not None and encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
        wire = wire or ("binary" if encoding is None else "json")
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, not {wire!r}")
        if shared_memory and wire != "binary":
            raise ValueError('shared_memory=True takes the binary wire\'s door (/v2); it cannot go with wire="json"')
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"base_url must be a URL or a non-empty list of URLs, not {base_url!r}")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.base_url = self.base_urls[0]
        self.timeout, self.retries, self.encoding, self.wire = timeout, retries, encoding or "b64", wire
        self.max_workers, self.backoff, self.max_retry_after, self.split = max_workers, backoff, max_retry_after, split
        headers = {"Accept": "application/json", "User-Agent": f"attention-client/{__version__}"}
        if api_key:
            if not (isinstance(api_key, str) and api_key.isascii() and api_key.isprintable()):  # the key itself is not repeated
                raise ValueError("api_key must be printable ASCII: no CR, LF, other control or non-ASCII character")
            headers["Authorization"] = f"Bearer {api_key}"
        self._https = [Pool(url, timeout, max(1, max_workers), headers) for url in self.base_urls]
        self._http = self._https[0]
        self._limits: dict | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # each pool thread's replica
        self._flight = threading.Condition()  # guards _in_flight: this client's requests in flight, by replica
        self._in_flight: dict[int, int] = {}
        self._admits: dict[int, int] = {}  # requests at once a replica was seen to admit (a 503 past them)
        self._next_replica = itertools.count()
        self._sleep = time.sleep  # replaced in tests
        self._regions = {http.base_url: _shm.Regions() for http in self._https} if shared_memory else None  # by replica

    # --- lifecycle ---

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for http in self._https:
            if self._regions is not None:
                self._regions[http.base_url].close(self._sender(http))
            http.close()

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- endpoints ---

    def ready(self) -> bool:
        """True when every replica answers /readyz with 200 (no retries)."""
        try:
            return all(http.request("GET", "/readyz").status == 200 for http in self._https)
        except TransportError:
            return False

    def limits(self, refresh: bool = False) -> dict:
        """The server's /limits (cached; refresh=True fetches again). With several replicas, each
        number their smallest (a block must fit wherever it is sent); the rest the first's."""
        if self._limits is None or refresh:
            answers = [self._call("GET", "/limits", http=http) for http in self._https]
            self._limits = {
                key: min(a[key] for a in answers) if all(_is_int(a.get(key)) for a in answers) else value
                for key, value in answers[0].items()
            }
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
        return_lse: bool = False,
        key_chunks: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None] | tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """softmax(q kᵀ · scale + bias + alibi, masked) v over any leading axes, on the server.

        q (..., T, d), k (..., S, d), v (..., S, dv); mask bool broadcasting to (..., T, S), True =
        attend; causal False | True (= "top_left") | "bottom_right"; key_lengths ints broadcasting
        to (...). dtype "float32" | "float64" | None: float64 if q, k or v is float64, else the
        server's default. The variants (the contract's "Attention variants"): enable_gqa (k, v
        with Hkv heads on axis -3 dividing q's H), window (left, right) as FlashAttention's
        window_size, bias broadcasting to (..., T, S), alibi_slopes broadcasting to (...),
        average_weights (weights averaged over axis -3), weights_dtype "float16" | "float32" |
        "float64" (the weights' precision on the wire). Returns out (..., T, dv) and weights
        (..., T, S) ((..., T, S) without axis -3 when averaged; None unless return_weights), and
        with return_lse lse (..., T) (the log-sum-exp of each row's scores, FlashAttention's
        softmax_lse; the dtype's lowest finite value for a row with no allowed key).

        Splitting: a request over the server's /limits (T, S, the scores, the weights, the body),
        or any with key_chunks=N (N key ranges of ceil(S / N) keys), is sent as blocks of leading
        indices, query rows and key ranges, every variant re-expressed exactly for each block's
        rows and keys; blocks no row may see (past a causal diagonal, outside a window, past
        key_lengths) are not sent. Blocks of whole key rows are placed as the server computed
        them, bit for bit; key ranges are merged by their states (attention_client.merge_states)
        in float64, so the result differs from one call's by the rounding of the compute dtype
        (float32: within 2e-6, relative and absolute, on out, lse and the weights; 1e-12 in float64).
        Memory: out and lse in float64 beside the result, plus one block per connection; the
        weights (B, T, S) when asked for. What cannot be split (one key of one row over the
        limits, or more than 1024 blocks) is sent whole, and the server says why it refuses it."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        mask = None if mask is None else np.asarray(mask)
        key_lengths = None if key_lengths is None else np.asarray(key_lengths)
        bias = None if bias is None else np.asarray(bias)
        alibi_slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        causal = "top_left" if causal is True else causal
        dtype = dtype or _float64_if_any(q, k, v)
        if key_chunks is not None and not (isinstance(key_chunks, int) and not isinstance(key_chunks, bool) and key_chunks >= 1):
            raise ValueError(f"key_chunks must be an integer of at least 1, not {key_chunks!r}")
        options = {
            **({"scale": scale} if scale is not None else {}),
            **({"dtype": dtype} if dtype is not None else {}),
            **({"weights_dtype": weights_dtype} if weights_dtype is not None else {}),
        }
        whole: dict[str, Any] = {
            "q": q,
            "k": k,
            "v": v,
            "mask": mask,
            "key_lengths": key_lengths,
            "bias": bias,
            "alibi_slopes": alibi_slopes,
            "causal": causal or None,
            "window": None if window is None else [int(n) for n in window],
            "enable_gqa": enable_gqa or None,
            "average_weights": average_weights or None,
        }
        blocks = None
        if self.split or key_chunks is not None:
            blocks = self._attention_plan(
                q, k, v, mask, key_lengths, causal, window, bias, alibi_slopes, enable_gqa, return_weights, key_chunks
            )
        if blocks is None:  # within the limits, or not to be split: one request
            (result,) = self._map(lambda block, http: self._attention_request(http, whole, options, return_weights, return_lse), [None])
            out, weights, lse = result
            _checked(out, weights, (*q.shape[:-2], q.shape[-2], v.shape[-1]), (q.shape[-2], k.shape[-2]))
            return (out, weights, lse) if return_lse else (out, weights)

        lead, (T, d), S, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
        B = math.prod(lead)
        kv_of = _kv_items(q.shape, k.shape) if enable_gqa else None  # (B,): the key/value item of each query item
        q3, k3, v3 = q.reshape(B, T, d), k.reshape(-1, S, d), v.reshape(-1, S, dv)  # (B|Bkv, T|S, d|dv)
        m3 = None if mask is None else _flat_mask(mask, lead)  # (B or 1, T or 1, S or 1)
        b3 = None if bias is None else _flat_mask(bias, lead)  # the same broadcast, of floats
        kl = None if key_lengths is None else np.broadcast_to(key_lengths, lead).reshape(B)  # (B,)
        sl = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, lead).reshape(B)  # (B,)
        lo, hi = _split.diagonals(T, S, causal or None, window)
        merged = any(b.s0 > 0 or (b.s1 or S) < S for b in blocks)  # key ranges: merged by their lse
        bias_dtype = np.float64 if dtype == "float64" else np.float32

        def body_of(block: Block) -> dict[str, Any]:
            b, t, s = slice(block.b0, block.b1), slice(block.t0, block.t1), slice(block.s0, block.s1)
            s1 = S if block.s1 is None else block.s1
            items = b if kv_of is None else kv_of[b]
            body: dict[str, Any] = {
                "q": q3[b, t],
                "k": k3[items, s],
                "v": v3[items, s],
                "mask": _part(m3, b, t, s),
                "bias": _part(b3, b, t, s),
            }
            if (block.t0, block.t1, block.s0, s1) == (0, T, 0, S):  # whole rows and keys: the positions hold
                body.update(causal=causal or None, window=whole["window"], alibi_slopes=None if sl is None else sl[b])
            else:
                win, band = _split.band(lo, hi, block.t0, block.t1, block.s0, s1)
                body["window"] = None if win is None else list(win)
                if band is not None:
                    body["mask"] = band if body["mask"] is None else np.logical_and(body["mask"], band)
                if sl is not None and _split.alibi_moves(T, S, block.t0, block.t1, block.s0, s1):
                    alibi = _split.alibi_bias(sl[b], T, S, block.t0, block.t1, block.s0, s1, bias_dtype)  # (nb, tb, sb)
                    body["bias"] = alibi if body["bias"] is None else (alibi + body["bias"]).astype(bias_dtype)
                elif sl is not None:
                    body["alibi_slopes"] = sl[b]
            if kl is not None:
                body["key_lengths"] = np.clip(kl[b] - block.s0, 0, s1 - block.s0)
            return body

        merger = Merger(B, T, S, dv, np.dtype(dtype or "float32"))
        want_lse = return_lse or merged

        def run(block: Block, http: Pool):
            out, weights, lse = self._attention_request(http, body_of(block), options, return_weights, want_lse)
            tb = block.t1 - block.t0
            _checked(out, weights, (block.b1 - block.b0, tb, dv), (tb, (block.s1 or S) - block.s0))
            return out, weights, (np.zeros(out.shape[:-1]) if lse is None else lse)

        def add(block: Block, result) -> None:
            out, weights, lse = result
            merger.dtype = out.dtype
            merger.add(block.b0, block.b1, block.t0, block.t1, block.s0, block.s1 or S, out, lse, weights)

        self._map(run, blocks, add)
        out, lse, weights = merger.finish()
        out = out.reshape(*lead, T, dv)
        if return_weights and weights is None:  # no block was sent: no row sees any key
            weights = np.zeros((B, T, S), np.dtype(weights_dtype or out.dtype))
        if weights is not None:
            weights = weights.reshape(*lead, T, S)
            weights = weights.mean(axis=-3) if average_weights else weights
        return (out, weights, lse.reshape(*lead, T)) if return_lse else (out, weights)

    def session(
        self,
        heads: int,
        head_dim: int,
        *,
        kv_heads: int | None = None,
        value_dim: int | None = None,
        dtype: str | None = None,
        max_tokens: int | None = None,
        shards: int = 1,
    ) -> Session:
        """A sequence's keys and values held by the server (the contract's "Sessions"): POST
        /sessions now, DELETE on leaving its `with` block (or close()). heads, head_dim required;
        kv_heads (grouped-query attention, dividing heads; default heads), value_dim (default
        head_dim), dtype ("float32" default, or "float64"), max_tokens (the server's
        ATTN_SESSION_MAX_TOKENS by default). Placed on the replicas in turn (the next if one
        refuses), and kept there. shards=N: the keys may spread over up to N segments, each a
        session of max_tokens on the next replica, a new one started when the last is full; each
        step is sent to all and merged by lse, exactly. See attention_client._sessions.Session."""
        from ._sessions import Session  # the sessions build on this module

        return Session.create(
            self, heads, head_dim, kv_heads=kv_heads, value_dim=value_dim, dtype=dtype, max_tokens=max_tokens, shards=shards
        )

    def attention_sessions(
        self, sessions: Sequence[Session], q: np.ndarray, k: np.ndarray | None = None, v: np.ndarray | None = None, **options
    ):
        """One step for several sessions of any lengths: q (B, H, t, d), k (B, Hkv, t, d), v (B, Hkv,
        t, dv) (their new tokens, appended first); options as Session.attention's but
        return_weights. Sessions on one replica go in one POST /sessions/attention. Returns out
        (B, H, t, dv), or (out, lse (B, H, t)) with return_lse=True."""
        from ._sessions import attention_sessions

        return attention_sessions(self, sessions, q, k, v, **options)

    def _attention_request(self, http: Pool, fields: dict, options: dict, return_weights: bool, return_lse: bool):
        """One /attention request of the given tensors and flags (None: not sent) -> (out, weights, lse)."""
        body = {name: value for name, value in fields.items() if value is not None}
        if "window" in body:
            body["window"] = list(body["window"])
        body = {**body, **options, "return_weights": return_weights, **({"return_lse": True} if return_lse else {})}
        return self._compute("/attention", body, http)

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

        def send(x, http=None):
            out, weights, _ = self._compute("/mha", {"x": x, **ws, **options}, http)
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
        results = self._map(lambda block, http: send(x[block.b0 : block.b1], http), blocks)
        out = np.concatenate([r[0] for r in results])
        weights = np.concatenate([r[1] for r in results]) if return_weights else None
        return out, weights

    # --- splitting ---

    def _attention_plan(
        self, q, k, v, mask, key_lengths, causal, window, bias, alibi_slopes, enable_gqa, return_weights, key_chunks
    ) -> list[Block] | None:
        """Blocks when the request is over the limits (or key_chunks asks) and splits exactly; None
        to send it whole (within the limits, or malformed or unsplittable: then the server says why)."""
        lim = self._known_limits()
        if (lim is None and key_chunks is None) or q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
            return None
        lead, (T, d), S, dv = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
        if k.shape[-1] != d or v.shape[:-1] != k.shape[:-1]:
            return None
        if enable_gqa:
            if q.ndim < 3 or k.shape[:-3] != lead[:-1] or k.shape[-3] < 1 or lead[-1] % k.shape[-3]:
                return None
        elif k.shape[:-2] != lead:
            return None
        if mask is not None and not _split.broadcasts(mask.shape, (*lead, T, S)):
            return None
        if key_lengths is not None and not _split.broadcasts(key_lengths.shape, lead):
            return None
        if bias is not None and (bias.ndim < 1 or not _split.broadcasts(bias.shape, (*lead, T, S))):
            return None
        if alibi_slopes is not None and not _split.broadcasts(alibi_slopes.shape, lead):
            return None
        if window is not None and not (len(window) == 2 and all(isinstance(n, int | np.integer) and n >= -1 for n in window)):
            return None
        if causal not in (False, None, "top_left", "bottom_right"):
            return None
        B, itemsize = math.prod(lead), _wire_itemsize(q)
        positional = bool(causal) or window is not None

        def fits(b: int, t: int, s: int, moved: bool = False) -> bool:  # moved: the band may travel as a mask, ALiBi as a bias
            mask_bytes = 0 if mask is None else min(mask.size, b * t * s) * mask.itemsize
            mask_bytes += t * s if moved and positional else 0
            bias_bytes = 0 if bias is None else min(bias.size, b * t * s) * _wire_itemsize(bias)
            bias_bytes += b * t * s * itemsize if moved and alibi_slopes is not None else 0
            nbytes = (b * t * d + b * s * (d + dv)) * itemsize + mask_bytes + bias_bytes + b * 16
            if lim is None:
                return True
            return self._fits(
                lim, rows=t, keys=s, scores=b * t * s, return_weights=return_weights, nbytes=nbytes
            ) and b * t * dv <= lim.get("max_output_elements", b * t * dv)

        if key_chunks is None and fits(B, T, S):
            return None
        lo, hi = _split.diagonals(T, S, causal or None, window)
        kl = None if key_lengths is None else np.broadcast_to(key_lengths, lead).reshape(B)

        def sees(block: Block) -> bool:
            s1 = S if block.s1 is None else block.s1
            if kl is not None and kl[block.b0 : block.b1].max() <= block.s0:
                return False
            return _split.sees_band(lo, hi, block.t0, block.t1, block.s0, s1)

        blocks = _split.plan_keys(B, T, S, fits, key_chunks, sees)
        if blocks is not None and any(self._moves(b, T, S, lo, hi, alibi_slopes is not None) for b in blocks):
            blocks = _split.plan_keys(B, T, S, lambda b, t, s: fits(b, t, s, moved=True), key_chunks, sees)  # with their bytes
        if blocks is None or (key_chunks is None and len(blocks) == 1 and blocks[0] == Block(0, B, 0, T, 0, S)):
            return None
        return blocks

    @staticmethod
    def _moves(block: Block, T: int, S: int, lo: int | None, hi: int | None, alibi: bool) -> bool:
        """Whether the block sends its band as an explicit mask, or ALiBi as a bias."""
        s1 = S if block.s1 is None else block.s1
        if (block.t0, block.t1, block.s0, s1) == (0, T, 0, S):
            return False
        return _split.band(lo, hi, block.t0, block.t1, block.s0, s1)[1] is not None or (
            alibi and _split.alibi_moves(T, S, block.t0, block.t1, block.s0, s1)
        )

    def _known_limits(self) -> dict | None:
        """/limits (every replica's smallest), or None when no server says (then nothing is split)."""
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

    def _map(self, fn, blocks: list, on_result=None) -> list:
        """fn(block, http) over the blocks, concurrently on up to max_workers connections per replica:
        each pool thread keeps to one replica (its connections), and takes the next block as it is
        free, so a faster replica takes more. With on_result, on_result(block, result) is called in
        this thread as each block completes (its result then dropped: memory of one block per
        connection) and [] returned; else the results in order. The first failure is raised."""
        if len(blocks) == 1 and len(self._https) == 1:  # one request: on the caller's thread
            result = fn(blocks[0], self._https[0])
            if on_result is None:
                return [result]
            on_result(blocks[0], result)
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers * len(self._https), thread_name_prefix="attention-client")
        with self._flight:
            self._admits.clear()  # what each replica admits is learned again by each call (its load changes)

        def task(block):
            return fn(block, self._thread_http())

        futures = {self._pool.submit(task, block): i for i, block in enumerate(blocks)}
        results: list = [None] * len(blocks) if on_result is None else []
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    i = futures.pop(f)
                    if on_result is None:
                        results[i] = f.result()
                    else:
                        on_result(blocks[i], f.result())
            return results
        finally:
            for f in futures:
                f.cancel()

    def _thread_http(self) -> Pool:
        """This pool thread's replica: the next in turn at its first block, then always the same."""
        http = getattr(self._local, "http", None)
        if http is None:
            http = self._local.http = self._https[next(self._next_replica) % len(self._https)]
        return http

    # --- the wire ---

    def _compute(self, path: str, body: dict, http: Pool | None = None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """One request: path "/attention" or "/mha", body its native fields (arrays and options),
        first to http (default the first replica). (out, weights or None, lse or None)."""
        arrays = {key: _wire_array(key, value) for key, value in body.items() if isinstance(value, np.ndarray)}
        if self.wire == "binary":
            binary = _binary_arrays(arrays)
            if binary is not None:
                result = self._compute_shm(path, body, binary, http or self._http) if self._regions is not None else None
                return result or self._compute_binary(path, body, binary, http)
        return self._compute_json(path, body, arrays, http)

    def _compute_binary(self, path: str, body: dict, arrays: dict[str, np.ndarray], http: Pool | None = None):
        """At /v2/models/{model}/infer: tensors as raw bytes both ways, outputs viewed in place."""
        options = {key: _wire.v2_parameter(value) for key, value in body.items() if key not in arrays}
        outputs = ["out", "weights"] if body.get("return_weights", True) else ["out"]
        outputs += ["lse"] if body.get("return_lse") else []
        parts = _wire.v2_request(arrays, options, outputs)
        headers = {_wire.HEAD_LENGTH: str(len(parts[0])), "Content-Type": "application/octet-stream"}
        answer = self._send("POST", f"/v2/models/{_wire.V2_MODELS[path]}/infer", parts, headers, align_at=_wire.v2_head_length, http=http)
        if answer.status != 200:
            code = answer.headers.get("X-Error-Code") or "http_error"
            field = answer.headers.get("X-Error-Field")
            status = _wire.native_status(answer.status, code)  # the same error whichever wire took it
            raise AttentionError(status, code, _v2_message(answer), _response(answer), field and unquote(field))
        try:
            results = _wire.v2_outputs(answer.body, int(answer.headers.get(_wire.HEAD_LENGTH) or 0))
            return results["out"], results.get("weights"), _lse_of(results.get("lse"), body, results["out"])
        except (ValueError, KeyError, TypeError) as exc:
            raise AttentionError(
                answer.status, "bad_response", f"the server's infer response is malformed: {exc!r}", _response(answer)
            ) from None

    def _compute_shm(self, path: str, body: dict, arrays: dict[str, np.ndarray], http: Pool):
        """Through shared memory (_shm): (out, weights, lse), or None to take the binary wire."""
        assert self._regions is not None
        outputs = ["out", "weights"] if body.get("return_weights", True) else ["out"]
        outputs += ["lse"] if body.get("return_lse") else []
        try:
            results = _shm.infer(self._regions[http.base_url], self._sender(http), path, body, arrays, outputs)
            if results is None:
                return None
            return results["out"], results.get("weights"), _lse_of(results.get("lse"), body, results["out"])
        except (ValueError, KeyError, TypeError) as exc:
            raise AttentionError(200, "bad_response", f"the server's infer response is malformed: {exc!r}") from None

    def _sender(self, http: Pool):
        """_send bound to one replica: (method, path, parts, headers) -> Answer."""
        return lambda method, path, parts, headers: self._send(method, path, parts, headers, http=http)

    def _compute_json(self, path: str, body: dict, arrays: dict[str, np.ndarray], http: Pool | None = None):
        """At the native endpoint, tensors in self.encoding (b64 by pybase64, spliced into orjson's text)."""
        doc = self._call("POST", path, _wire.json_request({**body, **arrays, "response_encoding": self.encoding}, self.encoding), http)
        try:
            out, weights, lse = doc["out"], doc.get("weights"), doc.get("lse")
            out, weights = _wire.decode_tensor(out), (None if weights is None else _wire.decode_tensor(weights))
            lse = _lse_of(None if lse is None else _wire.decode_tensor(lse), body, out)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not the response's shape: [], {}, a shape its data lacks
            raise AttentionError(200, "bad_response", f"the server's response is malformed: {exc!r}", None) from None
        if out.ndim < 2 or (weights is not None and weights.ndim < 2):  # out (..., T, dv), weights (..., T, S)
            raise AttentionError(200, "bad_response", f"the server's out has shape {out.shape}, not (..., T, dv)", None)
        return out, weights, lse

    def _call(self, method: str, path: str, parts: list[bytes] | None = None, http: Pool | None = None) -> dict:
        """One call with retries; the parsed JSON of a 200, else AttentionError."""
        headers = {"Content-Type": "application/json"} if parts is not None else {}
        answer = self._send(method, path, parts or (), headers, http=http)
        if answer.status != 200:
            raise _error(answer)
        try:
            return _wire.loads(answer.body)
        except ValueError as exc:
            raise AttentionError(answer.status, "bad_response", f"the server's answer is not JSON: {exc}", _response(answer)) from None

    def _send(self, method: str, path: str, parts, headers: dict, align_at=None, http: Pool | None = None, pinned: bool = False) -> Answer:
        """The answer, after retrying connection failures (backoff) and 503 (Retry-After): on the
        next replica while one is left untried this round, then after the wait (pinned: always on
        http, the replica that holds what the request names, a session). A 503 from a
        replica that is computing another of this client's requests is this client's own doing:
        the request waits for one of those to finish and goes again, no retry spent (so blocks are
        sent as fast as each replica admits them, whatever max_workers is)."""
        https = [http] if pinned and http is not None else self._https
        first = https.index(http) if http is not None else 0
        attempts = self.retries + len(https)  # every replica once, then `retries` more
        attempt = 0
        while True:
            last, pool = attempt == attempts - 1, https[(first + attempt) % len(https)]
            round_done = (attempt + 1) % len(https) == 0  # every replica tried since the last wait
            try:
                answer = self._counted(pool, method, path, parts, headers, align_at)
            except TransportError as exc:
                if exc.kind != "connection_error":  # a timeout, or an answer that cannot be read (bad_response)
                    raise AttentionError(None, exc.kind, str(exc)) from exc
                if last:
                    raise AttentionError(
                        None, "connection_error", f"{method} {pool.base_url}{path} failed after {attempt + 1} attempts: {exc}"
                    ) from exc
                if round_done:
                    self._sleep(self._backoff(attempt // len(https)))
                attempt += 1
                continue
            if answer.status != 503:
                return answer
            if self._wait_for_own(pool):
                continue
            if last:
                return answer
            if round_done:
                self._sleep(self._retry_after(answer, attempt // len(https)))
            attempt += 1

    def _counted(self, pool: Pool, method: str, path: str, parts, headers: dict, align_at) -> Answer:
        """pool.request, counted among this client's requests in flight to that replica, and held
        back while as many are in flight as the replica was seen to admit (_wait_for_own)."""
        with self._flight:
            self._flight.wait_for(lambda: self._in_flight.get(id(pool), 0) < self._admits.get(id(pool), math.inf))
            self._in_flight[id(pool)] = self._in_flight.get(id(pool), 0) + 1
        try:
            return pool.request(method, path, parts, headers, align_at)
        finally:
            with self._flight:
                self._in_flight[id(pool)] -= 1
                self._flight.notify_all()

    def _wait_for_own(self, pool: Pool) -> bool:
        """After a 503 from pool: if other requests of this client are in flight there, the replica
        admits no more than those (so no more are sent to it at once, not a 503 each time one is
        answered): wait (up to max_retry_after) until one of them is answered and return True;
        else False."""
        with self._flight:
            busy = self._in_flight.get(id(pool), 0)
            if busy == 0:
                return False
            self._admits[id(pool)] = min(busy, self._admits.get(id(pool), busy))
            self._flight.wait_for(lambda: self._in_flight.get(id(pool), 0) < busy, timeout=self.max_retry_after or None)
            return True

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _part(a3: np.ndarray | None, b: slice, t: slice, s: slice) -> np.ndarray | None:
    """A block's share of a (B or 1, T or 1, S or 1) mask or bias: broadcast axes kept at 1."""
    if a3 is None:
        return None
    return a3[b if a3.shape[0] > 1 else slice(None), t if a3.shape[1] > 1 else slice(None), s if a3.shape[2] > 1 else slice(None)]


def _kv_items(q_shape: tuple, k_shape: tuple) -> np.ndarray:
    """(B,): the flattened key/value item each flattened query item reads under enable_gqa: query
    head h of H reads key/value head h // (H / Hkv) (PyTorch's SDPA)."""
    B, H, Hkv = math.prod(q_shape[:-2]), q_shape[-3], k_shape[-3]
    i = np.arange(B)
    return (i // H) * Hkv + (i % H) // (H // Hkv)


def _lse_of(lse: np.ndarray | None, body: dict, out: np.ndarray) -> np.ndarray | None:
    """The answer's lse, (..., T) as out's (..., T, dv), when the request asked for it; else None."""
    if not body.get("return_lse"):
        return None
    if lse is None or lse.shape != out.shape[:-1]:
        raise AttentionError(
            200, "bad_response", f"the server answered lse {None if lse is None else lse.shape}, not {out.shape[:-1]}", None
        )
    return lse


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
    way requests' own adapter builds one, through its public attributes: the body is its raw
    file-like object, which .content, .text and .json() read."""
    resp = requests.Response()
    resp.status_code, resp.reason, resp.url, resp.encoding = answer.status, answer.reason, answer.url, "utf-8"
    resp.headers = CaseInsensitiveDict(answer.headers.items())
    resp.raw = io.BytesIO(answer.body)
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
