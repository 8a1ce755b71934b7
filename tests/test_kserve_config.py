"""Triton's model configuration extension (GET /v2/models/{name}[/versions/{v}]/config): the
same model as the metadata says, in model_config.proto's JSON, with the fields Triton's
perf_analyzer reads (its ModelParser) of the types it reads them as."""

from __future__ import annotations

import pytest
import tritonclient.http as triton

MODELS = ("attention", "mha")
# The keys that make perf_analyzer treat a model as batched, sequenced or an ensemble.
SCHEDULERS = ("dynamic_batching", "sequence_batching", "ensemble_scheduling")


def get(client, path: str) -> dict:
    resp = client.get(path)
    assert resp.status_code == 200 and resp.mimetype == "application/json", resp.data
    return resp.get_json()


@pytest.mark.parametrize("model", MODELS)
def test_the_configuration_says_what_the_metadata_says(client, model):
    meta, config = get(client, f"/v2/models/{model}"), get(client, f"/v2/models/{model}/config")
    assert config["name"] == meta["name"] == model
    assert config["platform"] == meta["platform"] and isinstance(config["backend"], str) and config["backend"]
    assert [(t["name"], t["data_type"], t["dims"], t["optional"]) for t in config["input"]] == [
        (t["name"], f"TYPE_{t['datatype']}", t["shape"], t["parameters"]["optional"]) for t in meta["inputs"]
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        (t["name"], f"TYPE_{t['datatype']}", t["shape"]) for t in meta["outputs"]
    ]
    assert config["version_policy"] == {"specific": {"versions": [int(v) for v in meta["versions"]]}}


def test_optional_inputs_are_marked(client):
    optional = {model: {t["name"] for t in get(client, f"/v2/models/{model}/config")["input"] if t["optional"]} for model in MODELS}
    assert optional == {"attention": {"mask", "key_lengths", "bias", "alibi_slopes"}, "mha": {"wo"}}
    types = {t["name"]: t["data_type"] for t in get(client, "/v2/models/attention/config")["input"]}
    assert (types["q"], types["mask"], types["key_lengths"]) == ("TYPE_FP32", "TYPE_BOOL", "TYPE_INT64")


@pytest.mark.parametrize("model", MODELS)
def test_the_fields_perf_analyzer_reads(client, model):
    """max_batch_size 0 (perf_analyzer would otherwise strip a batch axis from every shape), no
    scheduler, and each input's and output's name and flags as JSON strings, booleans, integers."""
    config = get(client, f"/v2/models/{model}/config")
    assert type(config["max_batch_size"]) is int and config["max_batch_size"] == 0
    assert not set(SCHEDULERS) & set(config)
    assert "model_transaction_policy" not in config or config["model_transaction_policy"]["decoupled"] is False
    for tensor in config["input"] + config["output"]:
        assert isinstance(tensor["name"], str) and tensor["is_shape_tensor"] is False
        assert tensor["dims"] and all(type(d) is int and (d == -1 or d > 0) for d in tensor["dims"])
        assert tensor["data_type"] in {"TYPE_FP32", "TYPE_FP64", "TYPE_FP16", "TYPE_BOOL", "TYPE_INT32", "TYPE_INT64"}
    assert all(type(t["optional"]) is bool for t in config["input"])


@pytest.mark.parametrize("model", MODELS)
def test_the_versioned_path_answers_the_same(client, model):
    assert get(client, f"/v2/models/{model}/versions/1/config") == get(client, f"/v2/models/{model}/config")


def test_the_server_lists_the_extension(client):
    assert "model_configuration" in get(client, "/v2")["extensions"]


@pytest.mark.parametrize("path", ["/v2/models/nope/config", "/v2/models/nope/versions/1/config", "/v2/models/attention/versions/2/config"])
def test_unknown_models_and_versions_are_404(client, path):
    meta_path = path.removesuffix("/config")
    for method in ("GET", "OPTIONS"):
        resp = client.open(path, method=method)
        assert resp.status_code == 404 and resp.get_json() == client.open(meta_path, method=method).get_json(), method


@pytest.mark.live
def test_tritonclient_reads_the_configuration(live_server, client):
    triton_client = triton.InferenceServerClient(live_server.removeprefix("http://"), network_timeout=60)
    try:
        for model in MODELS:
            assert triton_client.get_model_config(model) == get(client, f"/v2/models/{model}/config")
            assert triton_client.get_model_config(model, model_version="1")["name"] == model
    finally:
        triton_client.close()
