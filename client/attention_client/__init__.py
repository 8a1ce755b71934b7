"""A Python client for the attention service: numpy in, numpy out.

    from attention_client import AttentionClient
    with AttentionClient("http://127.0.0.1:8000") as api:
        out, weights = api.attention(q, k, v, causal=True)

Requests over the server's advertised /limits are split along the leading axes, query rows and
key ranges, sent concurrently (over several replicas when given a list of URLs) and merged exactly
by their attention states (merge_states); the result is the one a single request would give."""

__version__ = "2.0.0"  # the one version: the distribution's (read by the build), the User-Agent's and --version's

from ._client import AttentionClient, AttentionError  # noqa: E402  (after the version, which _client reads)
from ._replicas import replicas  # noqa: E402
from ._sessions import Session  # noqa: E402
from ._states import merge_states  # noqa: E402
from ._wire import encode_tensor  # noqa: E402

__all__ = ["AttentionClient", "AttentionError", "Session", "__version__", "encode_tensor", "merge_states", "replicas"]
