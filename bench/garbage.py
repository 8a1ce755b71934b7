"""Work before rejection, per MB of hostile body.

Times, in-process and without HTTP, what the service does with a body before it answers:
wire.loads + the depth check (service.web.http.parse_json) and the schema's load (validation, casts).
Each body of a catalogue of hostile (and a few valid) bodies is built at several sizes and run
once; prints ms per MB and the answer. The worst ms/MB over the catalogue is the figure to watch:
work must be linear in the bytes with a small constant.

    python -m bench garbage                 # sizes 1 4 16 MB
    python -m bench garbage --sizes 1 4 16 64 --only rows1
    python -m bench garbage --rss           # also each case's peak RSS growth, in a fresh subprocess
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import reset_peak, status_kb

MB = 2**20
# The allocator settings deploy/gunicorn.conf.py gives a worker (its _tune_malloc), as environment
# variables for a child process measured as a worker would run.
WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_TRIM_THRESHOLD_": "16777216", "MALLOC_ARENA_MAX": "2"}


def _fill(head: bytes, unit: bytes, tail: bytes, size: int, sep: bytes = b",") -> bytes:
    n = max(1, (size - len(head) - len(tail)) // (len(unit) + len(sep)))
    return head + sep.join([unit] * n) + tail


CATALOGUE = {
    "unknown_fields": lambda n: b"{" + b",".join(b'"f%d":0' % i for i in range(n // 12)) + b"}",
    "b64_not_json": lambda n: b'"b64":""' * (n // 8),
    "b64_empty_objects": lambda n: _fill(b'{"q":[', b'{"b64":""}', b"]}", n),
    "b64_many_fields": lambda n: (
        b"{" + b",".join(b'"f%d":{"shape":[1],"dtype":"float32","b64":"AAAAAA=="}' % i for i in range(n // 56)) + b"}"
    ),
    "rows1": lambda n: _fill(b'{"q":[', b"[0]", b"]}", n),
    "rows2": lambda n: _fill(b'{"q":[', b"[0,0]", b"]}", n),
    "rows3_ragged_end": lambda n: _fill(b'{"q":[', b"[0,0,0]", b",[0]]}", n),
    "rows_nested_deep": lambda n: _fill(b'{"q":[', b"[[[[[[0]]]]]]", b"]}", n),
    "brackets_open": lambda n: b"[" * n,
    "brackets_in_string": lambda n: b'{"q":"' + b"[" * (n - 10) + b'"}',
    "long_string": lambda n: b'{"q":"' + b"a" * (n - 10) + b'"}',
    "long_number": lambda n: b'{"q":[[' + b"1" * (n - 12) + b"]]}",
    "big_floats": lambda n: _fill(b'{"q":[[', b"1.7976931348623157e308", b"]]}", n),
    "repeated_key": lambda n: _fill(b"{", b'"q":0', b"}", n),
    "whitespace": lambda n: b"{" + b" " * (n - 2) + b"}",
    "flat_bools": lambda n: _fill(b'{"q":{"shape":[1],"data":[', b"true", b"]}}", n),
    "mask_numbers": lambda n: b'{"q":[[1.0]],"k":[[1.0]],"v":[[1.0]],"mask":' + _fill(b"[", b"2", b"]", n - 60) + b"}",
    "valid_shape_mismatch": lambda n: b'{"q":' + _fill(b"[", b"[0.5,0.5,0.5,0.5]", b"]", n - 40) + b',"k":[[1,1,1]],"v":[[1]]}',
    "nested_zeros": lambda n: _fill(b'{"q":[', b"[" + b",".join([b"0"] * 64) + b"]", b"]}", n),
    "nested_floats": lambda n: _fill(b'{"q":[', b"[" + b",".join([b"-0.123456789"] * 64) + b"]", b"]}", n),
    "strings_in_rows": lambda n: _fill(b'{"q":[', b'["a","b","c"]', b"]}", n),
    "nulls_in_rows": lambda n: _fill(b'{"q":[', b"[null,null,null]", b"]}", n),
}


def run_one(name: str, size: int, body: bytes | None = None) -> tuple[float, str]:
    """(seconds, answer) of one body through parse_json and the /attention schema."""
    from schemas import AttentionRequest, RequestError
    from service.config import Settings
    from service.web.errors import status_of
    from service.web.http import parse_json

    body = CATALOGUE[name](size) if body is None else body
    schema = AttentionRequest(Settings())
    t0 = time.perf_counter()
    try:
        schema.load(parse_json(body))
        answer = "200"
    except RequestError as exc:
        answer = f"{status_of(exc.code)} {exc.code}"
    return time.perf_counter() - t0, answer


def _child(name: str, size: int) -> None:
    """In a fresh process: peak RSS growth (MB) of one case over its body (built and held first,
    as the server holds it; the peak mark is reset after, through /proc/self/clear_refs)."""
    import schemas  # noqa: F401  (imports before the baseline)
    import service.web.http  # noqa: F401

    body = CATALOGUE[name](size)
    base = reset_peak("self")
    took, answer = run_one(name, size, body)
    print(json.dumps({"took": took, "answer": answer, "peak_mb": (status_kb("self", "VmHWM") - base) / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], int(a.child[1]))
        return
    names = a.only or list(CATALOGUE)
    worst = (0.0, "")
    peak = "   peak RSS growth over the body, MB" if a.rss else ""
    print(f"{'body':24} " + " ".join(f"{s:>7g}MB" for s in a.sizes) + "   (ms per MB; answer)" + peak)
    for name in names:
        cells, answer, peaks = [], "", []
        for s in a.sizes:
            size = int(s * MB)
            if a.rss:
                child = [sys.executable, "-m", "bench.garbage", "--child", name, str(size)]
                r = json.loads(
                    subprocess.run(child, capture_output=True, text=True, check=True, env={**os.environ, **WORKER_MALLOC_ENV}).stdout
                )
                took, answer = r["took"], r["answer"]
                peaks.append(f"{r['peak_mb']:.0f}")
            else:
                took, answer = run_one(name, size)
            per = took * 1000 / s
            worst = max(worst, (per, f"{name} at {s:g} MB"))
            cells.append(f"{per:9.1f}")
        print(f"{name:24} " + " ".join(cells) + f"   {answer}" + (f"   {' '.join(peaks)}" if peaks else ""), flush=True)
    print(f"worst: {worst[0]:.1f} ms/MB ({worst[1]})")


if __name__ == "__main__":
    main()
