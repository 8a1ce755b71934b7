"""`attention-loadtest` (or `python -m attention_client.loadtest`): parse the command line, run the sweep, write the outputs.

Exit status: 0 done, 1 the service could not be reached (one line on stderr, no
traceback), 2 bad arguments, 130 interrupted (what was measured is still written).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import __version__
from .cell import Load
from .payload import Workload
from .report import write_all
from .sweep import Sweep, SweepConfig, run_sweep
from .transport import ConnectionFailure


def parse_Ts(text: str) -> tuple[int, ...]:
    """`"64,128"` or `"256..4096"` (doubling) or a mix -> sorted distinct T values."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            lo_text, hi_text = part.split("..", 1)
            lo, hi = int(lo_text), int(hi_text)
            if lo < 1 or hi < lo:
                raise ValueError(f"bad range {part!r}: want 1 <= low <= high")
            while lo <= hi:
                values.add(lo)
                lo *= 2
        elif part:
            values.add(int(part))
    if not values or min(values) < 1:
        raise ValueError(f"want positive integers, got {text!r}")
    return tuple(sorted(values))


def _T_list(text: str) -> tuple[int, ...]:
    try:
        return parse_Ts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _window(text: str) -> tuple[int, int]:
    """`"256,0"` -> (256, 0): integers >= -1."""
    try:
        left, right = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LEFT,RIGHT (two integers, e.g. 256,0), got {text!r}") from None
    if min(left, right) < -1:
        raise argparse.ArgumentTypeError(f"window values must be >= -1 (-1: unbounded), got {text!r}")
    return left, right


DAY_S = 86_400.0  # the longest a duration, cell or request may be asked to take
MAX_TENSOR_BYTES = 2**30  # the most the tensors of one body may hold: they are built in memory
MAX_CONCURRENCY = 1024  # workers of one cell, each a thread with its own session


def _positive(kind: type, most: float | None = None):
    """A positive, finite number (NaN and infinity pass `value <= 0` and then bound nothing),
    at most `most` if given."""

    def convert(text: str):
        value = kind(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    """Every option, with the defaults the README documents."""
    p = argparse.ArgumentParser(
        prog="attention-loadtest",
        description="Sweep T x concurrency against POST /attention; write report.md, results.csv and latency.png.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--url",
        action="append",
        help="base URL of the service (default http://127.0.0.1:8000); repeat it for replicas, which implies --split",
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="send each request through the client (AttentionClient.attention over every --url): T may go past one "
        "server's limits, split into blocks of rows and key ranges merged by their lse",
    )
    p.add_argument(
        "--T",
        type=_T_list,
        default=parse_Ts("64..4096"),
        metavar="LIST",
        help="sequence lengths, e.g. 64,128,256 or 256..4096 doubling (default 64..4096)",
    )
    p.add_argument("--concurrency", type=_T_list, default=(1, 2, 4, 8), metavar="LIST", help="worker counts, same syntax (default 1,2,4,8)")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=_positive(float, DAY_S), metavar="S", help="seconds per cell (default 5 unless --requests)")
    amount.add_argument("--requests", type=_positive(int), metavar="N", help="requests per cell")
    p.add_argument(
        "--rounds",
        type=_positive(int),
        default=1,
        metavar="N",
        help="run the whole sweep N times, one round after the other, pooling each "
        "cell's samples; the report shows each cell's p50 spread across rounds "
        "(default 1)",
    )
    p.add_argument(
        "--rate",
        type=_positive(float),
        metavar="RPS",
        help="open loop: this many arrivals per second per cell, latency measured "
        "from the scheduled send time; --concurrency caps requests in flight",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument("--batch", type=_positive(int), default=1)
    wl.add_argument("--heads", type=_positive(int), default=1)
    wl.add_argument("--d", type=_positive(int), default=64, help="head dimension (default 64)")
    wl.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False)
    wl.add_argument(
        "--weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for the (T, S) weights (return_weights; default yes, as the API)",
    )
    wl.add_argument(
        "--window",
        type=_window,
        metavar="LEFT,RIGHT",
        help="sliding-window attention (FlashAttention's window_size, -1 unbounded), e.g. 256,0 (write --window=-1,0 when LEFT is negative): the work grows as T x window, not T^2",
    )
    wl.add_argument(
        "--kv-heads",
        type=_positive(int),
        metavar="N",
        help="grouped-query attention: k and v with N heads, dividing --heads (enable_gqa)",
    )
    wl.add_argument("--encoding", choices=("b64", "nested"), default="b64")
    wl.add_argument("--seed", type=int, default=0)
    slo = p.add_argument_group("SLO and fits")
    slo.add_argument("--slo-ms", type=_positive(float), metavar="MS")
    slo.add_argument("--slo-percentile", choices=("p50", "p90", "p99"), default="p99")
    slo.add_argument(
        "--early-stop-factor",
        type=_positive(float),
        default=4.0,
        metavar="X",
        help="skip a concurrency's larger T once a cell's p50 > X x SLO (default 4)",
    )
    slo.add_argument(
        "--max-error-rate", type=float, default=0.01, metavar="FRACTION", help="a cell with more errors fails the SLO (default 0.01)"
    )
    slo.add_argument(
        "--fit-min-T", type=int, default=512, metavar="T", help="fit the power-law exponent on cells with T >= this (default 512)"
    )
    bounds = p.add_argument_group("bounds")
    bounds.add_argument("--max-requests-per-cell", type=_positive(int), default=10_000)
    bounds.add_argument("--max-cell-seconds", type=_positive(float, DAY_S), default=60.0)
    bounds.add_argument("--timeout", type=_positive(float, DAY_S), default=30.0, help="seconds per request (default 30)")
    bounds.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed requests before each cell, at least 1: the first one also checks the server accepts the body (default 1)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("LOADTEST_API_KEY"),
        metavar="KEY",
        help="sent as Authorization: Bearer KEY (default $LOADTEST_API_KEY); never written to the report",
    )
    p.add_argument("--out", type=Path, default=Path("loadtest-out"), help="output directory (default %(default)s)")
    return p


