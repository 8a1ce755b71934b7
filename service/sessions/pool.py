"""The pool: every session's keys and values, and every session's description, in one mapping of
shared memory made before the server's workers fork, so that any worker serves any session.

Layout (one memfd, mapped shared by the arbiter and inherited by every worker):

    header   int64 cells: the pool lock's holder, sessions, pages, units used, expiries
    table    one record a session slot: state, token, owner, shapes, length, page table ...
    refs     int32 a unit: 0 free; a page's first unit its reference count; its other units -1
    data     units of UNIT bytes; a page is `units_per_page` consecutive units: k (Hkv, P, d)
             then v (Hkv, P, dv), P = page_tokens

A session's page table lists its pages' first units; page i holds tokens i*P .. i*P+P-1. A fork
copies the parent's page table and counts one more reference on each page: the prefix is shared.
A page with more than one reference is never written: a session that appends into a shared,
partly filled last page first copies it (copy on write).

Locks (POSIX record locks on the memfd's bytes, which the kernel releases when their holder dies,
as the census's: service/admission/census.py): byte 0 is the pool lock (the table's slots, the refs,
the header), byte 1 + slot a session's lock. A session's lock is held for a whole request on it
(requests on one session are serialised, on different sessions run in parallel); the pool lock
for a few stores at a time, always taken after a session's, never before.

A worker killed at any moment leaves every session as it was before its request:
- a request writes new tokens into pages past the session's length and commits the length last;
  the pages it reserved past its length are counted in the record (npages, spare), and the next
  holder of the session's lock finds the dead holder's mark (holder) and gives them back (_settle);
- under the pool lock, the holder's mark is in the header: the next holder that finds it there
  recounts every reference from the page tables (_recount), so a half-done allocation or release is
  never seen.

Idle sessions expire: looked up after ATTN_SESSION_IDLE_S they are gone (404), and sweep() frees
them all (on a create, on a full pool, and at most every few seconds). No live session is evicted
for room: a request the pool cannot serve raises PoolFull."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from service import memfd

UNIT = 4096  # bytes: the pool's allocation unit (a page is whole units)
HOLDER, SESSIONS, PAGES, USED_UNITS, EXPIRED, SWEPT_MS = range(6)
HEADER_CELLS = 16
FREE, LIVE = 0, 1
DTYPES: dict[int, np.dtype] = {4: np.dtype(np.float32), 8: np.dtype(np.float64)}  # itemsize -> dtype (float32, float64)
ID_SLOT_HEX, ID_TOKEN_BYTES = 6, 16  # an id: the slot in 6 hex digits, then 16 random bytes in hex
OWNER_BYTES = 32  # sha256 of the API key that made a session
SWEEP_EVERY_S = 5.0
LOCK_POLL_S = 0.002  # how often a request with a deadline tries a session another process holds
START_ATTEMPTS = 64  # Pool.start: starts of one name that may overtake another before it gives up


class SessionError(Exception):
    """A request the pool refuses; the web layer answers each kind with its status."""


class NotFound(SessionError):
    """Unknown, expired, deleted, or another key's."""


class Conflict(SessionError):
    """`at` is not the session's length."""

    def __init__(self, length: int):
        super().__init__(f"the session's length is {length}")
        self.length = length


class TooLong(SessionError):
    """Past the session's max_tokens."""

    def __init__(self, max_tokens: int):
        super().__init__(f"the session holds at most {max_tokens} tokens")
        self.max_tokens = max_tokens


class PageTooLarge(SessionError):
    """A page of the session's shape is larger than the whole pool: it could never hold a token."""

    def __init__(self, page_bytes: int, memory_bytes: int):
        super().__init__(f"a page takes {page_bytes} bytes, the pool {memory_bytes}")
        self.page_bytes, self.memory_bytes = page_bytes, memory_bytes


class NameTaken(SessionError):
    """A live session of the owner already has the name (Pool.start ends it and tries again)."""


