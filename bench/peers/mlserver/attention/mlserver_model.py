"""The attention model as an MLServer custom runtime (an MLModel, v2 REST, JSON tensors: its REST
server has no binary extension): `mlserver start bench/peers/mlserver` in its venv, the repository
root on PYTHONPATH; settings.json sets parallel_workers, peers/__main__.py the ports (MLSERVER_*).
Inputs q, k, v FP32, parameter `causal`; outputs `out` and `weights` (computed only when asked for)."""

from __future__ import annotations

import os

# One BLAS thread per inference worker process, as this service's workers have (before numpy loads).
from service.config import ONE_BLAS_THREAD  # noqa: E402  (stdlib only: numpy is not loaded yet)

for _var, _count in ONE_BLAS_THREAD.items():
    os.environ.setdefault(_var, _count)

from mlserver import MLModel  # noqa: E402  (after the BLAS setting)
from mlserver.codecs import NumpyCodec  # noqa: E402
from mlserver.types import InferenceRequest, InferenceResponse  # noqa: E402

from service import core  # noqa: E402

OUTPUTS = ("out", "weights")


class AttentionRuntime(MLModel):
    """Scaled dot-product attention, computed by this service's numeric core."""

    async def load(self) -> bool:
        return True  # nothing to load: the model is a function

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        causal = bool(getattr(payload.parameters, "causal", False))
        wanted = [o.name for o in payload.outputs] if payload.outputs else list(OUTPUTS)
        out, weights = core.attention(inputs["q"], inputs["k"], inputs["v"], causal=causal, return_weights="weights" in wanted)
        arrays = {"out": out, "weights": weights}
        return InferenceResponse(
            id=payload.id,
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(name, arrays[name]) for name in wanted],
        )
