"""The session pool (service.sessions.Pool), below the web: laws over any sequence of create,
append, fork, truncate and delete (hypothesis's state machine): every session reads back what was
appended to it; every page's reference count is the number of page tables that list it; the units
in use are exactly those of the pages referenced; a fork allocates at most one page; the bytes a
session takes are within one page of its tokens'. And crash safety: a process killed holding a
session's lock, or the pool's, leaves every session as it was."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from service.sessions import UNIT, Busy, Conflict, NotFound, Pool, PoolFull, Shape, TooLong, owner_hash

OWNER = owner_hash(None)
SHAPE = Shape(heads=2, kv_heads=1, head_dim=3, value_dim=2, dtype=np.dtype(np.float64))


def small_pool(units: int = 40, page_tokens: int = 4, max_tokens: int = 64, sessions: int = 8, idle_s: float = 600) -> Pool:
    return Pool(units * UNIT, page_tokens, max_tokens, sessions, idle_s)


def read(pool: Pool, sid: str) -> tuple[np.ndarray, np.ndarray]:
    """The session's keys and values, gathered from its pages (for checking only)."""
    with pool.session(sid, OWNER) as s:
        L = s.length
        if not L:
            return np.zeros((1, 0, 3)), np.zeros((1, 0, 2))
        runs = s.pages(L)  # runs of pages (m, Hkv, P, ...): their tokens in order
        k = np.concatenate([np.concatenate(list(k), axis=1) for k, _ in runs], axis=1)
        v = np.concatenate([np.concatenate(list(v), axis=1) for _, v in runs], axis=1)
        return k[:, :L], v[:, :L]


