"""Memory shared by gunicorn's arbiter and its workers (the admission census, Triton's statistics,
the shared-memory registry, the sessions' pool): each is one file, made before the workers fork
and mapped by all of them, whose rows name the process that holds them."""

from __future__ import annotations

import os
import tempfile


def anonymous_file(name: str, size: int) -> int:
    """A file descriptor of size bytes (sparse: untouched memory costs nothing) that no other
    process can open by name; name is what /proc/PID/fd shows of it."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # not Linux: a temporary file, unlinked at once
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


def alive(pid: int) -> bool:
    """Whether process pid still runs (a row's holder that died frees its row)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
