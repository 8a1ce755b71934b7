"""A Python client for the attention service: numpy in, numpy out.

    from client import AttentionClient
    with AttentionClient("http://127.0.0.1:8000") as api:
        out, weights = api.attention(q, k, v, causal=True)

Requests over the server's advertised /limits are split along the leading axes and query rows,
sent concurrently and reassembled; the result is the one a single request would give."""

from ._client import AttentionClient, AttentionError
from ._wire import encode_tensor

__all__ = ["AttentionClient", "AttentionError", "encode_tensor"]
