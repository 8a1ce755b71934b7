"""The peers in the benchmark: this service against the servers a user would pick instead.

    make bench-peers          # = python -m bench peers; builds the peers' venvs the first time

Each peer serves the same attention (this repository's service.core, numpy only, one BLAS thread
per worker process) in its own virtual environment (venvs.py), from a model of our own:
kserve_model.py (a kserve.Model), mlserver/attention/mlserver_model.py (an MLServer MLModel),
litserve_model.py (a LitServe LitAPI), rayserve_model.py (a Ray Serve deployment) and
bentoml_service.py (a BentoML service); the last three read and answer the native door's b64
JSON body with b64_body.py. __main__.py starts the servers on free loopback ports and measures
them side by side."""
