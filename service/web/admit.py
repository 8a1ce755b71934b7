"""The web layer's hooks into admission (service.admission): the request's deadline read, its
ticket taken before its body is parsed, its answer refused if the deadline passed before it could
start, and the ticket given back (its slot once the answer is built, its bytes once it is sent, or
at once for an error answer).

What parsing a body will take is its front door's to say (service.admission.charge): the native
door parses all of it as JSON; a door that parses otherwise (the /v2 binary extension) hands its
own charge to install()."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from functools import partial

from flask import Blueprint, Flask, Response, request

from schemas import RequestError
from service.admission import Admission, Deadline, census, parse_charge, unseen_charge
from service.config import Settings
from service.transport import BODY_KEY

from . import metrics
from .context import context, services
from .http import when_sent

COMPUTE_PATH = re.compile(r"/(attention|mha)|/v2/models/[^/]+(/versions/[^/]+)?/infer|/sessions(/[^/]+)?/attention")
DRAIN_S = 5.0  # longest spent reading and discarding the body of a refused request
DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")

Charge = Callable[[bytes | bytearray], int]  # a body in memory -> the bytes parsing it takes at that door


def make(settings: Settings, predict) -> Admission:
    """A worker's admission, in the server's census when gunicorn's arbiter made one, counting
    into the metrics."""
    return Admission(settings, predict, count=metrics.admission_count, table=census.shared())


def parse_deadline(raw: str | None) -> float | None:
    """X-Deadline-Ms as milliseconds (None without one), or 422 bad_option. Also read at the head
    by the event-loop worker (front.Front.check_head), before the body is."""
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


def late() -> RequestError:
    deadline = context().deadline
    ms = deadline.ms if deadline is not None else math.nan
    return RequestError(
        "deadline", f"Computed, but X-Deadline-Ms={ms:g} passed before its answer could start; allow more time or send a smaller request."
    )


def install(app: Flask, charges: dict[Blueprint, Charge] | None = None) -> None:
    """The hooks; charges: the doors whose parse is not the whole body as JSON, and their charge."""
    held = services(app)
    by_door = {bp.name: charge for bp, charge in (charges or {}).items()}

    def body_charge(nbytes: int) -> int | Callable[[], int]:
        """The body's parse charge: its bound if it is not in memory yet (it cannot be looked at
        first), else the door's count of it, for the gate to call if the bound does not fit."""
        body = request.environ.get(BODY_KEY)
        if body is None or len(body) != nbytes:
            return unseen_charge(nbytes)
        return partial(by_door.get(request.blueprint or "", parse_charge), body)

    @app.before_request
    def _gate():
        if request.method != "POST" or not COMPUTE_PATH.fullmatch(request.path):
            return
        ctx = context()
        try:
            ms = parse_deadline(request.headers.get("X-Deadline-Ms"))
            if ms is not None:
                ctx.deadline = Deadline(ms, ctx.arrived + ms / 1000)
            nbytes = request.content_length
            over = nbytes is not None and nbytes > held.settings.max_body_bytes  # about to be refused with 413, unparsed
            if nbytes is None or over:
                nbytes = held.settings.max_body_bytes  # chunked: read up to the limit
            ctx.ticket = held.admission.enter(nbytes, 0 if over else body_charge(nbytes), ctx.deadline)
        except Exception:
            _drain()
            raise

    @app.after_request
    def _hand_over(resp: Response):
        ctx = context()
        ticket = ctx.ticket
        if ticket is None or not ticket.holding:
            return resp
        ticket.end_compute()  # a slow reader must not pin a compute slot
        if resp.status_code >= 400:  # a refused request leaves nothing held: the next one is served as if it had not come
            ticket.release()
            return resp
        deadline = ctx.deadline
        if deadline is not None and time.perf_counter() > deadline.at:
            ticket.release()
            assert held.answer_error is not None  # errors.register() set it
            return held.answer_error(late())  # no answer starts after its deadline
        when_sent(resp, ticket.release)  # its bytes are held until the body is sent
        return resp

    @app.teardown_request
    def _release(exc):
        ticket = context().ticket
        if ticket is not None and ticket.holding:  # no answer was made
            ticket.release()
