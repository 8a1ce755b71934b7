"""Admission control for the compute endpoints: deadlines and overload (API keys: auth.py).

Before the body is parsed (a before_request hook, so a refusal costs no parsing):
  422 bad_option    when X-Deadline-Ms is not a positive number of milliseconds;
  504 deadline      when even receiving and parsing its Content-Length would outlast the deadline;
  503 overloaded    when that and the predicted wait for a compute slot (Gate.wait_ms()) would;
  503 overloaded    when the server as a whole already holds its safety cap of compute requests,
                    (max_inflight + max_queue) x the workers running, or the request's body, with
                    what parsing it can take (parse_charge(): by its encoding), would take this
                    worker's bytes past max_inflight_bytes.

After validation, before compute (admit(job), called by the routes), by predicted time: the
job's own (the cost model's compute at the load it joins, and the encoding and sending of its
answer beside the answers the server is sending: Gate.respond_ms(), sending.py) and its wait (the
predicted compute ahead of its place in the queue, over the worker's max_inflight compute slots:
Gate.wait_ms()):
  504 deadline      when X-Deadline-Ms cannot be met even without waiting (the time already spent
                    reading and validating, plus its own predicted time, exceeds it);
  503 overloaded    when its wait would make it miss X-Deadline-Ms, or without one when its
                    predicted wait exceeds max_queue_wait_ms (Retry-After: the predicted drain
                    time, the wait ahead, in whole seconds); when taking its place in the queue
                    would make a job waiting behind it miss its deadline or wait bound
                    (Gate.made_late()); or when the job's estimated working memory would pass
                    max_inflight_bytes (the parse charge is then given back: the job's working
                    bytes count what remains);
then the job waits for a compute slot (slots.py), at most until what is left of its deadline no
longer holds its own predicted time (504), or max_queue_wait_ms without one (503). A deadline
that passes while it computes stops it between the core's blocks (504, its slot and CPU freed at
once). Once computed, its answer joins the pipe of answers sending (start_sending()) only if it
will be written by its deadline beside them (else 504) and makes none of them late (else 503): no
200 leaves after X-Deadline-Ms, as far as the pipe's prediction (at the respond rate's 98th
percentile, CostModel.respond_bound()) can tell.

The queue's order is ATTN_QUEUE_ORDER: edf (the default), earliest deadline first, jobs without a
deadline after those with (by arrival among equals), or fifo, by arrival. Under either, a job is
admitted on the wait predicted from the work ahead of its place, and a newcomer takes a place
ahead of waiting jobs (edf) only if each of them still gets its slot in time: the prediction a
job was admitted on stays true. With equal deadlines, or none, the two orders are the same; with
a mix, edf meets more of the tight ones at no cost to the others (bench/README.md, "What many
clients see").

The slot, and the request's place in max_inflight + max_queue, are given back as soon as the
response is built (computed, and encoded but for the parts that stream): a client slow to read
its answer holds no compute. The request's bytes stay charged against max_inflight_bytes until the
response has been sent or the connection dropped, since the answer is in memory until then. Every
503 carries Retry-After.

What is counted where. The request cap is the server's: the workers share a census of their
admitted and computing requests (census.py, made by the gunicorn arbiter before they fork), so a
client is refused by count only when the server holds (max_inflight + max_queue) x workers
requests, however its keep-alive connections landed. One worker may then hold more than its own
share waiting; gunicorn's threads are sized to hold them all (deploy/gunicorn.conf.py). Compute
slots (max_inflight), the predicted wait and bytes (max_inflight_bytes) stay per worker: a worker
computes on its own threads, and the bytes bound keeps one process's memory bounded, whatever its
siblings hold. Without the shared census (the Flask test client) a gate counts alone: the cap is
then its own max_inflight + max_queue. server_computing() tells how many requests compute now in
the whole server (for splitting one request over idle cores).
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from collections.abc import Callable

import numpy as np
from flask import Flask, Response, has_app_context, request

from schemas import RequestError
from schemas.jobs import AttentionJob, MhaJob, SessionBatchJob, SessionStepJob
from service.config import Settings
from service.cost import CostModel, answer_bytes, work_of
from service.transport import BODY_KEY, SENT_KEY, STARTED_KEY

from . import census, metrics, parallel, sending
from .context import context, services
from .errors import ApiError
from .http import phase
from .slots import Slots

COMPUTE_PATH = re.compile(r"/(attention|mha)|/v2/models/[^/]+(/versions/[^/]+)?/infer|/sessions(/[^/]+)?/attention")
DRAIN_S = 5.0  # longest spent reading and discarding the body of a refused request
# Peak bytes of parsing a body (wire.loads, the depth check and the schema's load, up to the job's
# existence), beyond the body itself, as counted from the body: the gate charges them before the
# body is parsed, so that the peak one request can cause is in ATTN_MAX_INFLIGHT_BYTES before it
# happens; after validation the job's working bytes replace it (reserve()). Only the lone request
# of a worker may exceed the bound. What a JSON parse makes is counted by the characters that start
# its values and objects (parse_charge(), a comparison per character over the body): each value (after a '[', ',' or ':') costs the
# parser's tape entry, its Python object and a pointer to it, at most VALUE_BYTES; each object
# ('{') a dict, at most OBJECT_BYTES; and every byte STRING_FACTOR, for the parser's string buffer
# and the strings it makes (or the arrays b64 text decodes into). A b64 body, long strings and a few
# values, is then charged about three times its size; nested numbers by their count; the hostile
# bodies of `python -m bench.garbage --sizes 32 --rss` (objects of empty b64, rows of one) within
# each bound (bench/README.md). Never more than PARSE_FACTOR x the body, the worst measured: the
# charge is an upper bound, and /v2's binary tensors (after Inference-Header-Content-Length's JSON)
# are charged their own size, the arrays they become.
STRING_FACTOR = 2
VALUE_BYTES = 80
OBJECT_BYTES = 320
PARSE_FACTOR = 33
SCAN_CHUNK = 4 * 2**20  # the body is counted in slices of this: the comparisons' scratch stays this small


class Gate:
    """One worker's admission state: its admitted requests (counted in the server's census too),
    their bytes, and its compute slots."""

    def __init__(self, max_inflight: int, max_queue: int, max_bytes: int, table: census.Table | None = None, order: str = "edf"):
        """table: the server's shared census (census.shared() in a gunicorn worker); None, or a
        table with no free row, and this gate counts alone (its own bound). order: the queue's,
        "fifo" or "edf" (ATTN_QUEUE_ORDER)."""
        self.max_inflight, self.max_queue, self.max_bytes, self.order = max_inflight, max_queue, max_bytes, order
        self._lock = threading.RLock()  # reentrant: a refusal made under it reads the wait ahead (wait_ms)
        self._slots = Slots(max_inflight)
        self._arrivals = itertools.count()  # the order jobs were validated in
        self.admitted = 0  # this worker's requests past the gate, until their response has been built
        self.bytes = 0  # their Content-Length plus estimated working bytes, until sent
        self.pipe = sending.Pipe()  # computed answers being encoded and sent (they share the worker's CPU and the clients' reading)
        self._jobs: set[Ticket] = set()  # validated jobs, waiting or computing: the work ahead of a new one
        row = table.join(max_inflight + max_queue) if table is not None else None
        if table is None or row is None:
            table = census.Table(rows=1, shared=False)
            row = table.join(max_inflight + max_queue)
        assert row is not None  # a new private table has its one row free
        self.table: census.Table = table
        self.row: int = row

    def server_slots(self) -> int:
        """Compute requests the server admits at once: ATTN_MAX_INFLIGHT + ATTN_MAX_QUEUE for each
        worker that shares this gate's table (this one alone without a shared table)."""
        return self.table.total(census.CAPACITY)

    def computing(self) -> int:
        """Requests computing now in every worker that shares this gate's table."""
        return self.table.total(census.COMPUTING)

    def busy(self) -> int:
        """Requests computing at once in the server, or about to: each worker's admitted requests
        (computing, waiting for a slot, or being read and validated) up to its compute slots
        (every worker has this one's ATTN_MAX_INFLIGHT). The count the cost model's slowdown is
        learned and predicted by (a request admitted here is counted). A lock-free snapshot."""
        return sum(min(n, self.max_inflight) for n in self.table.cells[census.ADMITTED :: census.FIELDS].tolist())

    def server_admitted(self) -> int:
        """Requests admitted now in every worker that shares this gate's table: computing, waiting
        for a slot, or still being read and validated (about to compute)."""
        return self.table.total(census.ADMITTED)

    def enter(self, nbytes: int, parse_bytes: int = 0) -> Ticket:
        """Admit one more request of nbytes of body and parse_bytes of parsing it, or 503 now. A
        lone request is always admitted."""
        with self._lock:
            if self.bytes and self.bytes + nbytes + parse_bytes > self.max_bytes:
                raise self._overloaded(
                    f"a body of {nbytes} bytes and its parse ({parse_bytes} bytes) would take this worker past {self.max_bytes} bytes in flight (ATTN_MAX_INFLIGHT_BYTES)"
                )
            admitted, held, bound = self.table.admit(self.row)
            if not admitted:
                raise self._overloaded(
                    f"the server already holds {held} compute requests, its bound: (ATTN_MAX_INFLIGHT={self.max_inflight} + ATTN_MAX_QUEUE={self.max_queue}) x {bound // (self.max_inflight + self.max_queue)} workers"
                )
            self.admitted += 1
            self._add_bytes(nbytes + parse_bytes)
        return Ticket(self, nbytes + parse_bytes, parse_bytes)

    def _add_bytes(self, n: int) -> None:
        self.bytes += n
        metrics.BYTES.inc(n)

    @property
    def waiting(self) -> int:
        """Validated jobs waiting for a compute slot."""
        return self._slots.waiting

    def key(self, deadline_at: float, arrival: float = math.inf) -> tuple[float, ...]:
        """A job's place in the queue (least first): by arrival (fifo), or by deadline_at (a
        perf_counter(), inf without one), then arrival (edf). Without arrival, the place after
        every job validated so far (fifo) or after every one due no later (edf)."""
        return (deadline_at, arrival) if self.order == "edf" else (arrival,)

    def next_key(self, deadline_at: float) -> tuple[float, ...]:
        """The place of a job validated now."""
        return self.key(deadline_at, next(self._arrivals))

    def wait_ms(self, key: tuple[float, ...] | None = None) -> float:
        """The predicted wait for one of this worker's compute slots of a job whose place in the
        queue is key (None: after every job): the predicted compute ahead of it (the computing
        jobs' remainder, the whole of those waiting before it) over the slots, once every slot is
        taken; 0 while one is free for it."""
        now = time.perf_counter()
        with self._lock:
            jobs = [t for t in self._jobs if t.started is not None or key is None or t.key < key]
        if len(jobs) < self.max_inflight:
            return 0.0
        ahead = sum(t.predicted_ms if t.started is None else max(t.predicted_ms - (now - t.started) * 1000, 0.0) for t in jobs)
        return ahead / self.max_inflight

    def made_late(self, key: tuple[float, ...], predicted_ms: float) -> int:
        """How many jobs waiting behind key, each predicted to get its slot in time, would not if
        a job of predicted_ms took that place (edf: a job due sooner goes ahead of those waiting;
        fifo: no job waits behind a new one)."""
        now = time.perf_counter()
        with self._lock:
            behind = [t for t in self._jobs if t.started is None and t.key > key and math.isfinite(t.latest_start)]
            late = 0
            for t in behind:
                start = now + self.wait_ms(t.key) / 1000
                late += start <= t.latest_start < start + predicted_ms / self.max_inflight / 1000
            return late

    def respond_ms(self, nbytes: int, compute_ms: float, wait_ms: float, ms_per_mb: float) -> tuple[float, float]:
        """Predicted ms from the end of a job's compute until its answer of nbytes has been sent:
        (starting once computed, with nothing ahead of it; after the predicted wait_ms, with the
        answers of the jobs ahead of it sending too). The pipe's answers sending now drain
        meanwhile (sending.Pipe.respond_ms)."""
        with self._lock:
            others = self.advance_pipe(ms_per_mb)
            ahead = [t.answer_bytes for t in self._jobs]
            alone = self.pipe.respond_ms(nbytes, compute_ms, [], ms_per_mb, others)
            return alone, self.pipe.respond_ms(nbytes, wait_ms + compute_ms, ahead, ms_per_mb, others)

    def advance_pipe(self, ms_per_mb: float) -> sending.Others:
        """The pipe's model moved to now (under the lock), beside the other workers' answers
        sending as the census has them; those returned."""
        others = sending.Others(self.table.others(self.row, census.SENDING), self.table.others(self.row, census.SENDING_BYTES))
        self.pipe.advance(time.perf_counter(), ms_per_mb, others)
        return others

    def publish_pipe(self) -> None:
        """This worker's answers sending, and their bytes left, into its census row (under the lock)."""
        self.table.put(self.row, census.SENDING, len(self.pipe.sends))
        self.table.put(self.row, census.SENDING_BYTES, self.pipe.left())

    def _overloaded(self, why: str, wait_ms: float | None = None) -> ApiError:
        """503 overloaded, with Retry-After: the predicted drain time (the wait ahead, whole seconds)."""
        wait_s = (self.wait_ms() if wait_ms is None else wait_ms) / 1000
        retry = max(1, math.ceil(wait_s))
        return ApiError("overloaded", f"The server is at capacity: {why}. Retry after {retry} s.", headers={"Retry-After": str(retry)})


