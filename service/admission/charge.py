"""What parsing a request body can take in memory, counted from the body before it is parsed.

The gate charges it against ATTN_MAX_INFLIGHT_BYTES before the body is parsed, so that the peak
one request can cause is in the bound before it happens; after validation the job's working bytes
replace it (Ticket.admit). Only the lone request of a worker may exceed the bound.

A JSON parse (wire.loads, the depth check and the schema's load, up to the job's existence) is
counted by the characters that start its values and objects (a comparison per character): each
value (after a '[', ',' or ':') costs the parser's tape entry, its Python object and a pointer to
it, at most VALUE_BYTES; each object ('{') a dict, at most OBJECT_BYTES; and every byte
STRING_FACTOR, for the parser's string buffer and the strings it makes (or the arrays b64 text
decodes into). A b64 body, long strings and a few values, is then charged about three times its
size; nested numbers by their count; the hostile bodies of `python -m bench.garbage --sizes 32
--rss` (objects of empty b64, rows of one) within each bound (bench/README.md). Never more than
PARSE_FACTOR x the body, the worst measured: the charge is an upper bound.

Which bytes are JSON is the front door's to say, since it is the door that parses them: the native
door parses the whole body as JSON; the /v2 door only the JSON header the binary extension's
Inference-Header-Content-Length names, its binary tensors being charged their own size (the arrays
they become). A body not yet in memory cannot be looked at: it is charged PARSE_FACTOR x. Nor is
a body the gate has room for at PARSE_FACTOR x (Admission.enter): counting is a pass over it,
the largest cost of admitting a small request, and buys nothing while the bound fits."""

from __future__ import annotations

import numpy as np

STRING_FACTOR = 2
VALUE_BYTES = 80
OBJECT_BYTES = 320
PARSE_FACTOR = 33
SCAN_CHUNK = 4 * 2**20  # the body is counted in slices of this: the comparisons' scratch stays this small


def parse_charge(body, json_bytes: int | None = None) -> int:
    """Peak bytes parsing body (a bytes-like buffer, or an mmap) can take beyond the body itself:
    its first json_bytes (all of it when None) as JSON by what they hold, the rest (/v2's binary
    tensors) their own size. At most PARSE_FACTOR x the body."""
    n = len(body)
    json_bytes = n if json_bytes is None else max(0, min(json_bytes, n))
    values = objects = 0
    text = np.frombuffer(body, np.uint8, count=json_bytes)  # a view: nothing copied
    for start in range(0, json_bytes, SCAN_CHUNK):
        chunk = text[start : start + SCAN_CHUNK]
        objects += int(np.count_nonzero(chunk == ord("{")))
        values += sum(int(np.count_nonzero(chunk == c)) for c in b",:[")
    charge = STRING_FACTOR * json_bytes + VALUE_BYTES * values + OBJECT_BYTES * objects + (n - json_bytes)
    return min(charge, PARSE_FACTOR * n)


def unseen_charge(nbytes: int) -> int:
    """The charge for a body of nbytes not yet in memory (chunked, or read by the app itself)."""
    return PARSE_FACTOR * nbytes


POLICY = {
    "per_body_byte": STRING_FACTOR,
    "per_value": VALUE_BYTES,
    "per_object": OBJECT_BYTES,
    "at_most_per_body_byte": PARSE_FACTOR,
    "counted": "only where at_most_per_body_byte x the body would not fit; else that bound is charged",
    "binary_per_byte": 1,
    "binary_at": "/v2 only, the bytes after Inference-Header-Content-Length's JSON header",
}
