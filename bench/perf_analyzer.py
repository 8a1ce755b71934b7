"""`make bench-perf-analyzer` (`python -m bench perf_analyzer`): Triton's own latency tool against
this service over the Open Inference Protocol.

    python -m bench perf_analyzer --lengths 64,1024 --concurrency 1,4 --shared-memory none,system

perf_analyzer is the C++ binary of the tritonclient 2.40.0 wheel (the last to ship it), in a venv
of its own in $BENCH_PERF_ANALYZER_DIR (default .perf-analyzer/), with the CUDA runtime wheel's
libcudart on LD_LIBRARY_PATH (linked even over HTTP) and Debian's libb64-0d (apt-get, as root).
Against the service as `make run` starts it, with ATTN_ALLOW_CLIENT_SHM=true: q, k, v (1, 8, T, 64)
float32 from an --input-data file, synchronous, every output asked for, the tensors binary both
ways or in system shared-memory regions perf_analyzer registers; the server's side from its
statistics extension (queue, compute input, infer, output per request). One perf_analyzer run per
(T, concurrency, tensors), so that one that does not stabilise costs only its row. The table also
goes to bench/out/perf_analyzer.md.
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.common import ROOT, Server, publish, table, venv

REQUIREMENTS = ("tritonclient[all]==2.40.0", "nvidia-cuda-runtime-cu12==12.9.79")
B, H, D = 1, 8, 64
MODEL = "attention"


def tool_dir() -> Path:
    return Path(os.environ.get("BENCH_PERF_ANALYZER_DIR") or ROOT / ".perf-analyzer")


def ensure_tool() -> tuple[Path, dict[str, str]]:
    """perf_analyzer, in a venv (re)built when REQUIREMENTS changed since its stamp, and the
    environment it runs in: the CUDA runtime wheel's lib/ on LD_LIBRARY_PATH."""
    path = tool_dir() / "venv"
    venv(path, REQUIREMENTS, hashlib.sha256("\n".join(REQUIREMENTS).encode()).hexdigest())
    libs = glob.glob(str(path / "lib" / "python*" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"))
    if not libs:
        raise SystemExit(f"no nvidia/cuda_runtime/lib in {path}: the nvidia-cuda-runtime-cu12 wheel is missing")
    ld_path = os.pathsep.join([libs[0], *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    return path / "bin" / "perf_analyzer", {**os.environ, "LD_LIBRARY_PATH": ld_path}


def missing_libraries(binary: Path, env: dict[str, str]) -> list[str]:
    """The shared libraries the dynamic loader cannot find for binary (ldd's "not found" lines)."""
    lines = subprocess.run(["ldd", str(binary)], env=env, capture_output=True, text=True, check=False).stdout.splitlines()
    return [line.split()[0] for line in lines if "not found" in line]


def ensure_libb64(binary: Path, env: dict[str, str]) -> None:
    """libb64.so.0d from Debian's libb64-0d: installed when missing and we may; refused otherwise."""
    missing = missing_libraries(binary, env)
    if any(lib.startswith("libb64") for lib in missing) and shutil.which("apt-get") and os.geteuid() == 0:
        print("installing Debian's libb64-0d (perf_analyzer links libb64.so.0d)", file=sys.stderr, flush=True)
        if subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"], check=False).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], check=True)
            subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"], check=True)
        missing = missing_libraries(binary, env)
    if missing:
        raise SystemExit(f"perf_analyzer cannot load {', '.join(missing)} (libb64.so.0d: apt-get install libb64-0d)")


# perf_analyzer 2.40 sends every input through shared memory, and stops when an optional input has
# no data ("does not support optional inputs at this time"): with --shared-memory system every row
# sends these too, values that leave the computation as it is (every key allowed, nothing added).
NO_OP_INPUTS = {
    "mask": np.ones((1, 1, 1, 1), np.bool_),
    "key_lengths": None,  # (1, 1) int64 of T: every key
    "bias": np.zeros((1, 1, 1, 1), np.float32),
    "alibi_slopes": np.zeros((1, 1), np.float32),
}


def input_file(length: int, seed: int = 0, optional: bool = False) -> Path:
    """perf_analyzer's --input-data JSON: q, k, v (B, H, T, D) float32 as b64, with their shapes;
    with optional, NO_OP_INPUTS too."""
    rng = np.random.default_rng(seed)
    shape = [B, H, length, D]
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name in "qkv"}
    if optional:
        arrays.update({name: np.full((1, 1), length, np.int64) if a is None else a for name, a in NO_OP_INPUTS.items()})
    step = {name: {"b64": base64.b64encode(a.tobytes()).decode(), "shape": list(a.shape)} for name, a in arrays.items()}
    path = tool_dir() / "inputs" / f"attention-T{length}{'-all' if optional else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": [step]}))
    return path


