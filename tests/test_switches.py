"""The suite's own switches, which .ci/run sets: ATTN_REQUIRE_TOOLS=1 (a test whose system tool is
missing fails instead of skipping) and CI (hypothesis replays a fixed set of examples)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .helpers import REQUIRE_TOOLS, ROOT, unavailable


def test_a_missing_tool_skips_or_under_the_switch_fails(monkeypatch):
    monkeypatch.delenv(REQUIRE_TOOLS, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator here"):
        unavailable("no frobnicator here")
    monkeypatch.setenv(REQUIRE_TOOLS, "1")
    with pytest.raises(pytest.fail.Exception, match="ATTN_REQUIRE_TOOLS=1, and no frobnicator here"):
        unavailable("no frobnicator here")


@pytest.mark.parametrize("ci", [None, "1", "true"])
def test_ci_replays_a_fixed_set_of_examples(ci):
    """With CI set, the suite's hypothesis settings are derandomized, with no deadline and no
    example database; without it they explore (a random seed each run)."""
    code = "import tests.conftest\nfrom hypothesis import settings\ns = settings.default\nprint(s.derandomize, s.database is None, s.deadline)\n"
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({} if ci is None else {"CI": ci})
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    derandomized, no_database, deadline = out.stdout.split()
    assert (derandomized, no_database, deadline) == (("True", "True", "None") if ci else ("False", "False", "None"))


def test_ci_runs_with_both_switches():
    script = (ROOT / ".ci" / "run").read_text()
    (exported,) = re.findall(r"^export (.*)$", script, re.MULTILINE)
    assert set(exported.split()) >= {"CI=1", f"{REQUIRE_TOOLS}=1"}
    assert script.rstrip().endswith("make test")
