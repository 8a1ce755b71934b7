"""`python -m service`: serve with gunicorn, configured by deploy/gunicorn.conf.py."""

import os
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "deploy" / "gunicorn.conf.py"

# glibc reads its tunables once, when a process starts: gunicorn (and the workers it forks) get them
# from the environment of the exec below. hugetlb=1: malloc asks for transparent huge pages
# (madvise) for the blocks it maps, which the worker's allocator settings make every buffer of
# 4 MiB or more (deploy/gunicorn.conf.py, _tune_malloc): a request's body, its decoded tensors,
# the weights and the response's text then fault in 2 MiB pages, not 4 KiB ones, far fewer faults
# for a large request (git log -- bench/large_requests.py). Where the kernel has transparent huge pages
# off, or glibc is older than 2.35 or not glibc, it does nothing. An operator's own
# glibc.malloc.hugetlb in GLIBC_TUNABLES wins.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def environment(env: dict[str, str]) -> dict[str, str]:
    """The server's environment: env with HUGE_PAGES_TUNABLE added to GLIBC_TUNABLES unless it
    names glibc.malloc.hugetlb already."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return env
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE}


def main() -> None:
    argv = [sys.executable, "-m", "gunicorn", "--config", str(CONF), "service.web:create_app()"]
    os.execve(sys.executable, argv, environment(dict(os.environ)))


if __name__ == "__main__":
    main()