class Ticket:
    """One admitted request's hold on its gate: end_compute() gives back its slot and its place
    in the queue bound, release() the rest (its bytes); each once."""

    def __init__(self, gate: Gate, nbytes: int, parse_bytes: int = 0):
        self.gate, self.bytes, self.predicted_ms = gate, nbytes, 0.0
        self.answer_bytes = 0  # its answer's predicted bytes, sent once computed (the pipe ahead of later jobs)
        self.key: tuple[float, ...] = (math.inf,)  # its place in the queue (Gate.key)
        self.latest_start = math.inf  # perf_counter() past which a slot would come too late for it
        self.parse_bytes = parse_bytes  # part of bytes, charged for the parse until reserve()
        self.started: float | None = None  # perf_counter() when it got its compute slot
        self.running = False
        self.computing = True  # counted in gate.admitted

    def reserve(
        self, nbytes: int, predicted_ms: float, answer_bytes: int = 0, key: tuple[float, ...] | None = None, latest_start: float = math.inf
    ) -> None:
        """Replace the parse charge by the job's working bytes (503 if they do not fit beside the
        others) and count its predicted compute, and its answer's bytes, in what is ahead of the
        jobs behind it in the queue (key: its place, the next by default; latest_start: when a slot
        would come too late for it)."""
        gate = self.gate
        with gate._lock:
            others = gate.bytes - self.bytes
            change = nbytes - self.parse_bytes
            if others and gate.bytes + change > gate.max_bytes:
                raise gate._overloaded(
                    f"this job needs about {nbytes} working bytes and this worker holds {gate.bytes - self.parse_bytes} of {gate.max_bytes} (ATTN_MAX_INFLIGHT_BYTES)"
                )
            gate._add_bytes(change)
            self.bytes += change
            self.parse_bytes = 0
            self.predicted_ms, self.answer_bytes = predicted_ms, answer_bytes
            self.key, self.latest_start = key if key is not None else gate.next_key(math.inf), latest_start
            gate._jobs.add(self)

    def charge_body(self, nbytes: int) -> None:
        """The body is nbytes now (a compressed one, as it is inflated: http.read_body): charge
        what it and its parse take beyond what was charged for its Content-Length, or 503 if that
        does not fit beside the others' bytes."""
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

    def take_slot(self) -> bool:
        """A compute slot if one is free now and no job waits for one."""
        return self._got(self.gate._slots.try_take())

    def wait_for_slot(self, timeout_s: float) -> bool:
        """Wait in the queue for a compute slot, at most timeout_s, in the queue's order (slots.py)."""
        metrics.QUEUED.inc()
        try:
            got = self.gate._slots.take(self.key, timeout_s)
        finally:
            metrics.QUEUED.dec()
        return self._got(got)

    def _got(self, got: bool) -> bool:
        if got:
            self.running = True
            self.started = time.perf_counter()
            metrics.RUNNING.inc()
            self.gate.table.add(self.gate.row, census.COMPUTING, 1)
        return got

    def end_compute(self) -> None:
        """The response is built: the compute slot and the place in the request bound go back."""
        gate = self.gate
        if self.running:
            self.running = False
            metrics.RUNNING.dec()
            gate.table.add(gate.row, census.COMPUTING, -1)
            gate._slots.give()
        with gate._lock:
            if self.computing:
                self.computing = False
                gate.admitted -= 1
                gate.table.add(gate.row, census.ADMITTED, -1)
                gate._jobs.discard(self)

    def release(self) -> None:
        """The response is sent (or will never be): everything goes back."""
        self.end_compute()
        gate = self.gate
        with gate._lock:
            gate._add_bytes(-self.bytes)
            self.bytes = 0


