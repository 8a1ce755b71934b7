"""Where an HTTP/1.1 request ends, found in the bytes received so far (RFC 9112 section 6).

The event-loop worker (worker.py) buffers a whole request before a thread sees it, so it
must know when the request is complete: after the head, Content-Length bytes, or a chunked body
up to its last chunk and trailers. This module only finds that boundary; gunicorn's parser, in
the thread, still parses and validates the request. Anything this scanner cannot frame (both
Content-Length and Transfer-Encoding, a bad length, chunked not last, a bad chunk line, more
than MAX_CHUNKS chunks) is MALFORMED and a transfer coding other than chunked is
NOT_IMPLEMENTED (RFC 9112 sections 6.1 and 6.3): the front answers those itself, 400 or 501, and
closes the connection; they never reach a thread.

Pure: no sockets, no clocks. A scanner is fed the same growing buffer again and again and resumes
where it stopped, so scanning a body costs O(bytes) in total, however it trickles in."""

from __future__ import annotations

from dataclasses import dataclass

from . import clip

NEED_MORE = "need_more"  # the request is not complete yet
COMPLETE = "complete"  # buffer[:end] is one whole request
MALFORMED = "malformed"  # unframeable: 400, then close
NOT_IMPLEMENTED = "not_implemented"  # a transfer coding this server does not decode: 501, then close
BODY_TOO_LARGE = "body_too_large"  # the body is over the limit (413)
HEAD_TOO_LARGE = "head_too_large"  # no end of head within the limit (431)

MAX_CHUNK_LINE = 8192  # a chunk-size line (hex digits and extensions), as gunicorn bounds it
# Chunks per request. Each costs Python work twice (here, then gunicorn's reader in the thread), so a
# body of tiny chunks would cost far more CPU than any JSON body of its size; a body at the size
# limit within this many chunks still has chunks of hundreds of bytes (clients write 8 KiB and
# more: requests, curl, http.client).
MAX_CHUNKS = 2**16
_HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclass
class Verdict:
    kind: str
    end: int = 0  # COMPLETE: the length of the request in the buffer
    reason: str = ""  # MALFORMED, NOT_IMPLEMENTED: what is wrong, for the client


