"""Sessions: one sequence's keys and values held by the server (the contract's "Sessions", 1.3), so
that each step of a decode loop sends its new tokens and queries, not the whole cache.

A Session is a run of segments, each a server session on one replica holding the next keys of the
sequence (a segment's first key is at the sum of the earlier segments' lengths). With shards=1 (the
default) there is one segment, on the replica the session was placed on, and every call is one
request to it. With shards=N the keys spread over up to N segments: new tokens go to the last
segment until it holds its max_tokens, then a new segment starts on the next replica; a step sends
q to every segment, each aligned so that its queries see exactly the keys they see in the whole
sequence (segment_options), and merges the answers by their lse (merge_states). So a sequence can
outgrow one replica's max_tokens and pool.

Retries are safe: an append, or a step that appends, carries at = the length the client believes
the segment has; a retry after a lost answer meets 409 length_conflict with length at + t, which
means "applied" (applied()): an append is then done, a step is computed again without appending.

Shape legend: H query heads, Hkv key/value heads, t new tokens (queries), d head width, dv value
width, S the keys of the whole sequence, L a segment's keys."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from . import _wire
from ._client import AttentionError, _document, _response
from ._http import Pool
from ._states import merge_states

if TYPE_CHECKING:
    from ._client import AttentionClient

JSON = {"Content-Type": "application/json"}


@dataclass
class Segment:
    """One server session: a run of the sequence's keys on one replica. length is what the client
    last learned from its server; capacity the most keys it takes (its max_tokens)."""

    pool: Pool
    id: str
    length: int
    capacity: int

    @property
    def path(self) -> str:
        return f"/sessions/{quote(self.id, safe='')}"


# --- the rules, pure -------------------------------------------------------------------------------


def conflict_length(err: AttentionError) -> int | None:
    """The current length a 409 length_conflict reports (in its error object), else None."""
    if err.status != 409 or err.code != "length_conflict" or err.response is None:
        return None
    try:
        doc = err.response.json()
    except ValueError:
        return None
    for where in (doc.get("error") if isinstance(doc, dict) else None, doc):
        if isinstance(where, dict) and isinstance(where.get("length"), int) and not isinstance(where["length"], bool):
            return where["length"]
    return None


def applied(err: AttentionError, at: int, t: int) -> bool:
    """Whether err says that an append of t tokens at `at` had been applied: 409 length_conflict
    with length at + t, what a retry meets when the first request's answer was lost. (Another
    writer's append of t tokens would look the same: a session has one writer.)"""
    return conflict_length(err) == at + t


def segment_options(start: int, end: int, S: int, t: int, causal, window, alibi: bool) -> dict | None:
    """How the segment holding keys start..end-1 of a sequence of S keys (after the step's appends)
    is asked, so that each of the t queries sees exactly the keys of it that it sees in the whole:
    {"causal", "window" (None: none), "rows"} for the first `rows` queries (the others see none of
    its keys), or None when no query sees any.

    A segment's server aligns the queries at its own end; the whole's diagonal lies D = S - end
    keys further. The last segment (D = 0) takes the step's own options. An earlier one sees keys
    s <= S - t + i (+ right) as s' <= L - t + i + D (+ right) of its own: a window (left - D,
    right + D) with causal False, dropped where it hides nothing. Where a window's left edge lies
    past the segment's end for the later queries, only the earlier ones are sent (their diagonal
    then lies `left` past its end). ValueError where its server cannot express it: causal
    "top_left" (aligned at the start), ALiBi with t > 1 (the distance |t + S - T - s| changes sign
    inside the segment; with t = 1 it is the segment's own plus D, which the caller takes from
    its lse)."""
    D = S - end
    if D == 0:
        return {"causal": causal, "window": window, "rows": t}
    if causal is True or causal == "top_left":
        raise ValueError(
            "causal='top_left' aligns the queries at the start of the whole sequence; a session of several segments steps with 'bottom_right' or False"
        )
    if alibi and t > 1:
        raise ValueError("alibi_slopes on a session of several segments needs steps of one query (t=1)")
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:  # "bottom_right": no key past the diagonal
        right = 0 if right == -1 else min(right, 0)
    if 0 <= left < D:  # query i's window starts at key S - t + i - left: past the segment's end from i = t - D + left on
        t, D = t - D + left, left
        if t <= 0:
            return None
    lo = -1 if left == -1 else left - D
    hi = -1 if right == -1 else right + D
    L = end - start
    lo = -1 if lo >= L - 1 else lo  # every key at or after each query's lower edge
    hi = -1 if hi >= t - 1 else hi  # every key at or before each query's upper edge
    return {"causal": False, "window": None if (lo, hi) == (-1, -1) else (lo, hi), "rows": t}


