"""The fits and the SLO search of loadtest, on synthetic data with known answers."""

import math

import numpy as np
import pytest

from attention_client.loadtest import report
from attention_client.loadtest.cell import CellRun, Sample, reason_of, summarize
from attention_client.loadtest.cli import parse_Ts
from attention_client.loadtest.fit import fit_power, fit_quadratic, slo_search

T_GRID = [64, 128, 256, 512, 1024, 2048, 4096]


def test_quadratic_fit_recovers_a_and_b():
    T = np.array(T_GRID, dtype=float)
    fit = fit_quadratic(T, 3.0 + 2e-5 * T**2)
    assert fit.a == pytest.approx(3.0, rel=1e-9)
    assert fit.b == pytest.approx(2e-5, rel=1e-9)
    assert fit.solve(3.0 + 2e-5 * 1000**2) == pytest.approx(1000, rel=1e-9)


def test_quadratic_fit_weighs_small_T_by_relative_error():
    # Noise of +-10 % at every T: the overhead a must still come out near 3 ms, which an
    # unweighted fit dominated by T=4096 (335 ms) would not resolve.
    T = np.array(T_GRID, dtype=float)
    wiggle = np.array([1.1, 0.9, 1.1, 0.9, 1.1, 0.9, 1.1])
    fit = fit_quadratic(T, (3.0 + 2e-5 * T**2) * wiggle)
    assert fit.a == pytest.approx(3.0, rel=0.15)
    assert fit.b == pytest.approx(2e-5, rel=0.15)


