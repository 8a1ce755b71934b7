"""The sweep's outputs: results.csv (one row per cell), report.md (tables), latency.png.

The fits shown here are made from the cells by `analyze`:
- a + b*T^2 on the p50 of every cell with a successful response (the constant term
  absorbs the per-request overhead that dominates small T);
- the power-law exponent on the p50 of cells with T >= fit_min_T only, where compute
  dominates and the exponent means something (also on the server's own compute phase);
- the SLO search on the chosen percentile; a cell with more errors than max_error_rate
  fails the SLO whatever its latency.
"""

from __future__ import annotations

import csv
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cell import CellResult
from .fit import PowerFit, QuadraticFit, SloAnswer, fit_power, fit_quadratic, slo_search
from .sweep import Sweep
from .transport import PHASES


@dataclass(frozen=True)
class ConcurrencyFit:
    """The fits and SLO answer for the cells of one concurrency."""

    concurrency: int
    quadratic: QuadraticFit | None  # p50, all successful cells
    power: PowerFit | None  # p50, cells with T >= fit_min_T
    power_Ts: tuple[int, ...]  # the cells the exponent is fitted on
    compute_power: PowerFit | None  # server compute median, same cells
    slo: SloAnswer | None


def analyze(sweep: Sweep) -> list[ConcurrencyFit]:
    """Fit each concurrency's cells (see the module docstring for which cells)."""
    cfg = sweep.config
    fits = []
    for concurrency in sorted({c.concurrency for c in sweep.cells}):
        cells = sorted((c for c in sweep.cells if c.concurrency == concurrency), key=lambda c: c.T)
        good = [c for c in cells if c.ok > 0]
        big = [c for c in good if c.T >= cfg.fit_min_T]
        slo = None
        if cfg.slo_ms is not None:
            metric = [c.percentile(cfg.slo_percentile) if c.ok > 0 and c.error_rate <= cfg.max_error_rate else math.inf for c in cells]
            slo_fit = fit_quadratic([c.T for c in good], [c.percentile(cfg.slo_percentile) for c in good])
            slo = slo_search([c.T for c in cells], metric, cfg.slo_ms, slo_fit)
        fits.append(
            ConcurrencyFit(
                concurrency=concurrency,
                quadratic=fit_quadratic([c.T for c in good], [c.p50_ms for c in good]),
                power=fit_power([c.T for c in big], [c.p50_ms for c in big]),
                power_Ts=tuple(c.T for c in big),
                compute_power=fit_power([c.T for c in big], [c.phases_ms.get("compute", math.nan) for c in big]),
                slo=slo,
            )
        )
    return fits


CSV_FIELDS = (
    [
        "T",
        "concurrency",
        "mode",
        "rate",
        "batch",
        "heads",
        "d",
        "causal",
        "weights",
        "encoding",
        "kv_heads",
        "window",
        "body_bytes",
        "sent",
        "ok",
        "errors_503",
        "errors_504",
        "errors_other",
        "errors",
        "unsent",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "max_ms",
        "mean_ms",
        "throughput_rps",
        "elapsed_s",
        "rounds",
        "p50_by_round_ms",
    ]
    + [f"server_{name}_ms" for name in PHASES]
    + ["reasons", "note"]
)


def _num(value: float, digits: int = 3) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def write_csv(sweep: Sweep, path: Path) -> None:
    """One row per measured cell, in the order they ran; empty field = no value."""
    cfg, wl = sweep.config, sweep.config.workload
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for c in sweep.cells:
            other = {k: v for k, v in c.errors.items() if k not in ("503", "504")}
            writer.writerow(
                {
                    "T": c.T,
                    "concurrency": c.concurrency,
                    "mode": "open" if cfg.load.rate else "closed",
                    "rate": cfg.load.rate or "",
                    "batch": wl.batch,
                    "heads": wl.heads,
                    "d": wl.d,
                    "causal": wl.causal,
                    "weights": wl.weights,
                    "encoding": wl.encoding,
                    "kv_heads": wl.kv_heads or wl.heads,
                    "window": "" if wl.window is None else f"{wl.window[0]},{wl.window[1]}",
                    "body_bytes": c.body_bytes,
                    "sent": c.sent,
                    "ok": c.ok,
                    "errors_503": c.errors.get("503", 0),
                    "errors_504": c.errors.get("504", 0),
                    "errors_other": sum(other.values()),
                    "errors": " ".join(f"{k}:{v}" for k, v in c.errors.items()),
                    "unsent": c.unsent,
                    "p50_ms": _num(c.p50_ms),
                    "p90_ms": _num(c.p90_ms),
                    "p99_ms": _num(c.p99_ms),
                    "max_ms": _num(c.max_ms),
                    "mean_ms": _num(c.mean_ms),
                    "throughput_rps": _num(c.throughput_rps),
                    "elapsed_s": _num(c.elapsed_s),
                    "rounds": c.rounds,
                    "p50_by_round_ms": " ".join(_num(v) for v in c.round_p50s_ms),
                    **{f"server_{n}_ms": _num(c.phases_ms.get(n, math.nan)) for n in PHASES},
                    "reasons": "; ".join(f"{n} x {reason}" for reason, n in c.reasons.items()),
                    "note": c.note,
                }
            )


