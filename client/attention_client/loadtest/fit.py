"""Latency against T: the a + b*T^2 fit, the power-law exponent, and the SLO search.

Pure numpy on arrays of (T, latency in ms); the caller chooses which cells to pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuadraticFit:
    """latency ~ a + b * T^2 (ms)."""

    a: float
    b: float

    def predict(self, T: np.ndarray | float) -> np.ndarray | float:
        """Latency in ms at T."""
        return self.a + self.b * np.square(T)

    def solve(self, y: float) -> float | None:
        """The T at which the fit reaches `y` ms; None if it never does (y <= a or b <= 0)."""
        if self.b <= 0 or y <= self.a:
            return None
        return math.sqrt((y - self.a) / self.b)


@dataclass(frozen=True)
class PowerFit:
    """latency ~ coef * T^exponent (ms), fitted as a line on log-log axes."""

    exponent: float
    coef: float
    r2: float  # of the line on log-log axes

    def predict(self, T: np.ndarray | float) -> np.ndarray | float:
        """Latency in ms at T."""
        return self.coef * np.power(T, self.exponent)


def _usable(T: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    T_arr, y_arr = np.asarray(T, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(T_arr) & np.isfinite(y_arr) & (T_arr > 0) & (y_arr > 0)
    return T_arr[keep], y_arr[keep]


def fit_quadratic(T: Sequence[float], y: Sequence[float]) -> QuadraticFit | None:
    """Least squares of a + b*T^2 on the *relative* error (each row divided by its y).

    Latencies span decades, so plain least squares would fit the largest T alone; relative
    residuals weigh every cell alike, which is what a log-log plot shows. Needs two
    distinct T; non-positive or non-finite points are ignored.
    """
    T_arr, y_arr = _usable(T, y)
    if np.unique(T_arr).size < 2:
        return None
    design = np.column_stack([np.ones_like(T_arr), T_arr**2]) / y_arr[:, None]  # (n, 2)
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y_arr), rcond=None)
    return QuadraticFit(float(a), float(b))


def fit_power(T: Sequence[float], y: Sequence[float]) -> PowerFit | None:
    """log y = log coef + exponent * log T by least squares. Needs two distinct T."""
    T_arr, y_arr = _usable(T, y)
    if np.unique(T_arr).size < 2:
        return None
    x, z = np.log(T_arr), np.log(y_arr)
    exponent, intercept = np.polyfit(x, z, 1)
    residual = z - (intercept + exponent * x)
    spread = np.sum((z - z.mean()) ** 2)
    r2 = 1.0 - float(np.sum(residual**2) / spread) if spread > 0 else 1.0
    return PowerFit(float(exponent), float(math.exp(intercept)), r2)


@dataclass(frozen=True)
class SloAnswer:
    """The largest T meeting an SLO, three ways.

    last_met: the largest measured T such that it and every smaller measured T met the SLO
        (conservative: a noisy pass above a failure does not count).
    interpolated: where the line between last_met and the next measured T crosses the SLO
        on log-log axes; None if no measured T met it or none failed.
    from_fit: where the a + b*T^2 fit crosses the SLO; None without a fit or a crossing.
    """

    last_met: int | None
    interpolated: float | None
    from_fit: float | None
    all_met: bool


def slo_search(T: Sequence[int], y: Sequence[float], slo_ms: float, fit: QuadraticFit | None = None) -> SloAnswer:
    """Search measured (T, latency ms) for the largest T with latency <= slo_ms.

    A cell whose y is NaN or inf (no successful responses, too many errors) fails the SLO.
    """
    order = np.argsort(np.asarray(T))
    T_sorted = [int(T[i]) for i in order]
    y_sorted = [float(y[i]) for i in order]
    last, nxt = None, None
    for i, value in enumerate(y_sorted):
        if not (math.isfinite(value) and value <= slo_ms):
            nxt = i
            break
        last = i
    interpolated = None
    if last is not None and nxt is not None:
        (t0, y0), (t1, y1) = (T_sorted[last], y_sorted[last]), (T_sorted[nxt], y_sorted[nxt])
        if math.isfinite(y1) and y0 > 0 and y1 > y0 and t1 > t0:
            frac = (math.log(slo_ms) - math.log(y0)) / (math.log(y1) - math.log(y0))
            interpolated = math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0)))
    return SloAnswer(
        last_met=T_sorted[last] if last is not None else None,
        interpolated=interpolated,
        from_fit=fit.solve(slo_ms) if fit is not None else None,
        all_met=nxt is None and last is not None,
    )
