"""The worker's pipe of answers sending (service/web/sending.py): the arithmetic admission predicts
an answer's last byte by, as laws of sharing one rate equally."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.web.sending import Others, Pipe, Send, drained, finish_ms

lefts = st.lists(st.floats(0, 1e8), max_size=12)
rates = st.floats(0.01, 100.0)


def test_equal_answers_alone_finish_together_at_their_sum():
    """n answers of b bytes sharing the pipe each finish when n x b bytes have been sent."""
    assert finish_ms([2e6, 2e6, 2e6], 5.0) == pytest.approx([30.0, 30.0, 30.0])
    assert finish_ms([1e6], 5.0) == pytest.approx([5.0])


def test_the_smallest_finishes_first_and_the_rest_share_what_is_left():
    # 1 MB and 3 MB at 10 ms/MB: both send 1 MB each (20 ms), then the 3 MB one its last 2 MB alone.
    assert finish_ms([3e6, 1e6], 10.0) == pytest.approx([40.0, 20.0])


@given(lefts, rates, st.floats(0, 1e5))
def test_draining_sends_the_pipes_bytes_and_no_more(before, ms_per_mb, ms):
    after = drained(before, ms, ms_per_mb)
    assert all(0 <= a <= b for a, b in zip(after, before, strict=True))
    sent = sum(before) - sum(after)
    assert sent == pytest.approx(min(sum(before), ms * 1e6 / ms_per_mb), rel=1e-6, abs=1e-3)


@given(lefts, rates, st.floats(0, 1e8))
def test_a_new_answer_delays_every_other_and_finishes_no_sooner_than_its_own_bytes(before, ms_per_mb, new):
    alone = finish_ms(before, ms_per_mb)
    together = finish_ms([*before, new], ms_per_mb)
    assert all(t >= a - 1e-6 * max(a, 1.0) for t, a in zip(together, alone, strict=False))
    assert together[-1] >= new * ms_per_mb / 1e6 * (1 - 1e-9)
    # The last byte of all is written once every byte has been: the pipe is never idle meanwhile.
    assert max(together) == pytest.approx(sum([*before, new]) * ms_per_mb / 1e6, rel=1e-6, abs=1e-6)


@given(lefts, rates, st.floats(0, 1e5))
def test_finishing_times_are_consistent_with_draining(before, ms_per_mb, ms):
    """After ms of draining, what was to finish at f finishes at f - ms (or has finished)."""
    then = finish_ms(drained(before, ms, ms_per_mb), ms_per_mb)
    for f, g in zip(finish_ms(before, ms_per_mb), then, strict=True):
        assert g == pytest.approx(max(f - ms, 0.0), rel=1e-6, abs=1e-3)


def test_the_pipe_gives_each_answer_its_share_and_drains_it():
    pipe = Pipe()
    a, b = Send(2_000_000), Send(4_000_000)
    pipe.advance(10.0, 10.0)
    pipe.sends += [a, b]
    pipe.advance(10.020, 10.0)  # 20 ms at 10 ms/MB: 2 MB sent, 1 MB each
    assert (a.left, b.left) == pytest.approx((1e6, 3e6))
    assert a.share_ms == pytest.approx(10.0) and b.share_ms == pytest.approx(10.0)
    assert pipe.finishes(10.0) == pytest.approx([20.0, 40.0])
    assert (a.nbytes - a.left) / a.share_ms == pytest.approx(1e6 / 10.0)  # bytes sent over its share: the pipe's rate


def test_the_other_workers_answers_take_their_share():
    pipe = Pipe()
    mine = Send(1_000_000)
    pipe.advance(0.0, 10.0)
    pipe.sends.append(mine)
    others = Others(count=1, left=1_000_000)
    assert pipe.finishes(10.0, others=others) == pytest.approx([20.0])  # half the pipe: twice as long
    pipe.advance(0.010, 10.0, others)
    assert mine.left == pytest.approx(5e5) and mine.share_ms == pytest.approx(5.0)


def test_respond_counts_what_drains_before_and_what_starts_with_it():
    pipe = Pipe()
    pipe.advance(0.0, 10.0)
    pipe.sends.append(Send(2_000_000))
    assert pipe.respond_ms(1_000_000, 0.0, [], 10.0) == pytest.approx(20.0)  # beside 2 MB: both send 1 MB
    assert pipe.respond_ms(1_000_000, 20.0, [], 10.0) == pytest.approx(10.0)  # sent by then: alone
    assert pipe.respond_ms(1_000_000, 20.0, [1_000_000], 10.0) == pytest.approx(20.0)  # beside one ahead of it
    assert Pipe().respond_ms(0, 0.0, [], 10.0) == 0.0


def test_a_send_without_deadline_has_none():
    assert Send(10).deadline == math.inf and Send(10).left == 10.0
