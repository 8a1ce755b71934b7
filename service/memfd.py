"""Memory shared by gunicorn's arbiter and its workers (the admission census, Triton's statistics,
the shared-memory registry, the sessions' pool): each is one file, made before the workers fork
and mapped by all of them, whose rows name the process that holds them."""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading


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


class Lock:
    """A lock over one such file, for its processes and their threads: a record lock belongs to a
    process, so its threads take turns on a threading.Lock first; the process then holds the
    file's record lock, which the kernel releases if the process dies holding it. fd None (a table
    in this process's memory alone): the threads' lock only."""

    def __init__(self, fd: int | None):
        self._fd, self._threads = fd, threading.Lock()

    def __enter__(self) -> None:
        self._threads.acquire()
        if self._fd is not None:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._threads.release()
                raise

    def __exit__(self, *exc) -> None:
        try:
            if self._fd is not None:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()
