"""The playground: GET /playground, a page that sends /attention and /mha requests from presets
or pasted tensors and draws the returned weights as a heatmap per head, and steps a small session
(/sessions) one token at a time, its weights growing by a column per step. Plain HTML, CSS and JS
from service/web/static/playground/, served by this blueprint (no CDN, no build step); the page
talks to the API with relative URLs only, so it also works behind a path prefix."""

from __future__ import annotations

from flask import Blueprint, Response

bp = Blueprint("playground", __name__, url_prefix="/playground", static_folder="static/playground", static_url_path="/static")


@bp.get("")
def page() -> Response:
    """The page itself; its script and style are served from /playground/static/."""
    return bp.send_static_file("index.html")
