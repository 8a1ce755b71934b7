"""Each served model's inference statistics, cumulative since the server started and counted over
all of its workers: the numbers behind Triton's statistics extension (GET /v2/models/.../stats).

A table of int64 cells in memory shared by the gunicorn arbiter and its workers, as the admission
census (service/admission/census.py) is: made once in the arbiter (create(), from deploy/gunicorn.conf.py's
on_starting) before any worker forks, one row per worker, each row holding every model's counts
(MODELS slots; the web layer gives each model its slot). A worker writes only its own row, under a
lock of its threads; a reader sums the rows without a lock (each cell is true at some instant of
the read: a request half recorded is seen whole a moment later).

Counts are cumulative: a worker that exits leaves its row's counts in place, and the worker that
takes the row next adds to them (join() never zeroes a row). Without a shared table (the Flask test
client, create_app() in a script) a process counts in a private one-row table.

Nothing here knows HTTP or Triton's JSON: a row records durations in nanoseconds, the web layer
reads totals() and writes the protocol's document."""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

from service import memfd

ROWS = 64  # workers that can share one table; a worker past them counts alone (a private table)
MODELS = 8  # model slots per row
# The cells of one model in a row: the last request's time (ms since the epoch), then counts and
# nanoseconds. queue, input, infer and output are summed over successful requests only, as Triton does.
LAST_MS, SUCCESS, SUCCESS_NS, FAIL, FAIL_NS, QUEUE_NS, INPUT_NS, INFER_NS, OUTPUT_NS = range(9)
CELLS = 9
PID = 0  # each row's first cell: the pid of the worker that owns it (0: never taken)
CELL = 8  # bytes: int64 cells

_shared: Table | None = None  # the server's table, inherited by the workers from the arbiter


@dataclass(frozen=True)
class Totals:
    """One model's statistics summed over every row (durations in nanoseconds)."""

    last_ms: int
    success: int
    success_ns: int
    fail: int
    fail_ns: int
    queue_ns: int
    input_ns: int
    infer_ns: int
    output_ns: int


class Table:
    """Rows of (pid, then CELLS int64 per model slot) in a shared mapping (shared=True) or in this
    process's memory alone."""

    def __init__(self, rows: int = ROWS, models: int = MODELS, shared: bool = True):
        self.rows, self.models = rows, models
        self.width = 1 + models * CELLS  # cells per row
        size = rows * self.width * CELL
        self._fd = memfd.anonymous_file("attention-stats", size) if shared else None
        self._map = mmap.mmap(-1 if self._fd is None else self._fd, size)  # MAP_SHARED: the workers see our bytes
        self.cells = memoryview(self._map).cast("q")
        self._lock = memfd.Lock(self._fd)  # the processes' and their threads'
        self._row_lock = threading.Lock()  # this process's writes to its own row

    def join(self) -> int | None:
        """This process takes a row: its own, else one never taken, else one whose process is gone
        (its counts kept: they are the server's since start). The row's index, or None if every
        row belongs to a live process."""
        pid, cells, width = os.getpid(), self.cells, self.width
        with self._lock:
            owners = [cells[row * width + PID] for row in range(self.rows)]
            if pid in owners:
                return owners.index(pid)
            free = [row for row, owner in enumerate(owners) if owner == 0 or (self._fd is not None and not memfd.alive(owner))]
            if not free:
                return None
            cells[free[0] * width + PID] = pid
            return free[0]

    def record(
        self,
        row: int,
        model: int,
        *,
        ok: bool,
        when_ms: int,
        total_ns: int,
        queue_ns: int = 0,
        input_ns: int = 0,
        infer_ns: int = 0,
        output_ns: int = 0,
    ) -> None:
        """One request to model, answered at when_ms (ms since the epoch), total_ns from its first
        byte; a success also adds its phases."""
        base = row * self.width + 1 + model * CELLS
        cells = self.cells
        with self._row_lock:
            cells[base + LAST_MS] = max(cells[base + LAST_MS], when_ms)
            if not ok:
                cells[base + FAIL] += 1
                cells[base + FAIL_NS] += total_ns
                return
            cells[base + SUCCESS] += 1
            cells[base + SUCCESS_NS] += total_ns
            cells[base + QUEUE_NS] += queue_ns
            cells[base + INPUT_NS] += input_ns
            cells[base + INFER_NS] += infer_ns
            cells[base + OUTPUT_NS] += output_ns

    def totals(self, model: int) -> Totals:
        """model's statistics over every row (a snapshot without the lock)."""
        start = 1 + model * CELLS
        per_cell = [self.cells[start + cell :: self.width].tolist() for cell in range(CELLS)]
        return Totals(max(per_cell[LAST_MS]), *(sum(values) for values in per_cell[1:]))


@dataclass(frozen=True)
class Row:
    """A worker's row of a table: where it records, and the table it reads totals from."""

    table: Table
    row: int


def join(table: Table | None) -> Row:
    """This process's row of table (the server's), or of a private one-row table when there is no
    shared table or every row of it belongs to a live worker."""
    row = table.join() if table is not None else None
    if table is None or row is None:
        table = Table(rows=1, shared=False)
        row = table.join()
        assert row is not None  # a fresh table's first row
    return Row(table, row)


def create(rows: int = ROWS, models: int = MODELS) -> Table:
    """The server's table, made in the arbiter before the workers fork (they inherit it)."""
    global _shared
    _shared = Table(rows, models, shared=True)
    return _shared


def shared() -> Table | None:
    """The server's table, if this process was forked from an arbiter that made one."""
    return _shared
