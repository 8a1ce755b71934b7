"""The web layer: Flask blueprints for the two front doors (the native API in api.py, the Open
Inference Protocol in kserve.py), operations, docs, admission, metrics and the cost model; the
one mapping of error codes to HTTP statuses (errors.py). create_app() is in app.py."""

from .app import create_app

__all__ = ["create_app"]
