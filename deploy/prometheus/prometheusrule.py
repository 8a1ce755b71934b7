"""Write deploy/k8s-monitoring/prometheusrule.yaml: alerts.yaml's groups as a PrometheusRule for the
Prometheus Operator (kube-prometheus-stack). Run from anywhere: python deploy/prometheus/prometheusrule.py
(--check: exit 1 if the file differs from what would be written). tests/test_observability.py holds
the two equal."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE / "alerts.yaml"
TARGET = HERE.parent / "k8s-monitoring" / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/alerts.yaml by deploy/prometheus/prometheusrule.py: edit those.
# The Prometheus Operator loads it when its ruleSelector matches these labels (kube-prometheus-stack's
# default selects release: <its Helm release name>; set yours). Apply beside deploy/k8s/.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the expressions) as literal blocks, as in alerts.yaml."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def rule() -> dict:
    """The PrometheusRule document: alerts.yaml's groups as its spec."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "attention-service",
            "labels": {"app.kubernetes.io/name": "attention-service", "release": "prometheus"},
        },
        "spec": yaml.safe_load(ALERTS.read_text()),
    }


def render() -> str:
    return HEADER + yaml.dump(rule(), Dumper=_Dumper, sort_keys=False, width=10**6)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        return 0 if TARGET.read_text() == text else 1
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