def admit(job: AttentionJob | MhaJob | SessionStepJob | SessionBatchJob) -> None:
    """Between validation and compute: refuse a job that cannot meet its deadline (504), or that
    would wait past it or past max_queue_wait_ms, or does not fit in memory beside the others (503),
    then wait for a compute slot. The job's own predicted time is the cost model's compute for the
    load it is admitted into (the requests busy in the server, Gate.busy()) and the threads it is to
    compute on, plus the encoding and sending of its answer (respond_ms); the request's context
    keeps the job, its work, that count (the compute teaches the model by it), the prediction (for
    the compute metrics and the response's cost) and, under a deadline, when to stop (stop_at)."""
    ctx = context()
    ctx.job = job  # its shape, for the access log and the trace
    work = ctx.work = work_of(job)
    ctx.busy = server_busy()  # the load it is admitted into: its slowdown is predicted, then learned, by this count
    # Alone on the server, a large job is split on several threads (parallel.py): it is predicted
    # at what splits have taken, not at one thread's time (which would refuse deadlines it meets).
    threads = parallel.planned(work, parallel.computing())  # the count the split itself is decided by
    held = services()
    predicted = ctx.predicted_ms = held.cost.predict(work, ctx.busy, threads)
    ctx.answer_bytes = answer_bytes(job)
    deadline, ticket = ctx.deadline_ms, ctx.admission
    bound_ms = held.settings.max_queue_wait_ms
    gate = held.gate
    key = gate.next_key(math.inf if deadline is None else ctx.arrived + deadline / 1000)
    wait = gate.wait_ms(key) if ticket is not None else 0.0
    # The answers the server sends share its cores (encoding) and the clients' reading (sending.py):
    # this one's send is predicted beside those sending now, drained by the time it is computed,
    # and (after a wait) beside the answers of the jobs ahead of it.
    alone, respond = gate.respond_ms(ctx.answer_bytes, predicted, wait, held.cost.respond_bound())
    if deadline is not None:
        ctx.stop_at = ctx.arrived + (deadline - respond) / 1000  # past it, the answer could no longer be sent in time
        spent = elapsed_ms()
        if spent + predicted + alone > deadline:
            raise _deadline(
                f"{spent:.3g} ms spent reading and validating, then the predicted {predicted:.3g} ms of compute and {alone:.3g} ms of "
                f"sending the answer exceed X-Deadline-Ms={deadline:g}"
            )
    if ticket is None:
        return
    if deadline is not None and elapsed_ms() + wait + predicted + respond > deadline:
        raise ticket.gate._overloaded(
            f"the predicted wait for a compute slot ({wait:.3g} ms) would make this request miss X-Deadline-Ms={deadline:g}", wait
        )
    if wait > bound_ms:
        raise ticket.gate._overloaded(
            f"the predicted wait for a compute slot ({wait:.3g} ms) exceeds ATTN_MAX_QUEUE_WAIT_MS={bound_ms}", wait
        )
    # The latest its slot may come: what its deadline leaves for its compute, or its wait bound.
    latest = time.perf_counter() + bound_ms / 1000 if ctx.stop_at is None else ctx.stop_at - predicted / 1000
    if late := gate.made_late(key, predicted):
        raise gate._overloaded(
            f"queued ahead of the requests due after it (ATTN_QUEUE_ORDER=edf), it would make {late} of them miss their "
            "deadline or wait bound",
            wait,
        )
    ticket.reserve(job.working_bytes(), predicted, ctx.answer_bytes, key, latest)
    if ticket.take_slot():
        return
    with phase("queue"):  # only a request that waited has a queue phase
        if ctx.stop_at is None:
            timeout = bound_ms / 1000
        else:
            timeout = ctx.stop_at - predicted / 1000 - time.perf_counter()
        if not ticket.wait_for_slot(timeout):
            if deadline is not None:
                raise _deadline(
                    f"waiting for a compute slot left less than the predicted {predicted:.3g} ms of compute of X-Deadline-Ms={deadline:g}"
                )
            raise ticket.gate._overloaded(f"no compute slot came free within ATTN_MAX_QUEUE_WAIT_MS={bound_ms}")


