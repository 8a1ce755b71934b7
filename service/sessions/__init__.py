"""Sessions: attention state held by the server (contract 1.3, "Sessions"). The pool (pool.py)
holds every session's keys and values in pages of shared memory that every worker maps; the web
layer (service/web/sessions.py) serves it. Nothing here knows of HTTP."""

from __future__ import annotations

from service.config import Settings

from .pool import UNIT, Busy, Conflict, NotFound, PageTooLarge, Pool, PoolFull, Session, SessionError, Shape, TooLong, name_hash, owner_hash

__all__ = [
    "UNIT",
    "Busy",
    "Conflict",
    "NotFound",
    "Pool",
    "PageTooLarge",
    "PoolFull",
    "Session",
    "SessionError",
    "Shape",
    "TooLong",
    "create",
    "name_hash",
    "owner_hash",
    "pool_for",
    "shared",
]

_shared: Pool | None = None  # the server's pool, made by the arbiter and inherited by its workers


def pool_for(settings: Settings) -> Pool:
    """A pool of the sizes settings give."""
    return Pool(
        settings.session_memory_bytes,
        settings.session_page_tokens,
        settings.session_max_tokens,
        settings.session_max_count,
        settings.session_idle_s,
    )


def create(settings: Settings) -> Pool:
    """The server's pool, made in the arbiter before the workers fork (deploy/gunicorn.conf.py)."""
    global _shared
    _shared = pool_for(settings)
    return _shared


def shared() -> Pool | None:
    """The server's pool, if this process was forked from an arbiter that made one."""
    return _shared