@pytest.mark.parametrize("exponent", [1.0, 2.0, 2.5], ids=["linear", "quadratic", "steeper"])
def test_power_fit_recovers_the_exponent(exponent):
    T = np.array(T_GRID, dtype=float)
    fit = fit_power(T, 1e-4 * T**exponent)
    assert fit.exponent == pytest.approx(exponent, abs=1e-9)
    assert fit.coef == pytest.approx(1e-4, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_power_fit_of_noisy_quadratic_lands_near_two():
    rng = np.random.default_rng(0)
    T = np.repeat(np.array([512, 1024, 2048, 4096], dtype=float), 3)
    y = 5e-5 * T**2 * np.exp(rng.normal(0, 0.1, T.size))  # 10 % log-normal noise
    assert fit_power(T, y).exponent == pytest.approx(2.0, abs=0.15)


def test_power_fit_of_overhead_plus_quadratic_is_below_two_at_small_T():
    # Why the exponent is fitted on T >= --fit-min-T only: a constant overhead flattens it.
    T = np.array(T_GRID, dtype=float)
    y = 2.0 + 2e-5 * T**2
    assert fit_power(T[:3], y[:3]).exponent < 0.5
    assert fit_power(T[-3:], y[-3:]).exponent > 1.8


@pytest.mark.parametrize("fit", [fit_power, fit_quadratic], ids=["power", "quadratic"])
def test_fits_need_two_distinct_T_and_skip_bad_points(fit):
    assert fit([512], [10.0]) is None
    assert fit([512, 512], [10.0, 11.0]) is None
    assert fit([512, 1024, 2048], [10.0, math.nan, -1.0]) is None
    assert fit([512, 1024, 2048], [10.0, 40.0, math.nan]) is not None


def test_slo_search_on_a_pure_power_law_interpolates_exactly():
    T = np.array(T_GRID, dtype=float)
    y = 1e-4 * T**2  # 0.4 ms ... 1678 ms
    slo = 1e-4 * 1500.0**2  # crossed at T = 1500, between 1024 and 2048
    answer = slo_search(T_GRID, y, slo, fit_quadratic(T, y))
    assert answer.last_met == 1024
    assert answer.interpolated == pytest.approx(1500.0, rel=1e-9)
    assert answer.from_fit == pytest.approx(1500.0, rel=1e-6)
    assert not answer.all_met


def test_slo_search_is_conservative_about_noise_and_errors():
    # 256 fails (a noisy spike), 512 passes again: the answer stays 128.
    answer = slo_search([64, 128, 256, 512], [1.0, 2.0, 9.0, 3.0], 4.0)
    assert answer.last_met == 128
    assert answer.interpolated == pytest.approx(128 * 2 ** (math.log(2) / math.log(4.5)))
    # A cell failed by errors (passed as inf) fails the SLO, and nothing is interpolated past it.
    answer = slo_search([64, 128, 256], [1.0, 2.0, math.inf], 4.0)
    assert answer.last_met == 128 and answer.interpolated is None


def test_slo_search_edges():
    none_met = slo_search([64, 128], [10.0, 20.0], 5.0)
    assert none_met.last_met is None and none_met.interpolated is None and not none_met.all_met
    all_met = slo_search([128, 64], [2.0, 1.0], 5.0)  # order of the input does not matter
    assert all_met.last_met == 128 and all_met.interpolated is None and all_met.all_met
    assert slo_search([], [], 5.0).last_met is None


def test_fit_solve_has_no_answer_below_the_overhead():
    fit = fit_quadratic([64, 128, 256], [10.0 + 1e-4 * t * t for t in (64, 128, 256)])
    assert fit.solve(5.0) is None
    assert fit.solve(10.0 + 1e-4 * 200**2) == pytest.approx(200.0)


def test_summarize_counts_errors_by_status_and_takes_percentiles_of_successes():
    ok = [Sample(ms / 1e3, 200, phases={"compute": ms / 2, "total": ms}) for ms in range(1, 101)]
    bad = [Sample(0.001, 503), Sample(0.001, 503), Sample(0.002, 504), Sample(30.0, None, "timeout")]
    cell = summarize(256, 2, 1234, [CellRun(ok + bad, elapsed_s=2.0)])
    assert (cell.sent, cell.ok) == (104, 100)
    assert cell.errors == {"503": 2, "504": 1, "timeout": 1}
    assert cell.p50_ms == pytest.approx(50.5)
    assert cell.p90_ms == pytest.approx(90.1)
    assert cell.p99_ms == pytest.approx(99.01)
    assert cell.max_ms == pytest.approx(100.0)
    assert cell.throughput_rps == pytest.approx(50.0)
    assert cell.phases_ms == {"compute": pytest.approx(25.25), "total": pytest.approx(50.5)}
    assert cell.error_rate == pytest.approx(4 / 104)


def test_summarize_pools_rounds_and_keeps_their_p50s():
    quiet = CellRun([Sample(ms / 1e3, 200) for ms in (10, 11, 12)], elapsed_s=1.0)
    noisy = CellRun(
        [Sample(ms / 1e3, 200) for ms in (20, 22, 24)] + [Sample(0.001, 503)], elapsed_s=1.0, capped="stopped at the bound of 4 requests"
    )
    cell = summarize(512, 1, 10, [quiet, noisy])
    assert (cell.rounds, cell.sent, cell.ok, cell.errors) == (2, 7, 6, {"503": 1})
    assert cell.p50_ms == pytest.approx(16.0)  # of all six successes
    assert cell.round_p50s_ms == pytest.approx([11.0, 22.0])
    assert cell.round_spread == pytest.approx(2.0)
    assert cell.throughput_rps == pytest.approx(3.0)
    assert cell.note == "stopped at the bound of 4 requests"
    assert math.isnan(summarize(512, 1, 10, [quiet]).round_spread)


def test_parse_Ts():
    assert parse_Ts("256..4096") == (256, 512, 1024, 2048, 4096)
    assert parse_Ts("32,16, 16,100..300") == (16, 32, 100, 200)
    for bad in ("", "0", "64..32", "a"):
        with pytest.raises(ValueError):
            parse_Ts(bad)


@pytest.mark.parametrize(
    ("raw", "csv", "table"), [(3.3496, "3.350", "3.4"), (3.4496, "3.450", "3.5"), (0.03449, "0.034", "0.03"), (99.9996, "100.000", "100")]
)
def test_the_report_table_rounds_what_the_csv_holds(raw, csv, table):
    """A reader (and the live sweep's test) compares report.md with results.csv: the table's figure
    is the CSV's, rounded once more, never the raw value rounded another way."""
    assert report._num(raw) == csv
    assert report._ms(raw) == table


def test_refusals_are_counted_by_the_servers_reason_with_503_and_504_apart():
    ok = [Sample(0.01, 200)]
    refused = [
        Sample(0.001, 503, reason=reason_of("503 overloaded: the predicted wait (1234.5 ms) exceeds ATTN_MAX_QUEUE_WAIT_MS=5000")),
        Sample(0.002, 503, reason=reason_of("503 overloaded: the predicted wait (99 ms) exceeds ATTN_MAX_QUEUE_WAIT_MS=5000")),
        Sample(0.003, 504, reason=reason_of("504 deadline: X-Deadline-Ms=10 passed")),
    ]
    cell = summarize(64, 2, 100, [CellRun(ok + refused, 1.0)])
    assert cell.errors == {"503": 2, "504": 1}
    assert cell.reasons == {
        "503 overloaded: the predicted wait (# ms) exceeds ATTN_MAX_QUEUE_WAIT_MS=#": 2,
        "504 deadline: X-Deadline-Ms=# passed": 1,
    }
