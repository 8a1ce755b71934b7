"""The peers' venvs, one per peer from bench/peers/requirements-NAME.txt, in $BENCH_PEERS_DIR
(default .peers/, gitignored): `python -m bench.peers.venvs` builds them. A venv is reinstalled
when its requirements file changed since the last install (a stamp holds its hash)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from bench.common import venv

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEERS = ("kserve", "mlserver", "litserve", "rayserve", "bentoml")


def peers_dir() -> Path:
    return Path(os.environ.get("BENCH_PEERS_DIR") or ROOT / ".peers")


def ensure(name: str) -> Path:
    """The Python of peer `name`'s venv, built or updated first if its requirements changed."""
    requirements = HERE / f"requirements-{name}.txt"
    return venv(peers_dir() / name, ["-r", str(requirements)], hashlib.sha256(requirements.read_bytes()).hexdigest())


if __name__ == "__main__":
    for peer in PEERS:
        print(peer, ensure(peer))
