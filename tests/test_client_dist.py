"""The attention-client distribution: its wheel, built here from client/ without network (the
build backend pinned in requirements-dev.txt), holds the client and the load tester and nothing
of the service's, and its version is the one the CLIs and the User-Agent show."""

import configparser
import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import attention_client
from attention_client import AttentionClient

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "client"
SERVER_STACK = {"flask", "werkzeug", "gunicorn", "marshmallow", "apispec", "torch", "prometheus-client", "pysimdjson"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel, built from a copy of client/ (the build writes its scratch beside the sources)."""
    tmp = tmp_path_factory.mktemp("dist")
    shutil.copytree(SOURCE, tmp / "client", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), str(tmp / "client")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = (tmp / "dist").glob("*.whl")
    assert path.name == f"attention_client-{attention_client.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        yield zf


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    return wheel.read(f"attention_client-{attention_client.__version__}.dist-info/{name}").decode()


def test_the_wheel_holds_the_client_and_the_load_tester_and_nothing_else(wheel):
    code = {n for n in wheel.namelist() if ".dist-info/" not in n}
    sources = {p.relative_to(SOURCE).as_posix() for p in (SOURCE / "attention_client").rglob("*.py")}
    assert code == sources | {"attention_client/py.typed"}
    assert {n.rsplit("/", 1)[0] for n in code} == {"attention_client", "attention_client/loadtest"}


def test_the_entry_points_are_the_two_clis_and_they_load(wheel):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(_dist_info(wheel, "entry_points.txt"))
    scripts = dict(entry_points["console_scripts"])
    assert scripts == {"attention-client": "attention_client.__main__:main", "attention-loadtest": "attention_client.loadtest.cli:main"}
    for name, value in scripts.items():
        assert callable(EntryPoint(name, value, "console_scripts").load())


def test_the_metadata_names_the_version_and_requires_none_of_the_servers_stack(wheel):
    meta = Parser().parsestr(_dist_info(wheel, "METADATA"))
    assert meta["Name"] == "attention-client" and meta["Version"] == attention_client.__version__
    assert meta.get_all("Provides-Extra") == ["loadtest"]
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    names = {r.name.lower() for r in requires}
    assert {"numpy", "requests", "matplotlib"} <= names and not names & SERVER_STACK, names
    by_extra = {r.name.lower(): str(r.marker) if r.marker else None for r in requires}
    assert by_extra["matplotlib"] == 'extra == "loadtest"' and by_extra["numpy"] is None


@pytest.mark.parametrize("module", ["attention_client", "attention_client.__main__", "attention_client.loadtest.cli"])
def test_the_client_and_the_load_tester_load_nothing_of_the_server(module):
    code = f"import json, sys; import {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert not loaded & {"service", "schemas", "flask", "werkzeug", "gunicorn", "marshmallow", "torch", "matplotlib"}, loaded


@pytest.mark.parametrize("module, prog", [("attention_client", "attention-client"), ("attention_client.loadtest", "attention-loadtest")])
def test_the_clis_show_the_version(module, prog):
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"{prog} {attention_client.__version__}\n", proc.stderr


def test_the_user_agent_names_the_version():
    with AttentionClient("http://127.0.0.1:1") as api:
        head = api._http._head("GET", "/healthz", (), {})
    assert f"\r\nUser-Agent: attention-client/{attention_client.__version__}\r\n".encode() in head