def start_sending() -> None:
    """This request's answer is computed and about to be encoded and sent: in the worker's pipe of
    answers sending (Gate.pipe) until it has been written or dropped. Under X-Deadline-Ms, 504 if
    beside the answers sending now it would be written after the deadline, and 503 if it would make
    one of them, on time without it, miss its own: an answer being sent is not made late by a
    later one (as in the compute queue, Gate.made_late())."""
    ctx, held = context(), services()
    gate, ms_per_mb, deadline = held.gate, held.cost.respond_bound(), ctx.deadline_ms
    send = sending.Send(ctx.answer_bytes, math.inf if deadline is None else ctx.arrived + deadline / 1000)
    with gate._lock:
        others = gate.advance_pipe(ms_per_mb)
        now = time.perf_counter()
        if deadline is not None:
            before, after = gate.pipe.finishes(ms_per_mb, others=others), gate.pipe.finishes(ms_per_mb, send, others)
            if now + after[-1] / 1000 > send.deadline:
                raise RequestError(
                    "deadline",
                    f"Computed, but its answer ({send.nbytes / 1e6:.3g} MB) could not be sent by X-Deadline-Ms={deadline:g} beside the "
                    f"{len(before) + others.count} answers the server is sending; allow more time or send a smaller request.",
                )
            mine = gate.pipe.sends
            hurt = sum(1 for other, b, a in zip(mine, before, after, strict=False) if now + b / 1000 <= other.deadline < now + a / 1000)
            if hurt:
                raise gate._overloaded(
                    f"sending this answer ({send.nbytes / 1e6:.3g} MB) now would make {hurt} of the {len(mine)} answers this worker "
                    f"is sending miss their X-Deadline-Ms",
                    max(before),
                )
        gate.pipe.sends.append(send)
        gate.publish_pipe()
    ctx.send = send


