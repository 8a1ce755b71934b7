"""How many compute requests the whole server holds: a table in memory shared by the gunicorn
arbiter and its workers, one row per worker, so that admission bounds the server, not one worker.

A row is (pid, capacity, admitted, computing, draining): the worker's pid, the requests it brings
to the server's bound (its ATTN_MAX_INFLIGHT + ATTN_MAX_QUEUE), the requests it has admitted, those
of them computing now, and 1 once it drains (SIGTERM). A free row is all zeros, so sums over every
row are sums over live workers.

- Made once in the arbiter (create(), from deploy/gunicorn.conf.py's on_starting), before any
  worker forks: a memfd (an anonymous file; a temporary file where there is none) mapped shared,
  so every worker sees the same bytes, whatever starts the service (make run, the container,
  Kubernetes, the tests' `python -m service`).
- A worker takes a row when its app is created (join()), and writes only its own row.
- The only decision that reads other rows and must be exact, admitting one more request while
  the server's total is under its bound (admit()), holds a POSIX record lock (fcntl) on the file:
  the kernel releases it if its holder dies, so a worker killed at any moment cannot wedge the
  others. Giving back and computing counts (add()) are stores to the worker's own row, under a
  lock of its threads only: a reader sees the count before or after, both true at some instant.
- Connection placement (service/transport/worker.py, through service.web.front) reads
  busiest_margin(), a snapshot without lock.
- A dead worker's counts do not leak: the arbiter zeroes its row (forget(), from child_exit), and
  a worker that joins zeroes any row whose process is gone (should the hook not have run).

Without a shared table (the Flask test client, create_app() in a script) a worker counts alone in a
private one-row table: the bound is then its own."""

from __future__ import annotations

import mmap
import os
import threading

from service import memfd

ROWS = 16  # workers that can share one table; one past it counts alone (a private table)
PID, CAPACITY, ADMITTED, COMPUTING, DRAINING = range(5)
FIELDS = 5
CELL = 8  # bytes: int64 cells

_shared: Table | None = None  # the server's table, inherited by the workers from the arbiter


class Table:
    """Rows of int64 (pid, capacity, admitted, computing, draining) in a shared mapping (shared=True)
    or in this process's memory alone."""

    def __init__(self, rows: int = ROWS, shared: bool = True):
        self.rows = rows
        size = rows * FIELDS * CELL
        self._fd = memfd.anonymous_file("attention-census", size) if shared else None
        self._map = mmap.mmap(-1 if self._fd is None else self._fd, size)  # MAP_SHARED: the workers see our bytes
        self.cells = memoryview(self._map).cast("q")
        self._lock = memfd.Lock(self._fd)  # the processes' and their threads'
        self._row_lock = threading.Lock()  # this process's writes to its own row (never held across the record lock's wait)

    @property
    def shared(self) -> bool:
        return self._fd is not None

    def join(self, capacity: int) -> int | None:
        """This process takes a row bringing capacity to the server's bound; its index, or None if
        every row is taken (by live workers). Rows of processes that are gone are freed first."""
        pid, cells = os.getpid(), self.cells
        with self._lock:
            if self.shared:
                for row in range(self.rows):
                    owner = cells[row * FIELDS + PID]
                    if owner and owner != pid and not memfd.alive(owner):
                        self._zero(row)
            owners = cells[PID::FIELDS].tolist()
            if pid not in owners and 0 not in owners:
                return None
            row = owners.index(pid) if pid in owners else owners.index(0)
            self._zero(row)
            cells[row * FIELDS + CAPACITY] = capacity
            cells[row * FIELDS + PID] = pid
            return row

    def forget(self, pid: int) -> None:
        """The process pid is gone (the arbiter's child_exit): its row and its counts are freed."""
        with self._lock:
            for row in range(self.rows):
                if self.cells[row * FIELDS + PID] == pid:
                    self._zero(row)

    def _zero(self, row: int) -> None:
        base = row * FIELDS
        for field in (CAPACITY, ADMITTED, COMPUTING, DRAINING, PID):  # pid last: a reader never sees a live row with stale counts
            self.cells[base + field] = 0

    def admit(self, row: int) -> tuple[bool, int, int]:
        """One more request admitted by row's worker if the server holds fewer than its bound:
        (admitted, requests held by the server before this one, the server's bound)."""
        cells = self.cells
        with self._lock:
            held, bound = sum(cells[ADMITTED::FIELDS]), sum(cells[CAPACITY::FIELDS])
            if held >= bound:
                return False, held, bound
            with self._row_lock:
                cells[row * FIELDS + ADMITTED] += 1
            return True, held, bound

    def add(self, row: int, field: int, n: int) -> None:
        """Change one of row's own counts (ADMITTED down, COMPUTING up or down). Only row's worker
        writes its row, under its threads' lock: no record lock needed (nor a wait behind one)."""
        with self._row_lock:
            self.cells[row * FIELDS + field] += n

    def retire(self, row: int) -> None:
        """Row's worker is draining (SIGTERM): it accepts no new connection, so busiest_margin()
        no longer sends clients its way. Its slots still count until it exits: it still answers
        what arrives on the connections it has."""
        with self._row_lock:
            self.cells[row * FIELDS + DRAINING] = 1

    def total(self, field: int) -> int:
        """field summed over every row (a snapshot without the lock: each row's count is true at
        some instant of the read)."""
        return sum(self.cells[field::FIELDS])

    def busiest_margin(self, row: int) -> int:
        """How many more requests row's worker holds than the least busy other worker (0 if it is
        alone). A snapshot without the lock."""
        pids, draining = self.cells[PID::FIELDS].tolist(), self.cells[DRAINING::FIELDS].tolist()
        admitted = self.cells[ADMITTED::FIELDS].tolist()
        others = [n for i, (pid, gone, n) in enumerate(zip(pids, draining, admitted, strict=True)) if pid and not gone and i != row]
        return admitted[row] - min(others) if others else 0


def create(rows: int = ROWS) -> Table:
    """The server's table, made in the arbiter before the workers fork (they inherit it)."""
    global _shared
    _shared = Table(rows, shared=True)
    return _shared


def shared() -> Table | None:
    """The server's table, if this process was forked from an arbiter that made one."""
    return _shared
