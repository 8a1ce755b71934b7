"""The layers import downward only: each one imports on its own, in a fresh interpreter, and
loads none of the libraries of the layers above it; and no module of service/ or schemas/ imports,
however indirectly, one that imports it back (TYPE_CHECKING imports counted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grimp
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
        ("service.admission", ("flask", "werkzeug", "apispec", "prometheus_client", "gunicorn")),
    ],
)
def test_a_layer_imports_alone_and_loads_nothing_above_it(module, forbidden):
    loaded = loaded_after(module)
    assert not loaded & set(forbidden), f"import {module} loaded {sorted(loaded & set(forbidden))}"


def test_the_web_layer_builds_the_app_on_its_own():
    assert "flask" in loaded_after("service.web")


def test_no_import_cycle_anywhere():
    """Every import, TYPE_CHECKING ones included (grimp reads them all from the source): a package
    importing one of its own modules (a package's __init__ gathers its parts) is not a cycle."""
    graph = grimp.build_graph("service", "schemas", include_external_packages=False)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if module == imported.rpartition(".")[0] or imported.startswith(module + "."):
                continue  # a package and its own modules
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None and not any(_within(a, b) for a, b in zip(back, back[1:], strict=False)):
                cycles.append((module, *back))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def _within(a: str, b: str) -> bool:
    return b.startswith(a + ".") or a.startswith(b + ".")
