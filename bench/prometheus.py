"""A real Prometheus on loopback (Debian's `prometheus` package), and what the dashboard and the
alert rules ask of it: their queries and the metric names in them.

Used by tests/test_observability.py (a real scrape of a live service) and bench/dashboard.py
(docs/dashboard.png). Grafana's own variables ($__rate_interval, ...) are substituted here as
Grafana would: Prometheus sees plain PromQL."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from bench.common import ROOT, Server

DASHBOARD = ROOT / "deploy" / "grafana" / "attention.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
PROMETHEUS = Path(os.environ.get("PROMETHEUS", "/usr/bin/prometheus"))
PROMTOOL = Path(os.environ.get("PROMTOOL", "/usr/bin/promtool"))


class Unavailable(Exception):
    """Prometheus is missing and cannot be installed here (why, in the message)."""


def ensure_prometheus() -> None:
    """Debian's prometheus (prometheus and promtool), installed with apt-get if missing and we are
    root; else Unavailable saying why. bookworm ships 2.42, which has `promtool test rules`."""
    if PROMETHEUS.is_file() and PROMTOOL.is_file():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable(
            f"Prometheus is missing ({PROMETHEUS}, {PROMTOOL}) and cannot be installed here (that needs root and "
            "apt-get): run `apt-get install prometheus` as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]  # another apt run may hold the lock for a while
    for cmd in (
        ["apt-get", *lock, "update", "-qq"],
        ["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if not (PROMETHEUS.is_file() and PROMTOOL.is_file()):
        raise RuntimeError(f"apt-get installed prometheus but {PROMETHEUS} or {PROMTOOL} is not there")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


class LocalPrometheus(Server):
    """`prometheus` on a free loopback port scraping `targets` (host:port) every scrape_interval,
    with rule_files evaluated as often; storage in a temporary directory, removed at stop()."""

    def __init__(self, targets: list[str], scrape_interval: str = "1s", rule_files: list[Path] = ()):
        self.dir = Path(tempfile.mkdtemp(prefix="attention-prometheus-"))
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval, "scrape_timeout": scrape_interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "attention", "static_configs": [{"targets": targets}]}],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [str(PROMETHEUS), f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}"]
        super().__init__("prometheus", [*argv, "--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])

    def wait_ready(self, timeout: float = 60, in_a_row: int = 1, path: str = "/-/ready") -> None:
        super().wait_ready(timeout, in_a_row, path)

    def api(self, path: str, **params) -> dict | list:
        """GET /api/v1/<path>; the "data" of a success, else RuntimeError with Prometheus's error."""
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query at now: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range query: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def wait_for_scrape_after(self, t: float, timeout: float = 60) -> None:
        """Wait until every target has been scraped, successfully, after wall-clock time t."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = self.api("targets")["activeTargets"]
            if targets and all(tg["health"] == "up" and _epoch(tg["lastScrape"]) > t for tg in targets):
                return
            time.sleep(0.2)
        raise AssertionError(f"no successful scrape after {t} within {timeout} s: {json.dumps(self.api('targets'))[:2000]}")

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _epoch(rfc3339: str) -> float:
    """Prometheus's lastScrape ("2026-12-01T00:40:01.123456789Z", or with an offset) as epoch seconds."""
    from datetime import datetime

    text = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


# --- the dashboard's and the rules' queries ----------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One query of one dashboard panel."""

    panel: dict
    ref: str
    expr: str
    legend: str

    @property
    def name(self) -> str:
        return f"{self.panel['title']} [{self.ref}]"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> Iterator[dict]:
    """Every panel, those inside rows too."""
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dash: dict) -> list[Target]:
    return [Target(p, t["refId"], t["expr"], t.get("legendFormat", "")) for p in panels(dash) for t in p.get("targets", [])]


def alert_exprs() -> dict[str, str]:
    """alerts.yaml's expressions by alert (or recording rule) name."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r.get("alert") or r["record"]: r["expr"] for g in groups for r in g["rules"]}


def grafana_expr(expr: str, rate_interval: str, interval: str | None = None, range_: str | None = None) -> str:
    """expr as Grafana sends it: its interval variables replaced (${x} and $x forms)."""
    values = {"__rate_interval": rate_interval, "__interval": interval or rate_interval, "__range": range_ or rate_interval}
    out = re.sub(r"\$\{(__\w+)\}|\$(__\w+)", lambda m: values[m.group(1) or m.group(2)], expr)
    assert "$" not in out, f"a variable this helper does not know in {expr!r}"
    return out


def rate_interval(step_s: float, scrape_s: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)."""
    return f"{max(step_s + scrape_s, 4 * scrape_s):g}s"


_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (followed
    by "("), keywords, label names (inside {...} or by/without/on/ignoring (...)), durations or
    strings."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = re.findall(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\b(?!\s*\()", e)
    return {n for n in names if n.lower() not in _KEYWORDS}
