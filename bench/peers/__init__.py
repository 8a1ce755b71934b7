"""The peers in the benchmark: this service against KServe's Python model server and MLServer.

    make bench-peers          # = python -m bench.peers; builds the peers' venvs the first time

Each peer serves the same attention (this repository's service.core, numpy only, one BLAS thread
per worker process) in its own virtual environment (venvs.py), from a model class of our own:
kserve_model.py (a kserve.Model) and mlserver/attention/mlserver_model.py (an MLServer MLModel).
__main__.py starts the three servers on free loopback ports and measures them with tritonclient."""
