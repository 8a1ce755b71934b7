"""`python -m bench dashboard [--out docs/dashboard.png]`: the Grafana dashboard
(deploy/grafana/attention.json) drawn from its own queries over a real run with load. Grafana is
in none of the registries this project may use, so this is a faithful render, not a screenshot:
each panel's PromQL, as Grafana sends it, runs against a real Prometheus (Debian's) that scraped
the service (2 workers) while the load tester ran (T=64..1024, concurrency 1 and 4) beside the
other kinds of traffic the dashboard shows (every_kind()); matplotlib draws the panels where
gridPos puts them. About 2 minutes."""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import requests

from bench.common import ROOT, Server, attention_body, burst
from bench.prometheus import ALERTS, LocalPrometheus, dashboard, ensure_prometheus, grafana_expr, panels, rate_interval

SMALL = {"q": [[1, 0], [0, 1], [1, 1]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1, 0], [0, 10], [5, 5]], "causal": True}


# --- traffic -------------------------------------------------------------------------------------


def mha_body(n: int = 16, d: int = 32, heads: int = 4) -> dict:
    rng = np.random.default_rng(1)
    w = lambda: rng.standard_normal((d, d)).round(3).tolist()
    return {"x": rng.standard_normal((n, d)).round(3).tolist(), "wq": w(), "wk": w(), "wv": w(), "wo": w(), "heads": heads}


V2_BODY = {
    "inputs": [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": [1, 0, 0, 1, 1, 1]} for n in "qkv"],
    "parameters": {"causal": True},
}
JSON = {"Content-Type": "application/json"}


def every_kind(url: str, big: bytes, burst_size: int = 8, bursts: int = 5) -> dict[int, int]:
    """One of each kind of request the dashboard and the alerts show, counted by status: 200s of
    /attention (small nested, T=256 and T=1024 b64), /mha and /v2 (both models), 422 (a bad
    option, a shape mismatch), 404, 504 (a deadline shorter than the body's parse) and bursts of
    big requests until one is refused with 503 (at most `bursts` of them)."""
    counts: dict[int, int] = {}
    s = requests.Session()

    def note(status: int) -> None:
        counts[status] = counts.get(status, 0) + 1

    note(s.post(f"{url}/attention", json=SMALL, timeout=30).status_code)
    note(s.post(f"{url}/attention", data=attention_body(256, causal=False), headers=JSON, timeout=30).status_code)
    note(s.post(f"{url}/attention", data=big, headers=JSON, timeout=60).status_code)
    note(s.post(f"{url}/mha", json=mha_body(), timeout=30).status_code)
    note(s.post(f"{url}/v2/models/attention/infer", json=V2_BODY, timeout=30).status_code)
    note(s.post(f"{url}/v2/models/mha/infer", json=_v2_mha(), timeout=30).status_code)
    note(s.post(f"{url}/attention", json=SMALL, headers={"X-Deadline-Ms": "soon"}, timeout=30).status_code)
    note(s.post(f"{url}/attention", json={**SMALL, "k": [[1, 2, 3]]}, timeout=30).status_code)
    note(s.get(f"{url}/no-such-page", timeout=30).status_code)
    note(s.post(f"{url}/attention", data=big, headers={**JSON, "X-Deadline-Ms": "1"}, timeout=60).status_code)
    for _ in range(bursts):
        statuses = [status for status, _ in burst(url, big, burst_size)]
        for status in statuses:
            note(status)
        if 503 in statuses:
            break
    return counts


def _v2_mha() -> dict:
    body = mha_body()
    return {
        "inputs": [
            {"name": k, "datatype": "FP32", "shape": list(np.shape(v)), "data": np.ravel(v).tolist()}
            for k, v in body.items()
            if k != "heads"
        ],
        "parameters": {"heads": body["heads"]},
    }


# --- rendering -----------------------------------------------------------------------------------

BG, PANEL, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#8e8e8e"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d", "#fade2a"]


def legend(fmt: str, labels: dict) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) if fmt else str(labels)


def unit_formatter(unit: str):
    """A tick formatter for Grafana's unit names (s, bytes, reqps, short, none)."""
    from matplotlib.ticker import FuncFormatter

    def seconds(v, _):
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2g} s"

    def data(v, _):
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= size:
                return f"{v / size:.3g} {name}"
        return f"{v:.0f} B"

    return FuncFormatter({"s": seconds, "bytes": data, "reqps": lambda v, _: f"{v:.3g} req/s"}.get(unit, lambda v, _: f"{v:.3g}"))


