"""The sweep: for each concurrency, T from small to large, one cell each, with early stop.

A concurrency's sweep stops early (the larger T are skipped, never run) when a cell
- had its body refused with a 4xx (e.g. 413 too_long: a larger T would be refused too),
- got no successful response at all, or
- had a p50 past `early_stop_factor` x the SLO, so a sweep never runs for hours.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .cell import CellResult, CellRun, Load, run_cell, summarize
from .payload import Workload, build_body
from .split import build_arrays, run_split_cell
from .transport import check_reachable, fetch_limits


@dataclass(frozen=True)
class SweepConfig:
    """Everything a sweep needs; built by cli.py, kept whole in the report."""

    base_url: str  # e.g. http://127.0.0.1:8000, no trailing slash
    Ts: tuple[int, ...]
    concurrencies: tuple[int, ...]
    workload: Workload
    load: Load  # its concurrency is replaced per cell
    slo_ms: float | None = None
    slo_percentile: str = "p99"
    early_stop_factor: float = 4.0
    max_error_rate: float = 0.01
    fit_min_T: int = 512
    rounds: int = 1
    command: str = ""
    urls: tuple[str, ...] = ()  # with split: every replica's base URL (base_url the first)
    split: bool = False  # each request one AttentionClient call over urls, split past the limits (split.py)


@dataclass
class Sweep:
    """What a sweep found so far; filled cell by cell so an interrupted run still reports."""

    config: SweepConfig
    cells: list[CellResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    limits: dict[str, Any] | None = None
    started: str = ""
    finished: str = ""
    loadavg_start: tuple[float, float, float] | None = None
    loadavg_end: tuple[float, float, float] | None = None


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def stop_reason(cell: CellResult, config: SweepConfig) -> str | None:
    """Why the sweep of this cell's concurrency must not go to a larger T, or None."""
    if cell.refused:
        return cell.note
    if cell.ok == 0:
        return "no successful response"
    if config.slo_ms is not None and cell.p50_ms > config.early_stop_factor * config.slo_ms:
        return f"p50 {cell.p50_ms:.0f} ms is over {config.early_stop_factor:g} x the SLO of {config.slo_ms:g} ms"
    return None


def format_cell(cell: CellResult) -> str:
    """One progress line for a finished cell."""
    errors = " ".join(f"{k}:{v}" for k, v in cell.errors.items()) or "none"
    if cell.ok == 0:
        return f"ok 0/{cell.sent}, errors {errors}" + (f" ({cell.note})" if cell.note else "")
    compute = cell.phases_ms.get("compute")
    server = f", server compute p50 {compute:.1f} ms" if compute is not None else ""
    return (
        f"ok {cell.ok}/{cell.sent}, p50 {cell.p50_ms:.1f} ms, p99 {cell.p99_ms:.1f} ms, "
        f"{cell.throughput_rps:.1f} req/s, errors {errors}{server}" + (f" ({cell.note})" if cell.note else "")
    )


def run_sweep(config: SweepConfig, into: Sweep, log: Callable[[str], None], stop: threading.Event | None = None) -> Sweep:
    """Run every cell of `config` into `into`; raises ConnectionFailure if the server is gone.

    With `rounds` > 1 the whole sweep runs that many times, one round after the other, and
    each cell pools the samples of its rounds: slow drifts in the machine's load then fall
    on every cell alike instead of on whichever cells ran while it lasted. Bodies are built
    once per T, before any cell that uses them is timed.
    """
    check_reachable(config.base_url)
    into.limits = fetch_limits(config.base_url)
    into.started, into.loadavg_start = _now(), _loadavg()
    bodies: dict[int, bytes] = {}
    sizes: dict[int, int] = {}  # T -> the body's bytes (split: the tensors')
    tensors: dict[int, tuple] = {}  # T -> q, k, v (split)
    runs: dict[tuple[int, int], list[CellRun]] = {}
    stopped: dict[int, int] = {}  # concurrency -> the largest T still to run
    total = config.rounds * len(config.Ts) * len(config.concurrencies)
    done = 0
    try:
        for rnd in range(1, config.rounds + 1):
            for concurrency in config.concurrencies:
                load = replace(config.load, concurrency=concurrency)
                for T in config.Ts:
                    done += 1
                    if T > stopped.get(concurrency, T):
                        continue
                    tag = f"[{done}/{total}]" + (f" round {rnd}" if config.rounds > 1 else "")
                    if config.split:
                        if T not in tensors:
                            tensors[T] = build_arrays(config.workload, T)
                            sizes[T] = sum(a.nbytes for a in tensors[T])
                        log(f"{tag} T={T} concurrency={concurrency} ({sizes[T] / 1e6:.2f} MB of tensors, via the client's split) ...")
                        run = run_split_cell(config.urls or (config.base_url,), tensors[T], config.workload, load, stop)
                    else:
                        if T not in bodies:
                            bodies[T] = build_body(config.workload, T)
                            sizes[T] = len(bodies[T])
                        log(f"{tag} T={T} concurrency={concurrency} ({sizes[T] / 1e6:.2f} MB body) ...")
                        run = run_cell(config.base_url, bodies[T], load, stop)
                    runs.setdefault((T, concurrency), []).append(run)
                    this_round = summarize(T, concurrency, sizes[T], [run])
                    log(f"{tag} T={T} concurrency={concurrency}: {format_cell(this_round)}")
                    into.cells = [summarize(t, c, sizes[t], r) for (t, c), r in runs.items()]
                    reason = stop_reason(this_round, config)
                    if reason is not None and T < min(stopped.get(concurrency, T + 1), config.Ts[-1]):
                        stopped[concurrency] = T  # the larger T of this concurrency are skipped
                        skipped = ",".join(str(t) for t in config.Ts if t > T)
                        note = (
                            f"concurrency {concurrency}: stopped after T={T}"
                            + (f" in round {rnd}" if config.rounds > 1 else "")
                            + f" ({reason}); skipped T={skipped}"
                        )
                        into.notes.append(note)
                        log(note)
    finally:
        into.finished, into.loadavg_end = _now(), _loadavg()
    return into
