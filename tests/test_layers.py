"""The layers import downward only: each one imports on its own, in a fresh interpreter, and
loads none of the libraries of the layers above it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = ("flask", "werkzeug", "marshmallow", "apispec", "prometheus_client")


def loaded_after(module: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after importing module."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("service", (*WEB, "numpy", "schemas")),
        ("service.config", (*WEB, "numpy", "schemas")),
        ("service.core", (*WEB, "schemas", "orjson", "simdjson", "pybase64")),
        ("service.wire", (*WEB, "schemas")),
        ("service.transport.worker", (*WEB, "numpy", "schemas")),
        ("schemas", ("flask", "werkzeug", "apispec", "prometheus_client")),
        ("service.cost", ("flask", "werkzeug", "apispec", "prometheus_client", "gunicorn")),
    ],
)
def test_a_layer_imports_alone_and_loads_nothing_above_it(module, forbidden):
    loaded = loaded_after(module)
    assert not loaded & set(forbidden), f"import {module} loaded {sorted(loaded & set(forbidden))}"


def test_the_web_layer_builds_the_app_on_its_own():
    assert "flask" in loaded_after("service.web")
