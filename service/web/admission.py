"""Admission control for the compute endpoints: API keys, deadlines and overload.

Before the body is read (a before_request hook, so a refusal costs no parsing):
  401 unauthorized  when ATTN_API_KEYS is set and no key matches (constant-time comparison);
  422 bad_option    when X-Deadline-Ms is not a positive number of milliseconds;
  504 deadline      when even receiving and parsing its Content-Length would outlast the deadline;
  503 overloaded    when the server as a whole already holds its bound of compute requests,
                    (max_inflight + max_queue) x the workers running, or the request's
                    Content-Length, with what parsing it can take (PARSE_FACTOR times it), would
                    take this worker's bytes past max_inflight_bytes.

After validation, before compute (admit(job), called by the routes):
  504 deadline      when the cost model's prediction exceeds what is left of X-Deadline-Ms;
  503 overloaded    when the job's estimated working memory would pass max_inflight_bytes (the
                    parse charge is then given back: the job's working bytes count what remains);
then the job waits for one of max_inflight compute slots, in a queue bounded by max_queue (and
by its deadline). The slot, and the request's place in max_inflight + max_queue, are given back
as soon as the response is built (computed, and encoded but for the parts that stream): a client
slow to read its answer holds no compute. The request's bytes stay charged against
max_inflight_bytes until the response has been sent or the connection dropped, since the answer
is in memory until then. Every 503 carries Retry-After.

What is counted where. The request bound is the server's: the workers share a census of their
admitted and computing requests (census.py, made by the gunicorn arbiter before they fork), so a
client is refused only when the server holds (max_inflight + max_queue) x workers requests, however
its keep-alive connections landed (a connection stays with the worker that accepted it: with
per-worker counts, most connections on one worker got 503 while the other idled). One worker may
then hold more than its own share waiting; gunicorn's threads are sized to hold them all
(deploy/gunicorn.conf.py). Compute slots (max_inflight) and bytes (max_inflight_bytes) stay per
worker: a worker computes on its own threads, and the bytes bound keeps one process's memory
bounded, whatever its siblings hold. Without the shared census (the Flask test client) a gate
counts alone: the bound is then its own max_inflight + max_queue. server_computing() tells how many
requests compute now in the whole server (for splitting one request over idle cores).
"""

from __future__ import annotations

import hmac
import math
import re
import threading
import time

from flask import Flask, Response, has_app_context, request

from schemas import RequestError
from schemas.jobs import AttentionJob, MhaJob
from service.config import Settings
from service.cost import work_of

from . import census, metrics, parallel
from .context import context, services
from .errors import ApiError
from .http import phase

COMPUTE_PATH = re.compile(r"/(attention|mha)|/v2/models/[^/]+(/versions/[^/]+)?/infer")
MAX_WAIT_S = 30.0  # longest a job waits for a compute slot without a deadline: then 503
DRAIN_S = 5.0  # longest spent reading and discarding the body of a refused request
# Peak bytes of parsing a JSON body (wire.loads, the depth check and the schema's load), beyond
# the body itself, per byte of body, at most: above the worst hostile body measured (objects of
# empty b64) with `python -m bench.garbage --sizes 32 --rss` (peak RSS growth over the held body;
# bench/README.md), and far above valid bodies (bench/peak_rss.py). The gate charges
# Content-Length x PARSE_FACTOR before the body is read, so that the peak one request can cause
# is in ATTN_MAX_INFLIGHT_BYTES before it happens; after validation the job's working bytes
# replace it (reserve()). Only the lone request of a worker may exceed the bound.
PARSE_FACTOR = 33


class Gate:
    """One worker's admission state: its admitted requests (counted in the server's census too),
    their bytes, and its compute slots."""

    def __init__(self, max_inflight: int, max_queue: int, max_bytes: int, table: census.Table | None = None):
        """table: the server's shared census (census.shared() in a gunicorn worker); None, or a
        table with no free row, and this gate counts alone (its own bound)."""
        self.max_inflight, self.max_queue, self.max_bytes = max_inflight, max_queue, max_bytes
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_inflight)
        self.admitted = 0  # this worker's requests past the gate, until their response has been built
        self.bytes = 0  # their Content-Length plus estimated working bytes, until sent
        self.pending_ms = 0.0  # predicted compute of the admitted jobs that have been validated
        row = table.join(max_inflight + max_queue) if table is not None else None
        if row is None:
            table = census.Table(rows=1, shared=False)
            row = table.join(max_inflight + max_queue)
        self.table, self.row = table, row

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

    def _overloaded(self, why: str) -> ApiError:
        wait_s = self.pending_ms / 1000 / self.max_inflight
        retry = max(1, math.ceil(wait_s))
        return ApiError("overloaded", f"The server is at capacity: {why}. Retry after {retry} s.", headers={"Retry-After": str(retry)})


