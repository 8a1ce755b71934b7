"""`python -m loadtest`: see cli.py."""

from loadtest.cli import main

raise SystemExit(main())