SERVER_COLUMNS = {
    "queue": "Server Queue",
    "input": "Server Compute Input",
    "infer": "Server Compute Infer",
    "output": "Server Compute Output",
}


def measure(binary: Path, env: dict, url: str, data: Path, concurrency: int, args, shared_memory: str, length: int) -> dict | str:
    """One perf_analyzer run at one concurrency: {infer_s, p50_ms, p99_ms, and the server's
    queue_ms, input_ms, infer_ms, output_ms}, or its last error line."""
    csv_path = tool_dir() / "result.csv"
    csv_path.unlink(missing_ok=True)
    argv = [
        str(binary),
        *("-m", MODEL, "-u", url.removeprefix("http://"), "-i", "http"),
        *("--concurrency-range", f"{concurrency}:{concurrency}", "--input-data", str(data)),
        *("--measurement-interval", str(args.window_ms), "--max-trials", str(args.max_trials)),
        *("--stability-percentage", str(args.stability), "-f", str(csv_path)),
        *("--shared-memory", shared_memory),
        *(("--output-shared-memory-size", str(B * H * length * length * 4)) if shared_memory != "none" else ()),
    ]
    try:
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"stopped after {args.timeout:.0f} s"
    rows = list(csv.DictReader(csv_path.open())) if csv_path.exists() else []
    if run.returncode != 0 or not rows:
        lines = [line.strip() for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {run.returncode}"
    row = rows[0]
    return {
        "infer_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
        **{f"{name}_ms": float(row.get(column) or "nan") / 1e3 for name, column in SERVER_COLUMNS.items()},  # µs in the CSV
    }


def report(results: dict[tuple[int, int, str], dict | str], lengths, concurrencies, memories) -> str:
    rows = []
    for length in lengths:
        for c in concurrencies:
            for memory in memories:
                r, tensors = results[length, c, memory], "binary" if memory == "none" else f"{memory} shared memory"
                cells = [r, "", "", "", "", "", ""] if isinstance(r, str) else [f"{r['infer_s']:.0f}", r["p50_ms"], r["p99_ms"]]
                rows.append([length, c, tensors, *cells, *([] if isinstance(r, str) else (r[f"{name}_ms"] for name in SERVER_COLUMNS))])
    header = (
        "T | concurrency | tensors | infer/s | p50 ms | p99 ms | server queue ms | compute input ms | compute infer ms | compute output ms"
    )
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024", help="T values, comma-separated")
    parser.add_argument("--concurrency", default="1,2,3,4", help="concurrencies, comma-separated")
    parser.add_argument("--shared-memory", default="none,system", help="perf_analyzer's --shared-memory values, comma-separated")
    parser.add_argument("--window-ms", type=int, default=2000, help="perf_analyzer's --measurement-interval")
    parser.add_argument("--max-trials", type=int, default=8, help="windows before a concurrency gives up stabilising")
    parser.add_argument("--stability", type=int, default=50, help="perf_analyzer's --stability-percentage")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for one perf_analyzer run before it is stopped")
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    memories = args.shared_memory.split(",")

    binary, env = ensure_tool()
    ensure_libb64(binary, env)
    inputs = {length: input_file(length, optional=memories != ["none"]) for length in lengths}

    load = os.getloadavg()[0]
    results = {}
    with Server("perf-analyzer", env={"ATTN_ALLOW_CLIENT_SHM": "true"}, inherit_settings=False) as server:  # `make run`'s, with shm
        server.wait_ready(in_a_row=4, path="/v2/health/ready")
        for length in lengths:
            for c in concurrencies:
                for memory in memories:
                    results[length, c, memory] = measure(binary, env, server.url, inputs[length], c, args, memory, length)
                    print(f"T={length} concurrency={c} shared memory {memory}: {results[length, c, memory]}", file=sys.stderr, flush=True)
    text = f"`python -m bench perf_analyzer {' '.join(sys.argv[1:])}`: perf_analyzer (tritonclient 2.40.0), synchronous,"
    text += f" --measurement-interval {args.window_ms} ms, --stability-percentage {args.stability}, --max-trials {args.max_trials};"
    text += f" load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n\n"
    text += report(results, lengths, concurrencies, memories) + "\n"
    publish("perf_analyzer.md", text)


if __name__ == "__main__":
    main()
