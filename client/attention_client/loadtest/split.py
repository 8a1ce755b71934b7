"""A cell whose requests go through the client's split: each request is one
AttentionClient.attention() call over the given replicas, which the client cuts into blocks within
each server's limits (leading axes, query rows, key ranges) and merges by their lse. So T may go
past one replica's ATTN_MAX_T and ATTN_MAX_S, and more replicas take the blocks of one call at
once. The latency is the call's, end to end: splitting, sending, computing and merging.

Each worker has its own client (its own connections to every replica); the schedule, bounds and
samples are cell.py's."""

from __future__ import annotations

import threading
import time

import numpy as np

from .._client import AttentionClient, AttentionError
from .cell import JOIN_GRACE_S, CellRun, Load, Sample, _Schedule
from .payload import Workload
from .transport import check_reachable


def build_arrays(workload: Workload, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (batch, heads, T, d), k, v (batch, kv_heads or heads, T, d): build_body's, as arrays."""
    rng = np.random.default_rng([workload.seed, T])
    shape = (workload.batch, workload.heads, T, workload.d)
    kv_shape = (workload.batch, workload.kv_heads or workload.heads, T, workload.d)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in (shape, kv_shape, kv_shape))
    return q, k, v


def _call(api: AttentionClient, arrays, workload: Workload, at: float | None = None) -> Sample:
    """One attention call, timed from `at` (the scheduled send; default now); a refusal's status
    (or, with no answer, its code) recorded."""
    q, k, v = arrays
    t0 = time.perf_counter() if at is None else at
    try:
        api.attention(
            q,
            k,
            v,
            causal=workload.causal,
            return_weights=workload.weights,
            enable_gqa=workload.kv_heads is not None,
            window=workload.window,
        )
    except AttentionError as err:
        return Sample(time.perf_counter() - t0, err.status, None if err.status else err.code)
    return Sample(time.perf_counter() - t0, 200)


def run_split_cell(urls: tuple[str, ...], arrays, workload: Workload, load: Load, stop: threading.Event | None = None) -> CellRun:
    """Call attention on `arrays` under `load` through clients over `urls`; raise
    ConnectionFailure if a replica cannot be reached."""
    stop = stop or threading.Event()
    clients = [AttentionClient(list(urls), timeout=load.timeout_s, api_key=load.api_key, retries=1) for _ in range(load.concurrency)]
    try:
        for _ in range(load.warmup):
            sample = _call(clients[0], arrays, workload)
            if sample.status is None:
                for url in urls:
                    check_reachable(url)
            if sample.status is not None and 400 <= sample.status < 500:
                return CellRun([sample], 0.0, refused=f"refused: {sample.status}")
        outs: list[list[Sample]] = [[] for _ in clients]
        t0 = time.perf_counter()
        schedule = _Schedule(load, t0, stop)

        def work(api: AttentionClient, out: list[Sample]) -> None:
            while (at := schedule.take()) is not None:
                delay = at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                out.append(_call(api, arrays, workload, at))

        threads = [threading.Thread(target=work, args=(api, out), daemon=True) for api, out in zip(clients, outs, strict=True)]
        for thread in threads:
            thread.start()
        end = t0 + load.max_seconds + load.timeout_s + JOIN_GRACE_S
        for thread in threads:
            thread.join(max(0.0, end - time.perf_counter()))
        elapsed = time.perf_counter() - t0
        stuck = sum(thread.is_alive() for thread in threads)
        if stuck:
            stop.set()
            schedule.capped = f"{stuck} call(s) still unanswered past the bound of {load.max_seconds:g} s, abandoned"
    finally:
        for api in clients:
            api.close()
    samples = [s for out in outs for s in list(out)]
    unsent = schedule.planned - schedule.issued if schedule.planned is not None else 0
    return CellRun(samples, elapsed, unsent=unsent, capped=schedule.capped)
