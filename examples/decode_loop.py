"""A GPT decoding greedily, its attention on the attention service: one session per layer and
sequence holds that layer's keys and values, so each step sends one token's q, k, v (not the
whole cache) and gets back one token's attention; several sequences step together in one request
per layer (api.attention_sessions). The same loop run in-process, numpy over KV caches of its
own, gives the same tokens and logits.

The model is tiny and random (no weights to download): token and position embeddings, `layers`
pre-LayerNorm blocks (x -> LayerNorm -> Q, K, V projections, grouped-query attention, W_o, a
residual; then a GELU MLP, a residual), a final LayerNorm and the unembedding.

    python -m examples.decode_loop --url http://127.0.0.1:8000 --steps 16 --batch 3
    python -m examples.decode_loop --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --shards 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import numpy as np

from attention_client import AttentionClient

# attend(layer, seqs, q (B, H, t, hd), k (B, Hkv, t, hd), v (B, Hkv, t, hd)) -> out (B, H, t, hd):
# the new tokens of sequences seqs (B of them), attending over every token of their sequence so
# far (theirs included), causal.
Attend = Callable[[int, Sequence[int], np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class TinyGPT:
    """Random weights, float64. Shapes: B sequences, t tokens, D model width, H heads of hd, Hkv key/value heads."""

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

    def logits(self, tokens: np.ndarray, start: Sequence[int], attend: Attend, seqs: Sequence[int]) -> np.ndarray:
        """The logits (B, t, vocab) of tokens (B, t), sequence b's at positions start[b].., each
        layer's attention by attend."""
        B, t = tokens.shape
        x = self.embed[tokens] + np.stack([self.position[s : s + t] for s in start])  # (B, t, D)

        def heads(a: np.ndarray, n: int) -> np.ndarray:  # (B, t, n * hd) -> (B, n, t, hd)
            return a.reshape(B, t, n, self.head_dim).transpose(0, 2, 1, 3)

        for layer, b in enumerate(self.blocks):
            h = _norm(x)
            q, k, v = heads(h @ b["wq"], self.heads), heads(h @ b["wk"], self.kv_heads), heads(h @ b["wv"], self.kv_heads)
            a = attend(layer, seqs, q, k, v)  # (B, H, t, hd)
            x = x + a.transpose(0, 2, 1, 3).reshape(B, t, -1) @ b["wo"]
            x = x + _gelu(_norm(x) @ b["w1"]) @ b["w2"]
        return _norm(x) @ self.unembed


def _norm(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def generate(model: TinyGPT, prompts: list[list[int]], steps: int, attend: Attend) -> tuple[list[list[int]], np.ndarray]:
    """Greedy decoding of several sequences: each prompt in one step of its own (prefill: their
    lengths differ), then one token a step for all of them at once. Returns each sequence's new
    tokens and the logits (B, steps, vocab) each was chosen from."""
    last = np.stack([model.logits(np.array([p]), [0], attend, [b])[0, -1] for b, p in enumerate(prompts)])  # (B, vocab)
    tokens, chosen_from = [], []
    for step in range(steps):
        tokens.append(last.argmax(-1))
        chosen_from.append(last)
        positions = [len(p) + step for p in prompts]
        last = model.logits(tokens[-1][:, None], positions, attend, range(len(prompts)))[:, -1]
    return np.stack(tokens, 1).tolist(), np.stack(chosen_from, 1)


def in_process(model: TinyGPT, n: int) -> Attend:
    """The attention in numpy, over a KV cache per layer and sequence: the loop with nothing on the network."""
    empty = np.zeros((model.kv_heads, 0, model.head_dim))
    cache = [[(empty, empty) for _ in range(n)] for _ in range(model.layers)]
    group = model.heads // model.kv_heads

    def one(layer: int, b: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        K, V = (np.concatenate([c, new], axis=1) for c, new in zip(cache[layer][b], (k, v), strict=True))
        cache[layer][b] = (K, V)
        K, V = np.repeat(K, group, axis=0), np.repeat(V, group, axis=0)  # query head h reads key/value head h // group
        t, S = q.shape[1], K.shape[1]
        scores = q @ K.transpose(0, 2, 1) / math.sqrt(model.head_dim)  # (H, t, S)
        scores = np.where(np.arange(S)[None, :] <= np.arange(t)[:, None] + S - t, scores, -np.inf)  # causal, aligned at the end
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return (weights / weights.sum(-1, keepdims=True)) @ V

    def attend(layer, seqs, q, k, v):
        return np.stack([one(layer, b, q[i], k[i], v[i]) for i, b in enumerate(seqs)])

    return attend


@contextmanager
def on_the_server(model: TinyGPT, api: AttentionClient, n: int, dtype: str = "float32", **session_options) -> Iterator[Attend]:
    """The attention on the server: a session per layer and sequence, deleted at the end. One
    sequence's step is its session's; several step together (api.attention_sessions)."""
    with ExitStack() as stack:
        shape = {"heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim, "dtype": dtype}
        sessions = [[stack.enter_context(api.session(**shape, **session_options)) for _ in range(n)] for _ in range(model.layers)]

        def attend(layer, seqs, q, k, v):
            if len(seqs) == 1:  # the new tokens appended, then their attention
                return sessions[layer][seqs[0]].attention(q[0], k[0], v[0])[None].astype(np.float64)
            return api.attention_sessions([sessions[layer][b] for b in seqs], q, k, v).astype(np.float64)

        yield attend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", help="a replica's URL (repeat for several); default http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (prompts of different lengths)")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--shards", type=int, default=1, help="spread each session's keys over up to this many replicas")
    parser.add_argument("--max-tokens", type=int, default=None, help="each session's (segment's) most keys")
    args = parser.parse_args(argv)
    model = TinyGPT()
    prompts = [[1 + b, 2, 3, 4, 5, 6, 7, 8][: 8 - b % 4] for b in range(args.batch)]
    want, want_logits = generate(model, prompts, args.steps, in_process(model, len(prompts)))
    options = {"shards": args.shards, "max_tokens": args.max_tokens}
    with (
        AttentionClient(args.url or ["http://127.0.0.1:8000"]) as api,
        on_the_server(model, api, len(prompts), args.dtype, **options) as attend,
    ):
        got, logits = generate(model, prompts, args.steps, attend)
    for b, prompt in enumerate(prompts):
        print(f"prompt {prompt}: in-process {want[b]}")
        print(f"{' ' * len(f'prompt {prompt}:')} sessions   {got[b]}")
    print(f"same tokens: {got == want}; largest logit difference: {np.abs(logits - want_logits).max():.3g}")


if __name__ == "__main__":
    main()
