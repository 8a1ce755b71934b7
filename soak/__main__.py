"""`python -m soak`: see soak/run.py."""

from .run import main

if __name__ == "__main__":
    raise SystemExit(main())
