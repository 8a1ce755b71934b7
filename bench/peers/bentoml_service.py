"""The attention model as a BentoML service, POST /attention with the native b64 body (its fields
are the API method's parameters): `bentoml serve bentoml_service:Attention --host 127.0.0.1 --port
PORT` from bench/peers in its venv, the repository root on PYTHONPATH; two worker processes;
BENTOML_DO_NOT_TRACK=1 turns its usage tracking off (peers/__main__.py)."""

from __future__ import annotations

import os

# One BLAS thread per worker process, as this service's workers have (set before numpy loads).
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

import bentoml  # noqa: E402  (after the BLAS setting)

from bench.peers import b64_body  # noqa: E402


@bentoml.service(workers=2, traffic={"timeout": 600})
class Attention:
    """Scaled dot-product attention, computed by this service's numeric core."""

    @bentoml.api
    def attention(self, q: dict, k: dict, v: dict, causal: bool = False, return_weights: bool = True) -> dict:
        return b64_body.answer({"q": q, "k": k, "v": v, "causal": causal, "return_weights": return_weights})
