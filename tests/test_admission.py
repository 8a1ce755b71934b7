"""Admission control (service/admission/, and its hooks service/web/admit.py): deadlines
(X-Deadline-Ms against the cost model's prediction, kept as gRPC keeps them: until the answer
starts) and the overload gate's bounds on requests and bytes. API keys: test_auth.py; a real
burst: test_overload.py."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import signal
import socket
import threading
from dataclasses import replace

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from schemas import AttentionRequest
from service.admission import Admission, Refused, census, charge, parse_charge
from service.config import Settings
from service.cost import CostModel, Work
from service.web import create_app, metrics, ops
from service.web.context import services

from .helpers import WORKED, b64, big_body, start_server, stop_server, wait_until


def post(client, body=WORKED, **headers):
    return client.post("/attention", json=body, headers=headers)


WORK = Work(flops=1, score_elements=1, dtype="float32", T=1)  # never split


def gate_of(max_inflight: int = 1, max_queue: int = 8, max_bytes: int = 1_000, predicted_ms: float = 0.0, table=None) -> Admission:
    """An admission of its own, every job predicted at predicted_ms."""
    settings = Settings(max_inflight=max_inflight, max_queue=max_queue, max_inflight_bytes=max_bytes)
    return Admission(settings, lambda *_: predicted_ms, table=table)


# --- deadlines ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["abc", "", "0", "-5", "nan", "inf", "1e999", "10ms"])
def test_malformed_deadline_is_bad_option(client, raw):
    r = post(client, **{"X-Deadline-Ms": raw})
    assert r.status_code == 422
    assert r.json["error"]["code"] == "bad_option" and r.json["error"]["field"] == "X-Deadline-Ms"
    assert "X-Deadline-Ms" in r.json["error"]["message"]


@pytest.mark.parametrize("raw", ["5000", "2500.5", " 60000 "])
def test_a_generous_deadline_is_served(client, raw):
    assert post(client, **{"X-Deadline-Ms": raw}).status_code == 200


def test_a_deadline_shorter_than_the_prediction_is_504_before_compute(app, client, rng):
    # 1 s per thousand scores: 64x64 is predicted at 4 s, far past a deadline of 1 s that reading
    # and validating the body cannot use up even on a busy machine (a 3 ms deadline once could)
    services(app).cost = CostModel(a=0, b=1e6, c=0)
    q = rng.standard_normal((64, 16))
    body = {"q": b64(q), "k": b64(q), "v": b64(q)}
    r = post(client, body, **{"X-Deadline-Ms": "1000"})
    assert r.status_code == 504 and r.json["error"]["code"] == "deadline"
    assert "predicted" in r.json["error"]["message"]
    assert "compute" not in r.headers["Server-Timing"]  # refused before computing
    assert post(client, body, **{"X-Deadline-Ms": "100000"}).status_code == 200


def test_waiting_for_a_slot_counts_against_the_deadline(app, client):
    services(app).cost = CostModel(a=0, b=0, c=0)  # predicted at 0 ms: only the wait can miss the deadline
    gate = services(app).admission
    for _ in range(gate.max_inflight):
        assert gate._slots.acquire(blocking=False)  # every compute slot busy
    try:
        r = post(client, **{"X-Deadline-Ms": "500"})
        assert r.status_code == 504 and r.json["error"]["code"] == "deadline"
        assert "waiting for a compute slot" in r.json["error"]["message"]
        assert "queue" in r.headers["Server-Timing"] and "compute" not in r.headers["Server-Timing"]
    finally:
        for _ in range(gate.max_inflight):
            gate._slots.release()
    assert gate.admitted == 0 and gate.bytes == 0  # everything given back
    assert post(client).status_code == 200


@pytest.mark.live
def test_a_deadline_too_short_for_the_upload_is_refused_before_parsing(live_server):
    """X-Deadline-Ms: 1 on a 16.8 MB body (T=2048, B=1, H=8, d=64): it passed while the body was
    received, so it is refused before the body is parsed; the same body with a generous deadline is served. How long the
    refusal took is printed, not asserted."""
    body = big_body(2048, weights=False)
    headers = {"Content-Type": "application/json", "X-Deadline-Ms": "1"}
    r = requests.post(f"{live_server}/attention", data=body, headers=headers, timeout=120)
    print(f"\nX-Deadline-Ms: 1, T=2048 ({len(body) / 1e6:.1f} MB body): 504 in {r.elapsed.total_seconds() * 1000:.0f} ms")
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline"
    assert "passed while the request was received" in r.json()["error"]["message"]
    assert "decode" not in r.headers["Server-Timing"]  # refused before parsing
    r = requests.post(f"{live_server}/attention", data=body, headers={**headers, "X-Deadline-Ms": "600000"}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert "compute" in r.headers["Server-Timing"] and "weights" not in r.json()


def test_the_kserve_infer_route_is_admitted_the_same_way(app, client):
    services(app).cost = CostModel(a=0, b=0, c=50)  # every job predicted at 50 ms
    tensor = {"datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 1, 1, 1]}
    body = {"inputs": [{"name": name, **tensor} for name in ("q", "k", "v")]}
    r = client.post("/v2/models/attention/infer", json=body, headers={"X-Deadline-Ms": "10"})
    assert r.status_code == 504 and "predicted" in r.json["error"]  # the protocol's error shape
    assert client.post("/v2/models/attention/infer", json=body, headers={"X-Deadline-Ms": "5000"}).status_code == 200


# --- overload ----------------------------------------------------------------------------------


def test_past_the_request_bound_is_503_with_retry_after(app, client):
    gate = services(app).admission
    held = [gate.enter(0) for _ in range(gate.max_inflight + gate.max_queue)]
    try:
        r = post(client)
        assert r.status_code == 503 and r.json["error"]["code"] == "overloaded"
        assert int(r.headers["Retry-After"]) >= 1
        assert client.get("/healthz").status_code == 200  # only the compute endpoints are gated
    finally:
        for ticket in held:
            ticket.release()
    assert post(client).status_code == 200


def test_bytes_in_flight_are_bounded_before_the_body_is_read(settings, rng):
    app = create_app(replace(settings, max_inflight_bytes=50_000))
    client = app.test_client()
    gate = services(app).admission
    held = gate.enter(40_000)
    try:
        q = rng.standard_normal((64, 16))
        r = post(client, {"q": b64(q), "k": b64(q), "v": b64(q)})  # ~17 kB of body
        assert r.status_code == 503 and "ATTN_MAX_INFLIGHT_BYTES" in r.json["error"]["message"]
        assert "decode" not in r.headers["Server-Timing"]  # refused on Content-Length alone
        assert post(client).status_code == 200  # a small one still fits
    finally:
        held.release()
    assert gate.bytes == 0


def test_a_streamed_answer_frees_its_slot_at_once_and_its_bytes_when_sent(app, client, rng):
    gate = services(app).admission
    q = rng.standard_normal((2, 32, 8))
    r = post(client, {"q": b64(q), "k": b64(q), "v": b64(q)})  # b64 answers are encoded as they stream
    assert r.is_streamed and gate.bytes > 0  # the answer is in memory until it is sent ...
    assert gate.admitted == 0 and all(gate._slots.acquire(blocking=False) for _ in range(gate.max_inflight))  # ... computing is not
    for _ in range(gate.max_inflight):
        gate._slots.release()
    r.get_data()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_a_built_answer_holds_its_bytes_until_sent_too(app, client):
    gate = services(app).admission
    r = post(client)  # a small nested answer: built whole before it is sent
    assert gate.admitted == 0 and gate.bytes > 0
    r.get_data()
    assert gate.bytes == 0


def test_a_ticket_gives_back_each_part_once():
    gate = gate_of(max_queue=0)
    ticket = gate.enter(100)
    ticket.admit(WORK, 0)
    assert ticket.running
    ticket.end_compute()
    ticket.end_compute()
    assert (gate.admitted, gate.bytes) == (0, 100) and gate._slots.acquire(blocking=False)
    gate._slots.release()
    ticket.release()
    ticket.release()
    assert (gate.admitted, gate.bytes) == (0, 0)


def _stalled_download(url: str, body: bytes) -> socket.socket:
    """A client that asks for a large answer and never reads it (a tiny receive buffer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = f"POST /attention HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def _samples(url: str) -> list:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.live
def test_stalled_downloads_do_not_pin_compute_slots(rng):
    """More clients than compute slots + queue ask for a large answer and never read it: once
    their answers are built they hold no compute slot, so a small request still computes."""
    stalled_n = 4  # > ATTN_MAX_INFLIGHT + ATTN_MAX_QUEUE = 2
    env = {"WEB_CONCURRENCY": "1", "ATTN_MAX_INFLIGHT": "1", "ATTN_MAX_QUEUE": "1"}
    proc, url = start_server(env)
    q = rng.standard_normal((2, 1024, 8)).astype(np.float32)
    enc = {"shape": list(q.shape), "dtype": "float32", "b64": base64.b64encode(q.tobytes()).decode()}
    big = json.dumps({"q": enc, "k": enc, "v": enc, "return_weights": True}).encode()  # ~11 MB of b64 weights back
    socks = []
    try:
        for n in range(1, stalled_n + 1):  # one after another: a burst past the bounds is 503 by design
            socks.append(_stalled_download(url, big))

            def answered(n=n):
                """every stalled request so far answered 200 (its answer unread), none computing"""
                samples = _samples(url)
                ok = sum(
                    s.value
                    for s in samples
                    if s.name == "attention_http_requests_total"
                    and s.labels.get("endpoint") == "/attention"
                    and s.labels.get("status") == "200"
                )
                running = [s.value for s in samples if s.name == "attention_admission_running_requests"]
                return ok >= n and running == [0.0]

            wait_until(answered, timeout=60, interval=0.2)
        r = requests.post(f"{url}/attention", json=WORKED, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for sock in socks:
            sock.close()
        stop_server(proc)


def test_a_lone_request_is_always_admitted():
    gate = gate_of(max_queue=0, max_bytes=10)
    ticket = gate.enter(1_000)
    with pytest.raises(Refused) as err:
        gate.enter(1)
    assert err.value.code == "overloaded" and err.value.retry_after >= 1
    ticket.release()
    gate.enter(1_000).release()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_a_body_is_counted_only_where_its_bound_does_not_fit():
    """The door's count of a body's parse (a pass over the body) is called only where the bound,
    PARSE_FACTOR x the body, would not fit: a body with room for its bound is charged the bound
    uncounted; one without is charged its count, and admitted where that fits."""
    counted = []

    def count(n):
        return lambda: counted.append(n) or 2 * n

    gate = gate_of(max_bytes=1_000)
    roomy = gate.enter(10, count(10))  # 10 + 33 x 10 fits in 1,000
    assert counted == [] and gate.bytes == 10 + charge.PARSE_FACTOR * 10
    tight = gate.enter(100, count(100))  # 100 + 3,300 does not; 100 + 200 does
    assert counted == [100] and gate.bytes == 10 + charge.PARSE_FACTOR * 10 + 300
    with pytest.raises(Refused):
        gate.enter(300, count(300))  # counted, and still past the bound beside the others
    assert counted == [100, 300]
    roomy.release(), tight.release()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_the_parse_is_charged_before_the_body_is_read(settings, rng):
    """A body not yet in memory (here the test client's stream; a chunked one) is charged
    Content-Length x PARSE_FACTOR at the gate: parsing a JSON body can take up to that much
    (bench/garbage.py --rss), so a body whose parse would not fit beside the others is refused
    unread; a lone one is always admitted."""
    body = {"q": b64(rng.standard_normal((64, 16))), "k": b64(rng.standard_normal((64, 16))), "v": b64(rng.standard_normal((64, 16)))}
    length = len(json.dumps(body))  # ~17 kB: its body fits in 100 kB, its parse charge does not
    app = create_app(replace(settings, max_inflight_bytes=100_000))
    client = app.test_client()
    gate = services(app).admission
    assert length < 100_000 < length * (1 + charge.PARSE_FACTOR)
    held = gate.enter(1)
    try:
        r = post(client, body)
        assert r.status_code == 503 and "parse" in r.json["error"]["message"], r.json
        assert "decode" not in r.headers["Server-Timing"]
    finally:
        held.release()
    assert post(client, body).status_code == 200  # alone, it is admitted
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_after_validation_the_parse_charge_becomes_the_working_bytes(app, client, rng):
    gate = services(app).admission
    q = rng.standard_normal((2, 32, 8))
    body = {"q": b64(q), "k": b64(q), "v": b64(q)}
    r = post(client, body)  # b64 answers stream: the ticket is held until the body is read
    job = AttentionRequest(services(app).settings).load(json.loads(json.dumps(body)))
    assert r.is_streamed and gate.bytes == r.request.content_length + job.working_bytes()
    r.get_data()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_working_bytes_are_reserved_after_validation(settings, rng, monkeypatch):
    monkeypatch.setattr(charge, "PARSE_FACTOR", 0)  # the gate charges the body alone: the reservation is what is tested
    app = create_app(replace(settings, max_inflight_bytes=50_000))
    client = app.test_client()
    gate = services(app).admission
    held = gate.enter(10_000)
    try:
        q = rng.standard_normal((4, 64, 8))  # a 33 kB body fits; its 16k scores need ~16 kB more
        r = post(client, {"q": b64(q), "k": b64(q), "v": b64(q), "return_weights": False})
        assert r.status_code == 503 and "working bytes" in r.json["error"]["message"]
    finally:
        held.release()
    assert (gate.admitted, gate.bytes) == (0, 0)


def _nested(arr) -> list:
    return np.round(arr, 6).tolist()


def test_the_parse_charge_follows_what_the_body_holds(rng):
    """b64 is charged about its decoded size and the strings (a few times the body), nested numbers
    by their count, /v2's binary tensors their own size, and no body more than PARSE_FACTOR x:
    the worst hostile bodies (bench/garbage.py) are charged just that."""
    from bench.garbage import CATALOGUE

    q = rng.standard_normal((8, 256, 64)).astype(np.float32)
    b64_body = json.dumps({"q": b64(q), "k": b64(q), "v": b64(q)}).encode()
    nested_body = json.dumps({"q": _nested(q), "k": _nested(q), "v": _nested(q)}).encode()
    factor = lambda body: parse_charge(bytearray(body)) / len(body)
    assert factor(b64_body) <= charge.STRING_FACTOR + 0.01
    assert charge.STRING_FACTOR < factor(nested_body) < charge.PARSE_FACTOR / 2
    header = b'{"inputs":[]}'
    binary = header + q.tobytes()
    assert parse_charge(binary, len(header)) == pytest.approx(q.nbytes, rel=0.01)
    for name in ("b64_empty_objects", "rows1", "rows3_ragged_end", "nested_zeros"):
        body = CATALOGUE[name](2**20)
        assert parse_charge(body) == charge.PARSE_FACTOR * len(body), name


def test_a_body_in_memory_is_charged_by_what_it_holds(settings, rng):
    """The worker's event loop hands the app the whole body (service.transport.BODY_KEY): a b64 body
    that its worst-case charge would refuse beside another request is admitted."""
    from service.transport import BODY_KEY

    q = rng.standard_normal((64, 16))
    data = json.dumps({"q": b64(q), "k": b64(q), "v": b64(q)}).encode()
    app = create_app(
        replace(settings, max_inflight_bytes=len(data) * 20)
    )  # under PARSE_FACTOR x, above the b64 charge and its working bytes
    client, gate = app.test_client(), services(app).admission
    held = gate.enter(1)
    try:
        send = lambda **extra: client.post("/attention", data=data, content_type="application/json", **extra)
        assert send().status_code == 503  # unseen: Content-Length x PARSE_FACTOR does not fit
        r = send(environ_overrides={BODY_KEY: bytearray(data)})
        assert r.status_code == 200, r.json
        r.get_data()
    finally:
        held.release()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_the_binary_header_lowers_no_charge_at_the_native_door(settings, rng):
    """The native door parses the whole body as JSON, whatever Inference-Header-Content-Length
    says: with that header (0: "all of it is binary") a body is still charged as JSON, so a body
    whose JSON parse would take the worker past ATTN_MAX_INFLIGHT_BYTES beside another request is
    503, as without the header. (It was charged 1x, the binary rate, and admitted: the bound below
    holds the body at that rate and then the job's working bytes.)"""
    from service.transport import BODY_KEY

    q = _nested(rng.standard_normal((16, 64)))
    data = json.dumps({"q": q, "k": q, "v": q, "return_weights": False}).encode()
    working = AttentionRequest(settings).load(json.loads(data)).working_bytes()
    bound = 1 + len(data) + max(len(data), working) + 10  # another request's byte, the body, then its binary charge or its job
    assert 1 + len(data) + parse_charge(data) > bound >= 1 + len(data) + parse_charge(data, 0)
    app = create_app(replace(settings, max_inflight_bytes=bound))
    client = app.test_client()
    gate = services(app).admission
    held = gate.enter(1)
    try:
        send = lambda **headers: client.post(
            "/attention", data=data, content_type="application/json", headers=headers, environ_overrides={BODY_KEY: bytearray(data)}
        )
        for headers in ({}, {"Inference-Header-Content-Length": "0"}):
            r = send(**headers)
            assert r.status_code == 503 and "parse" in r.json["error"]["message"], (headers, r.json)
    finally:
        held.release()
    assert (gate.admitted, gate.bytes) == (0, 0)
    r = client.post("/attention", data=data, content_type="application/json", environ_overrides={BODY_KEY: bytearray(data)})
    assert r.status_code == 200  # alone, it is admitted


def test_the_v2_door_charges_its_binary_tensors_their_size(rng):
    """At /v2 the header says where the JSON ends: the JSON header is charged as JSON, the binary
    tensors after it their own size (the split the door really makes); a header the door refuses
    unparsed (past the body) leaves the whole body charged as JSON."""
    from flask import Flask

    from service.web import kserve

    bare = Flask(__name__)  # a request's headers, without the app's hooks
    head = json.dumps({"inputs": [{"name": "q", "datatype": "FP32", "shape": [4, 8], "parameters": {"binary_data_size": 128}}]}).encode()
    body = bytearray(head + rng.standard_normal(32).astype(np.float32).tobytes())
    for header, charged in ((str(len(head)), parse_charge(body, len(head))), (None, parse_charge(body)), ("99999", parse_charge(body))):
        headers = {} if header is None else {"Inference-Header-Content-Length": header}
        with bare.test_request_context("/v2/models/attention/infer", method="POST", headers=headers):
            assert kserve.body_charge(body) == charged
    assert parse_charge(body, len(head)) < parse_charge(body)


# --- admission by predicted wait -----------------------------------------------------------------


def _busy_slots(gate, predicted_ms: float) -> list:
    """Every compute slot of gate taken by a validated job predicted at predicted_ms."""
    held = []
    for _ in range(gate.max_inflight):
        ticket = gate.enter(0)
        ticket.admit(WORK, 0)
        assert ticket.running
        ticket.predicted_ms = predicted_ms
        held.append(ticket)
    return held


def test_the_wait_ahead_is_the_predicted_work_over_the_slots():
    gate = gate_of(max_inflight=2)
    assert gate.wait_ms() == 0
    held = _busy_slots(gate, 4_000)
    assert 3_000 < gate.wait_ms() <= 4_000  # computing: what remains of theirs
    queued, got = gate.enter(0), []
    gate.predict = lambda *_: 2_000.0
    thread = threading.Thread(target=lambda: got.append(queued.admit(WORK, 0)))
    thread.start()
    wait_until(lambda: gate.waiting == 1, timeout=HANG, interval=0.01)  # no slot is free: it waits
    assert 4_000 < gate.wait_ms() <= (4_000 * 2 + 2_000) / 2
    for ticket in held:
        ticket.release()
    thread.join(HANG)
    assert got == [None] and queued.running and queued.waited_ms > 0
    queued.release()
    assert gate.wait_ms() == 0 and (gate.admitted, gate.bytes) == (0, 0)


def test_a_free_slot_goes_to_the_job_that_waits_first():
    """First come, first served: a job waiting for a slot gets the one freed before a newcomer,
    whether the newcomer waits or arrives just as it is freed."""
    gate = gate_of(predicted_ms=100)
    (running,) = _busy_slots(gate, 100)
    order = []

    def admit(name):
        ticket = gate.enter(0)
        ticket.admit(WORK, 0)
        order.append(name)
        return ticket

    first = threading.Thread(target=lambda: order.append(admit("first").release()))
    first.start()
    wait_until(lambda: gate.waiting == 1, timeout=HANG, interval=0.01)
    second = threading.Thread(target=lambda: admit("second").release())
    second.start()
    wait_until(lambda: gate.waiting == 2, timeout=HANG, interval=0.01)
    running.release()
    first.join(HANG)
    second.join(HANG)
    assert order[0] == "first" and "second" in order
    assert (gate.admitted, gate.bytes, gate.waiting) == (0, 0, 0)


def test_a_predicted_wait_past_the_bound_is_503_with_retry_after_the_drain(app, client):
    services(app).cost = CostModel(a=0, b=0, c=0)  # the request itself is predicted at 0 ms
    gate = services(app).admission
    held = _busy_slots(gate, 60_000)  # a minute of work ahead on every slot
    try:
        r = post(client)
        assert r.status_code == 503 and r.json["error"]["code"] == "overloaded"
        assert "ATTN_MAX_QUEUE_WAIT_MS" in r.json["error"]["message"]
        assert 50 <= int(r.headers["Retry-After"]) <= 60  # the predicted drain time
        assert "compute" not in r.headers["Server-Timing"] and "queue" not in r.headers["Server-Timing"]  # refused at once
        r = post(client, **{"X-Deadline-Ms": "10000"})  # met alone, missed behind the queue: not now
        assert r.status_code == 503 and "X-Deadline-Ms" in r.json["error"]["message"] and int(r.headers["Retry-After"]) >= 50
    finally:
        for ticket in held:
            ticket.release()
    r = post(client, **{"X-Deadline-Ms": "10000"})
    assert r.status_code == 200
    r.get_data()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_a_short_wait_is_waited_for(app, client):
    services(app).cost = CostModel(a=0, b=0, c=0)
    gate = services(app).admission
    held = _busy_slots(gate, 200)
    timer = threading.Timer(0.3, lambda: [t.release() for t in held])
    timer.start()
    try:
        r = post(client)
        assert r.status_code == 200 and "queue" in r.headers["Server-Timing"]
        r.get_data()
    finally:
        timer.join()
    assert (gate.admitted, gate.bytes) == (0, 0)


def test_no_answer_starts_after_its_deadline(app, client, rng, monkeypatch):
    """A compute predicted in time that ends past the deadline (here made slow on purpose, with no
    block boundary to stop at) is answered 504, never a late 200; its ticket is given back."""
    from schemas.jobs import AttentionJob

    services(app).cost = CostModel(a=0, b=0, c=0)  # predicted at about 0 ms: admitted
    compute, passed = AttentionJob.compute, threading.Event()

    def slow(self, threads=1, pool=None, stop=None):
        passed.wait(1.0)  # past the deadline below
        return compute(self, threads, pool, None)

    monkeypatch.setattr(AttentionJob, "compute", slow)
    r = post(client, **{"X-Deadline-Ms": "500"})
    assert r.status_code == 504 and r.json["error"]["code"] == "deadline", r.json
    assert "before its answer could start" in r.json["error"]["message"]
    assert "compute" in r.headers["Server-Timing"]
    gate = services(app).admission
    assert (gate.admitted, gate.bytes) == (0, 0)
    assert post(client, **{"X-Deadline-Ms": "100000"}).status_code == 200


def _sample(metric, suffix: str, **labels) -> float:
    """metric's sample named with suffix (_total, _count) for labels, summed (0 if none yet)."""
    return sum(s.value for s in metric.collect()[0].samples if s.name.endswith(suffix) and s.labels.items() >= labels.items())


def test_an_answer_sent_after_its_deadline_is_counted_not_refused(app, client, rng):
    """The deadline covers the server's work until the answer starts: an answer started in time is
    sent however long its client takes to read it; /metrics counts the time it took and, past the
    deadline, one answer late."""
    q = rng.standard_normal((2, 32, 8))
    before_late = _sample(metrics.LATE_ANSWERS, "_total", endpoint="/attention")
    before_sent = _sample(metrics.ANSWER_SEND, "_count", endpoint="/attention")
    r = post(client, {"q": b64(q), "k": b64(q), "v": b64(q)}, **{"X-Deadline-Ms": "1000"})
    assert r.status_code == 200 and r.is_streamed  # started in time; its body not yet read
    threading.Event().wait(1.1)  # the client reads it only after the deadline
    r.get_data()
    assert _sample(metrics.LATE_ANSWERS, "_total", endpoint="/attention") == before_late + 1
    assert _sample(metrics.ANSWER_SEND, "_count", endpoint="/attention") > before_sent
    r = post(client, {"q": b64(q), "k": b64(q), "v": b64(q)}, **{"X-Deadline-Ms": "100000"})
    r.get_data()
    assert _sample(metrics.LATE_ANSWERS, "_total", endpoint="/attention") == before_late + 1  # read in time: not late


def test_a_deadline_that_passes_mid_compute_stops_it_between_blocks(app, client, rng, monkeypatch):
    """The core asks the stop hook before each block: past the deadline it stops, 504, and the slot
    and bytes are given back at once; far fewer blocks are computed than the job has."""
    from service.core import kernels

    services(app).cost = CostModel(a=0, b=0, c=0)  # predicted at 0 ms: admitted, then too slow
    computed, block = [], kernels._block

    def slow_block(*args):
        computed.append(1)
        threading.Event().wait(0.05)
        return block(*args)

    monkeypatch.setattr(kernels, "_block", slow_block)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 64)  # many blocks
    q = rng.standard_normal((4, 64, 8))
    body = {"q": b64(q), "k": b64(q), "v": b64(q), "return_weights": False}
    blocks = len(kernels.plan(4, 64, 64, 8, itemsize=4, return_weights=False).blocks)
    assert blocks > 10
    r = post(client, body, **{"X-Deadline-Ms": "300"})
    assert r.status_code == 504 and r.json["error"]["code"] == "deadline" and "Stopped" in r.json["error"]["message"]
    assert len(computed) < blocks
    gate = services(app).admission
    assert (gate.admitted, gate.bytes) == (0, 0) and gate._slots.acquire(blocking=False)
    gate._slots.release()


def test_limits_state_the_admission_policy(client, settings):
    policy = client.get("/limits").json["admission"]
    assert "queue_order" not in policy  # one order only: nothing to state
    assert policy["max_queue_wait_ms"] == settings.max_queue_wait_ms
    assert policy["compute_slots_per_worker"] == settings.max_inflight
    assert policy["max_inflight_bytes"] == settings.max_inflight_bytes


# --- the server's bound: a census shared by the workers (service/admission/census.py) -----------

FORK = multiprocessing.get_context("fork")  # a worker is forked from the arbiter that made the table
HANG = 30.0  # seconds: only ever stops a hang


def _in_child(target, *args) -> int:
    """Run target(*args) in a forked process to its end; its exit code (0: its asserts held)."""
    proc = FORK.Process(target=target, args=args)
    proc.start()
    proc.join(HANG)
    assert not proc.is_alive(), "the child hung"
    return proc.exitcode


def _admit_n_and_exit(table, capacity, n):
    """A worker that joins, admits n requests and dies holding them (no release, no goodbye)."""
    row = table.join(capacity)
    ok = [table.admit(row)[0] for _ in range(n)]
    os._exit(0 if all(ok) else 1)


def test_one_worker_may_hold_more_than_its_share_while_the_server_has_room():
    table = census.Table(rows=4)
    mine = table.join(2)
    child = FORK.Process(target=_admit_n_and_exit, args=(table, 2, 3))  # 3 > its own 2: the server has 4
    child.start()
    child.join(HANG)
    assert child.exitcode == 0
    assert table.total(census.ADMITTED) == 3 and table.total(census.CAPACITY) == 4
    assert table.admit(mine) == (True, 3, 4)
    assert table.admit(mine) == (False, 4, 4)  # the server's bound, whichever worker asks
    table.forget(child.pid)  # the arbiter's child_exit: the dead worker's counts do not leak
    assert (table.total(census.ADMITTED), table.total(census.CAPACITY)) == (1, 2)
    assert table.admit(mine) == (True, 1, 2) and table.admit(mine)[0] is False


def test_a_joining_worker_frees_the_rows_of_dead_processes():
    table = census.Table(rows=2)
    assert _in_child(_admit_n_and_exit, table, 6, 5) == 0  # gone, its row not forgotten by anyone
    assert table.total(census.ADMITTED) == 5
    row = table.join(6)
    assert (table.total(census.ADMITTED), table.total(census.CAPACITY)) == (0, 6)
    assert table.join(6) == row  # joining again keeps one row


def _die_holding_the_lock(table):
    with table._lock:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_holding_the_lock_does_not_wedge_the_others():
    table = census.Table(rows=4)
    row = table.join(2)
    assert _in_child(_die_holding_the_lock, table) == -signal.SIGKILL
    done = []
    thread = threading.Thread(target=lambda: done.append(table.admit(row)), daemon=True)
    thread.start()
    thread.join(HANG)
    assert done == [(True, 0, 2)]  # the kernel released the dead process's record lock


def _compute_until(table, started, stop, capacity=6):
    """A sibling worker: joins, admits one request that computes until stop is set."""
    row = table.join(capacity)
    table.admit(row)
    table.add(row, census.COMPUTING, 1)
    started.set()
    stop.wait(HANG)
    os._exit(0)


def test_server_computing_counts_every_worker(settings, monkeypatch):
    table = census.Table(rows=4)
    monkeypatch.setattr(census, "_shared", table)  # as in a worker forked from the arbiter
    app = create_app(settings)
    gate = services(app).admission
    assert gate.table is table
    started, stop = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_compute_until, args=(table, started, stop))
    child.start()
    try:
        assert started.wait(HANG)
        ticket = gate.enter(0)
        ticket.admit(WORK, 0)
        assert ticket.running
        with app.app_context():
            assert gate.computing() == 2  # this worker's and the other's
        ticket.release()
        assert gate.computing() == 1
    finally:
        stop.set()
        child.join(HANG)