def _end_sending(gate: Gate, cost: CostModel, send: sending.Send, learn: bool) -> None:
    """send's last byte has been written (or the connection dropped): out of the pipe; learn: its
    share of the pipe teaches the cost model the pipe's rate."""
    with gate._lock:
        gate.advance_pipe(cost.respond_bound())
        if send in gate.pipe.sends:
            gate.pipe.sends.remove(send)
        gate.publish_pipe()
    if learn:
        cost.observe_respond(send.nbytes, send.share_ms)


def stopper() -> Callable[[], bool] | None:
    """The core's stop hook for this request: True once its deadline leaves no time to send the
    answer (None without a deadline)."""
    stop_at = context().stop_at
    if stop_at is None:
        return None
    clock = time.perf_counter
    return lambda: clock() > stop_at


def late() -> RequestError:
    """504 for a job stopped mid-compute: its deadline passed, or left too little time to send the
    answer (stopper()). A computed answer that cannot be sent in time is start_sending()'s 504."""
    deadline = context().deadline_ms
    return RequestError(
        "deadline",
        f"Stopped: X-Deadline-Ms={deadline:g} passed, or left too little time to send the answer, while it computed; allow more time or send a smaller request.",
    )


def server_computing() -> int:
    """Requests computing right now in the whole server, in every worker (a lock-free snapshot of
    the shared census), the caller's own request included if it holds a compute slot. Without a
    shared table (the Flask test client) this app's own count; outside a request, the count of the
    last app created in this process (0 if none)."""
    gate = services().gate if has_app_context() else _last_gate
    return gate.computing() if gate is not None else 0


