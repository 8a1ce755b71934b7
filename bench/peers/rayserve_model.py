"""The attention model on Ray Serve (a serve.deployment), POST /attention with the native b64 body:
`python bench/peers/rayserve_model.py PORT` in its venv, the repository root on PYTHONPATH. A
one-node Ray of its own (2 CPUs, no dashboard), Serve's proxy on 127.0.0.1:PORT, two replicas;
GET /attention answers once they are up. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every Ray
process on 127.0.0.1, RAY_USAGE_STATS_ENABLED=0 its usage reporting off (peers/__main__.py)."""

from __future__ import annotations

import os
import sys
import threading

# One BLAS thread per worker process, as this service's workers have (set before numpy loads;
# Ray's worker processes inherit the driver's environment).
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

import ray  # noqa: E402  (after the BLAS setting)
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402

from bench.peers import b64_body  # noqa: E402


@serve.deployment(num_replicas=2)
class Attention:
    """Scaled dot-product attention, computed by this service's numeric core."""

    async def __call__(self, request: Request) -> dict | str:
        if request.method == "GET":
            return "ready"
        return b64_body.answer(await request.json())


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
    serve.run(Attention.bind(), route_prefix="/attention")
    threading.Event().wait()  # serve until stopped
