"""Operations endpoints: liveness, readiness, the limits in force."""
from __future__ import annotations

from flask import Blueprint, current_app

from .config import VERSION
from .http import json_response

bp = Blueprint("ops", __name__)


@bp.get("/healthz")
def healthz():
    """200 while the process lives."""
    return json_response({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """200 when this worker can serve, 503 while starting or draining."""
    ready = current_app.extensions["attention.state"]["ready"]
    return json_response({"status": "ready" if ready else "starting"}, status=200 if ready else 503)


@bp.get("/limits")
def limits():
    """The limits in force, the default dtype, the cost model's coefficients, the version."""
    settings = current_app.extensions["attention.settings"]
    return json_response({
        **settings.limits(),
        "cost_model": current_app.extensions["attention.cost"].coefficients(),
        "version": VERSION,
    })
