"""Blueprint for the sessions resource (contract 1.3, "Sessions"): attention state held by the
server, so that a decode step sends its new tokens and queries, not the whole cache.

Thin, as api.py: a body is read and validated (schemas/sessions.py), the session is locked for the
request in the pool (service.sessions: requests on one session are serialised, on different
sessions run in parallel, in any worker), new tokens are written past its length, the step is
admitted and computed over its pages in place like any other job (compute.py), and the length is
committed last: a request that fails, or a worker killed during it, leaves the session as it was."""

from __future__ import annotations

import contextlib

import numpy as np
from flask import Blueprint, Response
from werkzeug.routing import BaseConverter

from schemas import RequestError, SessionBatchJob, SessionStepJob
from schemas.sessions import (
    SessionAppendRequest,
    SessionBatchRequest,
    SessionCreateRequest,
    SessionLengthRequest,
    SessionStepRequest,
    step_job,
)
from service import sessions, wire
from service.sessions import Shape

from . import held
from .compute import cost, run, validate_only
from .context import services
from .http import json_response, phase, phases_ms, read_json

bp = Blueprint("sessions", __name__)


class SessionId(BaseConverter):
    """A session id in a path: any segment but "attention" (POST /sessions/attention is the batch,
    not a session: OPTIONS and 405s list each route's own methods)."""

    regex = r"(?!attention$)[^/]+"


@bp.record_once
def _converter(state) -> None:
    state.app.url_map.converters["sid"] = SessionId  # recorded before the routes below: known when they are added


SCHEMAS = (SessionCreateRequest, SessionAppendRequest, SessionLengthRequest, SessionStepRequest, SessionBatchRequest)


def _load(schema_cls: type):
    """The body validated by schema_cls (the decode and validate phases)."""
    doc = read_json()
    return doc, validate_only(services().schemas[schema_cls], doc)


@bp.post("/sessions")
def create():
    """A new empty session: 201, its description and Location."""
    _, data = _load(SessionCreateRequest)
    shape = Shape(data["heads"], data["kv_heads"], data["head_dim"], data["value_dim"], np.dtype(data["dtype"]))
    with held.refusals():
        sid = held.pool().create(shape, data["max_tokens"], held.owner())
    return _created(sid)


def _created(sid: str) -> Response:
    """201: the new session's description, and its Location."""
    with held.session(sid) as s:
        resp = json_response(s.describe(), status=201)
    resp.headers["Location"] = f"/sessions/{sid}"
    return resp


@bp.get("/sessions/<sid:sid>")
def describe(sid: str):
    """The session's description, its current length."""
    with held.session(sid) as s:
        return json_response(s.describe())


@bp.delete("/sessions/<sid:sid>")
def delete(sid: str):
    with held.session(sid) as s:
        s.delete()
    return Response(status=204)


@bp.post("/sessions/<sid:sid>/append")
def append(sid: str):
    """Tokens appended; with at, only if the session's length is at (exactly once)."""
    _, data = _load(SessionAppendRequest)
    with held.session(sid) as s, held.refusals():
        end = held.append(s, services().schemas[SessionAppendRequest], data["k"], data["v"], data["at"])
        s.commit(end)
    return json_response({"length": end})


def _encoding(data: dict, doc: dict) -> str:
    return data.get("response_encoding") or wire.wire_encoding(doc.get("q"))


@bp.post("/sessions/<sid:sid>/attention")
def attention(sid: str):
    """One step: new tokens (if sent) appended, then q attends to all of the session's keys; the
    length committed only once the answer is computed."""
    doc, data = _load(SessionStepRequest)
    schema = services().schemas[SessionStepRequest]
    with held.session(sid) as s, held.refusals():
        S = held.append(s, schema, data["k"], data["v"], data["at"])
        job = step_job(schema, data, data["q"], s.shape, S, _encoding(data, doc), s.pages(S))
        out, weights, *lse = run(job)
        s.commit(S)
    return _respond(job, {"out": out, "weights": weights, "lse": lse[0] if lse else None, "length": S})


@bp.post("/sessions/attention")
def attention_many():
    """One step for several sessions at once (their lengths may differ): each takes its new tokens
    and attends; all are committed together once every answer is computed, or none is."""
    doc, data = _load(SessionBatchRequest)
    schema = services().schemas[SessionBatchRequest]
    ids, q, k, v, at = data["sessions"], data["q"], data["k"], data["v"], data["at"]
    with contextlib.ExitStack() as locks, held.refusals():
        order = sorted(range(len(ids)), key=lambda i: ids[i])  # locked in one order: two batches never wait on each other
        locked = {i: locks.enter_context(held.session(ids[i])) for i in order}
        jobs, lengths = [], []
        shapes = {s.shape for s in locked.values()}
        if len(shapes) > 1:
            raise RequestError(
                "shape_mismatch",
                f"sessions have different shapes ({', '.join(sorted(_shape_text(shape) for shape in shapes))}); a batched step takes sessions of one shape.",
                "sessions",
            )
        for i, s in sorted(locked.items()):
            S = held.append(s, schema, None if k is None else k[i], None if v is None else v[i], None if at is None else at[i])
            jobs.append(step_job(schema, data, q[i], s.shape, S, _encoding(data, doc), s.pages(S)))
            lengths.append(S)
        batch = SessionBatchJob(tuple(jobs))
        schema.check_scores(
            batch.score_elements,
            data["return_weights"],
            f"q {list(q.shape)} against the sessions' lengths {lengths}",
            len(jobs) * q.shape[1] * q.shape[2] * max(lengths),
        )
        out, weights, *lse = run(batch)
        for (_, s), S in zip(sorted(locked.items()), lengths, strict=True):
            s.commit(S)
    return _respond(batch, {"out": out, "weights": weights, "lse": lse[0] if lse else None, "lengths": lengths})


def _shape_text(shape: Shape) -> str:
    return f"heads={shape.heads}, kv_heads={shape.kv_heads}, head_dim={shape.head_dim}, value_dim={shape.value_dim}, {shape.dtype.name}"


def _respond(job: SessionStepJob | SessionBatchJob, fields: dict) -> Response:
    """The 200 body: tensors in the job's encoding, the length(s), the cost and the phases so far."""
    timing = phases_ms()
    with phase("encode"):
        body = {}
        for name in ("out", "weights", "lse"):
            if fields.get(name) is not None:
                body[name] = wire.encode(fields[name], job.encoding, lazy=True, dtype=job.weights_dtype if name == "weights" else None)
        body.update({k: v for k, v in fields.items() if k in ("length", "lengths")})
        body["cost"] = cost(job)
        body["timing_ms"] = timing
        return json_response(body)


def _length_body() -> int | None:
    _, data = _load(SessionLengthRequest)
    return data["length"]


@bp.post("/sessions/<sid:sid>/fork")
def fork(sid: str):
    """A new session whose first length tokens (default all) are this one's, shared: 201."""
    length = _length_body()
    with held.session(sid) as s, held.refusals():
        length = s.length if length is None else length
        if length > s.length:
            raise sessions.Conflict(s.length)
        child = s.fork(length, held.owner())
    return _created(child)


@bp.post("/sessions/<sid:sid>/truncate")
def truncate(sid: str):
    """Tokens after length dropped (rejected draft tokens)."""
    length = _length_body()
    if length is None:
        raise RequestError("missing_field", "length is required: the tokens to keep.", "length")
    with held.session(sid) as s, held.refusals():
        if length > s.length:
            raise sessions.Conflict(s.length)
        s.truncate(length)
    return json_response({"length": length})
