"""The cost model behind cost.predicted_ms and deadline admission:

    ms ~ a * GFLOP + b * M_score_elements + c * blocks + e * M_elements      (one (a, b, c, e) per compute dtype)

a is the matmul rate, b the per-score softmax and mask pass, c the fixed cost of one of the
numeric core's blocks (a few numpy calls; a request is at least one block, the small path's one
call of reference() too), e the cost of an element of q and out (scaled, divided, checked, and
its row's passes over the max and sum), a share of it for each of k and v's, and each output of
a matmul one term wide (d = 1's q kᵀ, one key's weights v: numpy computes those element by
element) (features.Work.elements). e is all of a request's time where S or T is tiny, or d is 1;
b, that of a wide one. Counting blocks matters for causal requests without weights past the
small path's one block, which the core cuts into thin row blocks (plan.blocks). The calibration
times a shape that is almost all of each term (calibration.CALIBRATION), so that each is pinned.
calibrate() fits them at start-up on a few shapes run through the numeric core (bounded to a
second or two); observe() refines them from computed requests by a small weighted least squares.
predict() and observe() are the whole interface: admission predicts, the compute learns.

What the fit learns from, and how much. The features count plain work, causal masks, windows,
grouped-query heads, /mha and either dtype (each dtype its own fit). A bias, ALiBi or a mask add
passes over every score, and key_lengths cut the keys the core computes: their work
(features.work_of) counts the keys computed and a measured factor over the plain time
(EXTRA_COST), and it is marked fitted=False: predicted with the coefficients plain traffic
teaches, but never taught to them (fed to the fit, a stream of such requests moved every plain
request's prediction: bench/README.md). And once calibrated, each observation teaches at most
MAX_PULL x or 1/MAX_PULL of what the calibrated coefficients predict for it: relative error weighs
a request measured at a hundredth of its prediction at a residual of 99, so any request far
cheaper than its features say (a kind they miss, a clock's glitch) otherwise drags every
prediction down with it. Nor is any prediction taken past MAX_PULL of the calibrated one: a
stream of one shape taught at that bound moves all four terms, and took shapes that share them
past it.

The fit minimises relative error, sum(((x·θ - ms) / ms)^2), since what matters is the ratio of
prediction to measurement from fractions of a millisecond to seconds alike; old observations fade
(forget), and a ridge towards the calibrated coefficients keeps the fit well posed when traffic is
all one shape (then GFLOP and score elements are proportional and cannot be told apart).
Coefficients are kept non-negative. Each worker process has its own model.

Contention. The coefficients are one thread's time with a core to itself (the alone-time). Under
load the server computes several requests at once, more threads than cores, and each runs slower.
The compute measures what its request saw: the computing thread's CPU time (time.thread_time) is
its alone-time, since a thread waiting for a core or for the GIL burns none; so observe() fits the
CPU time, and the coefficients do not drift with load. wall / CPU is the slowdown the request saw;
the model keeps a running mean of it for each count of requests busy in the server when the
request was admitted (computing or about to, itself included: admission's Gate.busy(), from the
census of every worker), starting from contention(n, cores) = max(1, n / cores). predict() gives
alone-time x the slowdown at the count busy as it admits: predicted and learned by the same count,
so what the count does not see (the GIL, this server's threads that decode and encode, other
processes on the machine) is learned, and forgotten when the load goes. cost.predicted_ms, and
/metrics' measured/predicted ratio, so compare like with like under load too. A large request
alone, split over the idle cores (split.py), is not fed to the fit: it is predicted at one
thread's time x split_factor(threads), the running mean of the share of that time splits have
taken.

What admission reads is the prediction itself, the centre of what computes take (the fit of the
relative error), not a bound above it: a deadline is refused only when the prediction says it
cannot be met. How far measurements fall from it is measured (observe()'s predicted_ms: the
running mean and spread of log(measured / predicted), spread(); /limits shows its median and 98th
percentile, /metrics the attention_cost_prediction_ratio histogram).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time

import numpy as np

from schemas import COMPUTE_DTYPES

from .calibration import CALIBRATION, median_ms, probe
from .features import Work, work_of


def contention(threads: float, cores: int) -> float:
    """How many times slower one thread's computation runs while threads (itself included)
    compute at once on cores: each gets cores / threads of a core once they outnumber the cores,
    a core of its own otherwise."""
    return max(1.0, threads / max(cores, 1))


def _running_mean(before: float, seen: float, weight: float | None = None) -> float:
    """A ratio's running geometric mean (ratios of 2 and of 0.5 cancel): log(before) moved weight
    (SLOWDOWN_WEIGHT by default) of the way towards log(seen)."""
    w = SLOWDOWN_WEIGHT if weight is None else weight
    return math.exp((1 - w) * math.log(before) + w * math.log(seen))


def _level(busy: float) -> int:
    return max(1, min(round(busy), MAX_BUSY))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; a container's CPU quota is not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# The slowdown by requests busy (and a split's share of one thread's time, by threads): the weight
# of one observation in its running (geometric) mean (a memory of a few requests: a neighbour's
# load comes and goes quickly, and a smaller weight lagged it), and the most requests counted
# apart (more are counted as that many).
SLOWDOWN_WEIGHT = 0.15
MAX_BUSY = 32
# What the coefficients multiply, as /limits shows it (the docstring's first paragraph).
FORMULA = "ms = a*GFLOP + b*M_score_elements + c*blocks + e*M_elements"
# The most one observation tells a calibrated fit: its time is taken as between 1/MAX_PULL and
# MAX_PULL times what the calibrated coefficients predict, and so is every prediction. The fit weighs relative error against
# the measured time, so a request far cheaper than predicted pulled without bound (a hundredth of
# its prediction: a residual of 99), one far dearer by at most 1. Calibrated, plain requests land
# well within it of their prediction (`pytest -s tests/test_costmodel.py -k calibrated`,
# bench/README.md), so honest traffic is not cut.
MAX_PULL = 4.0
# Standard deviations of log(measured / predicted) above its mean that spread()'s high end is: 2.05
# is the 98th percentile of a normal distribution.
SPREAD_Z = 2.05


class _Fit:
    """Weighted least squares on (GFLOP, M score elements, blocks, M elements) -> ms with
    forgetting, a ridge towards prior (relative to its size), and θ >= 0."""

    FLOOR = np.array([0.1, 0.1, 0.01, 0.1])  # smallest scale of a, b, c, e for the relative ridge

    def __init__(self, prior, forget: float, ridge: float):
        self.forget, self.ridge = forget, ridge
        n = len(prior)
        self.A = np.zeros((n, n))
        self.r = np.zeros(n)
        self.n = 0
        self.anchor(np.asarray(prior, dtype=float))

    def anchor(self, prior: np.ndarray, measured: bool = False) -> None:
        """prior: the ridge's centre; measured: it was fitted to this machine's times (calibration),
        so what one observation teaches is bounded by it (CostModel._bounded)."""
        self.prior, self.measured = prior, measured
        scale = np.maximum(np.abs(prior), self.FLOOR)
        self.R = np.diag(self.ridge / scale**2)
        self.theta = self._solve()

    def add(self, x: np.ndarray, ms: float) -> None:
        w = 1.0 / ms**2
        self.A = self.forget * self.A + w * np.outer(x, x)
        self.r = self.forget * self.r + w * x * ms
        self.n += 1
        self.theta = self._solve()

    def _solve(self) -> np.ndarray:
        A, r = self.A + self.R, self.r + self.R @ self.prior
        unconstrained = _gauss(A.tolist(), r.tolist())
        if unconstrained is not None and min(unconstrained) >= 0:  # the unconstrained optimum is feasible, so it is the best
            return np.array(unconstrained)
        n = len(r)
        best, best_loss = np.zeros(n), 0.0
        for free in itertools.product((True, False), repeat=n):  # the best θ >= 0: try every other face
            idx = np.flatnonzero(free)
            if idx.size in (0, n):
                continue
            theta = np.zeros(n)
            try:
                theta[idx] = np.linalg.solve(A[np.ix_(idx, idx)], r[idx])
            except np.linalg.LinAlgError:  # observations whose weights (1/ms^2) swamp the ridge: not this face
                continue
            if (theta < 0).any():
                continue
            loss = theta @ A @ theta - 2 * theta @ r
            if loss < best_loss:
                best, best_loss = theta, loss
        return best


def _gauss(A: list[list[float]], r: list[float]) -> list[float] | None:
    """A x = r for a small A by Gaussian elimination with partial pivoting in plain Python, None if
    A is singular: every computed request refits, and np.linalg.solve's checks and wrapping cost
    several times this on a 4 x 4 (A is positive definite, its ridge keeps it well conditioned)."""
    n = len(r)
    m = [row[:] + [r[i]] for i, row in enumerate(A)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        if not m[pivot][col] or not math.isfinite(m[pivot][col]):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            if f:
                m[i] = [x - f * y for x, y in zip(m[i], m[col], strict=True)]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x if all(math.isfinite(v) for v in x) else None


class CostModel:
    """Predicts compute milliseconds per dtype; thread-safe (gthread workers share one)."""

    def __init__(
        self,
        a: float = 10.0,
        b: float = 6.0,
        c: float = 0.1,
        e: float = 1.0,
        *,
        forget: float = 0.99,
        ridge: float = 1e-3,
        cores: int | None = None,
    ):
        # Defaults: one core of a 2-core x86 machine, single-threaded BLAS, float32 (float64: twice).
        self._lock = threading.Lock()
        self._fits = {name: _Fit((a * k, b * k, c, e * k), forget, ridge) for name, k in zip(COMPUTE_DTYPES, (1.0, 2.0), strict=True)}
        self._error = (0.0, 0.0, 0)  # log(measured / predicted): running mean, running variance, computes seen
        self.calibrated = False
        self.calibration_s = 0.0
        self.cores = cores if cores is not None else available_cores()  # the contention is threads over these
        self._slowdown: dict[int, float] = {}  # requests busy -> running mean of wall / CPU seen
        self._split: dict[int, float] = {}  # threads -> running mean of a split's wall time / its one-thread prediction

    def contention(self, busy: float) -> float:
        """The slowdown a one-thread computation will see while busy requests (itself included)
        compute in the server: the running mean of what computations saw at that count,
        contention(busy, cores) until one has been seen."""
        n = _level(busy)
        return self._slowdown.get(n, contention(n, self.cores))

    @property
    def a(self) -> float:
        return float(self._fits["float32"].theta[0])

    @property
    def b(self) -> float:
        return float(self._fits["float32"].theta[1])

    @property
    def c(self) -> float:
        return float(self._fits["float32"].theta[2])

    @property
    def e(self) -> float:
        return float(self._fits["float32"].theta[3])

    def predict(self, work: Work, busy: float | None = None, threads: int = 1) -> float:
        """Predicted compute ms of work: its alone-time (one thread with a core to itself), x the
        slowdown seen while busy requests (itself included) were busy in the server (None: alone),
        x the share of one thread's time that a split on threads takes (split_factor). Once
        calibrated, the alone-time stays within MAX_PULL of what calibration predicts for it: a
        stream of one shape taught at that bound moves the other terms too, and alone it took
        shapes that share them past it."""
        fit = self._fits.get(work.dtype, self._fits["float32"])
        x = work.features()
        ms = self._bounded(fit, x, float(fit.theta @ x))  # no stream moves a prediction past MAX_PULL either
        if busy is not None:
            ms *= self.contention(busy)
        return ms * self.split_factor(threads)

    def spread(self) -> dict:
        """How measured computes compare with their predictions: the running median and 98th
        percentile of measured / predicted (a lognormal ratio), over the computes seen."""
        mean, var, n = self._error
        return {
            "measured_over_predicted_median": round(math.exp(mean), 3),
            "measured_over_predicted_p98": round(math.exp(mean + SPREAD_Z * math.sqrt(var)), 3),
            "computes_seen": n,
        }

    def observe(
        self, work: Work, ms: float, cpu_ms: float | None = None, busy: float = 1.0, threads: int = 1, predicted_ms: float = 0.0
    ) -> None:
        """Learn from one measured compute: ms of wall time, cpu_ms of the computing thread's CPU
        time over it (None: ms was measured alone), admitted while busy requests were computing in
        the server or about to (itself included), on threads threads. On one thread the fit learns
        the alone-time, min(cpu_ms, ms), and the slowdown at that count ms / alone-time; a split
        teaches only split_factor(threads), the fit being one thread's time. predicted_ms, what it
        was admitted on, counts in spread()."""
        if predicted_ms > 0 and ms > 0 and math.isfinite(ms):
            self._observe_error(math.log(ms / predicted_ms))
        if threads > 1:
            self._observe_split(work, ms, threads)
            return
        if not (ms > 0 and math.isfinite(ms)) or work.dtype not in self._fits:
            return
        alone = min(cpu_ms, ms) if cpu_ms is not None and cpu_ms > 0 else ms
        with self._lock:
            if work.fitted:  # not with a bias, ALiBi, a mask or key_lengths: those are predicted by the fit, not taught to it
                fit = self._fits[work.dtype]
                x = work.features()
                fit.add(x, self._bounded(fit, x, alone))
            if cpu_ms is not None and cpu_ms > 0:
                n = _level(busy)
                self._slowdown[n] = _running_mean(self._slowdown.get(n, contention(n, self.cores)), ms / alone)

    def _observe_error(self, gap: float) -> None:
        """One log(measured / predicted) into the running mean and variance (exponentially weighted)."""
        with self._lock:
            mean, var, n = self._error
            if n == 0:
                self._error = (gap, 0.0, 1)
                return
            w, d = SLOWDOWN_WEIGHT, gap - mean
            self._error = (mean + w * d, (1 - w) * (var + w * d * d), n + 1)

    def _bounded(self, fit: _Fit, x: np.ndarray, ms: float) -> float:
        """ms as the fit is taught it: once calibrated, within MAX_PULL x or 1/MAX_PULL of what
        the calibrated coefficients predict for x (a dtype calibration's budget did not reach keeps
        its default guess, and is not bounded by it). Bounded by the calibration, not by the current
        prediction: the fit follows each observation closely, so a bound that moved with it let a
        dozen requests at 1/100 of their time ratchet every prediction down MAX_PULL^12-fold."""
        anchored = float(fit.prior @ x)
        if not (fit.measured and anchored > 0):
            return ms
        return min(max(ms, anchored / MAX_PULL), anchored * MAX_PULL)

    def split_factor(self, threads: int) -> float:
        """What a computation split on this many threads takes, as a share of its predicted
        one-thread time: the running mean of what splits took (ms / predict(work)), 1 until one has
        been seen (and for threads <= 1)."""
        return self._split.get(threads, 1.0) if threads > 1 else 1.0

    def _observe_split(self, work: Work, ms: float, threads: int) -> None:
        """Learn split_factor(threads) from one split computation of ms wall time. The fit itself
        learns only from one-thread computations, the time a request gets under load."""
        predicted = self.predict(work)
        if threads <= 1 or not work.fitted or not (ms > 0 and math.isfinite(ms)) or not predicted > 0:
            return  # not fitted: its prediction is an estimate, whose error is not the split's
        # A split on n threads takes between 1/n of one thread's time and about all of it (alone, it
        # only splits when it gains); a ratio outside says the request's cost is not what the fit
        # models, not what splitting does. Taught as is, a few such requests would move the factor,
        # and every later split's prediction with it (deadlines refused that it met, or admitted
        # that it missed).
        share = min(max(ms / predicted, 1 / threads), 1.0)
        with self._lock:
            self._split[threads] = _running_mean(self._split.get(threads, 1.0), share)

    def calibrate(self, budget_s: float = 1.5, seed: int = 0) -> None:
        """Time the numeric core on a few shapes (a tiny one, T 64..2048, narrow and wide heads, the GPT block)
        and fit to them; stops early when the budget is spent. The fit then anchors the ridge."""
        rng = np.random.default_rng(seed)
        start = time.perf_counter()
        for dtype, shape, kind in CALIBRATION:
            if time.perf_counter() - start > budget_s:
                break
            job = probe(rng, dtype, shape, kind)
            job.compute()  # first touch: page faults, lazy initialisation
            self.observe(work_of(job), median_ms(job.compute, clock=time.thread_time))  # CPU time: the alone-time, neighbours or not
        self.anchor()
        self.calibration_s = time.perf_counter() - start

    def anchor(self) -> None:
        """Take the fit as calibrated: its coefficients become the ridge's prior and the reference
        that bounds what one observation teaches (MAX_PULL)."""
        with self._lock:
            for fit in self._fits.values():
                fit.anchor(fit.theta, measured=fit.n > 0)
            self.calibrated = True

    def coefficients(self) -> dict:
        fits = {
            name: dict(zip("abce", (round(float(t), 6) for t in fit.theta), strict=True), observations=fit.n)
            for name, fit in self._fits.items()
        }
        return {
            "formula": FORMULA,
            **{k: fits["float32"][k] for k in "abce"},
            "by_dtype": fits,
            "prediction_spread": self.spread(),
            "calibrated": self.calibrated,
            "calibration_s": round(self.calibration_s, 3),
            "cores": self.cores,
            "slowdown_by_busy": {str(n): round(v, 3) for n, v in sorted(self._slowdown.items())},
            "split_factor_by_threads": {str(n): round(v, 3) for n, v in sorted(self._split.items())},
        }
