"""Where a small request's CPU goes: T=64 b64 POST /attention without weights (B=1, H=8, d=64,
causal) against GET /healthz, in-process through the Flask test client, the body handed in memory
as the worker hands it (one thread: no event loop, no gunicorn, no access log;
bench/small_requests.py measures those in a real worker).

    python -m bench small_profile            # CPU per request (min of repetitions) and, with
                                             # py-spy installed, the table of where it goes

The CPU per request is the least of 15 repetitions of 100 requests (process time; the least is
the one other work on the machine disturbed least). The table samples a loop of 3,000 requests
with py-spy (`pip install py-spy`; not a dependency) and splits the samples among the stages of
the request by the frames on their stacks, as shares of the attention request's CPU.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in a worker (deploy/gunicorn.conf.py)
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="small-profile-"))  # as deployed


def _tune_malloc() -> None:
    """The allocator settings a worker runs with (deploy/gunicorn.conf.py's _tune_malloc): with
    glibc's defaults each 530 KB body (and its skeleton) is a fresh mmap, page-faulted afresh,
    which made the decode stage look ~2.5x what it costs in a worker."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    for env, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", -3, 4 << 20),
        ("MALLOC_TRIM_THRESHOLD_", -1, 16 << 20),
        ("MALLOC_ARENA_MAX", -8, 2),
    ):
        if env not in os.environ:
            libc.mallopt(param, value)


_tune_malloc()

from service.config import Settings  # noqa: E402  (after the environment above)
from service.transport import BODY_KEY  # noqa: E402
from service.web.app import create_app  # noqa: E402

from .common import attention_body, table  # noqa: E402

# Stage of a sample: the first stage any of whose markers is on its stack, else Flask and the rest.
# The body's generator runs inside metrics.when_sent's wrapper, and the hooks' "sent" callbacks
# (metrics, access log, admission, tracing) inside its finish: those frames are dropped first, so
# the streamed encoding counts as encode and each callback as its own module, not all as metrics.
SENT_WRAPPER = re.compile(r"(when_sent\.<locals>\.(chunks|finish)|_call_all) \([^)]*\);?")
STAGES = [
    ("compute (numeric core)", ["AttentionJob._compute"]),
    ("cost model (work, predict, observe)", ["CostModel.", "_Job.work"]),
    ("metrics (prometheus_client)", ["service/web/metrics.py", "prometheus_client"]),
    ("admission (service/admission, admit.py; the parse charge)", ["service/admission/", "service/web/admit.py"]),
    ("read + decode body (JSON, b64)", ["read_json"]),
    ("validate (marshmallow schema, cast)", ["Schema.load"]),
    ("access log, tracing (accesslog.py, tracing.py)", ["service/web/accesslog.py", "service/web/tracing.py"]),
    ("encode response", ["respond_job", "Response.get_data"]),
    ("Flask, werkzeug, test client, http.py hooks", [""]),
]


def requests(client, payload: bytes):
    in_memory = {BODY_KEY: bytearray(payload)}  # as the worker hands the app a body it has read (service.transport)

    def attention():
        r = client.post("/attention", data=payload, content_type="application/json", environ_overrides=in_memory)
        r.get_data()
        assert r.status_code == 200, r.get_data()[:200]

    def healthz():
        client.get("/healthz").get_data()

    return attention, healthz


def cpu_us(f, n: int = 100, reps: int = 15) -> float:
    best = []
    for _ in range(reps):
        t = time.process_time()
        for _ in range(n):
            f()
        best.append((time.process_time() - t) / n * 1e6)
    return min(best)


def stages(raw: Path) -> dict[str, float]:
    """Shares of the attention requests' samples by stage (py-spy's raw format: stack count)."""
    counts, total = collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "attention (bench/small_profile.py" not in stack and "attention (small_profile.py" not in stack:
            continue
        stack = SENT_WRAPPER.sub("", stack)
        name = next(name for name, marks in STAGES if any(m in stack for m in marks))
        counts[name] += int(n)
        total += int(n)
    return {name: counts[name] / total for name, _ in STAGES}


def main() -> None:
    attention, healthz = requests(create_app(Settings(warmup=False)).test_client(), attention_body(64))
    if sys.argv[1:] == ["--loop"]:  # under py-spy
        for _ in range(3000):
            attention()
        return
    for _ in range(50):
        attention(), healthz()
    h, a = cpu_us(healthz), cpu_us(attention)
    load = os.getloadavg()[0]
    print(f"CPU per request: /healthz {h:.0f} us, T=64 b64 /attention {a:.0f} us, beyond /healthz {a - h:.0f} us (load average {load:.1f})")
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy is not installed: no table")
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        cmd = [spy, *"record --rate 1000 --format raw -o".split(), str(raw), "--", sys.executable, "-m", "bench.small_profile", "--loop"]
        subprocess.run(cmd, check=True, capture_output=True)
        shares = stages(raw)
    print("\n" + table("stage | share | us per request", [(name, f"{share:.0%}", f"{share * a:.0f}") for name, share in shares.items()]))


if __name__ == "__main__":
    main()