def _ms(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    value = round(value, 3)  # as results.csv has it (_num): 3.3496 is 3.350 there, so 3.4 here, not 3.3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _T(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _load_line(sweep: Sweep) -> str:
    load = sweep.config.load
    amount = f"{load.requests} requests" if load.requests is not None else f"{load.duration_s:g} s"
    loop = (
        f"open loop at {load.rate:g} req/s (latency from the scheduled send time)"
        if load.rate
        else "closed loop (each worker sends when its last reply is read)"
    )
    rounds = (
        f" in each of {sweep.config.rounds} rounds (the sweep run {sweep.config.rounds} times over, samples pooled per cell)"
        if sweep.config.rounds > 1
        else ""
    )
    return (
        f"{loop}, {amount} per cell{rounds} after {load.warmup} warm-up request(s); hard bounds "
        f"{load.max_requests} requests and {load.max_seconds:g} s per cell, "
        f"{load.timeout_s:g} s per request"
    )


def _cells_table(cells: list[CellResult], rounds: int) -> list[str]:
    lines = [
        "| T | conc. | ok/sent | 503 | 504 | other errors | p50 ms | p90 ms | p99 ms | max ms "
        "| req/s | server decode | validate | compute | encode | total | compute / p50 |" + (" p50 by round, ms |" if rounds > 1 else ""),
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if rounds > 1 else ""),
    ]
    for c in sorted(cells, key=lambda c: (c.concurrency, c.T)):
        other = " ".join(f"{k}:{v}" for k, v in c.errors.items() if k not in ("503", "504"))
        ph = [_ms(c.phases_ms.get(n)) for n in PHASES]
        share = c.phases_ms.get("compute", math.nan) / c.p50_ms if c.ok else math.nan
        lines.append(
            f"| {c.T} | {c.concurrency} | {c.ok}/{c.sent} | {c.errors.get('503', 0)} "
            f"| {c.errors.get('504', 0)} | {other or '–'} | {_ms(c.p50_ms)} | {_ms(c.p90_ms)} "
            f"| {_ms(c.p99_ms)} | {_ms(c.max_ms)} | {c.throughput_rps:.1f} | "
            + " | ".join(ph)
            + f" | {f'{share:.0%}' if math.isfinite(share) else '–'} |"
            + (f" {', '.join(_ms(v) for v in c.round_p50s_ms)} |" if rounds > 1 else "")
        )
    return lines


def _reasons_lines(cells: list[CellResult]) -> list[str]:
    """The server's refusals, by status, code and message (numbers blanked), per cell that had any."""
    lines = []
    for c in sorted(cells, key=lambda c: (c.concurrency, c.T)):
        for reason, n in c.reasons.items():
            lines.append(f"- T={c.T}, concurrency {c.concurrency}: {n} x `{reason}`")
    return lines


