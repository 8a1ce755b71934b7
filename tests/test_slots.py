"""Compute slots handed in the queue's order (service/web/slots.py), and the earliest-deadline-first
queue built on them (ATTN_QUEUE_ORDER=edf, service/web/admission.py)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from service.config import Settings
from service.web import admission, create_app
from service.web.slots import Slots

from .helpers import wait_until

HANG = 10.0


def _queue(slots: Slots, keys: list[tuple], got: list) -> list[threading.Thread]:
    """One waiter a key, queued in the order given; each appends its key once it has a slot."""
    threads: list[threading.Thread] = []
    for key in keys:
        thread = threading.Thread(target=lambda k=key: slots.take(k, HANG) and got.append(k))
        thread.start()
        queued = len(threads) + 1
        wait_until(lambda n=queued: slots.waiting == n, timeout=HANG, interval=0.005)
        threads.append(thread)
    return threads


def test_a_freed_slot_goes_to_the_least_key_whatever_the_order_of_arrival():
    slots, got = Slots(1), []
    assert slots.try_take() and not slots.try_take()
    threads = _queue(slots, [(3.0,), (1.0,), (2.0,)], got)
    for n in range(1, 4):
        slots.give()
        wait_until(lambda n=n: len(got) == n, timeout=HANG, interval=0.005)
    for thread in threads:
        thread.join(HANG)
    assert got == [(1.0,), (2.0,), (3.0,)] and slots.waiting == 0 and slots.free == 0
    slots.give()
    assert slots.free == 1


def test_a_waiter_that_times_out_leaves_the_queue_and_the_slot_goes_on():
    slots, got = Slots(1), []
    assert slots.try_take()
    assert not slots.take((0.0,), 0.05) and slots.waiting == 0
    threads = _queue(slots, [(2.0,)], got)
    slots.give()
    threads[0].join(HANG)
    assert got == [(2.0,)]


def test_no_newcomer_takes_a_slot_while_a_job_waits():
    slots, got = Slots(1), []
    assert slots.try_take()
    threads = _queue(slots, [(5.0,)], got)
    slots.give()
    assert not slots.try_take()  # it went to the waiter
    threads[0].join(HANG)
    assert got == [(5.0,)]


def _waiting(gate: admission.Gate, deadline_in_s: float, predicted_ms: float) -> admission.Ticket:
    """A validated job queued at gate, due deadline_in_s from now, with that much to compute."""
    ticket = gate.enter(0)
    due = time.perf_counter() + deadline_in_s
    ticket.reserve(0, predicted_ms, 0, gate.next_key(due), due - predicted_ms / 1000)
    return ticket


def test_edf_puts_a_job_due_sooner_ahead_and_fifo_does_not():
    for order, sooner_waits_for_both in (("fifo", True), ("edf", False)):
        gate = admission.Gate(max_inflight=1, max_queue=8, max_bytes=1_000, order=order)
        running = _waiting(gate, 60, 1_000)
        assert running.take_slot()
        later = _waiting(gate, 60, 1_000)
        sooner = gate.key(time.perf_counter() + 5)  # the place of a job due in 5 s
        ahead = gate.wait_ms(sooner)
        assert (ahead > 1_500) is sooner_waits_for_both, (order, ahead)  # the later job's 1 s counted, or not
        for ticket in (running, later):
            ticket.release()


def test_edf_refuses_to_put_a_job_ahead_of_one_it_would_make_late():
    """A job due sooner goes ahead of those waiting, unless that makes one of them, on time
    without it, miss its deadline: then the newcomer is refused (admit's 503), not the one waiting."""
    gate = admission.Gate(max_inflight=1, max_queue=8, max_bytes=1_000, order="edf")
    running = _waiting(gate, 60, 1_000)
    assert running.take_slot()
    tight = _waiting(gate, 2.5, 1_000)  # gets its slot in about 1 s, computes 1 s: due in 2.5 s
    sooner = gate.key(time.perf_counter() + 2.0, -1)
    assert gate.made_late(sooner, 200) == 0  # 0.2 s more of wait: still on time
    assert gate.made_late(sooner, 1_000) == 1  # 1 s more: it would start too late
    assert gate.made_late(gate.key(math.inf, math.inf), 10_000) == 0  # a job due later goes behind it
    for ticket in (running, tight):
        ticket.release()


def test_the_queue_order_is_a_setting_and_listed(monkeypatch):
    monkeypatch.setenv("ATTN_QUEUE_ORDER", "EDF")
    assert Settings.from_env().queue_order == "edf"
    app = create_app(Settings(warmup=False, queue_order="edf"))
    assert app.test_client().get("/limits").get_json()["admission"]["queue_order"] == "edf"
    monkeypatch.setenv("ATTN_QUEUE_ORDER", "lifo")
    with pytest.raises(SystemExit, match="ATTN_QUEUE_ORDER"):
        Settings.from_env()