def _redact(argv: Sequence[str]) -> list[str]:
    """The command line with the value of --api-key replaced, for the report."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--api-key":
            arg = "***"
        elif arg.startswith("--api-key="):
            arg = "--api-key=***"
        out.append(arg)
    return out


def config_from_args(args: argparse.Namespace, argv: Sequence[str]) -> SweepConfig:
    """The SweepConfig the parsed arguments ask for."""
    urls = tuple(url.rstrip("/").removesuffix("/attention") for url in args.url)
    base_url = urls[0]
    duration = args.duration if args.duration is not None or args.requests else 5.0
    load = Load(
        concurrency=1,
        requests=args.requests,
        duration_s=duration,
        rate=args.rate,
        max_requests=args.max_requests_per_cell,
        max_seconds=args.max_cell_seconds,
        timeout_s=args.timeout,
        warmup=max(args.warmup, 1),
        api_key=args.api_key,
    )
    workload = Workload(
        batch=args.batch,
        heads=args.heads,
        d=args.d,
        causal=args.causal,
        weights=args.weights,
        encoding=args.encoding,
        seed=args.seed,
        window=args.window,
        kv_heads=args.kv_heads,
    )
    return SweepConfig(
        base_url=base_url,
        Ts=args.T,
        concurrencies=args.concurrency,
        workload=workload,
        load=load,
        slo_ms=args.slo_ms,
        slo_percentile=args.slo_percentile,
        early_stop_factor=args.early_stop_factor,
        max_error_rate=args.max_error_rate,
        fit_min_T=args.fit_min_T,
        rounds=args.rounds,
        command=shlex.join(["attention-loadtest", *_redact(argv)]),
        urls=urls,
        split=args.split or len(urls) > 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep the command line asks for; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.url = args.url or ["http://127.0.0.1:8000"]
    for url in args.url:
        if not url.startswith(("http://", "https://")):
            parser.error(f"--url must start with http:// or https://, got {url!r}")
    if not 0 <= args.max_error_rate <= 1:
        parser.error("--max-error-rate must be between 0 and 1")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.duration is not None and args.duration > args.max_cell_seconds:
        parser.error("--duration must not exceed --max-cell-seconds")
    if args.api_key and not (args.api_key.isascii() and args.api_key.isprintable()):  # the key itself is not repeated
        parser.error("--api-key must be printable ASCII: no CR, LF, other control or non-ASCII character")
    if max(args.concurrency) > MAX_CONCURRENCY:
        parser.error(f"--concurrency {max(args.concurrency)} is past {MAX_CONCURRENCY}: each is a thread and a connection")
    heads = args.heads + 2 * (args.kv_heads or args.heads)  # q's, and k's and v's
    tensor_bytes = 4 * args.batch * max(args.T) * args.d * heads
    if tensor_bytes > MAX_TENSOR_BYTES:
        parser.error(
            f"the body of T={max(args.T)} would hold {tensor_bytes / 2**30:.3g} GiB of tensors, past the "
            f"{MAX_TENSOR_BYTES / 2**30:g} GiB this tool builds in memory: lower --T, --batch, --heads or --d"
        )
    config = config_from_args(args, argv)
    sweep = Sweep(config)
    log = lambda line: print(f"loadtest: {line}", file=sys.stderr, flush=True)  # noqa: E731
    target = f"{len(config.urls)} replica(s) through the client's split" if config.split else f"{config.base_url}/attention"
    log(f"{config.workload.describe()} -> {target}")
    status, failure = 0, ""
    try:
        run_sweep(config, sweep, log)
    except ConnectionFailure as exc:
        status, failure = 1, str(exc)
    except KeyboardInterrupt:
        status, failure = 130, "interrupted"
    if sweep.cells:
        paths = write_all(sweep, args.out)
        where = f"{len(sweep.cells)} cells written to {args.out}/ ({', '.join(p.name for p in paths)})"
    else:
        where = "nothing measured"
    print(f"loadtest: {failure}; {where}" if failure else f"loadtest: {where}", file=sys.stderr, flush=True)
    return status