class PoolLaws(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self):
        super().__init__()
        self.pool = small_pool()
        self.model: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.counter = 0.0

    def tokens(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        self.counter += 1
        k = self.counter + np.arange(3 * t, dtype=np.float64).reshape(1, t, 3) / 100
        return k, -k[:, :, :2]

    @rule(target=sessions)
    def create(self):
        try:
            sid = self.pool.create(SHAPE, 64, OWNER)
        except PoolFull:
            return "gone"
        self.model[sid] = (np.zeros((1, 0, 3)), np.zeros((1, 0, 2)))
        return sid

    @rule(sid=sessions, t=st.integers(1, 9), wrong_at=st.booleans())
    def append(self, sid, t, wrong_at):
        if sid not in self.model:
            return
        k, v = self.tokens(t)
        mk, mv = self.model[sid]
        with self.pool.session(sid, OWNER) as s:
            if wrong_at:
                with pytest.raises(Conflict) as caught:
                    s.check_at(s.length + 1)
                assert caught.value.length == mk.shape[1]
                return
            try:
                end = s.append(k, v)
            except (PoolFull, TooLong):
                return  # nothing committed: the model is unchanged
            s.commit(end)
        self.model[sid] = (np.concatenate([mk, k], 1), np.concatenate([mv, v], 1))

    @rule(sid=sessions, t=st.integers(1, 5))
    def append_uncommitted(self, sid, t):
        """A request that fails after writing (a 422 in its computation): nothing changes."""
        if sid not in self.model:
            return
        with self.pool.session(sid, OWNER) as s:
            try:
                s.append(*self.tokens(t))
            except (PoolFull, TooLong):
                pass

    @rule(target=sessions, sid=sessions, cut=st.floats(0, 1))
    def fork(self, sid, cut):
        if sid not in self.model:
            return "gone"
        mk, mv = self.model[sid]
        L = int(mk.shape[1] * cut)
        pages_before = self.pool.header[2]
        with self.pool.session(sid, OWNER) as s:
            try:
                child = s.fork(L, OWNER)
            except PoolFull:
                return "gone"
        assert self.pool.header[2] == pages_before  # a fork allocates nothing until written
        self.model[child] = (mk[:, :L], mv[:, :L])
        return child

    @rule(sid=sessions, cut=st.floats(0, 1))
    def truncate(self, sid, cut):
        if sid not in self.model:
            return
        mk, mv = self.model[sid]
        L = int(mk.shape[1] * cut)
        with self.pool.session(sid, OWNER) as s:
            s.truncate(L)
        self.model[sid] = (mk[:, :L], mv[:, :L])

    @rule(sid=sessions)
    def delete(self, sid):
        if sid not in self.model:
            return
        with self.pool.session(sid, OWNER) as s:
            s.delete()
        del self.model[sid]
        with pytest.raises(NotFound):
            with self.pool.session(sid, OWNER):
                pass

    @precondition(lambda self: self.model)
    @invariant()
    def every_session_reads_back_what_was_appended(self):
        for sid, (mk, mv) in self.model.items():
            k, v = read(self.pool, sid)
            np.testing.assert_array_equal(k, mk)
            np.testing.assert_array_equal(v, mv)

    @invariant()
    def references_are_the_page_tables(self):
        pool = self.pool
        upp = pool.page_bytes(SHAPE) // UNIT
        want = np.zeros(pool.units, np.int64)
        for sid in self.model:
            with pool.session(sid, OWNER) as s:
                assert int(s.rec["npages"][0]) == -(-s.length // pool.page_tokens)  # nothing reserved past the length
                assert int(s.rec["spare"][0]) == -1
                for u in s.rec["pages"][0, : s.rec["npages"][0]]:
                    want[u] += 1
        firsts = np.flatnonzero(want)
        np.testing.assert_array_equal(pool.refs[firsts], want[firsts])
        used = np.zeros(pool.units, bool)
        for u in firsts:
            used[u : u + upp] = True
            assert (pool.refs[u + 1 : u + upp] == -1).all()
        assert ((pool.refs != 0) == used).all()  # every other unit is free
        assert pool.header[3] == used.sum() and pool.header[2] == len(firsts) and pool.header[1] == len(self.model)

    @invariant()
    def bytes_within_one_page_a_session(self):
        stats = self.pool.stats()
        tokens = sum(mk.shape[1] for mk, _ in self.model.values())
        page = self.pool.page_bytes(SHAPE)  # whole units: 2 * Hkv * d * itemsize a token where a page fills its units
        assert stats["used_bytes"] <= tokens * page / self.pool.page_tokens + len(self.model) * page


TestPoolLaws = PoolLaws.TestCase
TestPoolLaws.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_bytes_per_token_and_a_fork_of_4096_tokens():
    shape = Shape(8, 8, 64, 64, np.dtype(np.float32))
    pool = Pool(64 * 2**20, 256, 8192, 4, 600)
    sid = pool.create(shape, 8192, OWNER)
    rng = np.random.default_rng(0)
    with pool.session(sid, OWNER) as s:
        k = rng.standard_normal((8, 4000, 64)).astype(np.float32)
        s.commit(s.append(k, k))
    used = pool.stats()["used_bytes"]
    assert used <= 4000 * 2 * 8 * 64 * 4 + pool.page_bytes(shape)
    with pool.session(sid, OWNER) as s:
        child = s.fork(4000, OWNER)
    with pool.session(child, OWNER) as c:
        c.commit(c.append(k[:, :1], k[:, :1]))  # writes into the shared, partly filled last page: copied
    assert pool.stats()["used_bytes"] - used <= pool.page_bytes(shape)


def test_another_owner_and_a_malformed_id_are_not_found():
    pool = small_pool()
    sid = pool.create(SHAPE, 64, owner_hash("alice"))
    for other, owner in ((sid, owner_hash("bob")), (sid, OWNER), ("../etc", OWNER), (sid[:-1] + "g", owner_hash("alice")), ("", OWNER)):
        with pytest.raises(NotFound), pool.session(other, owner):
            pass
    with pool.session(sid, owner_hash("alice")):
        pass


def test_a_full_pool_refuses_and_evicts_nothing():
    pool = small_pool(units=2, page_tokens=4)  # one page of 4 tokens takes one unit here
    a = pool.create(SHAPE, 64, OWNER)
    with pool.session(a, OWNER) as s:
        s.commit(s.append(np.ones((1, 8, 3)), np.ones((1, 8, 2))))  # both units
    b = pool.create(SHAPE, 64, OWNER)
    with pool.session(b, OWNER) as s, pytest.raises(PoolFull):
        s.append(np.ones((1, 1, 3)), np.ones((1, 1, 2)))
    np.testing.assert_array_equal(read(pool, a)[0], np.ones((1, 8, 3)))
    for _ in range(6):  # 8 slots, 2 taken
        pool.create(SHAPE, 64, OWNER)
    with pytest.raises(PoolFull):  # every slot live
        pool.create(SHAPE, 64, OWNER)


def test_idle_sessions_expire():
    pool = small_pool(idle_s=0.05)
    sid = pool.create(SHAPE, 64, OWNER)
    with pool.session(sid, OWNER) as s:
        s.commit(s.append(np.ones((1, 5, 3)), np.ones((1, 5, 2))))
    kept = pool.create(SHAPE, 64, OWNER)
    deadline = time.monotonic() + 10
    while pool.stats()["expired"] < 2 and time.monotonic() < deadline:
        time.sleep(0.06)
        pool.sweep()
    assert pool.stats()["expired"] == 2 and pool.stats()["used_bytes"] == 0 and pool.stats()["sessions"] == 0
    with pytest.raises(NotFound), pool.session(kept, OWNER):
        pass


def _die_holding(pool: Pool, sid: str, pool_lock: bool) -> None:
    """Fork a child that appends to sid without committing (and, with pool_lock, dies inside the
    pool's lock, mid-allocation), then is killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reserve pages, write, say so, wait to be killed
        try:
            with pool.session(sid, OWNER) as s:
                s.append(np.full((1, 9, 3), 9.0), np.full((1, 9, 2), 9.0))
                if pool_lock:
                    with pool._pool_locked():
                        pool.refs[pool.refs == 0] = 5  # half-done stores the recount must undo
                        os.write(w, b"x")
                        time.sleep(60)
                os.write(w, b"x")
                time.sleep(60)
        finally:
            os._exit(0)
    os.read(r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("pool_lock", [False, True])
def test_a_process_killed_holding_a_lock_leaves_sessions_as_they_were(pool_lock):
    pool = small_pool()
    sid, other = pool.create(SHAPE, 64, OWNER), pool.create(SHAPE, 64, OWNER)
    k, v = np.arange(15.0).reshape(1, 5, 3), np.arange(10.0).reshape(1, 5, 2)
    for each in (sid, other):
        with pool.session(each, OWNER) as s:
            s.commit(s.append(k, v))
    before = pool.stats()
    _die_holding(pool, sid, pool_lock)
    for each in (sid, other):  # the next holders take the locks the kernel released, and undo the rest
        got_k, got_v = read(pool, each)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    assert pool.stats() == before


def test_a_session_held_longer_than_a_wait_is_busy():
    """A request that may wait wait_s for a session another holds (a thread of this process, or
    another process) gets Busy once it has waited that long, and the session once it is free."""
    pool = small_pool()
    sid = pool.create(SHAPE, 64, OWNER)
    held, release = threading.Event(), threading.Event()

    def hold_in_a_thread():
        with pool.session(sid, OWNER):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_in_a_thread)
    holder.start()
    assert held.wait(10)
    with pytest.raises(Busy), pool.session(sid, OWNER, wait_s=0.05):
        pass
    release.set()
    holder.join(10)
    with pool.session(sid, OWNER, wait_s=10):  # free: taken at once
        pass

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another process holds the session's record lock until it is killed
        try:
            with pool.session(sid, OWNER):
                os.write(w, b"x")
                time.sleep(60)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        with pytest.raises(Busy), pool.session(sid, OWNER, wait_s=0.05):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with pool.session(sid, OWNER, wait_s=10):  # the kernel released the dead holder's lock
        pass