def test_without_a_shared_table_server_computing_is_this_apps_count(app, client):
    gate = services(app).admission
    assert not gate.table.shared
    ticket = gate.enter(0)
    with app.app_context():
        assert gate.computing() == 0
        ticket.admit(WORK, 0)
        assert ticket.running
        assert gate.computing() == 1
    ticket.release()
    with app.app_context():
        assert gate.computing() == 0


def test_busy_counts_each_workers_admitted_up_to_its_compute_slots():
    """The count the cost model's slowdown is keyed by: what will compute at once in the server."""
    table = census.Table(rows=3, shared=False)
    gate = gate_of(max_inflight=2, max_queue=4, table=table)
    assert gate.busy() == 0
    ticket = gate.enter(0)
    assert gate.busy() == 1  # the request itself, being read
    for row, admitted in ((1, 5), (2, 1)):  # two siblings: one with 3 waiting beyond its 2 slots
        table.cells[row * census.FIELDS + census.ADMITTED] = admitted
    assert gate.busy() == 1 + 2 + 1
    ticket.release()


def test_the_gate_refuses_at_the_servers_bound_with_retry_after():
    table = census.Table(rows=4)
    gate = gate_of(max_inflight=1, max_queue=1, table=table)
    started, stop = FORK.Event(), FORK.Event()
    sibling = FORK.Process(target=_compute_until, args=(table, started, stop, 2))  # holds 1 of its 2
    sibling.start()
    try:
        assert started.wait(HANG)
        held = [gate.enter(0) for _ in range(3)]  # 3 > this worker's own 2: the server's bound is 4
        with pytest.raises(Refused) as err:
            gate.enter(0)
        assert err.value.code == "overloaded" and err.value.retry_after >= 1
        assert "already holds 4" in err.value.message and "x 2 workers" in err.value.message
        held.pop().release()
        gate.enter(0).release()  # room again
        for ticket in held:
            ticket.release()
        assert (gate.admitted, table.total(census.ADMITTED)) == (0, 1)
    finally:
        stop.set()
        sibling.join(HANG)