def server_busy() -> int:
    """Gate.busy() of this app's gate (at least 1: the caller's own request): the requests
    computing in the server, or about to, that the cost model's slowdown is keyed by."""
    gate = services().gate if has_app_context() else _last_gate
    return max(1, gate.busy() if gate is not None else 0)


_last_gate: Gate | None = None  # for server_computing() and server_busy() outside a request


def elapsed_ms() -> float:
    """Milliseconds since the request's first byte arrived: the clock X-Deadline-Ms runs on."""
    return (time.perf_counter() - context().arrived) * 1000


def _deadline(why: str) -> RequestError:
    return RequestError("deadline", f"Refused before computing: {why}; allow more time or send a smaller request.")


DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")


def _parse_deadline() -> float | None:
    return parse_deadline(request.headers.get("X-Deadline-Ms"))


def parse_deadline(raw: str | None) -> float | None:
    """X-Deadline-Ms's value in milliseconds (None without one), or 422 bad_option. Also read at the
    head by the event-loop worker (front.Front.check_head), before the body is."""
    if raw is None:
        return None
    # A decimal number only: float() also reads "1_000" and other scripts' digits.
    value = float(raw) if DECIMAL.fullmatch(raw.strip()) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise RequestError("bad_option", f"X-Deadline-Ms must be a positive number of milliseconds, not {raw[:40]!r}.", "X-Deadline-Ms")
    return value


