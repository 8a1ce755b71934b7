"""Content-Encoding both ways, at both front doors by the same rules (Triton's: gzip and deflate).

Requests: a body sent with `Content-Encoding: gzip` or `deflate` (or `identity`) is inflated as it
is read (inflate(), called by http.read_body), a step at a time with zlib's decompressobj and
max_length, so that the inflated bytes count against ATTN_MAX_BODY_BYTES, and against the request's
memory charge (admission), as they are produced: one byte past the limit is 413 body_too_large at
once, whatever the ratio, and no more is inflated. A corrupt or truncated stream, or bytes after its
end, is 400 bad_compression. Time is linear in the inflated bytes: each step inflates at most STEP
bytes from at most IN_STEP bytes of input (zlib copies what it left unread, at most IN_STEP). One
coding at most: `gzip, gzip` (and any list of two) is 415, said so, rather than inflated twice;
one gzip member (a second one is bytes after the end). deflate is zlib's format (RFC 9110, and
what tritonclient sends) or, as browsers and servers accept it, raw deflate.

Answers: compressed when Accept-Encoding asks for gzip or deflate (q-values respected; a coding
over identity on a tie, gzip over deflate) and the answer is at least ATTN_COMPRESS_MIN_BYTES and at
most ATTN_COMPRESS_MAX_BYTES (0: no most; an answer of unknown length, a large nested tensor
streamed in chunks, counts as over any most), at ATTN_COMPRESS_LEVEL, as it streams: each chunk the
wire's encoder yields is compressed on its way out. The most is there because a tensor's answer
gains little (random floats: b64 text to about three quarters, nested text to about half) for a
core's time that sends it more slowly than a fast network would, and because clients ask without
being asked (Python's requests sends `gzip, deflate` on every request): identity is always
acceptable unless refused (RFC 9110 12.5.3), so the server may choose it. Every answer that could
be compressed says Vary: Accept-Encoding. When identity is refused (`identity;q=0`, or `*;q=0`
without identity) the answer is compressed whatever its size if any coding is acceptable, and sent
uncompressed otherwise (RFC 9110 12.5.3 allows either; a 406 would hide the error it carries)."""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Callable, Iterable, Iterator

from flask import Flask, Response, request

from schemas import RequestError
from service.wire import show

CODINGS = ("gzip", "deflate")  # in order of preference on a tie
ALIASES = {"x-gzip": "gzip"}  # RFC 9110 8.4.1.3: x-gzip is gzip
STEP = 1 << 20  # inflated bytes per step at most: the granularity of the limit and of the charge
IN_STEP = 1 << 16  # compressed bytes fed per step
GZIP_WBITS, ZLIB_WBITS, RAW_WBITS = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS

Buffer = bytes | bytearray | memoryview | mmap.mmap


def request_coding(header: str | None) -> str | None:
    """The coding a request's Content-Encoding names: None for none or identity, else gzip or
    deflate; 415 for any other, or for more than one."""
    codings = [c.strip().lower() for c in (header or "").split(",")]
    codings = [ALIASES.get(c, c) for c in codings if c not in ("", "identity")]
    if len(codings) > 1:
        raise RequestError(
            "unsupported_media_type",
            f"Content-Encoding {show(header)} applies {len(codings)} codings; at most one (gzip or deflate) is accepted.",
        )
    if codings and codings[0] not in CODINGS:
        raise RequestError(
            "unsupported_media_type", f"Content-Encoding {show(codings[0])} is not accepted; send the body as identity, gzip or deflate."
        )
    return codings[0] if codings else None


def _wbits(coding: str, body: Buffer) -> int:
    if coding == "gzip":
        return GZIP_WBITS
    # A zlib stream starts with a header whose method is 8 (deflate) and whose two bytes are a
    # multiple of 31 (RFC 1950). Raw deflate starts so only with a stored block whose padding bits
    # are not zero, which no encoder writes.
    zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
    return ZLIB_WBITS if zlib_header else RAW_WBITS


def _bad(coding: str, why: str) -> RequestError:
    return RequestError("bad_compression", f"The request body is not a valid {coding} stream: {why}.")


