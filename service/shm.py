"""Client shared-memory regions (Triton's system shared-memory extension): the registry of
regions that every worker of a server sees, and the reading and writing of a region's bytes.

A region is a name the client chose for (key, offset, byte_size): byte_size bytes at offset in the
POSIX shared-memory object key (what shm_open(3) opens, e.g. "/input0"; the client makes it, with
tritonclient.utils.shared_memory or multiprocessing.shared_memory).

- The registry is one JSON document in a mapping shared by the gunicorn arbiter and its workers
  (create(), from deploy/gunicorn.conf.py's on_starting, before any worker forks), behind a record
  lock (fcntl) that the kernel releases if its holder dies: a region registered through one worker
  is used through any other. Without a shared registry (the Flask test client) a process keeps a
  private one.
- No region is ever mapped. Each use opens the object for that read or write alone (non-blocking:
  a FIFO named as a key would block a thread for ever), checks that it is a regular file and that
  the region still lies inside it (fstat), and moves the bytes with pread/pwrite. A mapping touched
  past the end of its file kills the process (SIGBUS), and a client may shrink its object
  (ftruncate) at any moment; pread past the end returns fewer bytes instead, which is refused here,
  and pwrite past it grows the client's object. So a region unregistered, unlinked or resized
  under the server is an error on its next use, never a crash, and a region costs the server no
  memory between requests.

Errors are ShmError(message): the web layer answers them 400."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import orjson

from service import memfd

try:
    from _posixshmem import shm_open  # type: ignore[import-not-found]  # CPython's own binding of shm_open(3), as multiprocessing.shared_memory uses
except ImportError:  # a platform without POSIX shared memory: every key is "not found"
    shm_open = None

MAX_REGIONS = 64  # registered at once, per server
MAX_NAME = 128  # characters of a region's name
MAX_KEY = 255  # characters of a key (NAME_MAX)
DOC_BYTES = 1 << 18  # the registry's JSON: 64 regions of the longest names and keys, escaped, fit
HEAD = 16  # bytes before the JSON: its length, and a version that every change increments

_shared: Registry | None = None  # the server's registry, inherited by the workers from the arbiter


class ShmError(Exception):
    """A region that cannot be registered, found, read or written; the message says why."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Region:
    """A registered region: byte_size bytes at offset in the shared-memory object key."""

    name: str
    key: str
    offset: int
    byte_size: int

    def status(self) -> dict:
        """The region as the extension's status lists it: name, key, offset, byte_size."""
        return asdict(self)


class Registry:
    """The regions registered on a server, by name: in a shared mapping (shared=True) or in this
    process's memory alone."""

    def __init__(self, shared: bool = True):
        self._fd = memfd.anonymous_file("attention-shm-registry", HEAD + DOC_BYTES) if shared else None
        self._map = mmap.mmap(-1 if self._fd is None else self._fd, HEAD + DOC_BYTES)
        self._lock = memfd.Lock(self._fd)  # the processes' and their threads'
        self._parsed: tuple[int, dict[str, Region]] = (0, {})  # (version, regions): parsed again only when another version is found

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Region]]:
        """The registry, read under the lock; what the block leaves in the dict is written back."""
        with self._lock:
            length, version = (int.from_bytes(self._map[i : i + 8], "little") for i in (0, 8))
            if self._parsed[0] != version:
                doc = orjson.loads(self._map[HEAD : HEAD + length]) if length else []
                self._parsed = (version, {r["name"]: Region(**r) for r in doc})
            regions = dict(self._parsed[1])
            yield regions
            if regions != self._parsed[1]:
                doc = orjson.dumps([r.status() for r in regions.values()])
                self._map[HEAD : HEAD + len(doc)] = doc  # fits: MAX_REGIONS of the longest, escaped, are under DOC_BYTES
                self._map[:8], self._map[8:16] = len(doc).to_bytes(8, "little"), (version + 1).to_bytes(8, "little")
                self._parsed = (version + 1, regions)

    def register(self, name: str, key, offset, byte_size) -> Region:
        """Register byte_size bytes at offset in the object key as the region name: its name unused,
        the object a regular file that holds them."""
        if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME and name.isprintable()):
            raise ShmError(f"a region's name must be 1 to {MAX_NAME} printable characters.")
        if not isinstance(key, str):
            raise ShmError(f'key must be a string (the shared-memory object\'s name, e.g. "/{name[:20]}"), not {type(key).__name__}.')
        for what, value, least in (("offset", offset, 0), ("byte_size", byte_size, 1)):
            if type(value) is not int or value < least:
                raise ShmError(f"{what} must be an integer of at least {least}, not {str(value)[:40]}.")
        region = Region(name, key, offset, byte_size)
        _check_fits(region, 0, byte_size, _size_of(key), "registered")
        with self._locked() as regions:
            if name in regions:
                raise ShmError(f"a region named {name!r} is already registered; unregister it first, or choose another name.")
            if len(regions) >= MAX_REGIONS:
                raise ShmError(f"{MAX_REGIONS} regions are registered, as many as the server holds; unregister one first.")
            regions[name] = region
        return region

    def unregister(self, name: str | None = None) -> None:
        """Forget the region name (every region: None). A name not registered is no error, as in Triton."""
        with self._locked() as regions:
            if name is None:
                regions.clear()
            else:
                regions.pop(name, None)

    def status(self, name: str | None = None) -> list[Region]:
        """The region name, or every region (None), in the order they were registered."""
        if name is None:
            with self._locked() as regions:
                return list(regions.values())
        return [self.get(name)]

    def get(self, name: str) -> Region:
        with self._locked() as regions:
            region = regions.get(name)
        if region is None:
            raise ShmError(f"no shared-memory region named {name!r} is registered.")
        return region


