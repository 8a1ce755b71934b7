"""The attention model on LitServe (a LitAPI), POST /attention with the native b64 body:
`python bench/peers/litserve_model.py PORT` in its venv, the repository root on PYTHONPATH. One
API server process hands each request to one of two inference workers; bound to 127.0.0.1 (its
default is 0.0.0.0), no client.py written."""

from __future__ import annotations

import os
import sys

# One BLAS thread per worker process, as this service's workers have (set before numpy loads).
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

import litserve as ls  # noqa: E402  (after the BLAS setting)

from bench.peers import b64_body  # noqa: E402


class AttentionAPI(ls.LitAPI):
    """Scaled dot-product attention, computed by this service's numeric core."""

    def setup(self, device: str) -> None:
        pass  # nothing to load: the model is a function

    def decode_request(self, request: dict) -> dict:
        return request  # the parsed JSON body

    def predict(self, body: dict) -> dict:
        return b64_body.answer(body)

    def encode_response(self, output: dict) -> dict:
        return output


if __name__ == "__main__":
    server = ls.LitServer(AttentionAPI(api_path="/attention"), accelerator="cpu", workers_per_device=2, timeout=600)
    server.run(host="127.0.0.1", port=int(sys.argv[1]), num_api_servers=1, generate_client_file=False)
