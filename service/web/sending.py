"""The answers one worker is encoding and sending, taken as one pipe they share: what admission
reads to predict when a new answer's last byte will have been written, and to keep a new answer
from making those already being sent miss their X-Deadline-Ms.

The pipe is the server's encoding and the clients' reading together, at one rate (ms per MB, the
cost model's respond_ms_per_mb) shared equally by the answers sending at once (processor
sharing): n answers each get 1/n of it. The answers of the other workers share it too (the
machine's cores and network): each worker models its own, and counts the others' as the census
tells them (Others: how many, and the bytes their workers last took them to have left). The transport does not report how far each answer has
gone, so the pipe keeps a model of it: each answer's bytes left, drained by its share of the rate
between events (an answer starting, an answer's last byte written). From the bytes left, the
moment each answer will finish follows: the one with the fewest bytes left finishes first, when
the n of them have sent that many each, and so on.

And each answer's share of the pipe over its life (the integral of 1/n over the time it was
sending) is kept: its bytes over that share is the pipe's rate as that answer saw it, exact under
equal sharing whatever joined or left meanwhile, which is what the cost model learns the rate from
(CostModel.observe_respond).

Plain data and arithmetic: the caller (admission.py) holds the lock and the clock."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Others:
    """The other workers' answers sending: how many, and their bytes left (as their workers last
    modelled them)."""

    count: int = 0
    left: float = 0.0

    def lefts(self) -> list[float]:
        return [self.left / self.count] * self.count if self.count > 0 else []


NOBODY = Others()


@dataclass(eq=False)
class Send:
    """One answer in the pipe."""

    nbytes: int  # its bytes on the wire (as predicted: cost.answer_bytes)
    deadline: float = math.inf  # perf_counter() by which its last byte must be written (inf: none)
    left: float = field(init=False)  # the bytes the model takes it still has to send
    share_ms: float = 0.0  # the integral of 1/n over its sending, in ms

    def __post_init__(self) -> None:
        self.left = float(self.nbytes)


def drained(lefts: list[float], ms: float, ms_per_mb: float) -> list[float]:
    """Bytes left of each answer after ms more of the pipe shared equally among those not done."""
    lefts = list(lefts)
    budget = ms * 1e6 / ms_per_mb if ms_per_mb > 0 else math.inf  # the bytes the pipe sends in ms
    while budget > 0:
        busy = [i for i, left in enumerate(lefts) if left > 0]
        if not busy:
            break
        step = min(min(lefts[i] for i in busy), budget / len(busy))  # each, until the first is done or the time is
        for i in busy:
            lefts[i] -= step
        budget -= step * len(busy)
        if step <= 0:
            break
    return [max(left, 0.0) for left in lefts]


def finish_ms(lefts: list[float], ms_per_mb: float) -> list[float]:
    """Milliseconds from now until each answer's last byte is written, the pipe shared equally
    among those not yet done."""
    order = sorted(range(len(lefts)), key=lefts.__getitem__)
    out, t, before = [0.0] * len(lefts), 0.0, 0.0
    for rank, i in enumerate(order):
        t += (len(lefts) - rank) * (lefts[i] - before) * ms_per_mb / 1e6
        before, out[i] = lefts[i], t
    return out


class Pipe:
    """The answers one worker sends, modelled as they drain."""

    def __init__(self) -> None:
        self.sends: list[Send] = []
        self._at: float | None = None  # perf_counter() the model was last moved to

    def advance(self, now: float, ms_per_mb: float, others: Others = NOBODY) -> None:
        """Move the model to now: each answer sending, this worker's and the others', had 1/n of
        the pipe since the last event."""
        if self._at is not None and self.sends and now > self._at:
            ms = (now - self._at) * 1000
            n = len(self.sends) + max(others.count, 0)
            for send in self.sends:
                send.share_ms += ms / n
            lefts = drained([s.left for s in self.sends] + others.lefts(), ms, ms_per_mb)
            for send, left in zip(self.sends, lefts, strict=False):
                send.left = left
        self._at = now

    def left(self) -> int:
        """The bytes this worker's answers sending have left, as modelled."""
        return int(sum(s.left for s in self.sends))

    def finishes(self, ms_per_mb: float, new: Send | None = None, others: Others = NOBODY) -> list[float]:
        """ms from the model's now until each of this worker's answers sending (then new, if
        given, starting now) has its last byte written, beside the others'."""
        sends = self.sends + ([new] if new is not None else [])
        times = finish_ms([s.left for s in sends] + others.lefts(), ms_per_mb)
        return times[: len(sends)]

    def respond_ms(self, nbytes: int, after_ms: float, ahead: list[int], ms_per_mb: float, others: Others = NOBODY) -> float:
        """Predicted ms from the start of sending an answer of nbytes, after_ms from the model's
        now, until its last byte is written: the answers sending now (this worker's and the
        others') drained by then, and those of the jobs ahead of it (ahead: their bytes) taken to
        start sending with it."""
        now = drained([s.left for s in self.sends] + others.lefts(), after_ms, ms_per_mb)
        return finish_ms([float(nbytes)] + now + [float(b) for b in ahead], ms_per_mb)[0]