def read(region: Region, offset: int, size: int) -> memoryview:
    """size bytes at offset in region, copied out of its object (into fresh memory, 64-byte aligned)."""
    fd = _open(region.key, os.O_RDONLY)
    try:
        _check_fits(region, offset, size, os.fstat(fd).st_size, "read")
        view, got = memoryview(np.empty(size, np.uint8)), 0  # type: ignore[arg-type]  # an ndarray is a buffer; not zeroed: every byte is read over
        while got < size:
            n = os.preadv(fd, [view[got:]], region.offset + offset + got)
            if n == 0:  # the object shrank since fstat
                raise ShmError(f"region {region.name!r} was resized while it was read; {got} of its {size} bytes were there.")
            got += n
        return view
    finally:
        os.close(fd)


def write(region: Region, offset: int, data: memoryview) -> None:
    """data's bytes at offset in region, written into its object."""
    size = data.nbytes
    fd = _open(region.key, os.O_RDWR)
    try:
        _check_fits(region, offset, size, os.fstat(fd).st_size, "written")
        done = 0
        while done < size:  # past the object's end (shrunk since fstat), pwrite grows it: no fault
            done += os.pwrite(fd, data[done:], region.offset + offset + done)
    finally:
        os.close(fd)


def _check_fits(region: Region, offset: int, size: int, object_size: int, doing: str) -> None:
    """ShmError unless size bytes at offset lie in region, and region in its object of object_size bytes."""
    if offset < 0 or size < 0 or offset + size > region.byte_size:
        raise ShmError(f"{size} bytes at offset {offset} of region {region.name!r} pass its end: it holds {region.byte_size} bytes.")
    if region.offset + region.byte_size > object_size:
        raise ShmError(
            f"region {region.name!r} cannot be {doing}: it is {region.byte_size} bytes at offset {region.offset} of "
            f"shared-memory object {region.key!r}, which holds {object_size} bytes."
        )


def _size_of(key: str) -> int:
    fd = _open(key, os.O_RDONLY)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _open(key: str, flags: int) -> int:
    """A descriptor of the shared-memory object key, a regular file (shm_open adds O_NOFOLLOW)."""
    if not (0 < len(key) <= MAX_KEY and "/" not in key[1:] and "\0" not in key and key.lstrip("/") not in ("", ".", "..")):
        raise ShmError(
            f"key {key[:MAX_KEY]!r} is not the name of a shared-memory object: one '/' first, then up to {MAX_KEY - 1} characters, none a '/'."
        )
    if shm_open is None:
        raise ShmError("this server's platform has no POSIX shared memory.")
    try:
        fd = shm_open(key, flags | os.O_NONBLOCK, 0)
    except FileNotFoundError:
        raise ShmError(f"no shared-memory object named {key!r} exists on the server's host.") from None
    except OSError as exc:
        raise ShmError(f"shared-memory object {key!r} cannot be opened: {exc.strerror}.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ShmError(f"{key!r} is not a shared-memory object (not a regular file).")
    return fd


def create() -> Registry:
    """The server's registry, made in the arbiter before the workers fork (they inherit it)."""
    global _shared
    _shared = Registry(shared=True)
    return _shared


def shared() -> Registry | None:
    """The server's registry, if this process was forked from an arbiter that made one."""
    return _shared
