"""Settings.from_env: every ATTN_* value a server cannot run with stops it at start-up, naming the variable."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from bench.common import terminate
from service.config import RANGES, Settings, session_table_bytes, warnings, web_concurrency
from tests.helpers import ROOT, free_port

# Each of these started a server that then misbehaved: a worker lost to ZeroDivisionError on the
# first body (ATTN_BODY_MIN_RATE=0), every POST hung (ATTN_MAX_INFLIGHT=0), every request refused
# (ATTN_MAX_T=-5, ATTN_MAX_BODY_BYTES=-1), answers computed in float16 (ATTN_DEFAULT_DTYPE=int8).
REFUSED = [
    ("ATTN_BODY_MIN_RATE", "0"),
    ("ATTN_MAX_INFLIGHT", "0"),
    ("ATTN_MAX_INFLIGHT", "100000000000"),
    ("ATTN_MAX_QUEUE", "-1"),
    ("ATTN_MAX_T", "-5"),
    ("ATTN_MAX_S", "0"),
    ("ATTN_MAX_BODY_BYTES", "-1"),
    ("ATTN_MAX_RANK", "0"),
    ("ATTN_MAX_D", "99999999999999999999999"),
    ("ATTN_SPLIT_THREADS", "0"),
    ("ATTN_SEND_TIMEOUT_S", "0"),
    ("ATTN_SEND_TIMEOUT_S", "10000000000"),
    ("ATTN_HEADER_TIMEOUT_S", "-1"),
    ("ATTN_BODY_TIMEOUT_S", "0"),
    ("ATTN_SEND_BUFFER_BYTES", "0"),
    ("ATTN_MAX_INFLIGHT_BYTES", "0"),
    ("ATTN_MAX_SCORE_ELEMENTS", "-3"),
    ("ATTN_DEFAULT_DTYPE", "int8"),
    ("ATTN_DEFAULT_DTYPE", "float16"),
    ("ATTN_MAX_T", "4k"),
    ("PORT", "99999"),
    ("PORT", "-1"),
]


@pytest.mark.parametrize(("variable", "value"), REFUSED, ids=[f"{n}={v}" for n, v in REFUSED])
def test_a_value_the_server_cannot_run_with_is_refused_by_name(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit, match=variable):
        Settings.from_env()


def test_the_defaults_and_the_bounds_of_each_range_are_accepted(monkeypatch):
    Settings.from_env()
    for name, (variable, least, most) in RANGES.items():
        for value in (least, most):
            monkeypatch.setenv(variable, str(value))
            assert getattr(Settings.from_env(), name) == value
        monkeypatch.delenv(variable)
    monkeypatch.setenv("ATTN_DEFAULT_DTYPE", "float64")
    assert Settings.from_env().default_dtype == "float64"


def test_sessions_whose_page_tables_pass_1_gib_are_refused_naming_the_variables(monkeypatch):
    """Each of the three in range, but together 2**20 sessions x 2**17 pages x 4 bytes = 512 GiB."""
    monkeypatch.setenv("ATTN_SESSION_MAX_COUNT", str(2**20))
    monkeypatch.setenv("ATTN_SESSION_MAX_TOKENS", str(2**17))
    monkeypatch.setenv("ATTN_SESSION_PAGE_TOKENS", "1")
    with pytest.raises(SystemExit, match="ATTN_SESSION_MAX_COUNT") as refused:
        Settings.from_env()
    assert all(name in str(refused.value) for name in ("ATTN_SESSION_MAX_TOKENS", "ATTN_SESSION_PAGE_TOKENS", str(2**39)))
    monkeypatch.setenv("ATTN_SESSION_PAGE_TOKENS", "512")  # 2**20 x 256 x 4: 1 GiB exactly, accepted
    assert session_table_bytes(Settings.from_env()) == 2**30


def test_the_server_does_not_start_with_one():
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(free_port()), "ATTN_BODY_MIN_RATE": "0"}
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "ATTN_BODY_MIN_RATE=0" in done.stderr + done.stdout


@pytest.mark.parametrize("value", ["0", "-2", "abc", "100000"])
def test_a_worker_count_the_server_cannot_run_with_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("WEB_CONCURRENCY", value)  # 0 started a server with no worker: every request hung
    with pytest.raises(SystemExit, match="WEB_CONCURRENCY"):
        web_concurrency()


def test_the_server_does_not_start_without_a_worker():
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(free_port()), "WEB_CONCURRENCY": "0"}
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "WEB_CONCURRENCY=0" in done.stderr + done.stdout


def test_an_in_flight_budget_below_the_body_limit_is_warned_about_at_start():
    """Each in range, but together a body between the two sizes fits the body limit and never the
    in-flight budget: said once at start (a test or an operator may mean it), never refused."""
    assert warnings(Settings()) == []
    [said] = warnings(Settings(max_inflight_bytes=300_000, max_body_bytes=1_000_000))
    assert "ATTN_MAX_INFLIGHT_BYTES=300000" in said and "ATTN_MAX_BODY_BYTES=1000000" in said


def test_an_ipv6_host_is_listened_on():
    """HOST=::1 (or ::, the IPv6 any-address of dual-stack clusters) stopped gunicorn at start with
    "'' is not a valid port number.": the bind address was written host:port, which an IPv6
    literal's colons make ambiguous. It is written [host]:port."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:  # a machine (or container) without IPv6 on loopback: nothing to listen on
        pytest.skip(f"no IPv6 loopback here: {exc}")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HOST="::1", PORT=str(port), ATTN_WARMUP="0", WEB_CONCURRENCY="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        status = None
        for _ in range(120):  # up to ~60 s: only stops a hang
            if proc.poll() is not None:
                break
            try:
                status = requests.get(f"http://[::1]:{port}/healthz", timeout=5).status_code
                break
            except requests.ConnectionError:
                time.sleep(0.5)
    finally:
        terminate(proc, 30)
    output = proc.stdout.read().decode(errors="replace")
    assert status == 200, output[-2000:]


@pytest.mark.parametrize("value", [",", " , ", ",,,"])
def test_api_keys_that_name_no_key_are_refused(monkeypatch, value):
    """Read as no keys, they turned authentication off without a word (attack round three)."""
    monkeypatch.setenv("ATTN_API_KEYS", value)
    with pytest.raises(SystemExit, match="ATTN_API_KEYS"):
        Settings.from_env()
    monkeypatch.setenv("ATTN_API_KEYS", " a, ,b ")
    assert Settings.from_env().api_keys == ("a", "b")
    monkeypatch.setenv("ATTN_API_KEYS", "")  # empty (or unset): no authentication, as documented
    assert Settings.from_env().api_keys == ()
