"""What the two doors that serve sessions share (the native resource, sessions.py, and /v2's
sequences, kserve.py): whose sessions a request sees, the pool's refusals as the contract's errors,
a session locked for a request, and new tokens written into it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
from flask import request

from schemas import RequestError
from schemas.sessions import tokens
from service import sessions
from service.sessions import Pool, Session

from .context import context, services
from .errors import ApiError


def pool() -> Pool:
    """The server's sessions (the arbiter's pool, or this app's own)."""
    return services().sessions


def owner() -> bytes:
    """Whose sessions this request sees: its API key's (auth.py has checked it), or everyone's
    without keys."""
    if not services().settings.api_keys:
        return sessions.owner_hash(None)
    return sessions.owner_hash(request.headers.get("Authorization", "").partition(" ")[2].strip())


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """The pool's refusals as the contract's errors."""
    try:
        yield
    except sessions.NotFound:
        raise RequestError(
            "session_not_found", "There is no such session: unknown, expired, deleted, or made with another API key.", "id"
        ) from None
    except sessions.Conflict as exc:
        raise ApiError(
            "length_conflict",
            f"The session's length is {exc.length}, not the length this request expects; nothing was changed.",
            "at",
            extra={"length": exc.length},
        ) from None
    except sessions.TooLong as exc:
        raise RequestError("too_long", f"The session would pass its max_tokens of {exc.max_tokens}; nothing was appended.", "k") from None
    except sessions.PageTooLarge as exc:
        raise RequestError(
            "too_large",
            f"A page of this session ({pool().page_tokens} tokens of kv_heads x (head_dim + value_dim) values) takes {exc.page_bytes} bytes, "
            f"more than all the sessions' memory, {exc.memory_bytes} bytes (ATTN_SESSION_MEMORY_BYTES): it could never hold a token.",
            "head_dim",
        ) from None
    except sessions.Busy:  # only a request with a deadline stops waiting
        deadline = context().deadline
        ms = f"={deadline.ms:g}" if deadline is not None else ""
        raise RequestError(
            "deadline", f"Another request held the session until X-Deadline-Ms{ms} passed; nothing was changed. Allow more time.", "id"
        ) from None
    except sessions.PoolFull as exc:
        retry = pool().retry_after()
        raise ApiError(
            "overloaded",
            f"The sessions' memory is full ({exc}); no live session is evicted. Delete sessions, or retry after {retry} s.",
            headers={"Retry-After": str(retry)},
        ) from None


@contextlib.contextmanager
def session(sid: str) -> Iterator[Session]:
    """The session sid of this request's key, locked for the block (404 if there is none). Waiting
    for another request's hold on it is part of this one's X-Deadline-Ms: past it, 504."""
    deadline = context().deadline
    wait_s = None if deadline is None else deadline.at - time.perf_counter()  # the clock X-Deadline-Ms runs on (context.arrived)
    with refusals(), pool().session(sid, owner(), wait_s) as s:
        yield s


def append(s: Session, schema, k: np.ndarray | None, v: np.ndarray | None, at: int | None) -> int:
    """New tokens checked against the session and written past its length (uncommitted): the
    length they make. 409 unless at is None or the length."""
    s.check_at(at)
    if k is None or v is None:
        return s.length
    shape = s.shape
    k, v = tokens(schema, k, v, shape.kv_heads, shape.head_dim, shape.value_dim, shape.dtype)
    return s.append(k, v)