def _drain() -> None:
    """Read and discard a refused request's body, so the client sees our answer rather than a
    connection reset while it is still sending (bounded by Content-Length and time)."""
    stream, stop = request.stream, time.monotonic() + DRAIN_S
    while time.monotonic() < stop and stream.read(1 << 20):
        pass


def parse_charge(body, json_bytes: int | None = None) -> int:
    """Peak bytes parsing body (a bytes-like buffer, or an mmap) can take beyond the body itself:
    its first json_bytes (all of it when None) as JSON by what they hold, the rest (/v2's binary
    tensors) their own size. See STRING_FACTOR, VALUE_BYTES, OBJECT_BYTES; at most PARSE_FACTOR x."""
    n = len(body)
    json_bytes = n if json_bytes is None else max(0, min(json_bytes, n))
    values = objects = 0
    text = np.frombuffer(body, np.uint8, count=json_bytes)  # a view: nothing copied
    for start in range(0, json_bytes, SCAN_CHUNK):
        chunk = text[start : start + SCAN_CHUNK]
        objects += int(np.count_nonzero(chunk == ord("{")))
        values += sum(int(np.count_nonzero(chunk == c)) for c in b",:[")
    charge = STRING_FACTOR * json_bytes + VALUE_BYTES * values + OBJECT_BYTES * objects + (n - json_bytes)
    return min(charge, PARSE_FACTOR * n)


def _body_charge(nbytes: int) -> int:
    """What the gate charges for parsing this request's body of nbytes: counted from the body when
    the worker has it in memory (service.transport's event loop read it all before the app saw it),
    else PARSE_FACTOR x nbytes (a body still to be read: it cannot be looked at first)."""
    body = request.environ.get(BODY_KEY)
    if body is None or len(body) != nbytes:
        return nbytes * PARSE_FACTOR
    header = request.headers.get("Inference-Header-Content-Length")
    json_bytes = int(header) if header is not None and header.isdigit() else None
    return parse_charge(body, json_bytes)