def render(prom: LocalPrometheus, start: float, end: float, out: Path, scrape_s: float, note: str) -> list[str]:
    """Draw every panel of the dashboard over [start, end] from prom; returns one line per panel
    saying how many series it drew (a panel with none is drawn with "No data", as Grafana does)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    dash = dashboard()
    step = max(1.0, math.ceil((end - start) / 240))
    ri = rate_interval(step, scrape_s)
    grid = [p for p in panels(dash) if p.get("type") == "timeseries"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in grid)
    fig = plt.figure(figsize=(WIDTH_IN, HEADER_IN + rows * ROW_IN), facecolor=BG)
    title = f"{dash['title']}   ·   {_dt(start):%Y-%m-%d %H:%M:%S} to {_dt(end):%H:%M:%S} UTC   ·   {note}"
    fig.suptitle(title, color=TEXT, fontsize=12, x=0.01, ha="left")
    summary = []
    for panel in grid:
        ax = fig.add_axes(_box(panel["gridPos"], fig.get_size_inches()))
        ax.set_facecolor(PANEL)
        for side in ax.spines.values():
            side.set_color(GRID)
        ax.tick_params(colors=MUTED, labelsize=7)
        ax.grid(color=GRID, linewidth=0.5)
        ax.set_title(panel["title"], color=TEXT, fontsize=10, loc="left")
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        custom = defaults.get("custom", {})
        unit = defaults.get("unit", "short")
        stacked = custom.get("stacking", {}).get("mode", "none") == "normal"
        series = []
        for target in panel["targets"]:
            for result in prom.query_range(grafana_expr(target["expr"], ri, f"{step:g}s", f"{end - start:.0f}s"), start, end, step):
                t, y = np.array(result["values"], dtype=float).T
                series.append((legend(target.get("legendFormat", ""), result["metric"]), t, y))
        series.sort(key=lambda s: s[0])
        axis = np.arange(start, end + step / 2, step)  # stacked lines share one time axis: the range's steps
        base = np.zeros_like(axis)
        for i, (name, t, y) in enumerate(series):
            color = PALETTE[i % len(PALETTE)]
            if stacked:
                full = np.full_like(axis, np.nan)
                full[np.searchsorted(axis, t).clip(0, len(axis) - 1)] = y
                top = base + np.nan_to_num(full)
                ax.fill_between([_dt(x) for x in axis], base, top, color=color, alpha=0.45, linewidth=0)
                ax.plot([_dt(x) for x in axis], np.where(np.isnan(full), np.nan, top), color=color, linewidth=1, label=name)
                base = top
            else:
                ax.plot([_dt(x) for x in t], y, color=color, linewidth=1.1, label=name, marker="." if len(t) < 3 else None)
        if custom.get("thresholdsStyle", {}).get("mode", "off") != "off":  # drawn as lines, dashed here
            for level in defaults.get("thresholds", {}).get("steps", []):
                if level.get("value") is not None:
                    ax.axhline(level["value"], color="#f2495c", linestyle="--", linewidth=0.9)
        if not series:
            ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes)
        if defaults.get("min") == 0:
            ax.set_ylim(bottom=0)
        ax.set_xlim(_dt(start), _dt(end))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.yaxis.set_major_formatter(unit_formatter(unit))
        if unit == "bytes":  # ticks at round MiB, not at round bytes
            from matplotlib.ticker import MultipleLocator

            top_mib = ax.get_ylim()[1] / 2**20
            mib = next(m for m in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10**9) if top_mib / m <= 6)
            ax.yaxis.set_major_locator(MultipleLocator(mib * 2**20))
        if series:
            ax.legend(fontsize=6.5, loc="upper left", ncol=max(1, min(4, len(series) // 5 + 1)), frameon=False, labelcolor=TEXT)
        summary.append(f"{panel['title']}: {len(series)} series")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=BG)
    plt.close(fig)
    return summary


WIDTH_IN, ROW_IN, HEADER_IN = 20.0, 0.42, 0.6  # the figure's width, a grid row's height, the title's band
PAD_IN = {"left": 0.75, "right": 0.12, "top": 0.32, "bottom": 0.32}  # around each panel's plot: ticks, its title


def _box(grid_pos: dict, size: tuple[float, float]) -> list[float]:
    """A panel's plot area in figure fractions from its gridPos (24 columns, rows of ROW_IN)."""
    fig_w, fig_h = size
    col_in = (fig_w - 0.2) / 24
    left = 0.1 + grid_pos["x"] * col_in + PAD_IN["left"]
    width = grid_pos["w"] * col_in - PAD_IN["left"] - PAD_IN["right"]
    top = HEADER_IN + grid_pos["y"] * ROW_IN + PAD_IN["top"]
    height = grid_pos["h"] * ROW_IN - PAD_IN["top"] - PAD_IN["bottom"]
    return [left / fig_w, 1 - (top + height) / fig_h, width / fig_w, height / fig_h]


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


# --- the run -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    ap.add_argument("--duration-per-cell", type=float, default=6.0, help="loadtest --duration (s)")
    ap.add_argument("--scrape-interval", type=float, default=2.0, help="Prometheus's scrape interval (s)")
    args = ap.parse_args(argv)

    ensure_prometheus()
    stop = threading.Event()
    with Server("dashboard", env={"WEB_CONCURRENCY": "2"}) as server:
        server.wait_ready(in_a_row=20)
        prom = LocalPrometheus([f"127.0.0.1:{server.port}"], scrape_interval=f"{args.scrape_interval:g}s", rule_files=[ALERTS])
        with prom:
            prom.wait_for_scrape_after(time.time())
            start = time.time()
            big = attention_body(1024, causal=False)
            counts: dict[int, int] = {}

            def side_traffic():
                """Every kind beside the load test, about every 8 s, bounded in count."""
                for _ in range(40):
                    for status, n in every_kind(server.url, big, burst_size=12, bursts=1).items():
                        counts[status] = counts.get(status, 0) + n
                    if stop.wait(8):
                        return

            side = threading.Thread(target=side_traffic, daemon=True)
            side.start()
            try:
                with tempfile.TemporaryDirectory(prefix="dashboard-loadtest-") as out:
                    cmd = [sys.executable, "-m", "attention_client.loadtest", "--url", server.url, "--T", "64..1024"]
                    cmd += ["--concurrency", "1,4", "--duration", f"{args.duration_per_cell:g}", "--heads", "8", "--no-weights"]
                    cmd += ["--encoding", "b64", "--out", out]
                    print("+", " ".join(cmd[1:]), file=sys.stderr)
                    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
            finally:
                stop.set()
            side.join(timeout=120)
            prom.wait_for_scrape_after(time.time())
            end = time.time()
            print(f"side traffic by status: {dict(sorted(counts.items()))}", file=sys.stderr)
            note = "rendered by bench/dashboard.py from the dashboard's queries on a real Prometheus (not a Grafana screenshot)"
            for line in render(prom, start - 5, end, args.out, args.scrape_interval, note):
                print(line, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