# --- requests --------------------------------------------------------------------------------------


def _exchange(client: AttentionClient, pool: Pool, method: str, path: str, body: dict | None = None, ok: Sequence[int] = (200,)) -> dict:
    """One request to the replica holding the session (retried there, never elsewhere)."""
    parts = () if body is None else _wire.json_request(_jsonable(body), client.encoding)
    answer = client._send(method, path, parts, JSON if body is not None else {}, http=pool, pinned=True)
    return _document(answer, ok)


def _jsonable(body: dict) -> dict:
    """The body without its None fields, windows as lists; arrays stay (json_request encodes them)."""
    return {key: (list(value) if isinstance(value, tuple) else value) for key, value in body.items() if value is not None}


def _int(doc: dict, key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AttentionError(200, "bad_response", f"the server's answer has {key}={value!r}, not a length", None)
    return value


def _tensor(doc: dict, key: str, shape: tuple) -> np.ndarray:
    """doc[key] decoded, of the given shape (None: any length on that axis), else bad_response."""
    try:
        arr = _wire.decode_tensor(doc[key])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AttentionError(200, "bad_response", f"the server's {key} is malformed: {exc!r}", None) from None
    if arr.ndim != len(shape) or any(n is not None and m != n for m, n in zip(arr.shape, shape, strict=True)):
        raise AttentionError(200, "bad_response", f"the server answered {key} {arr.shape}, not {shape}", None)
    return arr


def _new_segment(client: AttentionClient, spec: dict, replica: int) -> tuple[Segment, dict]:
    """A new server session, on replica (its index, modulo) or, if that one refuses or is down,
    the next that takes it; and the server's description of it."""
    pool = client._https[replica % len(client._https)]
    answer = client._send("POST", "/sessions", _wire.json_request(spec, client.encoding), JSON, http=pool)
    doc = _document(answer, (201, 200))
    pool = next((p for p in client._https if answer.url == p.base_url + "/sessions"), pool)  # the replica that answered
    if not isinstance(doc.get("id"), str) or not doc["id"]:
        raise AttentionError(answer.status, "bad_response", f"the server's new session has id {doc.get('id')!r}", _response(answer))
    return Segment(pool, doc["id"], _int(doc, "length"), _int(doc, "max_tokens")), doc


# --- the session -----------------------------------------------------------------------------------


class Session:
    """A sequence's keys and values held by the server: made by AttentionClient.session(), deleted
    by close() or on leaving its `with` block. One writer at a time (a Session is not thread-safe).

    heads, kv_heads, head_dim, value_dim, dtype: as the server described it. length: the keys it
    holds, as the client last learned (refresh() asks the servers)."""

    def __init__(self, client: AttentionClient, segments: list[Segment], spec: dict, shards: int):
        self._client, self._segments, self._spec, self.shards = client, segments, spec, shards
        self.heads, self.head_dim = spec["heads"], spec["head_dim"]
        self.kv_heads, self.value_dim, self.dtype = spec["kv_heads"], spec["value_dim"], spec["dtype"]
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._refused: Segment | None = None  # the segment whose replica last refused new tokens (503)

    @classmethod
    def create(
        cls,
        client: AttentionClient,
        heads: int,
        head_dim: int,
        *,
        kv_heads: int | None = None,
        value_dim: int | None = None,
        dtype: str | None = None,
        max_tokens: int | None = None,
        shards: int = 1,
    ) -> Session:
        if not (isinstance(shards, int) and not isinstance(shards, bool) and shards >= 1):
            raise ValueError(f"shards must be an integer of at least 1, not {shards!r}")
        asked = {
            "heads": heads,
            "head_dim": head_dim,
            "kv_heads": kv_heads,
            "value_dim": value_dim,
            "dtype": dtype,
            "max_tokens": max_tokens,
        }
        request = {key: value for key, value in asked.items() if value is not None}
        replica = next(client._next_replica)  # sessions are placed on the replicas in turn
        segment, doc = _new_segment(client, request, replica)
        defaults = {"kv_heads": heads, "value_dim": head_dim, "dtype": "float32", "max_tokens": segment.capacity}
        spec = {key: doc.get(key, request.get(key, defaults.get(key))) for key in ("heads", "head_dim", *defaults)}
        return cls(client, [segment], {**spec, "request": request}, shards)

    # --- what it is ---

    @property
    def length(self) -> int:
        return sum(seg.length for seg in self._segments)

    @property
    def id(self) -> str:
        """The (first) segment's session id."""
        return self._segments[0].id

    @property
    def segments(self) -> list[tuple[str, str, int]]:
        """(replica URL, session id, length) of each segment, in the order of their keys."""
        return [(seg.pool.base_url, seg.id, seg.length) for seg in self._segments]

    @property
    def max_tokens(self) -> int:
        """The most keys it can hold: a segment's max_tokens, times shards."""
        return self._spec["max_tokens"] * self.shards

    def __repr__(self) -> str:
        return f"Session({self.id!r}, length={self.length}, heads={self.heads}, kv_heads={self.kv_heads}, segments={len(self._segments)})"

    def refresh(self) -> int:
        """Ask each segment's server for its length; the session's."""
        self._open()
        for seg in self._segments:
            seg.length = _int(_exchange(self._client, seg.pool, "GET", seg.path), "length")
        return self.length

    # --- the calls ---

    def append(self, k: np.ndarray, v: np.ndarray) -> int:
        """Append t tokens: k (Hkv, t, d), v (Hkv, t, dv). Returns the new length."""
        self._open()
        k, v = self._kv(k, v)

        def run() -> None:
            for seg, i0, i1 in self._place(k.shape[1]):
                self._append(seg, k[:, i0:i1], v[:, i0:i1])

        self._spilling(run)
        return self.length

    def attention(
        self,
        q: np.ndarray,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        *,
        causal: bool | str = "bottom_right",
        scale: float | None = None,
        window: tuple[int, int] | None = None,
        alibi_slopes: np.ndarray | None = None,
        return_weights: bool = False,
        weights_dtype: str | None = None,
        return_lse: bool = False,
    ):
        """One step: k (Hkv, t, d), v (Hkv, t, dv) appended first (atomically with the computation
        on one segment), then q (H, t, d) attends to all S keys, aligned at the end (causal
        "bottom_right": query i sees keys s <= S - t + i; False: all). Options as
        AttentionClient.attention's. Returns out (H, t, dv); with return_weights (out, weights
        (H, t, S)); with return_lse (out, weights or None, lse (H, t)), as attention() does."""
        self._open()
        q = self._cast(q, "q")
        if q.ndim != 3:
            raise ValueError(f"q must be (heads, t, head_dim), not {q.shape}")
        if (k is None) != (v is None):
            raise ValueError("k and v come together (the new tokens' keys and values), or neither")
        options: dict[str, Any] = {
            "scale": scale,
            "alibi_slopes": None if alibi_slopes is None else self._slopes(alibi_slopes),
            "weights_dtype": weights_dtype,
            "return_weights": return_weights or None,
        }
        if k is None or v is None:
            return self._step_all(q, None, None, causal, window, options, return_weights, return_lse)
        k, v = self._kv(k, v)

        def run():
            place = self._place(k.shape[1])
            for seg, i0, i1 in place[:-1]:  # tokens past the last segment's room: appended first
                self._append(seg, k[:, i0:i1], v[:, i0:i1])
            _, i0, i1 = place[-1]
            return self._step_all(q, k[:, i0:i1], v[:, i0:i1], causal, window, options, return_weights, return_lse)

        return self._spilling(run)

    def fork(self, length: int | None = None) -> Session:
        """A new session whose keys are the first `length` of this one's (default all), shared on
        the server, not copied; on the same replicas."""
        self._open()
        n = self._length_arg(self.length if length is None else length, "length")
        made: list[Segment] = []
        try:
            start = 0
            for seg in self._segments:
                if made and start >= n:
                    break
                keep = min(seg.length, n - start)
                doc = _exchange(self._client, seg.pool, "POST", seg.path + "/fork", {"length": keep}, ok=(201, 200))
                if not isinstance(doc.get("id"), str) or not doc["id"]:
                    raise AttentionError(201, "bad_response", f"the server's fork has id {doc.get('id')!r}", None)
                made.append(Segment(seg.pool, doc["id"], _int(doc, "length"), seg.capacity))
                start += seg.length
        except BaseException:
            for seg in made:
                self._delete(seg, quiet=True)
            raise
        return Session(self._client, made, self._spec, self.shards)

    def truncate(self, length: int) -> int:
        """Drop the keys after the first `length` (rejected draft tokens). Returns the length."""
        self._open()
        n = self._length_arg(length, "length")
        starts = self._starts()
        cut = max((i for i, start in enumerate(starts) if start < n), default=0)  # the last segment that keeps a key
        seg = self._segments[cut]
        if seg.length != n - starts[cut]:
            seg.length = _int(_exchange(self._client, seg.pool, "POST", seg.path + "/truncate", {"length": n - starts[cut]}), "length")
        while len(self._segments) > cut + 1:
            self._delete(self._segments[-1])
            self._segments.pop()
        return self.length

    def close(self) -> None:
        """Delete it on its servers (one already gone, expired, is not an error)."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for seg in self._segments:
            self._delete(seg)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own error is the one to see
            self.close()
        except AttentionError:
            pass

    # --- inside ---

    def _open(self) -> None:
        if self._closed:
            raise ValueError(f"session {self.id} is closed (deleted on its server)")

    def _starts(self) -> list[int]:
        starts, at = [], 0
        for seg in self._segments:
            starts.append(at)
            at += seg.length
        return starts

    def _length_arg(self, n, name: str) -> int:
        if not (isinstance(n, int | np.integer) and not isinstance(n, bool) and 0 <= n <= self.length):
            raise ValueError(f"{name} must be an integer from 0 to the session's length {self.length}, not {n!r}")
        return int(n)

    def _cast(self, a, name: str) -> np.ndarray:
        """The array as it travels: float16 stays (half the bytes), other numbers in the session's dtype."""
        a = np.asarray(a)
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{name} must hold numbers, not {a.dtype}")
        return a if a.dtype == np.float16 else a.astype(self.dtype, copy=False)

    def _slopes(self, slopes) -> np.ndarray:
        """ALiBi's slopes as the server takes them: one a query head, (H,)."""
        slopes = self._cast(slopes, "alibi_slopes")
        try:
            return np.ascontiguousarray(np.broadcast_to(slopes, (self.heads,)))
        except ValueError:
            raise ValueError(f"alibi_slopes must broadcast to one a query head, ({self.heads},), not {slopes.shape}") from None

    def _kv(self, k, v) -> tuple[np.ndarray, np.ndarray]:
        k, v = self._cast(k, "k"), self._cast(v, "v")
        if k.ndim != 3 or v.ndim != 3 or k.shape[1] != v.shape[1]:
            raise ValueError(
                f"k and v must be (kv_heads, t, head_dim) and (kv_heads, t, value_dim) of the same t, not {k.shape} and {v.shape}"
            )
        return k, v

    def _place(self, t: int) -> list[tuple[Segment, int, int]]:
        """Where t new tokens go, as (segment, i0, i1) slices in order: the last segment up to its
        max_tokens, then new segments, on the next replicas in turn, while shards allow; the last
        allowed takes the rest (its server refuses what is past its max_tokens: 413)."""
        place: list[tuple[Segment, int, int]] = []
        i, seg = 0, self._segments[-1]
        while True:
            room = seg.capacity - seg.length
            if t - i <= room or len(self._segments) >= self.shards:
                return [*place, (seg, i, t)]
            if room > 0:
                place.append((seg, i, i + room))
                i += room
            seg, _ = _new_segment(self._client, self._spec["request"], self._client._https.index(seg.pool) + 1)
            self._segments.append(seg)

    def _spilling(self, run: Callable[[], Any]) -> Any:
        """run(), which appends, all or nothing (_Undo). While shards allow, when the last segment's
        replica cannot take its new tokens (503 after the retries: its pool is full), that segment
        is closed at its length and run() made again: the tokens go to a new segment on the next
        replica, so a sequence outgrows one replica's pool."""
        while True:
            last, self._refused = self._segments[-1], None
            try:
                with _Undo(self):
                    return run()
            except AttentionError as err:
                if err.status != 503 or self._refused is not last or last.length == 0 or len(self._segments) >= self.shards:
                    raise
                last.capacity = last.length  # no room on its replica: the next tokens start a new segment

    def _append(self, seg: Segment, k: np.ndarray, v: np.ndarray) -> None:
        at, t = seg.length, k.shape[1]
        try:
            doc = _exchange(self._client, seg.pool, "POST", seg.path + "/append", {"k": k, "v": v, "at": at})
        except AttentionError as err:
            if not applied(err, at, t):
                self._refused = seg if err.status == 503 else None
                raise
            doc = {"length": at + t}  # the answer to an earlier try was lost; it was applied
        seg.length = _int(doc, "length")

    def _step(self, seg: Segment, q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None, options: dict) -> dict:
        """One segment's step: k, v (if any) appended at its length, then q; the answer's document."""
        body = {"q": q, **options, "response_encoding": self._client.encoding}
        if k is None or v is None:
            doc = _exchange(self._client, seg.pool, "POST", seg.path + "/attention", body)
        else:
            at, t = seg.length, k.shape[1]
            try:
                doc = _exchange(self._client, seg.pool, "POST", seg.path + "/attention", {**body, "k": k, "v": v, "at": at})
            except AttentionError as err:
                if not applied(err, at, t):
                    self._refused = seg if err.status == 503 else None
                    raise
                doc = _exchange(self._client, seg.pool, "POST", seg.path + "/attention", body)  # applied: computed again, not appended
                if _int(doc, "length") != at + t:
                    raise AttentionError(409, "length_conflict", f"session {seg.id} changed while this step was retried", None) from err
        seg.length = _int(doc, "length")
        return doc

    def _step_all(self, q, k, v, causal, window, options: dict, return_weights: bool, return_lse: bool):
        """The step over every segment (k, v, if any, to the last), merged."""
        H, t = q.shape[0], q.shape[1]
        if len(self._segments) == 1:
            seg = self._segments[0]
            doc = self._step(seg, q, k, v, {**options, "causal": causal, "window": window, "return_lse": return_lse or None})
            out = _tensor(doc, "out", (H, t, None))
            weights = _tensor(doc, "weights", (H, t, seg.length)) if return_weights else None
            lse = _tensor(doc, "lse", (H, t)) if return_lse else None
            return _returned(out, weights, lse, return_weights, return_lse)

        new = 0 if k is None else k.shape[1]
        starts, last = self._starts(), len(self._segments) - 1
        S = self.length + new
        alibi = options["alibi_slopes"]
        slopes = None if alibi is None else alibi.astype(np.float64)  # (H,)
        jobs: list[tuple[int, dict | None]] = []
        for j, seg in enumerate(self._segments):
            end = starts[j] + seg.length + (new if j == last else 0)
            jobs.append((j, None if end == starts[j] else segment_options(starts[j], end, S, t, causal, window, alibi is not None)))

        def run(j: int, aligned: dict) -> dict:
            seg, rows = self._segments[j], aligned["rows"]
            kj, vj = (k, v) if j == last else (None, None)
            return self._step(
                seg, q[:, :rows], kj, vj, {**options, "causal": aligned["causal"], "window": aligned["window"], "return_lse": True}
            )

        docs = self._map(run, [(j, a) for j, a in jobs if a is not None])
        outs, lses, ws = [], [], []
        lowest = np.finfo(self.dtype).min
        for j, aligned in jobs:
            L = self._segments[j].length
            out, lse = np.zeros((H, t, self.value_dim), self.dtype), np.full((H, t), lowest)  # rows that see none of its keys
            w = np.zeros((H, t, L), options["weights_dtype"] or self.dtype) if return_weights else None
            if aligned is not None:
                doc, rows = docs[j], aligned["rows"]
                out[:, :rows], lse[:, :rows] = _tensor(doc, "out", (H, rows, self.value_dim)), _tensor(doc, "lse", (H, rows))
                if w is not None:
                    w[:, :rows] = _tensor(doc, "weights", (H, rows, L))
                D = S - starts[j] - L
                if slopes is not None and D:  # its ALiBi term is the whole's plus slope * D at every key (t = 1)
                    lse = np.where(lse <= lowest / 2, lse, lse - slopes[:, None] * D)
            outs.append(out)
            lses.append(lse)
            ws.append(w)
        merged = merge_states(outs, lses, [w for w in ws if w is not None] if return_weights else None)
        out, lse = merged[0].astype(self.dtype), np.where(merged[1] <= lowest / 2, lowest, merged[1]).astype(self.dtype)
        return _returned(out, merged[2] if len(merged) == 3 else None, lse, return_weights, return_lse)

    def _map(self, fn: Callable[[int, dict], dict], jobs: list[tuple[int, dict]]) -> dict[int, dict]:
        """fn over the jobs, concurrently (one thread per segment); the first failure raised once all are done."""
        if len(jobs) <= 1:
            return {j: fn(j, a) for j, a in jobs}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.shards, thread_name_prefix="attention-session")
        futures = {j: self._executor.submit(fn, j, a) for j, a in jobs}
        errors = [f.exception() for f in futures.values()]
        for error in errors:
            if error is not None:
                raise error
        return {j: f.result() for j, f in futures.items()}

    def _delete(self, seg: Segment, quiet: bool = False) -> None:
        try:
            _exchange(self._client, seg.pool, "DELETE", seg.path, ok=(204, 200))
        except AttentionError as err:
            if err.status != 404 and not quiet:  # already gone: expired, or deleted by a retry whose answer was lost
                raise


