"""`python -m attention_client.loadtest`, as `attention-loadtest`: see cli.py."""

from .cli import main

raise SystemExit(main())
