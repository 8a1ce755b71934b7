"""`make bench-peers`: this service against the servers a user would pick instead, each serving
service.core from a model of our own here (kserve_model.py, mlserver/, litserve_model.py,
rayserve_model.py, bentoml_service.py) in its own venv; __main__.py builds the venvs and measures them."""
