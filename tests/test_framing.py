"""service.transport.framing: where a request ends, from the bytes so far, however they arrive."""

from __future__ import annotations

import pytest

from service.transport import framing
from service.transport.framing import (
    BODY_TOO_LARGE,
    COMPLETE,
    HEAD_TOO_LARGE,
    MALFORMED,
    NEED_MORE,
    NOT_IMPLEMENTED,
    RequestScanner,
)

GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def post(body: bytes, extra: bytes = b"") -> bytes:
    return b"POST /attention HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    head = b"POST /attention HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailers + b"\r\n"


def scan_growing(data: bytes, step: int, scanner: RequestScanner | None = None):
    """Feed data step bytes at a time to one scanner; the first verdict that is not NEED_MORE."""
    scanner = scanner or RequestScanner(1024, 10_000)
    for n in range(step, len(data) + step, step):
        verdict = scanner.scan(bytearray(data[:n]))
        if verdict.kind != NEED_MORE:
            return verdict, scanner
    return verdict, scanner


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize(
    "request_bytes",
    [GET, post(b'{"q": [[1]]}'), post(b""), chunked(b'{"q": ', b"[[1]]}"), chunked(b"abc", trailers=b"X-Sum: 1\r\n"), b"\r\n" + GET],
)
def test_complete_requests_end_where_they_end(request_bytes, step):
    verdict, _ = scan_growing(request_bytes + GET, step)  # a pipelined request follows
    assert verdict.kind == COMPLETE and verdict.end == len(request_bytes)


def test_incomplete_requests_need_more():
    for data in (GET[:-1], post(b"12345")[:-1], chunked(b"abc")[:-2], chunked(b"abc")[:-6]):
        assert RequestScanner(1024, 10_000).scan(bytearray(data)).kind == NEED_MORE


def test_head_facts():
    data = post(b"{}", extra=b"Expect: 100-continue\r\n")
    scanner = RequestScanner(1024, 10_000)
    scanner.scan(bytearray(data[:-2]))
    assert scanner.path == "/attention" and scanner.body_length == 2 and scanner.expects_continue
    start, stop = scanner.expect_line
    assert data[start:stop] == b"Expect: 100-continue\r\n"
    assert scanner.body_received(len(data) - 1) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",  # both: smuggling-shaped
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",  # not chunked last
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",  # two lengths
        b"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # not hex
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY",  # no CRLF after the data
        b"GET /healthz HTTP/1.1\nHost: x\n\n",  # lines ended in a bare LF
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\n",  # the last one only
    ],
)
def test_unframeable_requests_are_malformed(data):
    verdict = RequestScanner(1024, 10_000).scan(bytearray(data))
    assert verdict.kind == MALFORMED and verdict.reason  # the reason goes to the client


@pytest.mark.parametrize(
    "codings",
    [b"chunked, chunked", b"chunked, gzip", b"chunked,", b", chunked", b"identity"],  # chunked not once and last (RFC 9112 6.3)
)
def test_chunked_not_once_and_last_is_malformed(codings):
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: %s\r\n\r\n0\r\n\r\n" % codings
    assert RequestScanner(1024, 10_000).scan(bytearray(data)).kind == MALFORMED


def test_transfer_encoding_in_http_1_0_is_malformed():
    data = b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert RequestScanner(1024, 10_000).scan(bytearray(data)).kind == MALFORMED


@pytest.mark.parametrize("codings", [b"gzip, chunked", b"deflate,chunked", b"x-custom , gzip, chunked"])
def test_a_coding_before_chunked_is_not_implemented(codings):
    """RFC 9112 6.1: chunked is last, so the body can be framed, but the server cannot decode it: 501."""
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: %s\r\n\r\n0\r\n\r\n" % codings
    verdict = RequestScanner(1024, 10_000).scan(bytearray(data))
    assert verdict.kind == NOT_IMPLEMENTED and codings.split(b",")[0].strip().decode() in verdict.reason


