"""The short soak (`make soak` runs the long one): 40 s of mixed traffic against a real server --
valid requests across T and encodings checked against the core, 20% invalid, some abandoned mid-
upload or mid-download -- then no 5xx but 503/504, every answer right, worker memory flat after
the warm-up (under 10% growth) and file descriptors flat."""
from __future__ import annotations

import pytest

from soak.run import soak

from .conftest import start_server, stop_server

DURATION_S, WARMUP_S = 40.0, 15.0


@pytest.mark.live
def test_short_soak():
    proc, url = start_server()
    try:
        report = soak(url, proc.pid, duration_s=DURATION_S, warmup_s=WARMUP_S, clients=4, window_s=6.0)
    finally:
        stop_server(proc)
    print("\n" + report.text(WARMUP_S, 6.0))
    assert report.ok, report.text(WARMUP_S, 6.0)
