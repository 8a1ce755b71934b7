"""Optional API keys: with ATTN_API_KEYS set, the compute endpoints need Authorization: Bearer
<key> (compared in constant time); health, readiness, limits and metrics stay open."""

from __future__ import annotations

import hmac
from dataclasses import replace

import pytest

from service.config import Settings
from service.web import auth, create_app

from .helpers import WORKED

KEYS = ("k-one", "k-two")
MHA = {"x": [[1.0, 0.0], [0.0, 1.0]], **{w: [[1.0, 0.0], [0.0, 1.0]] for w in ("wq", "wk", "wv", "wo")}, "heads": 1}


@pytest.fixture
def settings(settings) -> Settings:
    return replace(settings, api_keys=KEYS)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Bearer k-three", "Bearer k-one2", "Basic k-one", "k-one", "Bearer K-ONE"],
    ids=["none", "empty", "no key", "blank key", "unknown", "prefix", "basic", "no scheme", "wrong case"],
)
def test_compute_needs_a_valid_key(client, header):
    headers = {} if header is None else {"Authorization": header}
    for path, body in (("/attention", WORKED), ("/mha", MHA)):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 401, (path, header)
        assert r.json["error"]["code"] == "unauthorized" and "Authorization: Bearer" in r.json["error"]["message"]
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert "k-one" not in r.get_data(as_text=True)


@pytest.mark.parametrize("header", ["Bearer k-one", "Bearer k-two", "bearer k-one", "Bearer  k-two "])
def test_any_configured_key_is_accepted(client, header):
    assert client.post("/attention", json=WORKED, headers={"Authorization": header}).status_code == 200
    assert client.post("/mha", json=MHA, headers={"Authorization": header}).status_code == 200


def test_the_kserve_infer_path_is_guarded_in_its_error_shape(client):
    r = client.post("/v2/models/attention/infer", json={"inputs": []})
    assert r.status_code == 401 and isinstance(r.json["error"], str)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/limits", "/metrics"])
def test_operations_stay_open(client, path):
    assert client.get(path).status_code == 200


def test_keys_are_compared_in_constant_time(client, monkeypatch):
    calls, compare = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert client.post("/attention", json=WORKED, headers={"Authorization": "Bearer k-one"}).status_code == 200
    assert len(calls) == len(KEYS)  # every key compared, not only until the first match


def test_without_keys_nothing_is_asked(settings):
    client = create_app(replace(settings, api_keys=())).test_client()
    assert client.post("/attention", json=WORKED).status_code == 200


def test_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ATTN_API_KEYS", " alpha, beta ,,")
    assert Settings.from_env().api_keys == ("alpha", "beta")
    assert "api_keys" not in Settings.from_env().limits()