class PoolFull(SessionError):
    """No room: pages or session slots (no live session is evicted)."""


class Busy(SessionError):
    """Another request held the session for longer than this one could wait (its deadline)."""


@dataclass(frozen=True)
class Shape:
    """A session's shapes: H query heads, Hkv key/value heads, d, dv, and its dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: np.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values: Hkv * (d + dv) * itemsize."""
        return self.kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize


def name_hash(name: str) -> bytes:
    """What a session stores of a name it is found by (Pool.find)."""
    return hashlib.sha256(b"name:" + name.encode()).digest()


def owner_hash(key: str | None) -> bytes:
    """What a session stores of the API key that made it (zeros without keys)."""
    return hashlib.sha256(key.encode()).digest() if key else bytes(OWNER_BYTES)


class Pool:
    """All sessions of a server, in one shared mapping (see the module's docstring)."""

    def __init__(self, memory_bytes: int, page_tokens: int, max_tokens: int, max_sessions: int, idle_s: float):
        self.page_tokens, self.max_tokens, self.max_sessions, self.idle_s = page_tokens, max_tokens, max_sessions, idle_s
        self.max_pages = -(-max_tokens // page_tokens)  # page table entries per session
        self.units = max(1, memory_bytes // UNIT)
        self.record = np.dtype(
            [
                ("state", "i8"),
                ("holder", "i8"),
                ("length", "i8"),
                ("npages", "i8"),  # page table entries in use: those of length, plus any reserved by the holder
                ("spare", "i8"),  # a page the holder allocated to copy into (copy on write), -1 if none
                ("heads", "i8"),
                ("kv_heads", "i8"),
                ("head_dim", "i8"),
                ("value_dim", "i8"),
                ("itemsize", "i8"),
                ("max_tokens", "i8"),
                ("last_use", "f8"),  # time.monotonic(): the same clock in every process
                ("token", "u1", (ID_TOKEN_BYTES,)),
                ("owner", "u1", (OWNER_BYTES,)),
                ("name", "u1", (OWNER_BYTES,)),  # a name its owner finds it by (a /v2 sequence id's hash), zeros if none
                ("pages", "i4", (self.max_pages,)),
            ],
            align=True,
        )
        table_at = HEADER_CELLS * 8
        refs_at = table_at + self.record.itemsize * max_sessions
        data_at = -(-(refs_at + 4 * self.units) // UNIT) * UNIT
        size = data_at + self.units * UNIT
        self._fd = memfd.anonymous_file("attention-sessions", size)
        self._map = mmap.mmap(self._fd, size)  # MAP_SHARED: every worker forked after this sees these bytes
        _advise_huge_pages(self._map)
        self.header = np.ndarray((HEADER_CELLS,), np.int64, self._map, 0)
        self.table = np.ndarray((max_sessions,), self.record, self._map, table_at)
        self.refs = np.ndarray((self.units,), np.int32, self._map, refs_at)
        self.data = np.ndarray((self.units * UNIT,), np.uint8, self._map, data_at)
        self._data_at = data_at
        self.table["spare"] = -1
        self._threads = [threading.Lock() for _ in range(max_sessions + 1)]  # a record lock is a process's: its threads queue here
        self._mine = threading.local()  # .slots: the sessions' slots this thread holds (a lock is not reentrant)

    # --- locks --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _record_lock(self, index: int, wait: bool = True, timeout: float | None = None) -> Iterator[bool]:
        """Lock index (0: the pool, 1 + slot: a session) for this thread; yields False when wait is
        False, or another holds it past timeout seconds (None: as long as it takes)."""
        thread_lock = self._threads[index]
        until = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        took = thread_lock.acquire(blocking=wait) if until is None else thread_lock.acquire(timeout=max(until - time.monotonic(), 0.0))
        if not took:
            yield False
            return
        try:
            try:
                if until is None:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), 1, index)
                else:
                    _lock_before(self._fd, index, until)
            except OSError:  # LOCK_NB: another process holds it (past until)
                yield False
                return
            try:
                yield True
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, index)
        finally:
            thread_lock.release()

    @contextlib.contextmanager
    def _pool_locked(self) -> Iterator[None]:
        """The pool lock: the table's slots, the refs, the header. A mark left by a holder that died
        under it means its stores may be half done: every reference is recounted first."""
        with self._record_lock(0):
            if self.header[HOLDER]:
                self._recount()
            self.header[HOLDER] = os.getpid()
            try:
                yield
            finally:
                self.header[HOLDER] = 0

    def _recount(self) -> None:
        """The refs and the header's counts rebuilt from the page tables of the live sessions."""
        self.refs[:] = 0
        live = np.flatnonzero(self.table["state"] == LIVE)
        pages = units = 0
        for slot in live:
            rec = self.table[slot]
            upp = self._units_per_page(rec)
            held = [int(u) for u in rec["pages"][: rec["npages"]]] + ([int(rec["spare"])] if rec["spare"] >= 0 else [])
            for u in held:
                if self.refs[u] == 0:
                    self.refs[u + 1 : u + upp] = -1
                    pages, units = pages + 1, units + upp
                self.refs[u] += 1
        self.header[SESSIONS], self.header[PAGES], self.header[USED_UNITS] = len(live), pages, units

    # --- sessions -----------------------------------------------------------------------------

    def create(self, shape: Shape, max_tokens: int, owner: bytes, name: bytes = b"") -> str:
        """A new empty session's id; PoolFull when every slot is live. name: what find() knows it
        by (OWNER_BYTES; a live session of the same owner and name is the caller's to delete first).
        PageTooLarge when a page of shape would not fit in the whole pool."""
        if self.page_bytes(shape) > self.units * UNIT:
            raise PageTooLarge(self.page_bytes(shape), self.units * UNIT)
        self.sweep()
        with self._pool_locked():
            if name and self._named(name, owner).size:
                raise NameTaken(name.hex())
            free = np.flatnonzero(self.table["state"] == FREE)
            if not free.size:
                raise PoolFull(f"all {self.max_sessions} sessions are live")
            slot = int(free[0])
            token = secrets.token_bytes(ID_TOKEN_BYTES)
            self._fill(slot, shape, max_tokens, owner, token, length=0, pages=[], name=name)
            return _id(slot, token)

    def start(self, shape: Shape, max_tokens: int, owner: bytes, name: bytes) -> str:
        """A new session of owner named name, its live one of that name (if any) deleted first (a
        sequence started again): at most one live session of an owner has a name, however many
        starts of it race. PoolFull if others keep overtaking this one."""
        for _ in range(START_ATTEMPTS):
            old = self.find(name, owner)
            if old is not None:
                with contextlib.suppress(NotFound), self.session(old, owner) as s:
                    s.delete()
            try:
                return self.create(shape, max_tokens, owner, name)
            except NameTaken:  # another start made its session in between: that one is ended next
                continue
        raise PoolFull(f"{START_ATTEMPTS} other starts of this name overtook this one")

    def find(self, name: bytes, owner: bytes) -> str | None:
        """The id of owner's live session named name, or None (a snapshot: it may expire or be
        deleted before it is used, which session() then says)."""
        hits = self._named(name, owner)
        return _id(int(hits[0]), self.table["token"][hits[0]].tobytes()) if hits.size else None

    def _named(self, name: bytes, owner: bytes) -> np.ndarray:
        """The slots of owner's live sessions named name."""
        table = self.table
        return np.flatnonzero(
            (table["state"] == LIVE)
            & (table["name"] == np.frombuffer(name, np.uint8)).all(axis=1)
            & (table["owner"] == np.frombuffer(owner, np.uint8)).all(axis=1)
        )

    def _fill(
        self, slot: int, shape: Shape, max_tokens: int, owner: bytes, token: bytes, length: int, pages: list[int], name: bytes = b""
    ) -> None:
        """Write a free slot's record (under the pool lock); its state last, so that a slot is live
        only once whole."""
        rec = self.table[slot : slot + 1]
        rec["holder"], rec["spare"], rec["length"], rec["npages"] = 0, -1, length, len(pages)
        rec["heads"], rec["kv_heads"], rec["head_dim"], rec["value_dim"] = shape.heads, shape.kv_heads, shape.head_dim, shape.value_dim
        rec["itemsize"], rec["max_tokens"], rec["token"][0], rec["owner"][0] = (
            shape.dtype.itemsize,
            max_tokens,
            np.frombuffer(token, np.uint8),
            np.frombuffer(owner, np.uint8),
        )
        rec["name"][0] = np.frombuffer(name or bytes(OWNER_BYTES), np.uint8)
        rec["last_use"] = time.monotonic()
        rec["pages"][0, : len(pages)] = pages
        rec["state"] = LIVE
        self.header[SESSIONS] += 1

    @contextlib.contextmanager
    def session(self, sid: str, owner: bytes, wait_s: float | None = None) -> Iterator[Session]:
        """The session sid, locked for this request; NotFound if it is unknown, expired, deleted or
        owner's is not the key that made it; Busy if another request holds it for longer than
        wait_s seconds (None: as long as it takes). Pages it reserves and does not commit are given
        back when the block ends, however it ends."""
        slot, token = _parse(sid, self.max_sessions)
        held = self._mine.__dict__.setdefault("slots", set())
        if slot in held:  # this thread holds the slot already (a batch naming it twice): at most one id of a slot is live
            raise NotFound(sid)
        with self._record_lock(1 + slot, timeout=wait_s) as locked:
            if not locked:
                raise Busy(sid)
            rec = self.table[slot : slot + 1]
            if rec["holder"][0]:  # its last holder died during a request: what it reserved goes back
                self._settle(slot)
                rec["holder"] = 0
            if (
                rec["state"][0] != LIVE
                or not hmac.compare_digest(rec["token"][0].tobytes(), token)
                or not hmac.compare_digest(rec["owner"][0].tobytes(), owner)
            ):
                raise NotFound(sid)
            if time.monotonic() - rec["last_use"][0] > self.idle_s:
                self._free(slot, expired=True)
                raise NotFound(sid)
            rec["holder"] = os.getpid()
            held.add(slot)
            try:
                yield Session(self, slot, sid)
            finally:
                held.discard(slot)
                self._settle(slot)
                rec["last_use"] = time.monotonic()
                rec["holder"] = 0
        self.sweep(every=SWEEP_EVERY_S)

    def sweep(self, every: float = 0.0) -> int:
        """Free the sessions idle past idle_s that no request holds; at most once in `every`
        seconds (server-wide). The count freed."""
        now = time.monotonic()
        if every and now * 1000 - self.header[SWEPT_MS] < every * 1000:
            return 0
        self.header[SWEPT_MS] = int(now * 1000)
        idle = np.flatnonzero((self.table["state"] == LIVE) & (now - self.table["last_use"] > self.idle_s))
        freed = 0
        for slot in idle:
            with self._record_lock(1 + int(slot), wait=False) as got:
                rec = self.table[slot]
                if got and not rec["holder"] and rec["state"] == LIVE and time.monotonic() - rec["last_use"] > self.idle_s:
                    self._free(int(slot), expired=True)
                    freed += 1
        return freed

    def _free(self, slot: int, expired: bool = False) -> None:
        """The session in slot is gone (deleted, expired): its pages' references given back."""
        with self._pool_locked():
            rec = self.table[slot : slot + 1]
            if rec["state"][0] != LIVE:
                return
            rec["state"] = FREE
            self.header[SESSIONS] -= 1
            if expired:
                self.header[EXPIRED] += 1
            upp = self._units_per_page(rec[0])
            for u in [int(u) for u in rec["pages"][0, : rec["npages"][0]]] + ([int(rec["spare"][0])] if rec["spare"][0] >= 0 else []):
                self._decref(u, upp)
            rec["npages"], rec["spare"], rec["length"] = 0, -1, 0

    def _settle(self, slot: int) -> None:
        """Give back what the session's holder reserved and did not commit: page table entries past
        its length's pages, and a spare page."""
        rec = self.table[slot : slot + 1]
        needed = -(-int(rec["length"][0]) // self.page_tokens)
        if rec["state"][0] != LIVE or (rec["npages"][0] <= needed and rec["spare"][0] < 0):
            return
        with self._pool_locked():
            upp = self._units_per_page(rec[0])
            extra = [int(u) for u in rec["pages"][0, needed : rec["npages"][0]]]
            spare = int(rec["spare"][0])
            rec["npages"], rec["spare"] = min(needed, int(rec["npages"][0])), -1
            for u in extra + ([spare] if spare >= 0 else []):
                self._decref(u, upp)

    # --- pages ---------------------------------------------------------------------------------

    def _units_per_page(self, rec) -> int:
        token_bytes = int(rec["kv_heads"]) * (int(rec["head_dim"]) + int(rec["value_dim"])) * int(rec["itemsize"])
        return -(-token_bytes * self.page_tokens // UNIT)

    def page_bytes(self, shape: Shape) -> int:
        """The bytes a page of shape takes in the pool (whole units)."""
        return -(-shape.token_bytes * self.page_tokens // UNIT) * UNIT

    def _allocate(self, n: int, upp: int) -> list[int]:
        """n pages of upp units each, their first units, each with one reference (under the pool
        lock); PoolFull if there is no room for all n (then nothing is taken)."""
        free = np.concatenate(([False], self.refs == 0, [False]))
        edges = np.flatnonzero(np.diff(free.view(np.int8)))
        starts, ends = edges[::2], edges[1::2]  # runs of free units [start, end)
        fits = (ends - starts) // upp
        if fits.sum() < n:
            raise PoolFull(f"the pool has room for {int(fits.sum())} more pages of {upp * UNIT} bytes, not {n}")
        got: list[int] = []
        for start, count in zip(starts[fits > 0], fits[fits > 0], strict=True):
            take = min(int(count), n - len(got))
            got.extend(int(start) + i * upp for i in range(take))
            if len(got) == n:
                break
        for u in got:
            self.refs[u + 1 : u + upp] = -1
            self.refs[u] = 1
        self.header[PAGES] += n
        self.header[USED_UNITS] += n * upp
        return got

    def _decref(self, u: int, upp: int) -> None:
        self.refs[u] -= 1
        if self.refs[u] == 0:
            self.refs[u : u + upp] = 0
            self.header[PAGES] -= 1
            self.header[USED_UNITS] -= upp

    def views(self, u: int, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """Page u's keys (Hkv, P, d) and values (Hkv, P, dv), views into the pool."""
        P, Hkv = self.page_tokens, shape.kv_heads
        kb, vb = Hkv * P * shape.head_dim * shape.dtype.itemsize, Hkv * P * shape.value_dim * shape.dtype.itemsize
        base = u * UNIT
        k = self.data[base : base + kb].view(shape.dtype).reshape(Hkv, P, shape.head_dim)
        v = self.data[base + kb : base + kb + vb].view(shape.dtype).reshape(Hkv, P, shape.value_dim)
        return k, v

    def run_views(self, u: int, m: int, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """The m pages from unit u on, each upp units after the last, as one strided view each of
        keys (m, Hkv, P, d) and values (m, Hkv, P, dv): no copy."""
        P, Hkv, size = self.page_tokens, shape.kv_heads, shape.dtype.itemsize
        step = self.page_bytes(shape)
        at = self._data_at + u * UNIT
        k = np.ndarray(
            (m, Hkv, P, shape.head_dim), shape.dtype, self._map, at, (step, P * shape.head_dim * size, shape.head_dim * size, size)
        )
        v_at = at + Hkv * P * shape.head_dim * size
        v = np.ndarray(
            (m, Hkv, P, shape.value_dim), shape.dtype, self._map, v_at, (step, P * shape.value_dim * size, shape.value_dim * size, size)
        )
        return k, v

    # --- what is seen -------------------------------------------------------------------------

    def retry_after(self) -> int:
        """Seconds until the idlest live session expires (and frees its room), 1 at least: what a
        request the pool refused is told to wait."""
        live = self.table["state"] == LIVE
        if not live.any():
            return 1
        left = self.idle_s - (time.monotonic() - float(self.table["last_use"][live].min()))
        return max(1, min(int(self.idle_s), int(left) + 1))

    def stats(self) -> dict:
        """The pool's size and use (a snapshot without the lock)."""
        return {
            "memory_bytes": self.units * UNIT,
            "used_bytes": int(self.header[USED_UNITS]) * UNIT,
            "page_tokens": self.page_tokens,
            "sessions": int(self.header[SESSIONS]),
            "max_sessions": self.max_sessions,
            "pages": int(self.header[PAGES]),
            "expired": int(self.header[EXPIRED]),
        }


class Session:
    """One session, locked for one request (Pool.session). Writes go past its length; only
    commit() makes them part of it."""

    def __init__(self, pool: Pool, slot: int, sid: str):
        self.pool, self.slot, self.id = pool, slot, sid
        self.rec = pool.table[slot : slot + 1]
        r = self.rec[0]
        self.shape = Shape(int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]), int(r["value_dim"]), DTYPES[int(r["itemsize"])])
        self.max_tokens = int(r["max_tokens"])

    @property
    def length(self) -> int:
        return int(self.rec["length"][0])

    def describe(self) -> dict:
        s = self.shape
        return {
            "id": self.id,
            "heads": s.heads,
            "kv_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "value_dim": s.value_dim,
            "dtype": s.dtype.name,
            "max_tokens": self.max_tokens,
            "length": self.length,
            "idle_expiry_s": self.pool.idle_s,
        }

    def check_at(self, at: int | None) -> None:
        """Conflict unless at is None or the session's length."""
        if at is not None and at != self.length:
            raise Conflict(self.length)

    def append(self, k: np.ndarray, v: np.ndarray) -> int:
        """Write k (Hkv, t, d), v (Hkv, t, dv) after the session's tokens, uncommitted: the length
        they would make (commit() makes it so). TooLong past max_tokens, PoolFull without room."""
        L, t = self.length, k.shape[1]
        end = L + t
        if end > self.max_tokens:
            raise TooLong(self.max_tokens)
        self._reserve(L, end)
        P, pages = self.pool.page_tokens, self.rec["pages"][0]
        for p in range(L // P, -(-end // P)):
            kp, vp = self.pool.views(int(pages[p]), self.shape)
            a, b = max(L, p * P), min(end, (p + 1) * P)
            kp[:, a - p * P : b - p * P] = k[:, a - L : b - L]
            vp[:, a - p * P : b - p * P] = v[:, a - L : b - L]
        return end

    def _reserve(self, L: int, end: int) -> None:
        """Pages for tokens L .. end - 1, writable: a shared, partly filled last page is copied first."""
        pool, P, rec = self.pool, self.pool.page_tokens, self.rec
        upp = pool._units_per_page(rec[0])
        if L % P and pool.refs[rec["pages"][0, L // P]] > 1:  # copy on write
            with pool._pool_locked():
                (new,) = pool._allocate(1, upp)
                rec["spare"] = new
            old = int(rec["pages"][0, L // P])
            for dst, src in zip(pool.views(new, self.shape), pool.views(old, self.shape), strict=True):
                dst[:, : L % P] = src[:, : L % P]
            with pool._pool_locked():
                rec["pages"][0, L // P] = new
                rec["spare"] = -1
                pool._decref(old, upp)
        need = -(-end // P) - int(rec["npages"][0])
        if need > 0:
            with pool._pool_locked():
                got = pool._allocate(need, upp)
                n = int(rec["npages"][0])
                rec["pages"][0, n : n + need] = got
                rec["npages"] = n + need  # after the entries: a recount sees them whole or not at all

    def commit(self, length: int) -> None:
        """The session's length is now length: the last store of a request that appends."""
        self.rec["length"] = length

    def pages(self, S: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The pages that hold tokens 0 .. S - 1, as views: each run of pages that lie one after
        another in the pool as one (k (m, Hkv, P, d), v (m, Hkv, P, dv)) (core.paged_attention)."""
        table = self.rec["pages"][0, : -(-S // self.pool.page_tokens)].astype(np.int64)
        if not table.size:
            return []
        upp = self.pool.page_bytes(self.shape) // UNIT
        breaks = np.flatnonzero(np.diff(table) != upp) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [table.size]))
        return [self.pool.run_views(int(table[a]), int(b - a), self.shape) for a, b in zip(starts, ends, strict=True)]

    def truncate(self, length: int) -> None:
        """Tokens from length on are dropped (length <= the session's)."""
        self.commit(length)
        self.pool._settle(self.slot)

    def fork(self, length: int, owner: bytes) -> str:
        """A new session whose first length tokens are this one's, its pages shared: its id."""
        pool = self.pool
        pool.sweep()
        n = -(-length // pool.page_tokens)
        with pool._pool_locked():
            free = np.flatnonzero(pool.table["state"] == FREE)
            if not free.size:
                raise PoolFull(f"all {pool.max_sessions} sessions are live")
            pages = [int(u) for u in self.rec["pages"][0, :n]]
            for u in pages:
                pool.refs[u] += 1
            slot, token = int(free[0]), secrets.token_bytes(ID_TOKEN_BYTES)
            pool._fill(slot, self.shape, self.max_tokens, owner, token, length, pages)
            return _id(slot, token)

    def delete(self) -> None:
        self.pool._free(self.slot)


def _id(slot: int, token: bytes) -> str:
    return f"{slot:0{ID_SLOT_HEX}x}{token.hex()}"


def _parse(sid: str, slots: int) -> tuple[int, bytes]:
    """(slot, token) of an id; NotFound for anything that is not one of ours, spelt as _id spells
    it (int() and fromhex() would read other spellings, "0x", upper case, other scripts' digits,
    as the same slot: two ids naming one session)."""
    if len(sid) != ID_SLOT_HEX + 2 * ID_TOKEN_BYTES or sid.strip(_HEX):
        raise NotFound(sid)
    slot, token = int(sid[:ID_SLOT_HEX], 16), bytes.fromhex(sid[ID_SLOT_HEX:])
    if slot >= slots:
        raise NotFound(sid)
    return slot, token


_HEX = "0123456789abcdef"


def _lock_before(fd: int, index: int, until: float) -> None:
    """The record lock index of fd, taken before until (time.monotonic()); OSError if another
    process holds it until then. fcntl has no timed wait: the lock is tried every LOCK_POLL_S."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
            return
        except OSError:
            left = until - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(LOCK_POLL_S, left))


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages on the pool (MADV_HUGEPAGE). A step reads every page of its
    session once, a few MiB to hundreds; in 4 KiB pages that costs a TLB miss, and a stop of the
    hardware prefetcher, every 4 KiB (bench/README.md, "Sessions"). The kernel grants shared
    memory huge pages only where the host allows them
    (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise, within_size or always); elsewhere
    this changes nothing."""
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE (not Linux), or a kernel without THP
        mapping.madvise(mmap.MADV_HUGEPAGE)
