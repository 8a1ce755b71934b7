# The attention service: gunicorn serving the Flask app on 0.0.0.0:8000 as an unprivileged user.
#
#   podman build --format docker -t attention-service .      (or: docker build -t attention-service .)
#   podman run --rm -p 127.0.0.1:8000:8000 attention-service
#
# The base is pinned by tag only. Where a registry is reachable, pin the digest as well
# (FROM python:3.11-slim@sha256:...); this project's machines reach no container registry, so
# the digest cannot be looked up there. On such a machine a local stand-in tagged python:3.11-slim,
# built from Debian bookworm's python3 (3.11, at /usr/bin rather than /usr/local/bin, both on
# PATH), serves, and `podman build --pull=never` uses it.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HOST=0.0.0.0 \
    PORT=8000

# A fixed numeric UID, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin app

WORKDIR /app

# Dependencies in their own layer: a code change does not reinstall them.
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

# Code owned by root and compiled now: the app user cannot change it, and a read-only root
# filesystem costs nothing at start-up.
COPY service/ service/
COPY schemas/ schemas/
COPY deploy/gunicorn.conf.py deploy/
RUN python -m compileall -q service schemas deploy

USER 10001
EXPOSE 8000

# Exec form, and python rather than curl (the slim image has no curl). PORT is read inside.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PORT', '8000'), timeout=2)"]

CMD ["python", "-m", "service"]
