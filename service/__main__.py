"""`python -m service`: serve with gunicorn, configured by deploy/gunicorn.conf.py."""

import os
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "deploy" / "gunicorn.conf.py"


def main() -> None:
    argv = [sys.executable, "-m", "gunicorn", "--config", str(CONF), "service:create_app()"]
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
