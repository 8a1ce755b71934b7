"""The latency-limit sweep: T x concurrency against POST /attention -> table, CSV, plot.

    attention-loadtest --url http://127.0.0.1:8000 --T 256..4096 --concurrency 1,2 --slo-ms 200

Modules, in the order data flows:

    payload.py    the request body for one T, encoded once per cell (numpy + orjson + pybase64)
    transport.py  one timed POST, the Server-Timing header, reachability checks
    cell.py       one cell: workers in closed or open loop, summarized into a CellResult
    sweep.py      the T x concurrency loop, early stop, progress
    fit.py        latency vs T fits and the SLO search (pure numpy)
    report.py     report.md, results.csv, latency.png
    cli.py        argument parsing and exit codes
"""
