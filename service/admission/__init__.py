"""Admission control for the compute endpoints: which requests a worker takes, when they compute,
and when they are refused. Below the web layer: it imports neither Flask, prometheus_client nor
service.web (an import-linter contract); the app hands it what it needs when it starts (the
settings, the cost model's prediction as a callable, a clock, a callback for its metrics) and
maps its refusals (Refused: code, message, retry-after) to statuses in one place
(service/web/errors.py).

One entry, Admission.enter(), before the body is parsed (a refusal costs no parsing), with the
body's size, what its front door will take to parse it (charge.py) and the request's deadline:
  504 deadline      when X-Deadline-Ms has already passed;
  503 overloaded    when the predicted wait for a compute slot would make it miss it;
  503 overloaded    when the request's body and its parse charge would take this worker's bytes
                    past max_inflight_bytes (a lone request always fits), or when the server as a
                    whole already holds its safety cap of compute requests, (max_inflight +
                    max_queue) x the workers running (the census, census.py, made by gunicorn's
                    arbiter before the workers fork, so a client is refused by count only when the
                    server is full, however its keep-alive connections landed).
It gives a Ticket, whose admit(work, working_bytes), once the body is validated into a job, does
the rest, by the cost model's prediction of the job's compute (its median, at the load it joins:
Admission.busy()) and its predicted wait (the predicted compute ahead of it over the worker's
max_inflight compute slots, first come, first served):
  504 deadline      when X-Deadline-Ms cannot be met even without waiting;
  503 overloaded    when the predicted wait would make it miss X-Deadline-Ms, or without one when it
                    exceeds max_queue_wait_ms (Retry-After: the wait ahead, in whole seconds), or
                    when the job's working bytes would pass max_inflight_bytes;
then it waits for a compute slot, at most until what is left of its deadline no longer holds its
predicted compute (504), or max_queue_wait_ms without one (503). Ticket.stop is the core's hook:
past the deadline the core stops between blocks (504, its slot freed at once). The deadline covers
the server's work until the answer starts to be written (as a gRPC deadline does): the web layer
refuses to start an answer after it; the time the answer then takes to reach its client is
measured (service/web/metrics.py), not predicted.

The slot, and the request's place in the server's cap, go back as soon as the answer is built
(Ticket.end_compute): a client slow to read its answer holds no compute. Its bytes stay charged
until the answer has been sent (Ticket.release), since the answer is in memory until then.

Compute slots, the predicted wait and the bytes bound are per worker (a worker computes on its own
threads; the bytes bound keeps one process's memory bounded); the request cap is the server's. The
split policy (service/cost/split.py) is asked here too: a large job alone on the server computes on
several threads, and is predicted so."""

from . import census
from .charge import PARSE_FACTOR, parse_charge, unseen_charge
from .gate import Admission, Deadline, Refused, Ticket

__all__ = ["PARSE_FACTOR", "Admission", "Deadline", "Refused", "Ticket", "census", "parse_charge", "unseen_charge"]
