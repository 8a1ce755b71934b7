"""Resident memory and open file descriptors of a gunicorn server's workers (Linux /proc)."""

from __future__ import annotations

import os
from pathlib import Path


def worker_pids(arbiter: int) -> list[int]:
    """The arbiter's children: its workers."""
    try:
        return sorted(int(p) for p in Path(f"/proc/{arbiter}/task/{arbiter}/children").read_text().split())
    except OSError:
        return []


def rss_kb(pid: int) -> int | None:
    """VmRSS of a process in KiB; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def sample(arbiter: int) -> dict[int, tuple[int, int]]:
    """{worker pid: (RSS KiB, open fds)} now."""
    out = {}
    for pid in worker_pids(arbiter):
        rss, fds = rss_kb(pid), fd_count(pid)
        if rss is not None and fds is not None:
            out[pid] = (rss, fds)
    return out
