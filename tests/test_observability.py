"""The dashboard and the alert rules, checked against Prometheus itself (Debian's package,
installed here when missing and we are root with apt-get):

- promtool checks the rules and the compose Prometheus config, and `promtool test rules` runs
  deploy/prometheus/alerts.test.yaml (every alert fires where it should, stays quiet where not);
- the PrometheusRule for the Operator holds the same groups;
- the Grafana dashboard is well formed and provisioned as compose mounts it;
- a real scrape: the live service (2 workers) and a Prometheus on loopback scraping it every
  second; after traffic of every kind, every metric that the dashboard and the alerts name is
  there, every panel's query returns data, the rules evaluate without error, the 504s sent
  make AttentionServerErrors fire, and a killed worker shows as a drop of the ready workers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench import prometheus as prom_
from bench.common import attention_body
from bench.dashboard import every_kind
from tests.helpers import serving, unavailable, wait_for_workers, wait_until, worker_pids

ROOT = Path(__file__).resolve().parent.parent
PROM_DIR = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
RULE = ROOT / "deploy" / "k8s-monitoring" / "prometheusrule.yaml"
COMPOSE = ROOT / "deploy" / "compose.yaml"


@pytest.fixture(scope="session")
def prometheus_installed():
    try:
        prom_.ensure_prometheus()
    except prom_.Unavailable as e:
        unavailable(str(e))


def promtool(*args: str, cwd: Path = PROM_DIR) -> str:
    proc = prom_.promtool(*args, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# --- promtool --------------------------------------------------------------------------------


def test_promtool_checks_the_rules(prometheus_installed):
    out = promtool("check", "rules", "alerts.yaml")
    assert f"{len(prom_.alert_exprs())} rules found" in out, out


def test_promtool_unit_tests_every_alert(prometheus_installed):
    assert "SUCCESS" in promtool("test", "rules", "alerts.test.yaml")
    # Each alert is shown to fire (an expectation with alerts) and to stay quiet (one without).
    tests = yaml.safe_load((PROM_DIR / "alerts.test.yaml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for name in prom_.alert_exprs():
        assert any(c["alertname"] == name and c["exp_alerts"] for c in cases), f"{name} is never shown to fire"
        assert any(c["alertname"] == name and not c["exp_alerts"] for c in cases), f"{name} is never shown to stay quiet"


def test_promtool_unit_tests_can_fail(prometheus_installed, tmp_path):
    """So that the test above can fail: an SLO of 100 s instead of 1 s never fires."""
    rules = (PROM_DIR / "alerts.yaml").read_text()
    assert rules.count(") > 1\n") == 1
    (tmp_path / "alerts.yaml").write_text(rules.replace(") > 1\n", ") > 100\n"))
    (tmp_path / "alerts.test.yaml").write_text((PROM_DIR / "alerts.test.yaml").read_text())
    proc = prom_.promtool("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    assert proc.returncode != 0 and "AttentionLatencyP99OverSLO" in proc.stdout + proc.stderr


def test_promtool_checks_the_compose_prometheus_config(prometheus_installed):
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in out and "rules found" in out, out


# --- the Prometheus Operator's PrometheusRule ------------------------------------------------


def test_prometheusrule_holds_the_same_rules():
    doc = yaml.safe_load(RULE.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "attention-service"
    assert doc["spec"] == yaml.safe_load((PROM_DIR / "alerts.yaml").read_text())
    proc = subprocess.run([sys.executable, str(PROM_DIR / "prometheusrule.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, "prometheusrule.yaml is not what deploy/prometheus/prometheusrule.py writes: run it"


# --- the Grafana dashboard and its provisioning ----------------------------------------------


def test_dashboard_is_well_formed():
    dash = prom_.dashboard()
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ids, cells = set(), set()
    for panel in prom_.panels(dash):
        assert panel["id"] not in ids, panel["id"]
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{var['name']}}}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
    titles = " ".join(p["title"].lower() for p in prom_.panels(dash))
    for what in ("request rate", "p99", "phase", "compute time by t", "cost prediction", "rejections", "queued", "memory"):
        assert what in titles, what


def test_grafana_is_provisioned_beside_prometheus():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: (COMPOSE.parent / v.split(":")[0]).resolve() for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == GRAFANA / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    scrape = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "attention.yaml").read_text())["providers"]
    path = provider["options"]["path"]
    dashboards = {dest: src for dest, src in mounts.items() if dest.startswith(path.rstrip("/") + "/")}
    assert dashboards and all(src.suffix == ".json" and src.is_file() for src in dashboards.values())
    assert GRAFANA / "attention.json" in dashboards.values()
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in dashboards
    assert "prometheus" in grafana["depends_on"]


def test_metric_names_are_found_in_promql():
    expr = 'sum by (job, le) (rate(a_bucket{endpoint=~"/x|y"}[5m])) / on (job) group_left b_total offset 5m > bool 1 or histogram_quantile(0.5, c)'
    assert prom_.metric_names(expr) == {"a_bucket", "b_total", "c"}


# --- a real scrape ---------------------------------------------------------------------------

SCRAPE_S = 1
# Queried at the end of the test's traffic: a window that covers all of it.
RATE_INTERVAL = "5m"


@pytest.fixture(scope="module")
def scraped(prometheus_installed):
    """The live service (2 workers, 1 compute slot and 1 queued request each, so that a burst
    draws 503) scraped by a Prometheus every second with alerts.yaml loaded, after two rounds of
    every kind of traffic with a scrape between them (so that every series has grown between two
    samples, and rate() sees it)."""
    env = {"WEB_CONCURRENCY": "2", "ATTN_MAX_INFLIGHT": "1", "ATTN_MAX_QUEUE": "1"}
    with serving(env) as server:
        prom = prom_.LocalPrometheus([f"127.0.0.1:{server.port}"], scrape_interval=f"{SCRAPE_S}s", rule_files=[prom_.ALERTS])
        try:
            prom.wait_ready()
            prom.wait_for_scrape_after(time.time())
            big = attention_body(1024, causal=False)
            counts = []
            for _ in range(2):
                counts.append(every_kind(server.url, big))
                prom.wait_for_scrape_after(time.time())
            yield prom, counts, server
        finally:
            prom.stop()


@pytest.mark.live
def test_the_traffic_had_every_kind(scraped):
    _, counts, _ = scraped
    for round_ in counts:
        assert {200, 404, 422, 503, 504} <= set(round_), round_


@pytest.mark.live
def test_every_metric_of_the_dashboard_and_the_alerts_is_scraped(scraped):
    prom, _, _ = scraped
    names = set().union(*(prom_.metric_names(t.expr) for t in prom_.targets(prom_.dashboard())))
    names |= set().union(*map(prom_.metric_names, prom_.alert_exprs().values()))
    assert len(names) >= 10, names
    missing = [n for n in sorted(names) if not prom.query(n)]
    assert not missing, f"named by the dashboard or the alerts but not scraped: {missing}"


@pytest.mark.live
def test_every_dashboard_query_returns_data(scraped):
    prom, _, _ = scraped
    empty = []
    for target in prom_.targets(prom_.dashboard()):
        result = prom.query(prom_.grafana_expr(target.expr, RATE_INTERVAL))
        if not any(math.isfinite(float(r["value"][1])) for r in result):
            empty.append(f"{target.name}: {target.expr} -> {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


@pytest.mark.live
def test_the_alert_rules_evaluate_and_the_504s_fire_server_errors(scraped):
    prom, _, _ = scraped

    def evaluated():
        """every rule of alerts.yaml has been evaluated by the real Prometheus"""
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_until(evaluated, timeout=30)
    assert {r["name"] for r in rules} == set(prom_.alert_exprs())
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"

    def firing():
        """AttentionServerErrors fires for the 504s the traffic drew"""
        alerts = prom.api("alerts")["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "AttentionServerErrors" and a["state"] == "firing"]

    alerts = wait_until(firing, timeout=30)
    assert {(a["labels"]["endpoint"], a["labels"]["status"]) for a in alerts} >= {("/attention", "504")}, json.dumps(alerts)


@pytest.mark.live
def test_worker_metrics_name_the_live_workers(scraped):
    """attention_worker_resident_memory_bytes has one series per live worker, by pid, and
    attention_workers_ready counts them all ready."""
    prom, _, server = scraped
    pids = worker_pids(server.proc)
    assert len(pids) == 2
    rss = {int(r["metric"]["pid"]): float(r["value"][1]) for r in prom.query("attention_worker_resident_memory_bytes")}
    assert set(rss) == pids and all(v > 10 * 2**20 for v in rss.values()), rss
    (ready,) = prom.query("attention_workers_ready")
    assert float(ready["value"][1]) == 2


@pytest.mark.live
def test_a_lost_worker_drops_the_ready_workers(scraped):
    """Killed, a worker leaves the ready count (its live gauge is removed) until its replacement
    has warmed up: Prometheus sees the drop that AttentionReadinessFlapping counts. Last in this
    module: it replaces a worker."""
    prom, _, server = scraped
    survivors = worker_pids(server.proc)
    victim = min(survivors)
    survivors.discard(victim)
    os.kill(victim, signal.SIGKILL)
    # The replacement is paused before its warm-up can end, so that the drop lasts until Prometheus
    # has scraped it, however slowly a busy machine scrapes; it goes on once it has.
    [replacement] = wait_for_workers(server.proc, 2, gone=victim) - survivors
    os.kill(replacement, signal.SIGSTOP)

    def dropped():
        """Prometheus has seen the ready workers drop"""
        result = prom.query("resets(attention_workers_ready[5m])")
        return result and float(result[0]["value"][1]) >= 1

    try:
        wait_until(dropped, timeout=60)
    finally:
        os.kill(replacement, signal.SIGCONT)

    def back():
        """the replacement is ready and scraped: 2 ready workers again"""
        result = prom.query("attention_workers_ready")
        return result and float(result[0]["value"][1]) == 2

    wait_until(back, timeout=60)
    assert victim not in worker_pids(server.proc)
