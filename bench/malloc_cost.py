"""CPU time and minor page faults per request, in-process, for a few shapes: the cost of the
allocator settings in deploy/gunicorn.conf.py. Compare settings with env:

    python -m bench.malloc_cost 8
    MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=16777216 MALLOC_ARENA_MAX=2 python -m bench.malloc_cost 8
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the workers run (deploy/gunicorn.conf.py), before numpy loads

import resource
import sys

import numpy as np
import orjson

from attention_client import encode_tensor
from service.config import Settings
from service.web import create_app

app = create_app(Settings(warmup=False))
c = app.test_client()


def body(T, enc, w):
    q = np.random.default_rng(T).standard_normal((8, T, 64), dtype=np.float32)
    return orjson.dumps(
        {"q": encode_tensor(q, enc), "k": encode_tensor(q, enc), "v": encode_tensor(q, enc), "causal": True, "return_weights": w},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
for T, enc, w in [(256, "b64", True), (1024, "b64", True), (1024, "b64", False), (2048, "b64", True), (512, "nested", True)]:
    b = body(T, enc, w)
    for _ in range(2):
        c.post("/attention", data=b, content_type="application/json").get_data()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        c.post("/attention", data=b, content_type="application/json").get_data()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n * 1000
    print(
        f"T={T} {enc} w={int(w)}: CPU {cpu:6.1f} ms/request (sys {(r1.ru_stime - r0.ru_stime) / n * 1000:5.1f}), minor faults {(r1.ru_minflt - r0.ru_minflt) / n:8.0f}/request"
    )
