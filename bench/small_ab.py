"""A T=64 request's CPU on two checkouts side by side in one run: bench.small_profile's figure
(T=64 b64 POST /attention without weights, in-process through Flask's test client, CPU per
request the least of 15 x 100) in this checkout and in another, alternating, medians.

    python -m bench.small_ab ../main            # 5 rounds of each, ~1-2 min
    python -m bench.small_ab ../main --rounds 9

Each run is a fresh process started in its checkout (its own service, core and schemas), so
the two share the machine's noise round by round. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from .server import ROOT

LINE = re.compile(r"/healthz (\d+) us, T=64 b64 /attention (\d+) us")


def one(tree: Path) -> tuple[int, int]:
    """(/healthz, /attention) CPU us per request of one bench.small_profile run in tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_")}
    env["PYTHONPATH"] = str(tree)
    out = subprocess.run([sys.executable, "-m", "bench.small_profile"], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    found = LINE.search(out.stdout)
    if not found:
        sys.exit(f"no figure from {tree}:\n{out.stdout}\n{out.stderr}")
    return int(found.group(1)), int(found.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline", type=Path, help="another checkout (say a git worktree of main)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    runs: dict[str, list[tuple[int, int]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
            runs[name].append(one(tree))
            print(f"round {r + 1} {name:8s} /healthz {runs[name][-1][0]} us, /attention {runs[name][-1][1]} us", flush=True)
    print(f"\n{args.rounds} rounds, medians; load average {os.getloadavg()[0]:.1f}\n")
    print("| checkout | /healthz CPU us | T=64 /attention CPU us | beyond /healthz |\n|---|---|---|---|")
    med = {name: [statistics.median(x[i] for x in rs) for i in (0, 1)] for name, rs in runs.items()}
    for name, (h, a) in med.items():
        print(f"| {name} | {h:.0f} | {a:.0f} | {a - h:.0f} |")
    print(f"\nthis / baseline, /attention: {med['this'][1] / med['baseline'][1]:.3f}")


if __name__ == "__main__":
    main()
