"""Per-request state has one owner: a request's hooks and view share one RequestContext, the only
thing the app keeps in flask.g; the app's own state is one Services object (service/web/context.py)."""

from __future__ import annotations

import pytest
from flask import g

from service.admission import Admission, Deadline
from service.cost import CostModel, work_of
from service.web.context import RequestContext, context, services

from .helpers import post


@pytest.fixture
def seen(app):
    """What g and the request's context hold as the response leaves the view, per request."""
    found = []

    @app.after_request
    def _look(resp):  # registered last, so it runs before the app's own after hooks
        found.append((set(g), context()))
        return resp

    return found


def test_a_compute_request_keeps_its_state_in_one_context(client, seen):
    body = {"q": [[1.0, 0.0], [0.0, 1.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[1.0, 2.0], [3.0, 4.0]]}
    r = post(client, body, headers={"X-Request-Id": "req-1", "X-Deadline-Ms": "10000"})
    assert r.status_code == 200, r.json
    [(keys, ctx)] = seen
    assert keys == {"attention"} and isinstance(ctx, RequestContext)
    assert ctx.request_id == r.headers["X-Request-Id"] == "req-1"
    assert ctx.trace is not None and r.headers["traceparent"] == ctx.trace.traceparent()
    assert ctx.deadline == Deadline(10000.0, ctx.arrived + 10.0) and ctx.error_code is None
    ticket = ctx.ticket  # admission's facts about the job live on its ticket
    assert ctx.job is not None and ticket is not None and ticket.work == work_of(ctx.job)
    assert ticket.stop is not None and not ticket.stop()  # the core's hook, by the deadline
    assert r.json["cost"]["predicted_ms"] == round(ticket.predicted_ms, 3)
    assert {"decode", "validate", "compute"} <= set(ctx.phases)
    assert [name for name, _, _ in ctx.timeline] == list(ctx.phases)  # each phase timed once, in order


def test_an_error_answer_names_its_code_and_field_in_the_context(client, seen):
    r = post(client, {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]], "scale": -1})
    assert r.status_code == 422
    [(keys, ctx)] = seen
    assert keys == {"attention"}
    assert (ctx.error_code, ctx.error_field) == (r.json["error"]["code"], r.json["error"]["field"]) == ("bad_option", "scale")
    assert ctx.job is None and ctx.ticket is not None and ctx.ticket.work is None  # admitted to be read, refused before admit()


def test_a_request_without_compute_has_a_context_too(client, seen):
    assert client.get("/healthz").status_code == 200
    [(keys, ctx)] = seen
    assert keys == {"attention"} and ctx.job is None and ctx.ticket is None and ctx.deadline is None


def test_the_apps_state_is_one_services_object(app, settings):
    held = services(app)
    assert held.settings is settings
    assert isinstance(held.cost, CostModel) and isinstance(held.admission, Admission)
    assert held.readiness() == "ready"  # warmup=False
    held.draining = True
    assert held.readiness() == "draining"
    assert app.test_client().get("/readyz").json == {"status": "draining"}
