"""Operations endpoints (liveness, readiness, the limits in force) and the worker's lifecycle:
warm-up before it is ready, draining after SIGTERM. /metrics lives in metrics.py."""

from __future__ import annotations

import logging
import threading

from flask import Blueprint, Flask

from service.admission import charge
from service.config import VERSION

from . import metrics
from .context import services
from .http import json_response

bp = Blueprint("ops", __name__)
log = logging.getLogger("service")

WARMUP_BUDGET_S = 1.5  # the cost model's calibration stops after this much time


@bp.get("/healthz")
def healthz():
    """200 while the process lives."""
    return json_response({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """200 when this worker can serve, 503 while starting (warm-up) or draining (SIGTERM)."""
    status = services().readiness()
    return json_response({"status": status}, status=200 if status == "ready" else 503)


@bp.get("/limits")
def limits():
    """The limits in force (server_slots: the compute requests the whole server admits at once), the
    admission policy, the default dtype, the cost model's coefficients, the version."""
    svc = services()
    return json_response(
        {
            **svc.settings.limits(),
            "server_slots": svc.admission.server_slots(),
            "sessions": svc.sessions.stats(),
            "admission": {**svc.admission.policy(), "parse_charge": charge.POLICY},
            "cost_model": svc.cost.coefficients(),
            "version": VERSION,
        }
    )


def warm_up(app: Flask) -> None:
    """Calibrate the cost model on this machine, then report ready. Never raises: a failed
    calibration leaves the default coefficients, which still serve."""
    try:
        services(app).cost.calibrate(WARMUP_BUDGET_S)
    except Exception:
        log.exception("cost model calibration failed; serving with the default coefficients")
    services(app).ready = True
    metrics.READY.set(1)


def start_warm_up(app: Flask) -> threading.Thread | None:
    """Warm up in the background, so /healthz answers (and /readyz says 503) meanwhile. None if
    the settings ask for no warm-up (the app is ready at once)."""
    if services(app).ready:
        return None
    thread = threading.Thread(target=warm_up, args=(app,), name="warm-up", daemon=True)
    thread.start()
    return thread


def drain(app: Flask) -> None:
    """From now on /readyz says 503; requests in flight finish (the server stops accepting)."""
    services(app).admission.retire()  # the other workers send no keep-alive clients this way (admission's census)
    services(app).draining = True
    metrics.READY.set(0)
