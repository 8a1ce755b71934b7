"""Is worker memory growth a leak? tracemalloc (which also traces numpy buffers) over N mixed
valid /attention requests through the Flask app in one process.

    python -m bench.leak_check
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the workers run (deploy/gunicorn.conf.py), before numpy loads

import gc
import random
import tracemalloc

import numpy as np
import orjson

from attention_client import encode_tensor
from service.config import Settings
from service.web import create_app

app = create_app(Settings(warmup=False))
c = app.test_client()
rng = random.Random(0)


def body():
    T = rng.choice([16, 64, 256, 512])
    H = rng.choice([1, 8])
    enc = rng.choice(["b64", "nested"])
    q = np.random.default_rng(rng.randrange(2**32)).standard_normal((H, T, 64), dtype=np.float32)
    return orjson.dumps(
        {
            "q": encode_tensor(q, enc),
            "k": encode_tensor(q, enc),
            "v": encode_tensor(q, enc),
            "causal": rng.random() < 0.5,
            "return_weights": rng.random() < 0.5,
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


bodies = [body() for _ in range(16)]


def run(n):
    for _ in range(n):
        r = c.post("/attention", data=rng.choice(bodies), content_type="application/json")
        assert r.status_code == 200
        r.get_data()


def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


run(50)
gc.collect()
tracemalloc.start()
s0 = tracemalloc.take_snapshot()
r0 = rss()
for i in range(4):
    run(100)
    gc.collect()
    cur, peak = tracemalloc.get_traced_memory()
    print(
        f"after {100 * (i + 1)} more: traced {cur / 2**20:.2f} MB (peak {peak / 2**20:.1f}), RSS {rss():.0f} MB (start {r0:.0f})",
        flush=True,
    )
s1 = tracemalloc.take_snapshot()
for st in s1.compare_to(s0, "lineno")[:6]:
    print(st)
