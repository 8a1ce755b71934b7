"""Replicas by name: the URLs of every address a host name resolves to. A Kubernetes headless
Service's name resolves to each ready pod's own address, so that a client can keep to one pod
(a session lives in the memory of the pod that made it)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit, urlunsplit


def replicas(url: str) -> list[str]:
    """url with its host replaced by each address the host resolves to, sorted (so that clients
    made at the same time list them in the same order); the scheme, port and path kept. For
    AttentionClient(replicas("http://attention-service-replicas:8000")). Resolved once: pods
    that start later are not in the list (make the client again to see them)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http://host[:port][/prefix] or https://..., not {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{parts.hostname!r} does not resolve: {exc}") from None
    addresses = sorted({str(info[4][0]) for info in infos})
    return [urlunsplit((parts.scheme, f"[{a}]:{port}" if ":" in a else f"{a}:{port}", parts.path, "", "")) for a in addresses]
