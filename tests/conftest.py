"""Shared fixtures: an app with small limits, its test client, a seeded rng, and a live_server
that runs the real gunicorn (python -m service) on a free loopback port. Plain helpers (the
worked example, tensor encodings, starting a server): helpers.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import settings as hypothesis_settings

from service.config import Settings
from service.web import create_app

from .helpers import serving, start_server, stop_server

# Property tests explore freely on a developer's machine and replay a fixed set in CI (CI set, as
# .ci/run does): hypothesis's own "ci" profile, derandomized, no deadline, no example database, and
# the too_slow health check off (a busy CI machine is not a failing test).
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")

SMALL = Settings(max_t=64, max_s=64, max_score_elements=20_000, max_weights_elements=10_000, max_body_bytes=200_000, max_d=64, warmup=False)


@pytest.fixture
def settings() -> Settings:
    return SMALL


@pytest.fixture
def app(settings):
    app = create_app(settings)
    app.testing = True
    return app


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def live_server():
    """Base URL of the real gunicorn server, shared by the session's end-to-end tests."""
    proc, url = start_server()
    yield url
    stop_server(proc)


@pytest.fixture(scope="session")
def shm_server():
    """A real server of two workers that takes client shared memory (ATTN_ALLOW_CLIENT_SHM=true): a helpers.Server."""
    with serving({"ATTN_ALLOW_CLIENT_SHM": "true", "WEB_CONCURRENCY": "2"}) as server:
        yield server


@pytest.fixture(scope="session")
def attack_server():
    """(process, base URL) of a real gunicorn server for the attack suite: default limits, but a
    32 MiB body limit (so that over-limit bodies stay cheap to send) and a 2**24-element output
    limit, both pinned so the cases do not depend on future defaults."""
    proc, url = start_server({"ATTN_MAX_BODY_BYTES": str(32 * 2**20), "ATTN_MAX_OUTPUT_ELEMENTS": str(2**24)})
    yield proc, url
    stop_server(proc)