class _Undo:
    """A context: when what it runs fails after one of several requests changed a segment, each
    segment is truncated back to its length before (new segments deleted), so that the call can
    be made again (best effort: a server out of reach keeps what it has; refresh())."""

    def __init__(self, session: Session):
        self.session = session
        self.before = [(seg, seg.length) for seg in session._segments]

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, *exc) -> None:
        s = self.session
        touched = len(s._segments) > len(self.before) or any(seg.length != n for seg, n in self.before)
        if exc_type is None or not touched or len(s._segments) == 1:  # one segment, one request: it applied or it did not
            return
        while len(s._segments) > len(self.before):
            s._delete(s._segments.pop(), quiet=True)
        for seg, n in self.before:
            try:
                doc = _exchange(s._client, seg.pool, "POST", seg.path + "/truncate", {"length": n})
                seg.length = _int(doc, "length")
            except AttentionError:
                pass


def _returned(out, weights, lse, return_weights: bool, return_lse: bool):
    """attention()'s convention: out; (out, weights) with weights; (out, weights or None, lse) with lse."""
    if return_lse:
        return out, weights, lse
    return (out, weights) if return_weights else out


# --- many sessions, one step -----------------------------------------------------------------------


def attention_sessions(
    client: AttentionClient,
    sessions: Sequence[Session],
    q: np.ndarray,
    k: np.ndarray | None = None,
    v: np.ndarray | None = None,
    *,
    return_lse: bool = False,
    **options,
):
    """One step for B sessions (of any lengths): q (B, H, t, d), k (B, Hkv, t, d), v (B, Hkv, t, dv)
    (the new tokens, appended first), options as Session.attention's but return_weights. The
    sessions on one replica (of one segment each) go in one POST /sessions/attention; a session of
    several segments (or about to start one) steps on its own; all concurrently. Returns out (B, H, t, dv), or (out, lse
    (B, H, t)) with return_lse."""
    if not sessions:
        raise ValueError("attention_sessions needs at least one session")
    q = np.asarray(q)
    if q.ndim != 4 or q.shape[0] != len(sessions) or (k is None) != (v is None):
        raise ValueError(
            f"q must be (B, heads, t, head_dim) for B={len(sessions)} sessions, and k and v come together or neither; q is {q.shape}"
        )
    if k is not None and v is not None:
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != len(sessions) or v.shape[0] != len(sessions):
            raise ValueError(f"k and v must be (B, kv_heads, t, ·) for B={len(sessions)}, not {k.shape} and {v.shape}")
    if "return_weights" in options:
        raise TypeError("attention_sessions returns no weights (their lengths differ): step a session with return_weights=True")
    groups: dict[int, list[int]] = {}
    alone: list[int] = []
    t = 0 if k is None else k.shape[2]
    for i, s in enumerate(sessions):
        seg = s._segments[0]
        if len(s._segments) == 1 and (s.shards == 1 or seg.capacity - seg.length >= t):
            groups.setdefault(id(seg.pool), []).append(i)
        else:  # its keys span segments, or are about to
            alone.append(i)
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("a session may appear once in a step")

    def pick(a, idx):
        return None if a is None else a[idx]

    def batch(idx: list[int]):
        members = [sessions[i] for i in idx]
        return _batch_step(client, members, pick(q, idx), pick(k, idx), pick(v, idx), options)

    def single(i: int):
        out, _, lse = sessions[i].attention(q[i], pick(k, i), pick(v, i), return_lse=True, **options)
        return out[None], lse[None]

    tasks: list[tuple[list[int], Callable[[], tuple[np.ndarray, np.ndarray]]]] = [
        *((idx, (lambda idx=idx: batch(idx))) for idx in groups.values()),
        *(([i], (lambda i=i: single(i))) for i in alone),
    ]
    before = [s.length for s in sessions]
    try:
        if len(tasks) == 1:
            results = [tasks[0][1]()]
        else:
            with ThreadPoolExecutor(max_workers=min(len(tasks), client.max_workers * len(client._https))) as pool:
                futures = [pool.submit(fn) for _, fn in tasks]
                errors = [f.exception() for f in futures]  # every task done before any is undone
                for error in errors:
                    if error is not None:
                        raise error
                results = [f.result() for f in futures]
    except BaseException:
        for s, n in zip(sessions, before, strict=True):  # the steps that went in are taken back, so the call can be made again
            if s.length > n:
                with contextlib.suppress(AttentionError):
                    s.truncate(n)
        raise
    first = results[0][0]
    out = np.zeros((len(sessions), *first.shape[1:]), first.dtype)
    lse = np.zeros((len(sessions), *results[0][1].shape[1:]), results[0][1].dtype)
    for (idx, _), (o, lo) in zip(tasks, results, strict=True):
        out[idx], lse[idx] = o, lo
    return (out, lse) if return_lse else out


