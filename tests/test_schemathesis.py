"""Property fuzzing of the contract: schemathesis reads /openapi.json from the live server,
generates requests for every operation (schema-conforming ones, and for request bodies also
schema-violating ones) and checks every response: no 5xx, a documented status, content type,
headers and body schema, and (negative data) that invalid requests are refused with a 4xx.

Bounded: at most MAX_EXAMPLES generated cases per operation and mode, each test under a time
limit; derandomized in CI by the hypothesis profile conftest loads (CI=1), random on a laptop. The figures (cases per operation, statuses seen,
failures) are printed at the end and written to out/schemathesis.json.

schemathesis' own pytest loader (`schemathesis.pytest.from_fixture`) reads a private attribute
pytest 9.2 no longer has (`request.node._nodeid`), so the cases come from its documented
strategy API (`operation.as_strategy`) driven by hypothesis directly; the checks are its own."""
from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck
from schemathesis import GenerationMode, checks

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parent.parent
MAX_EXAMPLES = 30
RESPONSE_CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]
OPERATIONS = [
    ("POST", "/attention", ("positive", "negative")),
    ("POST", "/mha", ("positive", "negative")),
    ("GET", "/healthz", ("positive",)),
    ("GET", "/readyz", ("positive",)),
    ("GET", "/limits", ("positive",)),
]
CASES = [(method, path, mode) for method, path, modes in OPERATIONS for mode in modes]

FIGURES: dict = {"cases": collections.Counter(), "statuses": collections.Counter(), "failures": 0, "seconds": 0.0}


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(f"{live_server}/openapi.json")


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    report = {
        "max_examples_per_operation_and_mode": MAX_EXAMPLES,
        "cases_total": sum(FIGURES["cases"].values()),
        "cases": dict(FIGURES["cases"]),
        "statuses": {f"{key[0]} -> {key[1]}": n for key, n in sorted(FIGURES["statuses"].items())},
        "failures": FIGURES["failures"],
        "seconds": round(FIGURES["seconds"], 1),
    }
    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    (out / "schemathesis.json").write_text(json.dumps(report, indent=2))
    print("\nschemathesis:", json.dumps(report, indent=2))


def test_every_served_operation_is_fuzzed(api_schema):
    documented = {(op.method.upper(), op.path) for op in (result.ok() for result in api_schema.get_all_operations())}
    assert documented == {(method, path) for method, path, _ in OPERATIONS}


@pytest.mark.parametrize("path", ["/attention", "/mha"])
def test_documented_examples_pass_every_check(api_schema, path):
    """The examples in the document (what /docs pre-fills) are accepted and answered as documented."""
    operation = api_schema[path]["POST"]
    examples = operation.definition.raw["requestBody"]["content"]["application/json"]["examples"]
    for example in examples.values():
        case = operation.Case(body=example["value"], media_type="application/json")
        response = case.call_and_validate(checks=RESPONSE_CHECKS + [checks.positive_data_acceptance], timeout=30)
        assert response.status_code == 200
        FIGURES["cases"][f"POST {path} (documented examples)"] += 1
        FIGURES["statuses"][(f"POST {path} (documented examples)", response.status_code)] += 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_contract(api_schema, live_server, method, path, mode):
    operation = api_schema[path][method]
    negative = mode == "negative"
    response_checks = RESPONSE_CHECKS + ([checks.negative_data_rejection] if negative else [])
    label = f"{method} {path} ({mode})"
    session = requests.Session()
    start = time.perf_counter()

    @hypothesis.given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    def run(case):
        try:
            response = case.call_and_validate(session=session, checks=response_checks, timeout=30)
        except Exception:
            FIGURES["failures"] += 1
            raise
        FIGURES["cases"][label] += 1
        FIGURES["statuses"][(label, response.status_code)] += 1

    try:
        run()
    finally:
        FIGURES["seconds"] += time.perf_counter() - start
        session.close()
    assert FIGURES["cases"][label] > 0
