"""One cell of the sweep: `concurrency` workers send one prepared body, then a summary.

Closed loop (default): each worker sends its next request as soon as the last one is
answered, so latency is measured from the actual send.

Open loop (`rate`): arrivals are scheduled at t0 + i/rate whatever the server does, and
latency is measured from the *scheduled* time. When every worker is busy, the next
request starts late and that wait counts, as it would for a user: a slow server cannot
hide its queue by slowing the generator down (coordinated omission).

Both loops stop at the cell's request count or duration, and always at the hard bounds
`max_requests` and `max_seconds` (a request in flight at the bound may finish, up to
its `timeout_s`; one the server holds longer is abandoned).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import requests

from .transport import DETAIL_BYTES, PHASES, Reply, check_reachable, new_session, post

JOIN_GRACE_S = 2.0  # past max_seconds + timeout_s, a cell waits this long for a request in flight


@dataclass(frozen=True)
class Load:
    """How hard and how long one cell pushes. Exactly one of `requests`, `duration_s`."""

    concurrency: int
    requests: int | None = None
    duration_s: float | None = None
    rate: float | None = None  # open-loop arrivals per second; None = closed loop
    max_requests: int = 10_000
    max_seconds: float = 60.0
    timeout_s: float = 30.0
    warmup: int = 1
    api_key: str | None = None  # sent as Authorization: Bearer

    def __post_init__(self) -> None:
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of requests and duration_s")


@dataclass(frozen=True)
class Sample:
    """One timed request: latency in seconds, HTTP status or None with `error`."""

    latency_s: float
    status: int | None
    error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    reason: str = ""  # for a non-2xx status: the server's code and message, numbers blanked (reason_of)


def reason_of(detail: str) -> str:
    """`"503 overloaded: ... # ms ..."`: an error's detail with its numbers blanked, so that the
    refusals of one kind (the server's code and the sentence it explains them with) count together."""
    status, _, said = detail.partition(" ")
    return f"{status} {re.sub(r'[0-9][0-9.e+]*', '#', said)}"[:160]


@dataclass
class CellRun:
    """What the workers of one cell saw, before any statistics."""

    samples: list[Sample]
    elapsed_s: float
    unsent: int = 0  # planned requests the hard bounds cut off
    capped: str = ""  # which hard bound stopped the cell early, if any
    refused: str = ""  # the warm-up's error when the server refused the body


@dataclass
class CellResult:
    """The summary of one (T, concurrency) cell, one row of results.csv."""

    T: int
    concurrency: int
    body_bytes: int
    sent: int
    ok: int
    errors: dict[str, int]  # "503", "504", "413", "timeout", "connection" -> count
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    throughput_rps: float  # successful responses per second of the cell
    elapsed_s: float
    phases_ms: dict[str, float]  # Server-Timing medians over successful responses
    unsent: int = 0
    rounds: int = 1
    round_p50s_ms: list[float] = field(default_factory=list)  # one per round with a success
    refused: bool = False  # a warm-up request was refused; that round timed nothing
    note: str = ""
    reasons: dict[str, int] = field(default_factory=dict)  # the server's refusals: "503 overloaded: ..." -> count

    @property
    def error_count(self) -> int:
        """Requests sent that got no 200."""
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        """error_count / sent; 1.0 when nothing was sent."""
        return self.error_count / self.sent if self.sent else 1.0

    @property
    def round_spread(self) -> float:
        """max / min of the rounds' p50s: 1.0 on a quiet machine; NaN with fewer than 2."""
        if len(self.round_p50s_ms) < 2:
            return math.nan
        return max(self.round_p50s_ms) / min(self.round_p50s_ms)

    def percentile(self, name: str) -> float:
        """`"p50"` -> p50_ms, for the SLO metric chosen on the command line."""
        return float(getattr(self, f"{name}_ms"))


class _Schedule:
    """Hands out send times to the workers under one lock; owns every stop rule of a cell."""

    def __init__(self, load: Load, t0: float, stop: threading.Event) -> None:
        self.load, self.t0, self.stop = load, t0, stop
        self.issued = 0
        self.capped = ""
        self._lock = threading.Lock()
        if load.requests is not None:
            self.planned: int | None = load.requests
        elif load.rate is not None:
            assert load.duration_s is not None  # Load holds exactly one of requests and duration_s
            self.planned = math.ceil(load.duration_s * load.rate)
        else:
            self.planned = None  # closed loop for a duration: as many as fit
        self.end = t0 + (load.duration_s if load.duration_s is not None else math.inf)
        self.hard_end = t0 + load.max_seconds

    def take(self) -> float | None:
        """The perf_counter time at which to send the next request, or None to stop."""
        with self._lock:
            now = time.perf_counter()
            at = now if self.load.rate is None else self.t0 + self.issued / self.load.rate
            if self.stop.is_set() or (self.planned is not None and self.issued >= self.planned):
                return None
            if self.planned is None and now >= self.end:
                return None
            if self.issued >= self.load.max_requests:
                self.capped = f"stopped at the bound of {self.load.max_requests} requests"
                return None
            if max(now, at) >= self.hard_end:
                self.capped = f"stopped at the bound of {self.load.max_seconds:g} s"
                return None
            self.issued += 1
            return at


def _worker(session: requests.Session, url: str, body: bytes, schedule: _Schedule, timeout_s: float, out: list[Sample]) -> None:
    while (at := schedule.take()) is not None:
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        reply = post(session, url, body, timeout_s)
        reason = reason_of(reply.detail) if reply.status is not None and reply.status != 200 else ""
        out.append(Sample(reply.done_at - at, reply.status, reply.error, reply.phases, reason))


def _warm_up(sessions: list[requests.Session], url: str, base_url: str, body: bytes, load: Load) -> Reply | None:
    """Open each session's connection; send the real body `load.warmup` times on the first.

    Returns the reply if the server refuses the body with a 4xx (too long, unauthorized...:
    every request of the cell would be), and raises ConnectionFailure if the server cannot
    be reached at all. A 5xx or a timeout is load, not refusal: the cell goes on and counts it.
    """
    for _ in range(load.warmup):
        reply = post(sessions[0], url, body, load.timeout_s)
        if reply.error == "connection":
            check_reachable(base_url)  # raises if the server is gone, not just this request
        if reply.status is not None and 400 <= reply.status < 500:
            return reply
    for session in sessions[1:]:
        try:
            with session.get(f"{base_url}/healthz", timeout=load.timeout_s, stream=True) as response:
                response.raw.read(DETAIL_BYTES)  # read whole, the connection stays for the cell; but never more than this
        except requests.RequestException:
            check_reachable(base_url)
    return None


def run_cell(base_url: str, body: bytes, load: Load, stop: threading.Event | None = None) -> CellRun:
    """Send `body` to `{base_url}/attention` under `load`; raise ConnectionFailure if unreachable."""
    url = f"{base_url}/attention"
    stop = stop or threading.Event()
    sessions = [new_session(load.api_key) for _ in range(load.concurrency)]
    try:
        refused = _warm_up(sessions, url, base_url, body, load)
        if refused is not None:
            sample = Sample(refused.done_at - refused.sent_at, refused.status)
            return CellRun([sample], 0.0, refused=f"refused: {refused.detail.rstrip('.')}")
        outs: list[list[Sample]] = [[] for _ in sessions]
        t0 = time.perf_counter()
        schedule = _Schedule(load, t0, stop)
        threads = [
            threading.Thread(target=_worker, args=(s, url, body, schedule, load.timeout_s, out), daemon=True)
            for s, out in zip(sessions, outs, strict=True)
        ]
        for thread in threads:
            thread.start()
        # No request is sent past max_seconds, and post() bounds each by timeout_s, but a server
        # that trickles an answer's head outlasts any per-read timeout: past the bounds (and a
        # grace) a worker still waiting is abandoned (a daemon thread, sending nothing more).
        end = t0 + load.max_seconds + load.timeout_s + JOIN_GRACE_S
        try:
            for thread in threads:
                thread.join(max(0.0, end - time.perf_counter()))
        except KeyboardInterrupt:
            stop.set()  # workers finish their request in flight and send no more
            raise
        elapsed = time.perf_counter() - t0
        stuck = sum(thread.is_alive() for thread in threads)
        if stuck:
            stop.set()
            schedule.capped = (
                f"{stuck} request(s) still unanswered {load.timeout_s + JOIN_GRACE_S:g} s past the bound of "
                f"{load.max_seconds:g} s, abandoned"
            )
    finally:
        for session in sessions:
            session.close()
    samples = [s for out in outs for s in list(out)]  # an abandoned worker may append later
    if samples and all(s.error == "connection" for s in samples):
        check_reachable(base_url)
    unsent = schedule.planned - schedule.issued if schedule.planned is not None else 0
    return CellRun(samples, elapsed, unsent=unsent, capped=schedule.capped)


def summarize(T: int, concurrency: int, body_bytes: int, runs: Sequence[CellRun]) -> CellResult:
    """Pool the samples of one or more runs (rounds) of a cell into its summary.

    Percentiles are over the successful (200) responses; every other outcome is an error,
    counted by status ("503", "504", "413" ...) or by "timeout"/"connection". The p50 of
    each round is kept apart too: their spread says how noisy the machine was.
    """
    samples = [s for run in runs for s in run.samples]
    elapsed = sum(run.elapsed_s for run in runs)
    ok = [s for s in samples if s.status == 200]
    errors = Counter(str(s.status) if s.status is not None else s.error or "unknown" for s in samples if s.status != 200)
    reasons = Counter(s.reason for s in samples if s.reason)
    lat_ms = np.array([s.latency_s * 1e3 for s in ok])
    if lat_ms.size:
        p50, p90, p99 = np.percentile(lat_ms, [50, 90, 99])
        top, mean = lat_ms.max(), lat_ms.mean()
    else:
        p50 = p90 = p99 = top = mean = math.nan
    phases = {}
    for name in PHASES:
        values = [s.phases[name] for s in ok if name in s.phases]
        if values:
            phases[name] = float(np.median(values))
    round_p50s = [
        float(np.median([s.latency_s * 1e3 for s in run.samples if s.status == 200]))
        for run in runs
        if any(s.status == 200 for s in run.samples)
    ]
    notes = [run.refused or run.capped for run in runs if run.refused or run.capped]
    return CellResult(
        T=T,
        concurrency=concurrency,
        body_bytes=body_bytes,
        sent=len(samples),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        reasons=dict(reasons.most_common()),
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        max_ms=float(top),
        mean_ms=float(mean),
        throughput_rps=len(ok) / elapsed if elapsed > 0 else 0.0,
        elapsed_s=elapsed,
        phases_ms=phases,
        unsent=sum(run.unsent for run in runs),
        rounds=len(runs),
        round_p50s_ms=round_p50s,
        refused=any(run.refused for run in runs),
        note="; ".join(dict.fromkeys(notes)),
    )