def _batch_step(client: AttentionClient, members: list[Session], q, k, v, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """POST /sessions/attention for sessions of one segment each on one replica: (out, lse). On 409
    length_conflict each session's length says whether its tokens went in (at + t) or not (at):
    those not yet in are appended, and the step is computed again without appending."""
    first = members[0]
    segs = [s._segments[0] for s in members]
    pool, B = segs[0].pool, len(members)
    body: dict[str, Any] = {"sessions": [seg.id for seg in segs], "q": first._cast(q, "q"), **options, "return_lse": True}
    body["response_encoding"] = client.encoding
    if body.get("alibi_slopes") is not None:
        body["alibi_slopes"] = first._slopes(body["alibi_slopes"])
    if k is None:
        doc = _exchange(client, pool, "POST", "/sessions/attention", body)
    else:
        k, v, t = first._cast(k, "k"), first._cast(v, "v"), k.shape[2]
        ats = [seg.length for seg in segs]
        try:
            doc = _exchange(client, pool, "POST", "/sessions/attention", {**body, "k": k, "v": v, "at": ats})
        except AttentionError as err:
            if err.status != 409 or err.code != "length_conflict":
                raise
            for i, (s, seg, at) in enumerate(zip(members, segs, ats, strict=True)):
                now = _int(_exchange(client, pool, "GET", seg.path), "length")
                if now == at:
                    s._append(seg, k[i], v[i])
                elif now != at + t:
                    raise
                seg.length = at + t
            doc = _exchange(client, pool, "POST", "/sessions/attention", body)
            if doc.get("lengths") != [at + t for at in ats]:
                raise AttentionError(409, "length_conflict", "a session changed while this step was retried", None) from err
    lengths = doc.get("lengths")
    if not (isinstance(lengths, list) and len(lengths) == B and all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)):
        raise AttentionError(200, "bad_response", f"the server's lengths are {lengths!r}, not {B} lengths", None)
    for seg, n in zip(segs, lengths, strict=True):
        seg.length = n
    H, T = q.shape[1], q.shape[2]
    return _tensor(doc, "out", (B, H, T, None)), _tensor(doc, "lse", (B, H, T))
