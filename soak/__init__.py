"""The soak: closed-loop mixed traffic against a real server for a bounded time, checking that it
neither fails, lies nor grows. `python -m soak --help`; `make soak` runs it for 10 minutes.

traffic.py   the requests: valid ones across T and encodings (each answer checked against the
             in-process core), everyday invalid ones, and clients that abandon an upload or a
             download midway (raw sockets)
resources.py the server's workers: resident memory and open file descriptors, from /proc
run.py       start the server (or use --url), run the clients, sample, check, summarise
"""
