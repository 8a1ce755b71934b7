"""Settings: every knob of the service, read once from the environment. The only reader of os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

VERSION = "1.0.0"
# The thread counts of a process that computes on one core (the workers, deploy/gunicorn.conf.py;
# the local replicas; the benchmarks' peers), set before numpy loads: OpenBLAS reads them then.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _env(name: str, default, cast):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise SystemExit(f"configuration error: {name}={raw!r} is not a valid {cast.__name__}") from None


# The range each ATTN_* number must lie in, inclusive: outside it the server refuses to start (a
# server that started with ATTN_BODY_MIN_RATE=0 lost its worker to a ZeroDivisionError on the first
# body; ATTN_MAX_INFLIGHT=0 hung every POST; ATTN_MAX_T=-5 refused every request). Upper bounds keep
# a typo from asking for what the process cannot do: a timeout past a day overflows poll()'s
# milliseconds, and gunicorn starts a thread per admitted request (deploy/gunicorn.conf.py).
DAY_S = 86400
RANGES: dict[str, tuple[str, int, int]] = {  # field: (variable, least, most)
    "port": ("PORT", 0, 65535),
    "max_t": ("ATTN_MAX_T", 1, 2**31),
    "max_s": ("ATTN_MAX_S", 1, 2**31),
    "max_score_elements": ("ATTN_MAX_SCORE_ELEMENTS", 1, 2**62),
    "max_weights_elements": ("ATTN_MAX_WEIGHTS_ELEMENTS", 1, 2**62),
    "max_output_elements": ("ATTN_MAX_OUTPUT_ELEMENTS", 1, 2**62),
    "max_body_bytes": ("ATTN_MAX_BODY_BYTES", 1, 2**62),
    "max_rank": ("ATTN_MAX_RANK", 1, 32),  # numpy's arrays have at most 64 axes; the core adds some
    "max_d": ("ATTN_MAX_D", 1, 2**31),
    "max_inflight": ("ATTN_MAX_INFLIGHT", 1, 1024),
    "max_queue": ("ATTN_MAX_QUEUE", 0, 1024),
    "max_inflight_bytes": ("ATTN_MAX_INFLIGHT_BYTES", 1, 2**62),
    "max_queue_wait_ms": ("ATTN_MAX_QUEUE_WAIT_MS", 1, DAY_S * 1000),
    "header_timeout_s": ("ATTN_HEADER_TIMEOUT_S", 1, DAY_S),
    "body_timeout_s": ("ATTN_BODY_TIMEOUT_S", 1, DAY_S),
    "body_min_rate": ("ATTN_BODY_MIN_RATE", 1, 2**62),
    "body_total_timeout_s": ("ATTN_BODY_TOTAL_TIMEOUT_S", 1, DAY_S),
    "send_timeout_s": ("ATTN_SEND_TIMEOUT_S", 1, DAY_S),
    "send_buffer_bytes": ("ATTN_SEND_BUFFER_BYTES", 1, 2**62),
    "split_threads": ("ATTN_SPLIT_THREADS", 1, 256),
    "compress_level": ("ATTN_COMPRESS_LEVEL", 1, 9),  # zlib's levels (0 would send stored blocks: larger than identity)
    "compress_min_bytes": ("ATTN_COMPRESS_MIN_BYTES", 0, 2**62),
    "compress_max_bytes": ("ATTN_COMPRESS_MAX_BYTES", 0, 2**62),
    "session_memory_bytes": ("ATTN_SESSION_MEMORY_BYTES", 1, 2**43),  # below 4 KiB: one unit; 8 TiB: page tables hold int32 units
    "session_page_tokens": ("ATTN_SESSION_PAGE_TOKENS", 1, 2**16),
    "session_idle_s": ("ATTN_SESSION_IDLE_S", 1, 30 * DAY_S),
    "session_max_tokens": ("ATTN_SESSION_MAX_TOKENS", 1, 2**24),
    "session_max_count": ("ATTN_SESSION_MAX_COUNT", 1, 2**20),
}
SESSION_TABLE_MAX_BYTES = 2**30  # the sessions' page tables at most: see session_table_bytes
DEFAULT_DTYPES = ("float32", "float64")  # as schemas.COMPUTE_DTYPES (config imports nothing of the layers)


def check(settings: Settings) -> Settings:
    """settings, if every number is in its RANGES and the default dtype one a request may ask for;
    else SystemExit naming the variable, as for a value that is not a number."""
    for name, (variable, least, most) in RANGES.items():
        value = getattr(settings, name)
        if not least <= value <= most:
            raise SystemExit(f"configuration error: {variable}={value} is out of range; it must be {least}..{most}")
    if settings.default_dtype not in DEFAULT_DTYPES:
        raise SystemExit(f"configuration error: ATTN_DEFAULT_DTYPE={settings.default_dtype!r} must be one of {', '.join(DEFAULT_DTYPES)}")
    table = session_table_bytes(settings)
    if table > SESSION_TABLE_MAX_BYTES:
        raise SystemExit(
            f"configuration error: the sessions' page tables would take {table} bytes, over {SESSION_TABLE_MAX_BYTES} (1 GiB): "
            f"ATTN_SESSION_MAX_COUNT={settings.session_max_count} x ceil(ATTN_SESSION_MAX_TOKENS={settings.session_max_tokens} / "
            f"ATTN_SESSION_PAGE_TOKENS={settings.session_page_tokens}) x 4 bytes, mapped at start whether used or not; "
            "lower ATTN_SESSION_MAX_COUNT or ATTN_SESSION_MAX_TOKENS, or raise ATTN_SESSION_PAGE_TOKENS"
        )
    return settings


def session_table_bytes(settings: Settings) -> int:
    """The bytes of the sessions' page tables (service/sessions/pool.py): an int32 entry a page of
    ATTN_SESSION_MAX_TOKENS, for each of ATTN_SESSION_MAX_COUNT sessions, mapped at start. Each
    variable's range alone keeps them within SESSION_TABLE_MAX_BYTES (1 GiB, the default pool's
    size: the bookkeeping never outweighs the memory it keeps); their extremes together would map
    64 TiB."""
    pages = -(-settings.session_max_tokens // settings.session_page_tokens)
    return settings.session_max_count * pages * 4


def warnings(settings: Settings) -> list[str]:
    """Settings each in range that together refuse requests for ever: said once at start
    (deploy/gunicorn.conf.py, on_starting), not refused, since a test or an operator may mean them."""
    said = []
    if settings.max_inflight_bytes < settings.max_body_bytes:
        said.append(
            f"ATTN_MAX_INFLIGHT_BYTES={settings.max_inflight_bytes} is below ATTN_MAX_BODY_BYTES={settings.max_body_bytes}: "
            "a body between the two is accepted by size but never fits in flight, and gets 503 on every retry"
        )
    return said


def web_concurrency() -> int:
    """WEB_CONCURRENCY, gunicorn's worker count (deploy/gunicorn.conf.py): 2 by default, 1..256.
    0 started an arbiter with no worker, whose listening socket took connections no one answered."""
    workers = _env("WEB_CONCURRENCY", 2, int)
    if not 1 <= workers <= 256:
        raise SystemExit(f"configuration error: WEB_CONCURRENCY={workers} is out of range; it must be 1..256")
    return workers


def _bool(raw: str) -> bool:
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise ValueError(raw)


def _cores() -> int:
    """The cores this process may run on (its CPU affinity; a container's CPU quota is not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _keys(raw: str) -> tuple[str, ...]:
    """ATTN_API_KEYS: comma-separated keys. A value that names none (" , ") is refused: read as no
    keys, it turned authentication off, which is what an empty or unset variable means."""
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise SystemExit(f"configuration error: ATTN_API_KEYS={raw!r} names no key; unset it to turn authentication off")
    return keys


def log_format(raw: str) -> str:
    """ATTN_LOG_FORMAT: json or plain (any case)."""
    if raw.strip().lower() not in ("json", "plain"):
        raise ValueError(raw)
    return raw.strip().lower()


def compress_answers(raw: str) -> str:
    """ATTN_COMPRESS_ANSWERS: preferred or accepted (any case)."""
    if raw.strip().lower() not in ("preferred", "accepted"):
        raise ValueError(raw)
    return raw.strip().lower()


def _otel_trace_exporters() -> tuple[str, ...]:
    """The OpenTelemetry span exporters the SDK's standard variables ask for, as entry-point names
    of the group opentelemetry_traces_exporter ("otlp" resolved by OTEL_EXPORTER_OTLP_PROTOCOL as
    the SDK does: grpc unless http/protobuf). None unless OTEL_TRACES_EXPORTER names one or an OTLP
    endpoint is set: tracing is off by default, and costs nothing then (service.web.tracing)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = "otlp"
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    otlp = "otlp_proto_http" if protocol.startswith("http") else "otlp_proto_grpc"
    return tuple(otlp if n == "otlp" else n for n in (n.strip() for n in names.split(",")) if n and n != "none")


@dataclass(frozen=True)
class Settings:
    """The limits and options in force. Defaults keep one request within about a second and a
    gigabyte on a 2-core machine: attention is O(T*S) in time and memory, so T, S and the score
    count B*T*S are bounded separately (and returned weights, which also cost wire bytes, tighter)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_t: int = 4096  # query positions per request
    max_s: int = 4096  # key positions per request
    max_score_elements: int = 2**27  # B*T*S computed (134M: 8 heads at T=S=4096)
    max_weights_elements: int = 2**25  # B*T*S returned as weights (33.5M: 8 heads at T=S=2048, 134 MB f32)
    max_output_elements: int = 2**25  # out returned, B*T*dv (or B*n*d for /mha): 134 MB f32, as the weights
    # Request body, refused before it is parsed. 32 MiB: parsing a hostile JSON body peaks at up to
    # 33x its size (service.admission.PARSE_FACTOR), ~1.1 GB here, which a worker's lone
    # request may take. Valid b64 bodies up to q, k, v (8, 4096, 63) float32 fit.
    max_body_bytes: int = 32 * 2**20
    max_rank: int = 6  # rank of q, k, v
    max_d: int = 4096  # head dimension / model width
    default_dtype: str = "float32"
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_inflight: int = 2  # computing requests per worker (its compute slots); the rest wait in its queue
    # Admission is by predicted wait (service/admission/): a request waits, first come first served,
    # while its predicted wait and compute fit its X-Deadline-Ms, or without one while its predicted wait
    # fits max_queue_wait_ms. max_queue is only a safety cap on the requests the server holds,
    # (max_inflight + max_queue) x workers: room for a burst of 128 small requests on 2 workers.
    max_queue: int = 64
    max_queue_wait_ms: int = 5000
    max_inflight_bytes: int = 512 * 2**20  # bodies + estimated working bytes per worker before 503
    warmup: bool = True  # calibrate the cost model at start-up
    # Slow and stalled clients (service/transport/worker.py): a request is read by the event loop, under
    # these deadlines, before a thread sees it; a response a client does not read is held here.
    header_timeout_s: int = 10  # a request line and headers must arrive within this (408 past it)
    body_timeout_s: int = 30  # a body gets this long, plus 1 s per body_min_rate bytes received
    body_min_rate: int = 64 * 2**10  # bytes/s a body must average beyond body_timeout_s (408 below)
    # ... and never longer than this in all, however steadily it comes: a body at the limit (32 MiB)
    # must average 280 KB/s. At the rate alone, one held its bytes for 542 s.
    body_total_timeout_s: int = 120
    send_timeout_s: int = 30  # a client that reads nothing of its response this long is dropped
    send_buffer_bytes: int = 256 * 2**20  # unread response bytes held per worker; past it new POSTs get 503, writers wait (worker.py)
    # Logs and traces (service/web/accesslog.py, tracing.py): one JSON line per request on stdout,
    # or a plain one for a terminal; OpenTelemetry span exporters, set by the standard OTEL_* variables.
    log_format: str = "json"
    otel_trace_exporters: tuple[str, ...] = ()
    # One large request alone on the server is computed on this many threads (service/cost/split.py);
    # under load every request keeps one. Default: the cores; 1 turns splitting off.
    split_threads: int = field(default_factory=_cores)
    # Answers compressed (service/web/compression.py) when the client prefers a coding to identity
    # (Accept-Encoding names identity below it, or refuses it); with "accepted", also when it merely
    # accepts one (identity unnamed: `gzip, deflate`, what Python's requests sends on every call).
    # Measured (bench/README.md, Compression): zlib at level 1 takes a core longer than a gigabit
    # link takes to send what it saves, for every tensor encoding (b64 and binary shrink by a
    # quarter or less, nested text by half at ~100 MB/s), so "accepted" pays only on slow links.
    # Then zlib's level (1 is the fastest; tensors gain little from more), the size below which an
    # answer goes uncompressed (a gzip member costs 18 bytes and the client a decompression), and
    # the size above which an answer merely accepted goes uncompressed too (0: no such size).
    compress_answers: str = "preferred"
    compress_level: int = 1
    compress_min_bytes: int = 1024
    compress_max_bytes: int = 2**20
    # Sessions (service/sessions/): every session's keys and values share one pool of this many
    # bytes, made before the workers fork, in pages of session_page_tokens tokens; a session idle
    # session_idle_s expires; one holds at most session_max_tokens tokens; at most
    # session_max_count sessions live at once.
    session_memory_bytes: int = 2**30
    session_page_tokens: int = 256
    session_idle_s: int = 600
    session_max_tokens: int = 65536
    session_max_count: int = 1024
    # Triton's system shared-memory extension (service/shm.py): clients on this host may register
    # POSIX shared-memory objects and pass tensors through them. Off by default, as Triton's
    # --allow-client-shm: it lets a local client have the server read and write any shared-memory
    # object the server's user can open (docs/operations.md).
    allow_client_shm: bool = False

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        return check(
            cls(
                host=_env("HOST", d.host, str),
                port=_env("PORT", d.port, int),
                max_t=_env("ATTN_MAX_T", d.max_t, int),
                max_s=_env("ATTN_MAX_S", d.max_s, int),
                max_score_elements=_env("ATTN_MAX_SCORE_ELEMENTS", d.max_score_elements, int),
                max_weights_elements=_env("ATTN_MAX_WEIGHTS_ELEMENTS", d.max_weights_elements, int),
                max_output_elements=_env("ATTN_MAX_OUTPUT_ELEMENTS", d.max_output_elements, int),
                max_body_bytes=_env("ATTN_MAX_BODY_BYTES", d.max_body_bytes, int),
                max_rank=_env("ATTN_MAX_RANK", d.max_rank, int),
                max_d=_env("ATTN_MAX_D", d.max_d, int),
                default_dtype=_env("ATTN_DEFAULT_DTYPE", d.default_dtype, str),
                api_keys=_env("ATTN_API_KEYS", d.api_keys, _keys),
                max_inflight=_env("ATTN_MAX_INFLIGHT", d.max_inflight, int),
                max_queue=_env("ATTN_MAX_QUEUE", d.max_queue, int),
                max_inflight_bytes=_env("ATTN_MAX_INFLIGHT_BYTES", d.max_inflight_bytes, int),
                max_queue_wait_ms=_env("ATTN_MAX_QUEUE_WAIT_MS", d.max_queue_wait_ms, int),
                warmup=_env("ATTN_WARMUP", d.warmup, _bool),
                header_timeout_s=_env("ATTN_HEADER_TIMEOUT_S", d.header_timeout_s, int),
                body_timeout_s=_env("ATTN_BODY_TIMEOUT_S", d.body_timeout_s, int),
                body_min_rate=_env("ATTN_BODY_MIN_RATE", d.body_min_rate, int),
                body_total_timeout_s=_env("ATTN_BODY_TOTAL_TIMEOUT_S", d.body_total_timeout_s, int),
                send_timeout_s=_env("ATTN_SEND_TIMEOUT_S", d.send_timeout_s, int),
                send_buffer_bytes=_env("ATTN_SEND_BUFFER_BYTES", d.send_buffer_bytes, int),
                log_format=_env("ATTN_LOG_FORMAT", d.log_format, log_format),
                otel_trace_exporters=_otel_trace_exporters(),
                split_threads=_env("ATTN_SPLIT_THREADS", d.split_threads, int),
                compress_answers=_env("ATTN_COMPRESS_ANSWERS", d.compress_answers, compress_answers),
                compress_level=_env("ATTN_COMPRESS_LEVEL", d.compress_level, int),
                compress_min_bytes=_env("ATTN_COMPRESS_MIN_BYTES", d.compress_min_bytes, int),
                compress_max_bytes=_env("ATTN_COMPRESS_MAX_BYTES", d.compress_max_bytes, int),
                session_memory_bytes=_env("ATTN_SESSION_MEMORY_BYTES", d.session_memory_bytes, int),
                session_page_tokens=_env("ATTN_SESSION_PAGE_TOKENS", d.session_page_tokens, int),
                session_idle_s=_env("ATTN_SESSION_IDLE_S", d.session_idle_s, int),
                session_max_tokens=_env("ATTN_SESSION_MAX_TOKENS", d.session_max_tokens, int),
                session_max_count=_env("ATTN_SESSION_MAX_COUNT", d.session_max_count, int),
                allow_client_shm=_env("ATTN_ALLOW_CLIENT_SHM", d.allow_client_shm, _bool),
            )
        )

    def limits(self) -> dict:
        """The public view of the limits (no secrets)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in {"api_keys", "host", "port", "warmup", "log_format", "otel_trace_exporters"}
        }
