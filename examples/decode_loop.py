"""A GPT decoding greedily, its attention on the attention service: one session per layer holds
that layer's keys and values, so each step sends one token's q, k, v (not the whole cache) and
gets back one token's attention. The same loop run in-process, numpy over a KV cache of its own,
gives the same tokens and logits.

The model is tiny and random (no weights to download): token and position embeddings, `layers`
pre-LayerNorm blocks (x -> LayerNorm -> Q, K, V projections, grouped-query attention, W_o, a
residual; then a GELU MLP, a residual), a final LayerNorm and the unembedding.

    python -m examples.decode_loop --url http://127.0.0.1:8000 --steps 16
    python -m examples.decode_loop --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --shards 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import numpy as np

from attention_client import AttentionClient

# attend(layer, q (H, t, hd), k (Hkv, t, hd), v (Hkv, t, hd)) -> out (H, t, hd): the t new tokens'
# attention over every token so far (theirs included), causal.
Attend = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class TinyGPT:
    """Random weights, float64. Shapes: t tokens, D model width, H heads of hd, Hkv key/value heads."""

    def __init__(
        self, vocab: int = 64, width: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2, max_len: int = 256, seed: int = 0
    ):
        rng = np.random.default_rng(seed)
        self.heads, self.kv_heads, self.head_dim, self.layers = heads, kv_heads, width // heads, layers
        D, hd = width, width // heads

        def w(*shape):
            return rng.standard_normal(shape) / math.sqrt(shape[0])

        self.embed, self.position, self.unembed = rng.standard_normal((vocab, D)), 0.1 * rng.standard_normal((max_len, D)), w(D, vocab)
        self.blocks = [
            {
                "wq": w(D, heads * hd),
                "wk": w(D, kv_heads * hd),
                "wv": w(D, kv_heads * hd),
                "wo": w(heads * hd, D),
                "w1": w(D, 4 * D),
                "w2": w(4 * D, D),
            }
            for _ in range(layers)
        ]

    def logits(self, tokens: list[int], start: int, attend: Attend) -> np.ndarray:
        """The logits (t, vocab) of the tokens at positions start.., each layer's attention by attend."""
        x = self.embed[tokens] + self.position[start : start + len(tokens)]  # (t, D)
        for layer, b in enumerate(self.blocks):
            h = _norm(x)
            t = len(tokens)
            q = (h @ b["wq"]).reshape(t, self.heads, self.head_dim).transpose(1, 0, 2)  # (H, t, hd)
            k = (h @ b["wk"]).reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)  # (Hkv, t, hd)
            v = (h @ b["wv"]).reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            a = attend(layer, q, k, v)  # (H, t, hd)
            x = x + a.transpose(1, 0, 2).reshape(t, -1) @ b["wo"]
            x = x + _gelu(_norm(x) @ b["w1"]) @ b["w2"]
        return _norm(x) @ self.unembed


def _norm(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def generate(model: TinyGPT, prompt: list[int], steps: int, attend: Attend) -> tuple[list[int], np.ndarray]:
    """Greedy decoding: the prompt in one step (prefill), then one token a step. Returns the new
    tokens and the logits (steps, vocab) each was chosen from."""
    logits = model.logits(prompt, 0, attend)[-1]
    tokens, chosen_from = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        chosen_from.append(logits)
        logits = model.logits(tokens[-1:], len(prompt) + len(tokens) - 1, attend)[-1]
    return tokens, np.stack(chosen_from)


def in_process(model: TinyGPT) -> Attend:
    """The attention in numpy, over a KV cache per layer: the loop with nothing on the network."""
    cache = [(np.zeros((model.kv_heads, 0, model.head_dim)),) * 2 for _ in range(model.layers)]

    def attend(layer, q, k, v):
        K, V = (np.concatenate([c, new], axis=1) for c, new in zip(cache[layer], (k, v), strict=True))
        cache[layer] = (K, V)
        group = model.heads // model.kv_heads
        K, V = np.repeat(K, group, axis=0), np.repeat(V, group, axis=0)  # query head h reads key/value head h // group
        t, S = q.shape[1], K.shape[1]
        scores = q @ K.transpose(0, 2, 1) / math.sqrt(model.head_dim)  # (H, t, S)
        scores = np.where(np.arange(S)[None, :] <= np.arange(t)[:, None] + S - t, scores, -np.inf)  # causal, aligned at the end
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return (weights / weights.sum(-1, keepdims=True)) @ V

    return attend


@contextmanager
def on_the_server(model: TinyGPT, api: AttentionClient, dtype: str = "float32", **session_options) -> Iterator[Attend]:
    """The attention on the server: one session per layer, deleted at the end."""
    with ExitStack() as stack:
        sessions = [
            stack.enter_context(
                api.session(heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=dtype, **session_options)
            )
            for _ in range(model.layers)
        ]

        def attend(layer, q, k, v):
            return sessions[layer].attention(q, k, v).astype(np.float64)  # the new tokens appended, then their attention

        yield attend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", help="a replica's URL (repeat for several); default http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--shards", type=int, default=1, help="spread each layer's keys over up to this many replicas")
    parser.add_argument("--max-tokens", type=int, default=None, help="each session's (segment's) most keys")
    args = parser.parse_args(argv)
    model, prompt = TinyGPT(), [1, 2, 3, 4, 5, 6, 7, 8]
    want, want_logits = generate(model, prompt, args.steps, in_process(model))
    with (
        AttentionClient(args.url or ["http://127.0.0.1:8000"]) as api,
        on_the_server(model, api, args.dtype, shards=args.shards, max_tokens=args.max_tokens) as attend,
    ):
        got, logits = generate(model, prompt, args.steps, attend)
    print("in-process:", want)
    print("sessions:  ", got)
    print(f"same tokens: {got == want}; largest logit difference: {np.abs(logits - want_logits).max():.3g}")


if __name__ == "__main__":
    main()