def test_busiest_margin_compares_with_the_least_busy_sibling():
    """What the worker's connection placement reads (service.web.front.Front.margin)."""
    table = census.Table(rows=4)
    mine = table.join(6)
    assert table.busiest_margin(mine) == 0  # alone: never crowded
    started, stop = FORK.Event(), FORK.Event()
    sibling = FORK.Process(target=_compute_until, args=(table, started, stop))  # holds 1
    sibling.start()
    try:
        assert started.wait(HANG)
        for _ in range(3):
            table.admit(mine)
        assert table.busiest_margin(mine) == 2
    finally:
        stop.set()
        sibling.join(HANG)


def test_limits_reports_the_servers_slots(client, settings):
    assert client.get("/limits").json["server_slots"] == settings.max_inflight + settings.max_queue  # one worker, alone


def test_a_draining_worker_draws_no_clients(settings, monkeypatch):
    """After SIGTERM (ops.drain) a worker accepts no connection: siblings stop comparing themselves
    with it (busiest_margin), while its slots and what it holds still count until it exits."""
    table = census.Table(rows=4)
    monkeypatch.setattr(census, "_shared", table)
    started, stop = FORK.Event(), FORK.Event()
    sibling = FORK.Process(target=_compute_until, args=(table, started, stop))  # holds 1
    sibling.start()
    try:
        assert started.wait(HANG)
        app = create_app(settings)
        gate = services(app).admission
        held = [gate.enter(0) for _ in range(3)]
        row = next(r for r in range(table.rows) if table.cells[r * census.FIELDS + census.PID] == sibling.pid)
        assert table.busiest_margin(row) == -2 and table.busiest_margin(gate.row) == 2
        ops.drain(app)
        assert table.busiest_margin(row) == 0  # as if alone: nothing to send its way
        assert table.total(census.ADMITTED) == 4 and table.total(census.CAPACITY) == 6 + gate.max_inflight + gate.max_queue
        for ticket in held:
            ticket.release()
    finally:
        stop.set()
        sibling.join(HANG)
