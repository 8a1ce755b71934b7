"""One worker's admission: its gate (the requests it holds, their bytes), its compute slots, and
its place in the server's census. See the package's docstring for the policy."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.config import Settings
from service.cost import Work, threads_for

from . import census
from .charge import PARSE_FACTOR

Predict = Callable[[Work, float, int], float]  # (work, requests busy, threads) -> predicted ms (the cost model's median)
Count = Callable[[str, float], None]  # (what, change): "queued", "running", "bytes", "splits"


def _uncounted(what: str, change: float) -> None:
    pass


class Refused(Exception):
    """A request admission will not take: code "overloaded" (come back later: retry_after, whole
    seconds) or "deadline" (its deadline cannot be met, or passed), and a message for the client."""

    def __init__(self, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after = code, message, retry_after


@dataclass(frozen=True)
class Deadline:
    """X-Deadline-Ms: ms, from the request's first byte, which is at on admission's clock; at is
    when it passes."""

    ms: float
    at: float


class Admission:
    """One worker's gate and compute slots, in the server's census (table: census.shared() in a
    gunicorn worker; None, or a table with no free row, and it counts alone)."""

    def __init__(
        self,
        settings: Settings,
        predict: Predict,
        *,
        clock: Callable[[], float] = time.perf_counter,
        count: Count = _uncounted,
        table: census.Table | None = None,
    ):
        self.max_inflight, self.max_queue = settings.max_inflight, settings.max_queue
        self.max_bytes, self.max_wait_ms = settings.max_inflight_bytes, settings.max_queue_wait_ms
        self.split_threads = settings.split_threads
        self.predict, self.clock, self.count = predict, clock, count
        self._lock = threading.RLock()  # reentrant: a refusal made under it reads the wait ahead (wait_ms)
        self._slots = threading.Semaphore(self.max_inflight)
        self.waiting = 0  # validated jobs waiting for a compute slot
        self.admitted = 0  # this worker's requests past the gate, until their response has been built
        self.bytes = 0  # their body and parse (then working) bytes, until their answer is sent
        self._jobs: set[Ticket] = set()  # validated jobs, waiting or computing: the work ahead of a new one
        row = table.join(self.max_inflight + self.max_queue) if table is not None else None
        if table is None or row is None:
            table = census.Table(rows=1, shared=False)
            row = table.join(self.max_inflight + self.max_queue)
        assert row is not None  # a new private table has its one row free
        self.table: census.Table = table
        self.row: int = row

    # --- the one entry -------------------------------------------------------------------------

    def enter(self, nbytes: int, charge: int | Callable[[], int] = 0, deadline: Deadline | None = None) -> Ticket:
        """Take one more request of nbytes of body whose parse the front door charges at charge
        bytes, before the body is parsed: its ticket, or Refused. 504 if its deadline has passed
        already; 503 if the predicted wait for a compute slot would make it miss it, if its bytes
        would take this worker past max_inflight_bytes (a lone request always fits), or if the
        server already holds its cap of requests.

        charge may be a function that counts it (charge.parse_charge, a pass over the body): it is
        called only where the body's upper bound, PARSE_FACTOR x nbytes, would not fit, and the
        bound is charged where it does. Counting costs more than the rest of admission for a small
        body, and buys nothing while the bound fits."""
        if deadline is not None:
            left_ms = (deadline.at - self.clock()) * 1000
            if left_ms <= 0:
                raise _deadline(f"X-Deadline-Ms={deadline.ms:g} passed while the request was received")
            wait = self.wait_ms()
            if wait > left_ms:
                raise self._overloaded(
                    f"the predicted wait for a compute slot ({wait:.3g} ms) would make this request miss X-Deadline-Ms={deadline.ms:g}",
                    wait,
                )
        most = PARSE_FACTOR * nbytes  # the most parsing the body can take
        count = None if isinstance(charge, int) else charge
        parse = charge if isinstance(charge, int) else most if self.bytes + nbytes + most <= self.max_bytes else charge()
        with self._lock:
            if count is not None and parse == most and self.bytes + nbytes + parse > self.max_bytes:
                parse = count()  # another request took the room since: counted after all
            if self.bytes and self.bytes + nbytes + parse > self.max_bytes:
                raise self._overloaded(
                    f"a body of {nbytes} bytes and its parse ({parse} bytes) would take this worker past {self.max_bytes} bytes in flight (ATTN_MAX_INFLIGHT_BYTES)"
                )
            admitted, held, bound = self.table.admit(self.row)
            if not admitted:
                raise self._overloaded(
                    f"the server already holds {held} compute requests, its bound: (ATTN_MAX_INFLIGHT={self.max_inflight} + ATTN_MAX_QUEUE={self.max_queue}) x {bound // (self.max_inflight + self.max_queue)} workers"
                )
            self.admitted += 1
            self._add_bytes(nbytes + parse)
        return Ticket(self, nbytes + parse, parse, deadline)

    # --- what it knows -------------------------------------------------------------------------

    def wait_ms(self) -> float:
        """The predicted wait for one of this worker's compute slots of a job validated now: the
        predicted compute ahead of it (what remains of the computing jobs', the whole of those
        waiting: first come, first served) over the slots, once every slot is taken; 0 while one
        is free."""
        now = self.clock()
        with self._lock:
            jobs = list(self._jobs)
        if len(jobs) < self.max_inflight:
            return 0.0
        ahead = sum(t.predicted_ms if t.started is None else max(t.predicted_ms - (now - t.started) * 1000, 0.0) for t in jobs)
        return ahead / self.max_inflight

    def server_slots(self) -> int:
        """Compute requests the server holds at most: (max_inflight + max_queue) for each worker
        that shares this census (this one alone without a shared table)."""
        return self.table.total(census.CAPACITY)

    def computing(self) -> int:
        """Requests computing now in every worker of the census."""
        return self.table.total(census.COMPUTING)

    def server_admitted(self) -> int:
        """Requests admitted now in every worker of the census: computing, waiting for a slot, or
        still being read and validated (about to compute). What the split policy reads: two
        requests on two workers see each other, so neither splits."""
        return self.table.total(census.ADMITTED)

    def busy(self) -> int:
        """Requests computing at once in the server, or about to: each worker's admitted requests
        up to its compute slots (every worker has this one's max_inflight). The count the cost
        model's slowdown is learned and predicted by. A lock-free snapshot."""
        return sum(min(n, self.max_inflight) for n in self.table.cells[census.ADMITTED :: census.FIELDS].tolist())

    def policy(self) -> dict:
        """The policy in force, for /limits."""
        return {
            "admit_by": "predicted time until the answer starts: compute (the cost model's median) after the predicted wait, within X-Deadline-Ms, or a wait within max_queue_wait_ms",
            "max_queue_wait_ms": self.max_wait_ms,
            "compute_slots_per_worker": self.max_inflight,
            "server_request_cap": self.server_slots(),
            "max_inflight_bytes": self.max_bytes,
            "predicted_wait_ms": round(self.wait_ms(), 3),
        }

    def retire(self) -> None:
        """This worker drains (SIGTERM): its siblings send it no more clients (census.retire)."""
        self.table.retire(self.row)

    # --- inside --------------------------------------------------------------------------------

    def _add_bytes(self, n: int) -> None:
        self.bytes += n
        self.count("bytes", n)

    def _overloaded(self, why: str, wait_ms: float | None = None) -> Refused:
        """503 overloaded, with Retry-After: the predicted drain time (the wait ahead, whole seconds)."""
        retry = max(1, math.ceil((self.wait_ms() if wait_ms is None else wait_ms) / 1000))
        return Refused("overloaded", f"The server is at capacity: {why}. Retry after {retry} s.", retry)


def _deadline(why: str) -> Refused:
    return Refused("deadline", f"Refused before computing: {why}; allow more time or send a smaller request.")


class Ticket:
    """One admitted request's hold: admit() its job's work (or Refused), then the facts the compute
    needs (threads, stop, predicted_ms, busy, waited_ms); end_compute() gives back its slot and its
    place in the server's cap once its answer is built, release() the rest (its bytes) once the
    answer is sent; each once, in any order."""

    def __init__(self, gate: Admission, nbytes: int, parse_bytes: int, deadline: Deadline | None):
        self.gate, self.deadline = gate, deadline
        self.bytes, self.parse_bytes = nbytes, parse_bytes  # parse_bytes: part of bytes, charged for the parse until admit()
        self.work: Work | None = None
        self.predicted_ms = 0.0  # the cost model's prediction of its compute, at the load it joined
        self.busy = 1  # requests busy in the server when it was admitted: its slowdown's count
        self.threads = 1  # the threads it computes on (the split policy, as it takes its slot)
        self.waited_ms = 0.0  # how long it waited for its slot (0: one was free)
        self.started: float | None = None  # clock() when it got its compute slot
        self.running = False  # holds a compute slot
        self.holding = True  # counted in the gate's admitted requests

    def admit(self, work: Work, working_bytes: int) -> None:
        """Admit the validated job's work, then wait for a compute slot, or Refused: 504 if it
        cannot meet its deadline even without waiting (what has passed plus its predicted compute);
        503 if its predicted wait would make it miss it, or without one if that exceeds
        max_queue_wait_ms (Retry-After: the wait ahead), or if its working bytes do not fit beside
        the others'; then it waits at most until what is left of its deadline no longer holds its
        predicted compute (504), or max_queue_wait_ms (503)."""
        gate, deadline = self.gate, self.deadline
        self.work, self.busy = work, max(1, gate.busy())
        # Alone on the server, a large job is split on several threads: predicted at what splits take.
        planned = threads_for(work, gate.server_admitted(), gate.split_threads)
        predicted = self.predicted_ms = gate.predict(work, self.busy, planned)
        now = gate.clock()
        if deadline is not None and now + predicted / 1000 > deadline.at:
            spent = deadline.ms - (deadline.at - now) * 1000
            raise _deadline(
                f"{spent:.3g} ms spent receiving and validating, then the predicted {predicted:.3g} ms of compute exceed X-Deadline-Ms={deadline.ms:g}"
            )
        wait = gate.wait_ms()
        if deadline is not None and now + (wait + predicted) / 1000 > deadline.at:
            raise gate._overloaded(
                f"the predicted wait for a compute slot ({wait:.3g} ms) would make this request miss X-Deadline-Ms={deadline.ms:g}", wait
            )
        if deadline is None and wait > gate.max_wait_ms:
            raise gate._overloaded(
                f"the predicted wait for a compute slot ({wait:.3g} ms) exceeds ATTN_MAX_QUEUE_WAIT_MS={gate.max_wait_ms}", wait
            )
        self._reserve(working_bytes)
        if not self._take_slot(predicted):
            if deadline is not None:
                raise _deadline(
                    f"waiting for a compute slot left less than the predicted {predicted:.3g} ms of compute of X-Deadline-Ms={deadline.ms:g}"
                )
            raise gate._overloaded(f"no compute slot came free within ATTN_MAX_QUEUE_WAIT_MS={gate.max_wait_ms}")
        self.threads = threads_for(work, gate.server_admitted(), gate.split_threads)
        if self.threads != planned:  # the server emptied (or filled) while it waited
            self.predicted_ms = gate.predict(work, self.busy, self.threads)
        if self.threads > 1:
            gate.count("splits", 1)

    @property
    def stop(self) -> Callable[[], bool] | None:
        """The core's stop hook: True once the deadline has passed (None without one)."""
        if self.deadline is None:
            return None
        at, clock = self.deadline.at, self.gate.clock
        return lambda: clock() > at

    def stopped(self) -> Refused:
        """504 for a job its deadline stopped between the core's blocks."""
        ms = self.deadline.ms if self.deadline is not None else math.nan
        return Refused("deadline", f"Stopped: X-Deadline-Ms={ms:g} passed while it computed; allow more time or send a smaller request.")

    def charge_body(self, nbytes: int) -> None:
        """The body is nbytes now (a compressed one, as it is inflated): charge what it and its
        parse take beyond what was charged for its Content-Length, or 503 if that does not fit
        beside the others' bytes."""
        gate = self.gate
        with gate._lock:
            grown = nbytes - (self.bytes - self.parse_bytes)
            if grown <= 0:
                return
            change = grown * (1 + PARSE_FACTOR)
            if gate.bytes - self.bytes and gate.bytes + change > gate.max_bytes:
                raise gate._overloaded(
                    f"its body inflates to {nbytes} bytes, which with its parse would take this worker past {gate.max_bytes} bytes in flight (ATTN_MAX_INFLIGHT_BYTES)"
                )
            gate._add_bytes(change)
            self.bytes += change
            self.parse_bytes += grown * PARSE_FACTOR

    def end_compute(self) -> None:
        """The answer is built: the compute slot and the place in the server's cap go back."""
        gate = self.gate
        if self.running:
            self.running = False
            gate.count("running", -1)
            gate.table.add(gate.row, census.COMPUTING, -1)
            gate._slots.release()
        with gate._lock:
            if self.holding:
                self.holding = False
                gate.admitted -= 1
                gate.table.add(gate.row, census.ADMITTED, -1)
                gate._jobs.discard(self)

    def release(self) -> None:
        """The answer is sent (or will never be): everything goes back."""
        self.end_compute()
        gate = self.gate
        with gate._lock:
            gate._add_bytes(-self.bytes)
            self.bytes = 0

    def _reserve(self, working_bytes: int) -> None:
        """The parse charge replaced by the job's working bytes (503 if they do not fit beside the
        others'), and its predicted compute counted in what is ahead of later jobs."""
        gate = self.gate
        with gate._lock:
            change = working_bytes - self.parse_bytes
            if gate.bytes - self.bytes and gate.bytes + change > gate.max_bytes:
                raise gate._overloaded(
                    f"this job needs about {working_bytes} working bytes and this worker holds {gate.bytes - self.parse_bytes} of {gate.max_bytes} (ATTN_MAX_INFLIGHT_BYTES)"
                )
            gate._add_bytes(change)
            self.bytes += change
            self.parse_bytes = 0
            gate._jobs.add(self)

    def _take_slot(self, predicted: float) -> bool:
        """A compute slot: at once if one is free and no job waits for one, else in turn (first
        come, first served), at most until the deadline leaves less than the predicted compute, or
        max_queue_wait_ms without one."""
        gate = self.gate
        with gate._lock:
            got = not gate.waiting and gate._slots.acquire(blocking=False)
            if not got:
                gate.waiting += 1
        if not got:
            start = gate.clock()
            timeout = gate.max_wait_ms / 1000 if self.deadline is None else self.deadline.at - predicted / 1000 - start
            gate.count("queued", 1)
            try:
                got = gate._slots.acquire(timeout=max(timeout, 0.0))
            finally:
                gate.count("queued", -1)
                with gate._lock:
                    gate.waiting -= 1
                self.waited_ms = (gate.clock() - start) * 1000
        if got:
            self.running, self.started = True, gate.clock()
            gate.count("running", 1)
            gate.table.add(gate.row, census.COMPUTING, 1)
        return got