def _fit_table(fits: list[ConcurrencyFit], fit_min_T: int) -> list[str]:
    lines = [
        f"| conc. | p50 ≈ a + b·T² (all cells) | exponent of p50 (T ≥ {fit_min_T}) | R² log-log "
        f"| cells fitted | exponent of server compute |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for f in fits:
        quad = f"{f.quadratic.a:.2f} ms + {f.quadratic.b:.3g} ms·T²" if f.quadratic else "–"
        power = f"**{f.power.exponent:.2f}**" if f.power else "– (needs 2 cells)"
        r2 = f"{f.power.r2:.3f}" if f.power else "–"
        comp = f"{f.compute_power.exponent:.2f}" if f.compute_power else "–"
        Ts = ",".join(map(str, f.power_Ts)) or "–"
        lines.append(f"| {f.concurrency} | {quad} | {power} | {r2} | {Ts} | {comp} |")
    return lines


def _slo_table(fits: list[ConcurrencyFit], sweep: Sweep) -> list[str]:
    cfg = sweep.config
    lines = [
        f"SLO: {cfg.slo_percentile} ≤ {cfg.slo_ms:g} ms with at most {cfg.max_error_rate:.0%} errors.",
        "",
        f"| conc. | last measured T that met it | interpolated T (log-log) | T where the a + b·T² fit of {cfg.slo_percentile} crosses it |",
        "|---:|---:|---:|---:|",
    ]
    for f in fits:
        s = f.slo
        if s is None:
            continue
        last = _T(s.last_met) if s.last_met is not None else "none met"
        interp = _T(s.interpolated) if s.interpolated else ("all met" if s.all_met else "–")
        lines.append(f"| {f.concurrency} | {last} | {interp} | {_T(s.from_fit)} |")
    return lines


def write_markdown(sweep: Sweep, fits: list[ConcurrencyFit], path: Path, plot_name: str | None = "latency.png") -> None:
    """The human report: setup, one row per cell, the fits, the SLO answer, notes, plot."""
    cfg = sweep.config
    version = (sweep.limits or {}).get("version", "unknown")
    la = lambda v: " / ".join(f"{x:.2f}" for x in v) if v else "unknown"  # noqa: E731
    lines = [
        "# Attention latency sweep",
        "",
        *([f"- command: `{cfg.command}`"] if cfg.command else []),
        (
            f"- target: {len(cfg.urls)} replica(s), {', '.join(f'`{u}`' for u in cfg.urls)}, each request one "
            f"`AttentionClient.attention` call split past the servers' limits (service version {version})"
            if cfg.split
            else f"- target: `{cfg.base_url}/attention` (service version {version})"
        ),
        f"- workload: {cfg.workload.describe()}",
        f"- load: {_load_line(sweep)}",
        f"- client machine: {platform.platform()}, {os.cpu_count()} CPUs, load average "
        f"(1/5/15 min) {la(sweep.loadavg_start)} at start, {la(sweep.loadavg_end)} at end",
        f"- ran {sweep.started} to {sweep.finished}",
        "",
        "Latency is measured by the client, over successful (200) responses only; errors are "
        "counted by status. Server columns are medians of the `Server-Timing` phases, ms; "
        "compute / p50 says how compute-dominated a cell is.",
        "",
        "## Cells",
        "",
        *_cells_table(sweep.cells, cfg.rounds),
        "",
        *(["## Refusals by the server's reason", "", *reasons, ""] if (reasons := _reasons_lines(sweep.cells)) else []),
        "## Latency against T",
        "",
        *_fit_table(fits, cfg.fit_min_T),
        "",
    ]
    if cfg.slo_ms is not None:
        lines += ["## Largest T meeting the SLO", "", *_slo_table(fits, sweep), ""]
    if sweep.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in sweep.notes], ""]
    if plot_name:
        lines += [f"![latency percentiles against T]({plot_name})", ""]
    path.write_text("\n".join(lines))


def plot(sweep: Sweep, fits: list[ConcurrencyFit], path: Path) -> None:
    """Log-log latency percentiles vs T, one colour per concurrency, the a + b·T² fit, the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cfg = sweep.config
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_conc = {f.concurrency: f for f in fits}
    for i, concurrency in enumerate(sorted(by_conc)):
        color = colors[i % len(colors)]
        cells = sorted((c for c in sweep.cells if c.concurrency == concurrency and c.ok > 0), key=lambda c: c.T)
        if not cells:
            continue
        T = np.array([c.T for c in cells], dtype=float)
        for name, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(T, [c.percentile(name) for c in cells], style, color=color, ms=4, label=f"c={concurrency} {name}")
        fit = by_conc[concurrency]
        if fit.quadratic is not None:
            grid = np.geomspace(T.min(), T.max(), 100)
            label = f"c={concurrency} fit {fit.quadratic.a:.1f} + {fit.quadratic.b:.2g}·T²"
            if fit.power is not None:
                label += f" (exponent {fit.power.exponent:.2f})"
            ax.plot(grid, fit.quadratic.predict(grid), "-", color=color, alpha=0.35, lw=3, label=label)
    if cfg.slo_ms is not None:
        ax.axhline(cfg.slo_ms, color="crimson", lw=1.2, label=f"SLO {cfg.slo_percentile} ≤ {cfg.slo_ms:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    Ts = sorted({c.T for c in sweep.cells if c.ok > 0})
    if Ts:
        ax.set_xticks(Ts, [str(t) for t in Ts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("T (sequence length, S = T)")
    ax.set_ylabel("latency, ms (client-measured)")
    ax.set_title(f"POST /attention: {cfg.workload.describe()}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no successful responses", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_all(sweep: Sweep, out_dir: Path) -> list[Path]:
    """Write report.md, results.csv and latency.png into `out_dir` (created); return the paths.

    Without matplotlib (the [loadtest] extra) the plot is left out and the report says so.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    fits = analyze(sweep)
    csv_path, md_path = out_dir / "results.csv", out_dir / "report.md"
    png_path = out_dir / "latency.png"
    write_csv(sweep, csv_path)
    try:
        plot(sweep, fits, png_path)
        plots = [png_path]
    except ImportError:
        sweep.notes.append("no latency.png: matplotlib is not installed (pip install 'attention-client[loadtest]')")
        plots = []
    write_markdown(sweep, fits, md_path, plot_name=png_path.name if plots else None)
    return [csv_path, md_path, *plots]