def inflate(body: Buffer, coding: str, limit: int, charge: Callable[[int], None] | None = None) -> bytearray:
    """body decoded from coding: 413 body_too_large as soon as it passes limit bytes, 400
    bad_compression if it is corrupt, truncated or followed by other bytes. charge(n) is called with
    the bytes inflated so far after each step (it may raise: the admission gate's 503)."""
    inflater = zlib.decompressobj(_wbits(coding, body))
    out, fed = bytearray(), 0
    data: bytes | bytearray | memoryview
    try:
        while not inflater.eof:
            if inflater.unconsumed_tail:  # the last step stopped at STEP: the rest of its input first
                data = inflater.unconsumed_tail
            elif fed < len(body):
                data, fed = body[fed : fed + IN_STEP], fed + IN_STEP  # a copy: the compressed bytes once in all
            else:
                data = b""  # input spent: what zlib still holds, then the end or a truncation
            piece = inflater.decompress(data, min(STEP, limit + 1 - len(out)))  # one byte past the limit says it is over
            out += piece
            if len(out) > limit:
                raise RequestError(
                    "body_too_large",
                    f"The request body inflates past the limit of {limit} bytes (ATTN_MAX_BODY_BYTES); it was refused there.",
                )
            if charge is not None and piece:
                charge(len(out))
            if not piece and not data:
                raise _bad(coding, "it ends before the stream does")
    except zlib.error as exc:
        raise _bad(coding, str(exc)) from None
    if inflater.unused_data or fed < len(body):
        raise _bad(coding, "bytes follow the end of the compressed stream")
    return out


# --- answers ---------------------------------------------------------------------------------------


def _qualities(header: str) -> dict[str, float]:
    """Accept-Encoding -> {coding: q}; a q that is not a number in 0..1 reads as 0 (not acceptable)."""
    found = {}
    for item in header.split(","):
        name, *params = (p.strip() for p in item.split(";"))
        if not name:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
                q = q if 0.0 <= q <= 1.0 else 0.0  # NaN too
        found[ALIASES.get(name.lower(), name.lower())] = q
    return found


def answer_coding(header: str | None) -> tuple[str | None, bool]:
    """(the coding to compress an answer with, or None; whether identity is refused). identity
    competes by its own q (or that of "*") only when one is given: unlisted, it is acceptable but
    asked for least, so that `gzip;q=0.8` compresses."""
    if not header:
        return None, False  # no Accept-Encoding, or an empty one: identity (RFC 9110 12.5.3)
    q = _qualities(header)
    star = q.get("*")
    identity = q.get("identity", star)
    best = max(CODINGS, key=lambda c: q.get(c, star or 0.0))  # max keeps the first of equals: gzip
    best_q = q.get(best, star or 0.0)
    refused = identity is not None and identity <= 0
    if best_q <= 0 or (identity is not None and best_q < identity):
        return None, refused
    return best, refused


def compressed(chunks: Iterable[Buffer], coding: str, level: int) -> Iterator[bytes]:
    """chunks compressed as they come (gzip, or deflate as zlib's format)."""
    packer = zlib.compressobj(level, zlib.DEFLATED, GZIP_WBITS if coding == "gzip" else ZLIB_WBITS)
    try:
        for chunk in chunks:
            if out := packer.compress(chunk):
                yield out
        yield packer.flush()
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:  # the body's own end (metrics.when_sent) runs even if the client left
            close()


UNCOMPRESSED = frozenset({204, 206, 304})  # no body, or a byte range of the uncompressed one


def install(app: Flask, level: int, min_bytes: int, max_bytes: int = 0) -> None:
    """Compress answers as Accept-Encoding asks. Installed after every other hook, so that it runs
    first (Flask runs after_request hooks last-installed first): the hooks that count an answer's
    bytes as it is sent (access log, metrics) count what goes on the wire."""

    @app.after_request
    def _compress(resp: Response) -> Response:
        if resp.status_code in UNCOMPRESSED or "Content-Encoding" in resp.headers or request.method == "HEAD":
            return resp
        resp.vary.add("Accept-Encoding")
        coding, identity_refused = answer_coding(request.headers.get("Accept-Encoding"))
        length = resp.content_length
        small = length is not None and length < min_bytes
        large = max_bytes > 0 and (length is None or length > max_bytes)
        if coding is None or ((small or large) and not identity_refused):
            return resp
        resp.response = compressed(resp.iter_encoded(), coding, level)
        if (etag := resp.headers.get("ETag")) and not etag.startswith("W/"):
            resp.headers["ETag"] = f"W/{etag}"  # a strong ETag names these exact bytes, and they are others now
        resp.direct_passthrough = False
        del resp.headers["Content-Length"]  # sent chunked: the compressed length is known only at the end
        resp.headers["Content-Encoding"] = coding
        return resp
