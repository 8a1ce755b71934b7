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

Answers: compressed where that pays, as Accept-Encoding allows (q-values respected; gzip over
deflate on a tie). Identity is acceptable unless refused (RFC 9110 12.5.3), so the server may
choose it, and it does unless the client prefers a coding: names identity with a lower q
(`gzip, identity;q=0.5`) or refuses it (`identity;q=0`, or `*;q=0` without identity). A client
that merely accepts a coding (identity unnamed: `gzip, deflate`, which Python's requests sends on
every call, or a tie) gets identity, because compressing costs it time on the links a service like
this is reached over: zlib at level 1 runs at ~45 MB/s of a core on b64 or binary tensors, which
shrink by a quarter or less, and ~100 MB/s on nested text, which halves; a gigabit link sends the
bytes saved in a third of that time or less (bench/README.md, Compression). Operators whose
clients sit behind slow links set compress_answers="accepted" (ATTN_COMPRESS_ANSWERS): then what
is merely accepted is compressed too if the answer is at most ATTN_COMPRESS_MAX_BYTES (0: no
most; an answer of unknown length, a large nested tensor streamed in chunks, counts as over any
most). An answer under ATTN_COMPRESS_MIN_BYTES goes uncompressed unless identity is refused.
Compression runs at ATTN_COMPRESS_LEVEL, as the answer streams: each chunk the wire's encoder
yields is compressed on its way out. Every answer that could be compressed says Vary:
Accept-Encoding. When identity is refused the answer is compressed whatever its size if any
coding is acceptable, and sent uncompressed otherwise (RFC 9110 12.5.3 allows either; a 406 would hide the error it carries)."""

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


def answer_coding(header: str | None) -> tuple[str | None, str]:
    """(the best coding acceptable for an answer, or None; how the client stands on identity:
    "refused", "below" (named with a lower q than the coding's) or "acceptable" (unnamed, or no
    lower)). Unnamed, identity is acceptable (RFC 9110 12.5.3)."""
    if not header:
        return None, "acceptable"  # no Accept-Encoding, or an empty one: identity
    q = _qualities(header)
    star = q.get("*")
    identity = q.get("identity", star)
    best = max(CODINGS, key=lambda c: q.get(c, star or 0.0))  # max keeps the first of equals: gzip
    best_q = q.get(best, star or 0.0)
    if identity is not None and identity <= 0:
        return (best if best_q > 0 else None), "refused"
    if best_q <= 0 or (identity is not None and best_q < identity):
        return None, "acceptable"
    return best, "below" if identity is not None and identity < best_q else "acceptable"


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


def install(app: Flask, level: int, min_bytes: int, max_bytes: int = 0, when: str = "preferred") -> None:
    """Compress answers where the client prefers it (when="preferred") or accepts it ("accepted"),
    as the module's docstring says. Installed after every other hook, so that it runs first (Flask
    runs after_request hooks last-installed first): the hooks that count an answer's bytes as it is
    sent (access log, metrics) count what goes on the wire."""
    merely_accepted = when == "accepted"

    @app.after_request
    def _compress(resp: Response) -> Response:
        if resp.status_code in UNCOMPRESSED or "Content-Encoding" in resp.headers or request.method == "HEAD":
            return resp
        resp.vary.add("Accept-Encoding")
        header = request.headers.get("Accept-Encoding")
        if not merely_accepted and (not header or ("identity" not in header.lower() and "*" not in header)):
            return resp  # identity neither named nor refused (requests' `gzip, deflate`): no preference to parse
        coding, identity = answer_coding(header)
        if coding is None or (identity == "acceptable" and not merely_accepted):
            return resp
        length = resp.content_length
        if identity != "refused":
            if length is not None and length < min_bytes:
                return resp
            if identity == "acceptable" and max_bytes > 0 and (length is None or length > max_bytes):
                return resp
        resp.response = compressed(resp.iter_encoded(), coding, level)
        if (etag := resp.headers.get("ETag")) and not etag.startswith("W/"):
            resp.headers["ETag"] = f"W/{etag}"  # a strong ETag names these exact bytes, and they are others now
        resp.direct_passthrough = False
        del resp.headers["Content-Length"]  # sent chunked: the compressed length is known only at the end
        resp.headers["Content-Encoding"] = coding
        return resp
