"""The attention model on KServe's Python model server (a kserve.Model, v2 REST, binary tensors):
`python bench/peers/kserve_model.py --http_port PORT --workers 2 --enable_grpc false` in its venv,
the repository root on PYTHONPATH; bound to 127.0.0.1 (see _on_loopback). Inputs q, k, v FP32,
parameter `causal`; outputs `out` and `weights` (computed only when asked for)."""

from __future__ import annotations

import os

# One BLAS thread per worker process, as this service's workers have (set before numpy loads).
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

import kserve  # noqa: E402  (after the BLAS setting)
import uvicorn  # noqa: E402
from kserve import InferOutput, InferRequest, InferResponse  # noqa: E402

from service import core  # noqa: E402

_uvicorn_config = uvicorn.Config.__init__


def _on_loopback(self, *args, **kwargs) -> None:
    """KServe 0.21's REST server passes uvicorn host="0.0.0.0" and has no flag for it: every
    interface. The benchmark keeps every socket on loopback, so the host is replaced here."""
    _uvicorn_config(self, *args, **{**kwargs, "host": "127.0.0.1"})


uvicorn.Config.__init__ = _on_loopback

OUTPUTS = ("out", "weights")


class AttentionModel(kserve.Model):
    """Scaled dot-product attention, computed by this service's numeric core."""

    def __init__(self, name: str):
        super().__init__(name)
        self.ready = False

    def load(self) -> bool:
        self.ready = True  # nothing to load: the model is a function
        return self.ready

    def predict(self, payload: InferRequest, headers: dict | None = None, response_headers: dict | None = None) -> InferResponse:
        q, k, v = (payload.get_input_by_name(name).as_numpy() for name in ("q", "k", "v"))
        params = payload.parameters or {}
        wanted = [o.name for o in payload.request_outputs] if payload.request_outputs else list(OUTPUTS)
        out, weights = core.attention(q, k, v, causal=bool(params.get("causal", False)), return_weights="weights" in wanted)
        arrays = {"out": out, "weights": weights}
        # The arrays themselves: InferResponse encodes each as the request asked (binary or JSON,
        # per output or request-wide) when it writes the response, once.
        outputs = [InferOutput(name, list(arrays[name].shape), "FP32", data=arrays[name]) for name in wanted]
        return InferResponse(
            payload.id,
            self.name,
            outputs,
            use_binary_outputs=payload.use_binary_outputs,
            requested_outputs=payload.request_outputs,
        )


if __name__ == "__main__":
    model = AttentionModel("attention")
    model.load()
    kserve.ModelServer().start([model])  # port, workers, gRPC: from the command line (kserve's parser)
