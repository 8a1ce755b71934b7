"""The peers' venvs, one per peer from bench/peers/requirements-NAME.txt, in $BENCH_PEERS_DIR
(default .peers/, gitignored): `python -m bench.peers.venvs` builds them. A venv is reinstalled
when its requirements file changed since the last install (a stamp holds its hash)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEERS = ("kserve", "mlserver", "litserve", "rayserve", "bentoml")


def peers_dir() -> Path:
    return Path(os.environ.get("BENCH_PEERS_DIR") or ROOT / ".peers")


def ensure(name: str) -> Path:
    """The Python of peer `name`'s venv, built or updated first if its requirements changed."""
    requirements = HERE / f"requirements-{name}.txt"
    venv = peers_dir() / name
    python, stamp = venv / "bin" / "python", venv / ".requirements-sha256"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return python
    print(f"building the {name} venv in {venv} from {requirements.name} (a few minutes, once)", file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
    stamp.write_text(digest + "\n")
    return python


if __name__ == "__main__":
    for peer in PEERS:
        print(peer, ensure(peer))
