"""`attention-client` (or `python -m attention_client`): the attention service from the shell, for numpy users.

    attention-client --url http://127.0.0.1:8000 attention q.npy k.npy v.npy [--mask m.npy] [--causal] -o result.npz
    attention-client --url URL attention q.npy k.npy v.npy --enable-gqa --window 256,0 --bias b.npy \
        --alibi-slopes s.npy --average-weights --weights-dtype float16 -o result.npz
    attention-client --url URL mha x.npy wq.npy wk.npy wv.npy [wo.npy] --heads 8 [--kv-heads 2 --scale 1 --window 256,0] -o result.npz
    attention-client --url A --url B attention q.npy k.npy v.npy --causal --no-weights --lse --key-chunks 4 -o result.npz
    attention-client --url URL limits
    attention-client --url URL ready

Tensors travel as raw bytes both ways (the /v2 door's binary extension); --wire json sends b64 JSON
to the native endpoints instead.

Several --url: replicas of one service, over which a request past one server's limits (or split by
--key-chunks) is spread, block by block. The result file holds `out`, unless --no-weights
`weights`, and with --lse `lse`. Exit status: 0 on success, 1 when
the service refuses (its status, code and message on stderr), 2 for bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from . import __version__
from ._client import AttentionClient, AttentionError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attention-client", description="Call the attention service with .npy files.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--url",
        action="append",
        help="service base URL; repeat it for replicas (default $ATTN_URL or http://127.0.0.1:8000)",
    )
    p.add_argument("--api-key", default=os.environ.get("ATTN_API_KEY"), help="bearer key (default $ATTN_API_KEY)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    p.add_argument("--retries", type=int, default=3, help="retries on connection errors and 503")
    p.add_argument(
        "--wire",
        choices=["binary", "json"],
        default="binary",
        help="binary: raw tensors both ways at /v2 (default, the fastest); json: b64 JSON at the native endpoints",
    )
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("attention", help="scaled dot-product attention")
    a.add_argument("q")
    a.add_argument("k")
    a.add_argument("v")
    a.add_argument("--mask", help=".npy bool mask broadcasting to (..., T, S); true = attend")
    a.add_argument("--key-lengths", help=".npy ints broadcasting to the leading axes")
    a.add_argument(
        "--causal", nargs="?", const="top_left", choices=["top_left", "bottom_right"], help="causal mask (default alignment top_left)"
    )
    a.add_argument("--scale", type=float)
    a.add_argument("--enable-gqa", action="store_true", help="k and v may have fewer heads (axis -3) than q, dividing them")
    a.add_argument("--bias", help=".npy floats broadcasting to (..., T, S), added to the scaled scores")
    a.add_argument("--alibi-slopes", help=".npy floats broadcasting to the leading axes: ALiBi")
    a.add_argument("--average-weights", action="store_true", help="weights averaged over the heads axis -3")
    a.add_argument("--lse", action="store_true", help="also save lse (..., T), each row's log-sum-exp of its scores")
    a.add_argument("--key-chunks", type=int, help="split the keys into this many ranges, merged exactly by their lse")

    m = sub.add_parser("mha", help="multi-head self-attention with projections")
    for name in ("x", "wq", "wk", "wv"):
        m.add_argument(name)
    m.add_argument("wo", nargs="?", help="output projection (heads*dv, d_out); omitted: the heads concatenated")
    m.add_argument("--heads", type=int, required=True)
    m.add_argument("--kv-heads", type=int, help="key/value heads dividing --heads (grouped-query attention)")
    m.add_argument("--scale", type=float, help="default 1/sqrt(dk)")
    m.add_argument("--no-causal", dest="causal", action="store_false")

    for cmd in (a, m):
        cmd.add_argument(
            "--window", type=_window, help="LEFT,RIGHT: sliding window (FlashAttention's window_size; -1 unbounded: write --window=-1,0)"
        )
        cmd.add_argument("--weights-dtype", choices=["float16", "float32", "float64"], help="precision of the returned weights")
        cmd.add_argument("--dtype", choices=["float32", "float64"])
        cmd.add_argument("--no-weights", dest="weights", action="store_false", help="do not compute or save the weights")
        cmd.add_argument("-o", "--output", required=True, help="result .npz (out, weights)")

    sub.add_parser("limits", help="print the limits in force")
    sub.add_parser("ready", help="exit 0 if the service is ready, 1 if not")
    return p


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (two integers, e.g. 256,0)") from None
    return left, right


def _printable(text) -> str:
    """text with its control (and other unprintable) characters escaped, as \x1b: the server's
    words go to the user's terminal, and escape sequences there would drive it."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))


def _load_if(path: str | None) -> np.ndarray | None:
    return None if path is None else _load(path)


def _load(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        urls = args.url or [os.environ.get("ATTN_URL", "http://127.0.0.1:8000")]
        api = AttentionClient(urls, timeout=args.timeout, retries=args.retries, api_key=args.api_key, wire=args.wire)
    except ValueError as exc:  # a setting that cannot work: a usage error, as an unreadable file is
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with api:
        try:
            if args.command == "ready":
                ok = api.ready()
                print("ready" if ok else "not ready")
                return 0 if ok else 1
            if args.command == "limits":
                print(json.dumps(api.limits(), indent=2))
                return 0
            if args.command == "attention":
                out, weights, *lse = api.attention(
                    _load(args.q),
                    _load(args.k),
                    _load(args.v),
                    _load_if(args.mask),
                    causal=args.causal or False,
                    key_lengths=_load_if(args.key_lengths),
                    scale=args.scale,
                    return_weights=args.weights,
                    dtype=args.dtype,
                    enable_gqa=args.enable_gqa,
                    window=args.window,
                    bias=_load_if(args.bias),
                    alibi_slopes=_load_if(args.alibi_slopes),
                    average_weights=args.average_weights,
                    weights_dtype=args.weights_dtype,
                    return_lse=args.lse,
                    key_chunks=args.key_chunks,
                )
            else:
                lse = []
                out, weights = api.mha(
                    _load(args.x),
                    _load(args.wq),
                    _load(args.wk),
                    _load(args.wv),
                    _load_if(args.wo),
                    args.heads,
                    causal=args.causal,
                    return_weights=args.weights,
                    dtype=args.dtype,
                    scale=args.scale,
                    kv_heads=args.kv_heads,
                    window=args.window,
                    weights_dtype=args.weights_dtype,
                )
        except AttentionError as err:
            print(f"error: {err.status or '-'} {_printable(err.code)}: {_printable(err.message)}", file=sys.stderr)
            return 1
    arrays: dict[str, Any] = {"out": out, **({} if weights is None else {"weights": weights}), **({"lse": lse[0]} if lse else {})}
    np.savez(args.output, **arrays)
    print(f"wrote {args.output}: " + ", ".join(f"{name} {list(a.shape)}" for name, a in arrays.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
