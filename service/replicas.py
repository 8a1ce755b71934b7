"""`python -m service.replicas N [--port 8000]`: N replicas of the service on this machine, for the
client's key splitting across replicas (AttentionClient([url, ...]), attention-client --url A --url B).

Each replica is `python -m service` on 127.0.0.1 at consecutive ports from --port, one worker
computing one request at a time on one thread (WEB_CONCURRENCY=1, ATTN_MAX_INFLIGHT=1,
ATTN_SPLIT_THREADS=1, one BLAS thread): one replica is one core. The rest of the environment is
passed on (ATTN_MAX_T and the other limits apply to every replica). Ctrl-C or SIGTERM stops them
all. In production the replicas are a Kubernetes Deployment behind one Service (docs/operations.md)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from service.config import ONE_BLAS_THREAD

ONE_CORE = {"WEB_CONCURRENCY": "1", "ATTN_MAX_INFLIGHT": "1", "ATTN_SPLIT_THREADS": "1", **ONE_BLAS_THREAD}


def start(n: int, port: int, env: dict[str, str] | None = None, quiet: bool = False) -> list[subprocess.Popen]:
    """Start n replicas on 127.0.0.1 at ports port .. port + n - 1; returns their processes.
    quiet: their logs are dropped (else they go to this process's stdout and stderr)."""
    inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # each replica its own metrics
    base = {**inherited, **(env or {}), **ONE_CORE, "HOST": "127.0.0.1"}
    out = subprocess.DEVNULL if quiet else None
    return [
        subprocess.Popen([sys.executable, "-m", "service"], env={**base, "PORT": str(port + i)}, stdout=out, stderr=out) for i in range(n)
    ]


def stop(procs: list[subprocess.Popen], timeout: float = 35.0) -> None:
    """SIGTERM every replica (each drains), then SIGKILL those still running after timeout."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, help="how many replicas")
    parser.add_argument("--port", type=int, default=8000, help="the first replica's port (default %(default)s)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("n must be at least 1")
    procs = start(args.n, args.port)
    urls = " ".join(f"--url http://127.0.0.1:{args.port + i}" for i in range(args.n))
    print(f"{args.n} replicas; attention-client {urls} ...", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1  # one replica exited on its own
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())