class RequestScanner:
    """Scans one request; make a new one for the next request on the connection.

    After the head is complete, head_end, method, path, expects_continue and body_length (None
    for chunked) describe it; body_received() is how many body bytes have arrived."""

    def __init__(self, max_head_bytes: int, max_body_bytes: int):
        self.max_head = max_head_bytes
        self.max_body = max_body_bytes
        self.head_end: int | None = None  # offset of the first body byte
        self.method = self.path = ""
        self.expects_continue = False
        self.expect_line: tuple[int, int] | None = None  # (start, end) of the Expect header line
        self.body_length: int | None = None  # Content-Length; None when chunked
        self._searched = 0  # where the next search for the end of head resumes
        self._line_start = self._line_searched = 0  # the request line: where it starts, where to search on
        self._chunk_pos = 0  # chunked: start of the next chunk-size line
        self._chunk_total = 0  # chunked: decoded bytes so far
        self._chunks = 0  # chunked: data chunks so far

    # -- the head -------------------------------------------------------------------------------

    def _scan_head(self, buf) -> Verdict | None:
        """None once the head is complete (and understood); otherwise the verdict."""
        idx = buf.find(b"\r\n\r\n", max(0, self._searched - 3))
        if idx < 0:
            # LF LF before any CR LF CR LF: lines ended in a bare LF, which RFC 9112 section 2.2 lets
            # a server refuse. Waited for, such a head never ended: 408 after the header timeout.
            bare = buf.find(b"\n\n", max(0, self._searched - 1))
            self._searched = len(buf)
            if bare >= 0:
                return Verdict(MALFORMED, reason="the head's lines end in a bare LF; HTTP/1.1 ends each line in CR LF")
            self._scan_request_line(buf)
            return Verdict(HEAD_TOO_LARGE if len(buf) > self.max_head else NEED_MORE)
        if idx + 4 > self.max_head:
            return Verdict(HEAD_TOO_LARGE)
        self.head_end = idx + 4
        head = bytes(buf[:idx])
        stripped = head.lstrip(b"\r\n")  # the empty lines RFC 9112 section 2.2 lets a server ignore
        offset = len(head) - len(stripped)
        lines = stripped.split(b"\r\n")
        parts = self._request_line(lines[0])
        lengths, codings = [], []
        for i, line in enumerate(lines):
            start = offset
            offset += len(line) + 2
            name, sep, value = line.partition(b":")
            if i == 0 or not sep:
                continue
            name, value = name.lower(), value.strip()
            if name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
            elif name == b"expect" and value.lower() == b"100-continue":
                self.expects_continue, self.expect_line = True, (start, offset)
        if codings:
            # RFC 9112 section 6.3: with both, the length is ambiguous (the shape of request
            # smuggling) and chunked not last leaves it unknown: 400. Section 6.1: HTTP/1.0 has no
            # transfer codings; a coding the server does not know (gzip, ...) is 501.
            if lengths:
                return Verdict(MALFORMED, reason="both Content-Length and Transfer-Encoding")
            if codings[-1] != b"chunked" or codings.count(b"chunked") > 1 or b"" in codings:
                return Verdict(MALFORMED, reason="Transfer-Encoding does not end in one chunked")
            if len(parts) == 3 and parts[2] == b"HTTP/1.0":
                return Verdict(MALFORMED, reason="Transfer-Encoding in an HTTP/1.0 request")
            if len(codings) > 1:
                unknown = clip(", ".join(c.decode("latin-1") for c in codings[:-1]))  # quoted: never the whole value
                return Verdict(NOT_IMPLEMENTED, reason=f"the transfer coding {unknown}; only chunked is understood")
            self._chunk_pos = self.head_end
            return None
        if not lengths:
            self.body_length = 0
            return None
        if len(set(lengths)) != 1 or not lengths[0].isdigit():
            return Verdict(MALFORMED, reason="Content-Length is not one decimal number")
        self.body_length = int(lengths[0])
        return Verdict(BODY_TOO_LARGE) if self.body_length > self.max_body else None

    def _scan_request_line(self, buf) -> None:
        """Before the head is complete: method and path as soon as the request line is in, so that
        an answer to a head that never ends (408, 400) is in its front door's shape. Resumes."""
        while not self.method:
            eol = buf.find(b"\r\n", self._line_searched)
            if eol < 0:
                self._line_searched = max(self._line_start, len(buf) - 1)
                return
            if eol == self._line_start:  # an empty line before the request line (RFC 9112 section 2.2)
                self._line_start = self._line_searched = eol + 2
                continue
            self._request_line(bytes(buf[self._line_start : eol]))

    def _request_line(self, line: bytes) -> list[bytes]:
        parts = line.split(b" ")
        self.method = parts[0].decode("latin-1")
        self.path = parts[1].decode("latin-1") if len(parts) == 3 else ""
        return parts

    # -- the body -------------------------------------------------------------------------------

    def _scan_chunked(self, buf) -> Verdict:
        pos = self._chunk_pos
        while True:
            eol = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE + 2)
            if eol < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    return Verdict(MALFORMED, reason=f"a chunk-size line over {MAX_CHUNK_LINE} bytes")
                return Verdict(NEED_MORE)
            digits = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            if not digits or len(digits) > 16 or not set(digits) <= _HEX:
                return Verdict(MALFORMED, reason="a chunk size that is not hexadecimal digits")
            size = int(digits, 16)
            if self._chunk_total + size > self.max_body:
                return Verdict(BODY_TOO_LARGE)
            data = eol + 2
            if size == 0:  # the last chunk, then trailer lines and an empty line
                if len(buf) < data + 2:
                    return Verdict(NEED_MORE)
                if buf[data : data + 2] == b"\r\n":
                    return Verdict(COMPLETE, data + 2)
                end = buf.find(b"\r\n\r\n", data)
                if end < 0:
                    if len(buf) - data > self.max_head:
                        return Verdict(MALFORMED, reason=f"trailers over {self.max_head} bytes")
                    return Verdict(NEED_MORE)
                return Verdict(COMPLETE, end + 4)
            if len(buf) < data + size + 2:
                return Verdict(NEED_MORE)
            if buf[data + size : data + size + 2] != b"\r\n":
                return Verdict(MALFORMED, reason="a chunk's data is not followed by CRLF")
            pos = self._chunk_pos = data + size + 2
            self._chunk_total += size
            self._chunks += 1
            if self._chunks > MAX_CHUNKS:
                return Verdict(MALFORMED, reason=f"more than {MAX_CHUNKS} chunks; send the body in fewer, larger chunks")

    def scan(self, buf) -> Verdict:
        """The verdict on buf (a bytes-like object holding this request's bytes from its start)."""
        if self.head_end is None:
            verdict = self._scan_head(buf)
            if verdict is not None:
                return verdict
        if self.body_length is None:
            return self._scan_chunked(buf)
        end = (self.head_end or 0) + self.body_length  # head_end is set once _scan_head returns None
        return Verdict(COMPLETE, end) if len(buf) >= end else Verdict(NEED_MORE)

    def body_received(self, buffered: int) -> int:
        """Body bytes received, given the request's bytes buffered so far (for the rate limit)."""
        return 0 if self.head_end is None else max(0, buffered - self.head_end)
