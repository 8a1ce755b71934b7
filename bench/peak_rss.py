"""Peak memory of one request, measured against Job.working_bytes.

Each case runs in a fresh subprocess: the body is built and held (the gate charges it as its
Content-Length), the peak RSS mark is reset (/proc/self/clear_refs), then the whole pipeline runs
in-process as a worker would: parse_json, the schema's load, the core, the response encoded and
written chunk by chunk (the chunks discarded). Prints the peak RSS growth over the held body next
to the prediction, and the parse's peak next to what admission charges for it (parse_charge).

    python -m bench.peak_rss
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.garbage import WORKER_MALLOC_ENV

MB = 2**20
CASES = [  # (endpoint, encoding, lead, T, S, d, dv, return_weights)
    ("attention", "b64", (8,), 1024, 1024, 64, 64, True),
    ("attention", "b64", (8,), 2048, 2048, 64, 64, True),
    ("attention", "b64", (8,), 4096, 4096, 64, 64, False),
    ("attention", "nested", (8,), 1024, 1024, 64, 64, True),
    ("attention", "nested", (8,), 2048, 2048, 64, 64, False),
    ("attention", "b64", (4,), 4096, 1, 1, 2048, False),
    ("mha", "b64", (4,), 2048, 2048, 512, 512, False),
    ("mha", "nested", (1,), 1024, 1024, 256, 256, True),
]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _child(i: int) -> None:
    import numpy as np
    import orjson

    from attention_client import encode_tensor
    from schemas import AttentionRequest, MhaRequest
    from service import wire
    from service.config import Settings
    from service.web.http import parse_json

    endpoint, enc, lead, T, S, d, dv, weights = CASES[i]
    rng = np.random.default_rng(0)
    if endpoint == "attention":
        doc = {
            "q": rng.standard_normal((*lead, T, d), np.float32),
            "k": rng.standard_normal((*lead, S, d), np.float32),
            "v": rng.standard_normal((*lead, S, dv), np.float32),
        }
        schema = AttentionRequest(Settings())
    else:
        doc = {
            "x": rng.standard_normal((*lead, T, d), np.float32),
            **{w: rng.standard_normal((d, d), np.float32) / 8 for w in ("wq", "wk", "wv", "wo")},
            "heads": 8,
        }
        schema = MhaRequest(Settings())
    doc = {k: encode_tensor(v, enc) if isinstance(v, np.ndarray) else v for k, v in doc.items()}
    body = orjson.dumps({**doc, "return_weights": weights}, option=orjson.OPT_SERIALIZE_NUMPY)
    del doc
    from service.admission import parse_charge

    charge = parse_charge(bytearray(body))  # what the gate charges for the parse, counted from the body
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    job = schema.load(parse_json(body))
    load_peak = _status("VmHWM:") - base
    predicted = job.working_bytes()
    out, w = job.compute()
    resp = {"out": wire.encode(out, job.encoding, lazy=True)}
    if w is not None:
        resp["weights"] = wire.encode(w, job.encoding, lazy=True)
    data, _ = wire.dump_chunks(resp)
    sent = sum(len(c) for c in ([data] if isinstance(data, bytes) else data))
    peak = _status("VmHWM:") - base
    print(
        json.dumps(
            {
                "body_mb": len(body) / MB,
                "peak_mb": peak / MB,
                "load_mb": load_peak / MB,
                "charge_mb": charge / MB,
                "predicted_mb": predicted / MB,
                "sent_mb": sent / MB,
            }
        )
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]))
        return
    print(f"{'case':52} {'body MB':>8} {'parse MB':>8} {'charged':>8} {'peak MB':>8} {'pred MB':>8} {'pred/peak':>9}")
    for i, case in enumerate(CASES):
        env = {**os.environ, **WORKER_MALLOC_ENV}
        r = json.loads(
            subprocess.run(
                [sys.executable, "-m", "bench.peak_rss", "--child", str(i)], capture_output=True, text=True, check=True, env=env
            ).stdout
        )
        endpoint, enc, lead, T, S, d, dv, weights = case
        name = f"{endpoint} {enc} B={lead[0]} T={T} S={S} d={d} dv={dv} w={int(weights)}"
        print(
            f"{name:52} {r['body_mb']:8.1f} {r['load_mb']:8.1f} {r['charge_mb']:8.1f} {r['peak_mb']:8.1f} {r['predicted_mb']:8.1f} {r['predicted_mb'] / max(r['peak_mb'], 1e-9):9.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