def policy(settings: Settings, gate: Gate) -> dict:
    """The admission policy in force, for /limits: what a client can expect when many arrive."""
    return {
        "admit_by": "predicted time until the answer is sent: within X-Deadline-Ms, or a predicted wait within max_queue_wait_ms",
        "queue_order": settings.queue_order,
        "max_queue_wait_ms": settings.max_queue_wait_ms,
        "compute_slots_per_worker": settings.max_inflight,
        "server_request_cap": gate.server_slots(),
        "max_inflight_bytes": settings.max_inflight_bytes,
        "predicted_wait_ms": round(gate.wait_ms(), 3),
        "parse_charge": {
            "per_body_byte": STRING_FACTOR,
            "per_value": VALUE_BYTES,
            "per_object": OBJECT_BYTES,
            "at_most_per_body_byte": PARSE_FACTOR,
            "binary_per_byte": 1,
        },
    }


def make_gate(settings: Settings) -> Gate:
    """A worker's gate, in the server's census when gunicorn's arbiter made one (census.shared())."""
    global _last_gate
    _last_gate = Gate(settings.max_inflight, settings.max_queue, settings.max_inflight_bytes, census.shared(), settings.queue_order)
    return _last_gate


def install(app: Flask) -> None:
    """The gate's hooks: refusals before the body is read, and the ticket given back (its slot
    once the response is built, its bytes once it is sent)."""
    held = services(app)
    settings = held.settings

    @app.before_request
    def _gate():
        if request.method != "POST" or not COMPUTE_PATH.fullmatch(request.path):
            return
        ctx = context()
        started = request.environ.get(STARTED_KEY)
        if started is not None:  # the event loop read the body before the app saw it: the deadline ran meanwhile
            ctx.arrived = ctx.t0 - max(time.monotonic() - started, 0.0)
        try:
            deadline = ctx.deadline_ms = _parse_deadline()
            nbytes = request.content_length
            if deadline is not None:
                floor = held.cost.read_floor_ms(nbytes) if nbytes else 0.0
                if nbytes and floor > deadline - elapsed_ms():
                    raise _deadline(
                        f"receiving and parsing a body of {nbytes} bytes takes at least {floor:.3g} ms, more than X-Deadline-Ms={deadline:g}"
                    )
                # The compute ahead of its place in the queue: a request that would miss its deadline waiting is not parsed.
                wait = held.gate.wait_ms(held.gate.key(ctx.arrived + deadline / 1000))
                if floor + wait > deadline - elapsed_ms():
                    raise held.gate._overloaded(
                        f"the predicted wait for a compute slot ({wait:.3g} ms) would make this request miss X-Deadline-Ms={deadline:g}",
                        wait,
                    )
            over = nbytes is not None and nbytes > settings.max_body_bytes  # about to be refused with 413, unparsed
            if nbytes is None or over:
                nbytes = settings.max_body_bytes  # chunked: read up to the limit
            ctx.admission = held.gate.enter(nbytes, 0 if over else _body_charge(nbytes))
        except RequestError:
            _drain()
            raise

    @app.after_request
    def _hand_over(resp: Response):
        ctx = context()
        ticket, ctx.admission = ctx.admission, None
        if ticket is not None:
            ticket.end_compute()  # a slow reader must not pin a compute slot
            metrics.when_sent(resp, ticket.release)  # its bytes are held until the body is sent
        send, ctx.send = ctx.send, None
        if send is not None:
            # The answer leaves the pipe at the last byte written to the socket: the event loop's
            # (SENT_KEY) when the worker has one, since the thread hands a slow reader's rest to it;
            # else when the body has been iterated.
            cost, gate, ok = held.cost, held.gate, resp.status_code == 200

            def sent(written: bool = True) -> None:
                _end_sending(gate, cost, send, written and ok)

            when_written = request.environ.get(SENT_KEY)
            if when_written is not None:
                when_written(sent)
            else:
                metrics.when_sent(resp, sent)
        return resp

    @app.teardown_request
    def _release(exc):
        ctx = context()
        ticket, ctx.admission = ctx.admission, None  # still here only if no response was made
        if ticket is not None:
            ticket.release()
        send, ctx.send = ctx.send, None
        if send is not None:
            _end_sending(held.gate, held.cost, send, False)