class Ticket:
    """One admitted request's hold on its gate: end_compute() gives back its slot and its place
    in the queue bound, release() the rest (its bytes); each once."""

    def __init__(self, gate: Gate, nbytes: int, parse_bytes: int = 0):
        self.gate, self.bytes, self.predicted_ms = gate, nbytes, 0.0
        self.parse_bytes = parse_bytes  # part of bytes, charged for the parse until reserve()
        self.running = False
        self.computing = True  # counted in gate.admitted

    def reserve(self, nbytes: int, predicted_ms: float) -> None:
        """Replace the parse charge by the job's working bytes (503 if they do not fit beside the
        others) and add its prediction."""
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
            gate.pending_ms += predicted_ms
            self.predicted_ms = predicted_ms

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
        """A compute slot if one is free now."""
        return self._got(self.gate._slots.acquire(blocking=False))

    def wait_for_slot(self, timeout_s: float) -> bool:
        """Wait in the queue for a compute slot, at most timeout_s."""
        metrics.QUEUED.inc()
        try:
            got = self.gate._slots.acquire(timeout=max(timeout_s, 0.0))
        finally:
            metrics.QUEUED.dec()
        return self._got(got)

    def _got(self, got: bool) -> bool:
        if got:
            self.running = True
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
            gate._slots.release()
        with gate._lock:
            if self.computing:
                self.computing = False
                gate.admitted -= 1
                gate.table.add(gate.row, census.ADMITTED, -1)
                gate.pending_ms -= self.predicted_ms
                self.predicted_ms = 0

    def release(self) -> None:
        """The response is sent (or will never be): everything goes back."""
        self.end_compute()
        gate = self.gate
        with gate._lock:
            gate._add_bytes(-self.bytes)
            self.bytes = 0


def admit(job: AttentionJob | MhaJob) -> None:
    """Between validation and compute: refuse a job that cannot meet its deadline (504) or does
    not fit in memory beside the others (503), then wait for a compute slot. The prediction is the
    cost model's for the load it is admitted into (the requests busy in the server, Gate.busy())
    and the threads it is to compute on; the request's context keeps the job, its work, that
    count (the compute teaches the model by it) and the prediction (for the compute metrics and
    the response's cost)."""
    ctx = context()
    ctx.job = job  # its shape, for the access log and the trace
    work = ctx.work = work_of(job)
    ctx.busy = server_busy()  # the load it is admitted into: its slowdown is predicted, then learned, by this count
    # Alone on the server, a large job is split on several threads (parallel.py): it is predicted
    # at what splits have taken, not at one thread's time (which would refuse deadlines it meets).
    threads = parallel.planned(work, parallel.computing())  # the count the split itself is decided by
    predicted = ctx.predicted_ms = services().cost.predict(work, ctx.busy, threads)
    deadline, ticket = ctx.deadline_ms, ctx.admission
    if deadline is not None:
        left = deadline - elapsed_ms()
        if predicted > left:
            raise _deadline(
                f"the predicted compute time is {predicted:.3g} ms but {max(left, 0):.3g} ms of X-Deadline-Ms={deadline:g} remain"
            )
    if ticket is None:
        return
    ticket.reserve(job.working_bytes(), predicted)
    if ticket.take_slot():
        return
    with phase("queue"):  # only a request that waited has a queue phase
        timeout = MAX_WAIT_S if deadline is None else (deadline - elapsed_ms() - predicted) / 1000
        if not ticket.wait_for_slot(timeout):
            if deadline is not None:
                raise _deadline(f"waiting for a compute slot left less than the predicted {predicted:.3g} ms of X-Deadline-Ms={deadline:g}")
            raise ticket.gate._overloaded(f"no compute slot came free within {MAX_WAIT_S:g} s")


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
    return (time.perf_counter() - context().t0) * 1000


def _deadline(why: str) -> RequestError:
    return RequestError("deadline", f"Refused before computing: {why}; allow more time or send a smaller request.")


def _check_key(keys: tuple[str, ...]) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given_b = given.strip().encode()
    ok = False
    for key in keys:  # compare with every key: the time taken does not tell which one came close
        ok |= hmac.compare_digest(given_b, key.encode())
    if scheme.lower() != "bearer" or not given_b or not ok:
        raise ApiError(
            "unauthorized",
            "This endpoint needs an API key: send the header Authorization: Bearer <key>.",
            headers={"WWW-Authenticate": 'Bearer realm="attention"' + (', error="invalid_token"' if given_b else "")},
        )


DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")


def _parse_deadline() -> float | None:
    raw = request.headers.get("X-Deadline-Ms")
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


def make_gate(settings: Settings) -> Gate:
    """A worker's gate, in the server's census when gunicorn's arbiter made one (census.shared())."""
    global _last_gate
    _last_gate = Gate(settings.max_inflight, settings.max_queue, settings.max_inflight_bytes, census.shared())
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
        try:
            if settings.api_keys:
                _check_key(settings.api_keys)
            deadline = ctx.deadline_ms = _parse_deadline()
            nbytes = request.content_length
            if deadline is not None and nbytes:
                floor = held.cost.read_floor_ms(nbytes)
                if floor > deadline - elapsed_ms():
                    raise _deadline(
                        f"receiving and parsing a body of {nbytes} bytes takes at least {floor:.3g} ms, more than X-Deadline-Ms={deadline:g}"
                    )
            over = nbytes is not None and nbytes > settings.max_body_bytes  # about to be refused with 413, unparsed
            if nbytes is None or over:
                nbytes = settings.max_body_bytes  # chunked: read up to the limit
            ctx.admission = held.gate.enter(nbytes, 0 if over else nbytes * PARSE_FACTOR)
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
        return resp

    @app.teardown_request
    def _release(exc):
        ctx = context()
        ticket, ctx.admission = ctx.admission, None  # still here only if no response was made
        if ticket is not None:
            ticket.release()
