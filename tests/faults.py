"""Faults put into the service on purpose, for the tests that must see it fail, or be slow, at a
moment they choose: the numeric core's attention() (and a session's step, paged_attention()) made
to raise, or to hold a request until the test lets it go, for a request that sends scale=TRIGGER;
any other request is computed as usual.

In-process: monkeypatch service.core.attention with raising() or holding(). In a real server
(helpers.start_server / serving): faulty_env() gives the environment that puts the fault into
every process of the server at start (a sitecustomize module on PYTHONPATH, which Python runs as
it starts; gunicorn's workers are forks of a process that ran it), so that the service's code
carries no hook for tests. The server's processes then import numpy before gunicorn's config is
read: start_server() sets the BLAS threads itself, so nothing changes for the workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

TRIGGER = 0.3125  # the scale that meets the fault (exact in binary: float32 and float64 alike)
MESSAGE = "injected fault 5c1e: this text must never leave the server"
ENV = "ATTENTION_TEST_FAULT"  # "raise", or "hold" with the directory in ENV_DIR
ENV_DIR = "ATTENTION_TEST_FAULT_DIR"
HOLD_LIMIT_S = 300.0  # a held request the test never releases fails after this, not never


def raising(real: Callable) -> Callable:
    """attention() that raises RuntimeError(MESSAGE) for scale=TRIGGER: a bug, as the app sees one."""

    def attention(*args, **kwargs):
        if kwargs.get("scale") == TRIGGER:
            raise RuntimeError(MESSAGE)
        return real(*args, **kwargs)

    return attention


def holding(real: Callable, directory: Path) -> Callable:
    """attention() that, for scale=TRIGGER, writes a file `entered-<pid>-<n>` in directory, then
    waits until a file `release` is there before it computes: a request slow on purpose, for as
    long as the test wants (Held)."""
    entered = 0

    def attention(*args, **kwargs):
        nonlocal entered
        if kwargs.get("scale") == TRIGGER:
            entered += 1
            (directory / f"entered-{os.getpid()}-{entered}").touch()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not (directory / "release").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"held for {HOLD_LIMIT_S} s and never released")
                time.sleep(0.01)
        return real(*args, **kwargs)

    return attention


class Held:
    """The test's side of holding(): how many held requests have entered the core, and their release."""

    def __init__(self, directory: Path):
        self.directory = directory

    def entered(self) -> int:
        return len(list(self.directory.glob("entered-*")))

    def release(self) -> None:
        (self.directory / "release").touch()


def install() -> None:
    """Replace service.core.attention by the fault ENV names (run by the server's sitecustomize)."""
    fault = os.environ.get(ENV)
    if not fault:
        return
    from service import core

    if fault == "raise":
        core.attention = raising(core.attention)
        core.paged_attention = raising(core.paged_attention)  # a session's step
    elif fault == "hold":
        core.attention = holding(core.attention, Path(os.environ[ENV_DIR]))
        core.paged_attention = holding(core.paged_attention, Path(os.environ[ENV_DIR]))
    else:
        raise ValueError(f"{ENV}={fault!r}: raise or hold")


def faulty_env(site: Path, fault: str, directory: Path | None = None) -> dict[str, str]:
    """The environment for start_server() whose server has the fault ("raise" or "hold", the
    latter with its directory, the Held's); site is an empty directory for the sitecustomize."""
    root = Path(__file__).resolve().parent.parent
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("from tests import faults\n\nfaults.install()\n")
    paths = [str(site), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths), ENV: fault}
    if directory is not None:
        env[ENV_DIR] = str(directory)
    return env