@pytest.mark.parametrize("header", [b"Transfer-Encoding: Chunked", b"transfer-encoding:  CHUNKED  ", b"Transfer-Encoding:chunked"])
def test_chunked_is_case_and_space_insensitive(header):
    data = b"POST / HTTP/1.1\r\n%s\r\n\r\n2\r\n{}\r\n0\r\n\r\n" % header
    verdict = RequestScanner(1024, 10_000).scan(bytearray(data))
    assert verdict.kind == COMPLETE and verdict.end == len(data)


@pytest.mark.parametrize(
    "body",
    [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n", b"-2\r\n{}\r\n0\r\n\r\n", b"\r\n{}\r\n0\r\n\r\n"],
    ids=["not-hex", "no-crlf-after-data", "negative", "empty-size"],
)
def test_bad_chunks_are_malformed_however_they_arrive(body):
    """The scanner, not the parser in a thread, refuses a bad chunk: it never reaches the app."""
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    for step in (1, 4, len(data)):
        verdict, _ = scan_growing(data, step)
        assert verdict.kind == MALFORMED, step


def test_limits():
    assert RequestScanner(64, 10_000).scan(bytearray(b"GET /" + b"a" * 100)).kind == HEAD_TOO_LARGE
    assert RequestScanner(1024, 10).scan(bytearray(post(b"x" * 11)[:60])).kind == BODY_TOO_LARGE
    assert RequestScanner(1024, 10).scan(bytearray(chunked(b"x" * 6, b"y" * 6))).kind == BODY_TOO_LARGE
    huge_line = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * (framing.MAX_CHUNK_LINE + 10)
    assert RequestScanner(1024, 10**30).scan(bytearray(huge_line)).kind == MALFORMED


def test_a_trickled_chunked_body_is_scanned_once():
    """Resuming where it stopped: 2,000 one-byte chunks fed one chunk at a time stay linear."""
    data = chunked(*[b"x"] * 2000)
    verdict, _ = scan_growing(data, 6)
    assert verdict.kind == COMPLETE and verdict.end == len(data)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_method_and_path_are_known_before_the_head_ends(step):
    """So that a 408 or 400 to a head that never ends is in its front door's shape."""
    scanner = RequestScanner(1024, 10_000)
    data = b"\r\nPOST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\nX-Slow: "
    verdict, scanner = scan_growing(data, step, scanner)
    assert verdict.kind == NEED_MORE and (scanner.method, scanner.path) == ("POST", "/v2/models/attention/infer")


@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_bare_lf_head_is_malformed_however_it_arrives(step):
    """Seen whole or a byte at a time, LF LF ends the scan at once (before, it waited for a CR LF
    CR LF that never came: 408 after the header timeout); a body's LF LF is not a head's."""
    verdict, _ = scan_growing(b"GET /healthz HTTP/1.1\nHost: x\n\n", step)
    assert verdict.kind == MALFORMED and "bare LF" in verdict.reason
    verdict, _ = scan_growing(post(b"\n\n{}\n\n"), step)
    assert verdict.kind == COMPLETE


def test_a_body_of_more_chunks_than_the_limit_is_malformed():
    """Attack round three: every chunk costs Python work twice (this scanner, in the event loop,
    then gunicorn's chunked reader in the thread), ~16 us in all: a 6 MB body of 1-byte chunks
    took 16 s of the server's CPU (8.6 s of it "decode"), a 32 MiB one would take ~90 s, against
    ~0.6 s for any 32 MiB JSON body. Past MAX_CHUNKS chunks the request is refused, 400."""
    n = framing.MAX_CHUNKS
    big = RequestScanner(1024, 10 * n)
    assert big.scan(bytearray(chunked(*[b"x"] * n))).kind == COMPLETE
    verdict = RequestScanner(1024, 10 * n).scan(bytearray(chunked(*[b"x"] * (n + 1))))
    assert verdict.kind == MALFORMED and f"more than {n} chunks" in verdict.reason
