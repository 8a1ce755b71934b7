"""The OpenAPI document, the /docs page and the landing page."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import json
import re
import urllib.parse
from urllib.parse import urljoin, urlsplit

import jsonschema
import numpy as np
import pytest
import requests
from flask import Flask
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.definitions import OPENAPI_30
from swagger_ui_bundle import swagger_ui_path

from schemas import AttentionRequest, MhaRequest
from service.config import Settings
from service.web import create_app, kserve

from .helpers import WORKED_OUT, WORKED_WEIGHTS
from .helpers import Q as WORKED_Q
from .helpers import V as WORKED_V
from .test_playground import TIMEOUT_MS, browser  # noqa: F401 - browser: the playground's headless Chromium fixture


@pytest.fixture
def doc(client) -> dict:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    return resp.get_json()


def json_schema(doc: dict, name: str) -> dict:
    """A component as plain JSON Schema (draft 4): OpenAPI 3.0's nullable becomes anyOf null."""

    def convert(node):
        if isinstance(node, dict):
            node = {k: convert(v) for k, v in node.items()}
            if node.pop("nullable", False):
                return {"anyOf": [node, {"type": "null"}]}
            return node
        if isinstance(node, list):
            return [convert(v) for v in node]
        return node

    return {"$ref": f"#/components/schemas/{name}", "components": convert(copy.deepcopy(doc["components"]))}


def test_document_is_valid_openapi_3(doc):
    """Validated against the OpenAPI 3.0 meta-schema (the copy schemathesis ships)."""
    assert doc["openapi"].startswith("3.0")
    errors = sorted(jsonschema.Draft4Validator(OPENAPI_30).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


V2_OPERATIONS = {
    ("get", "/v2"),
    ("get", "/v2/health/live"),
    ("get", "/v2/health/ready"),
    *(("get", f"/v2/models/{{name}}{version}{what}") for version in ("", "/versions/{version}") for what in ("", "/ready", "/config")),
    ("post", "/v2/models/{name}/infer"),
    ("post", "/v2/models/{name}/versions/{version}/infer"),
    ("get", "/v2/models/stats"),
    ("get", "/v2/models/{name}/stats"),
    ("get", "/v2/models/{name}/versions/{version}/stats"),
    ("get", "/v2/systemsharedmemory/status"),
    ("get", "/v2/systemsharedmemory/region/{region}/status"),
    ("post", "/v2/systemsharedmemory/region/{region}/register"),
    ("post", "/v2/systemsharedmemory/unregister"),
    ("post", "/v2/systemsharedmemory/region/{region}/unregister"),
    ("get", "/v2/cudasharedmemory/status"),
    ("get", "/v2/cudasharedmemory/region/{region}/status"),
    ("post", "/v2/cudasharedmemory/region/{region}/register"),
    ("post", "/v2/cudasharedmemory/unregister"),
    ("post", "/v2/cudasharedmemory/region/{region}/unregister"),
}


SESSION_OPERATIONS = {
    ("post", "/sessions"),
    ("get", "/sessions/{sid}"),
    ("delete", "/sessions/{sid}"),
    *(("post", f"/sessions/{{sid}}/{action}") for action in ("append", "attention", "fork", "truncate")),
    ("post", "/sessions/attention"),
}


def operations(doc: dict, prefix: str = "/") -> set[tuple[str, str]]:
    return {(method, path) for path, item in doc["paths"].items() if path.startswith(prefix) for method in item}


def test_document_lists_the_served_operations(app, doc):
    served = {rule.rule for rule in app.url_map.iter_rules()}
    ops = {path for path in ("/healthz", "/readyz", "/limits", "/metrics") if path in served}  # /metrics: once ops lands
    assert {"/healthz", "/readyz", "/limits"} <= ops
    assert set(doc["paths"]) == {"/attention", "/mha"} | ops | {path for _, path in V2_OPERATIONS} | {
        path for _, path in SESSION_OPERATIONS
    }
    assert operations(doc, "/sessions") == SESSION_OPERATIONS
    for path in ("/attention", "/mha"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "413", "415", "422", "503", "504"}
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ComputeResponse"}
        assert op["responses"]["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
        assert op["responses"]["503"]["headers"]["Retry-After"]["required"] is True


def test_v2_operations_are_the_routes_served(app, client, doc):
    """Every /v2 route the app serves is documented with its methods, and each documented one answers."""
    served = {
        (method.lower(), re.sub(r"<([^>]+)>", r"{\1}", rule.rule))
        for rule in app.url_map.iter_rules()
        if rule.rule.startswith("/v2")
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    assert served == V2_OPERATIONS == operations(doc, "/v2")
    for method, path in V2_OPERATIONS:
        op = doc["paths"][path][method]
        assert op["tags"] == ["Open Inference Protocol"] and op["summary"] and op["description"]
        params = {p["name"]: p["schema"].get("enum") or [p["schema"]["example"]] for p in op.get("parameters", []) if p["in"] == "path"}
        assert set(params) == set(re.findall(r"{([^}]+)}", path))
        url = path.format(**{name: values[0] for name, values in params.items()})
        resp = client.open(url, method=method.upper(), json={"inputs": []} if method == "post" else None)
        assert resp.status_code not in (404, 405), (method, url)
        assert str(resp.status_code) in op["responses"], (method, url, resp.status_code)


def test_every_operation_is_tagged(doc):
    tags = [tag["name"] for tag in doc["tags"]]
    assert tags == ["Attention", "Sessions", "Operations", "Open Inference Protocol"]
    assert all(op["tags"][0] in tags for item in doc["paths"].values() for op in item.values())


def test_no_lab_vocabulary(client):
    """The document speaks to a reader, not of how it was made."""
    text = client.get("/openapi.json").get_data(as_text=True).lower()
    assert not re.search(r"\b(seed|rounds?|load averages?)\b", text)


@pytest.mark.parametrize("name", ["attention", "mha"])
@pytest.mark.parametrize(
    ("path", "schema"),
    [
        ("/v2", "metadata_server_response"),
        ("/v2/health/live", "server_live_response"),
        ("/v2/health/ready", "server_ready_response"),
        ("/v2/models/{name}", "metadata_model_response"),
        ("/v2/models/{name}/versions/1", "metadata_model_response"),
        ("/v2/models/{name}/ready", "model_ready_response"),
        ("/v2/models/{name}/config", "model_config_response"),
        ("/v2/models/{name}/versions/1/config", "model_config_response"),
    ],
)
def test_v2_answers_match_their_schemas(client, doc, path, schema, name):
    resp = client.get(path.format(name=name))
    assert resp.status_code == 200
    jsonschema.Draft4Validator(json_schema(doc, schema)).validate(resp.get_json())


def test_v2_metadata_schema_comes_from_the_model_table(doc):
    """Names, datatypes and parameters are those of kserve.py's models, not a copy that can drift."""
    schemas = doc["components"]["schemas"]
    assert schemas["metadata_model_response"]["properties"]["name"]["enum"] == list(kserve.MODELS)
    inputs = schemas["request_input"]["properties"]["name"]["enum"]
    assert set(inputs) == {n for m in kserve.MODELS.values() for n in m.inputs}
    assert set(schemas["request_parameters"]["properties"]) == {p for m in kserve.MODELS.values() for p in m.parameters} | {
        "binary_data_output",
        *kserve.IGNORED_PARAMETERS,
    }
    assert schemas["model_config_response"]["properties"]["input"]["items"]["properties"]["data_type"]["enum"] == [
        f"TYPE_{d}" for d in kserve.DATATYPES
    ]
    for model in kserve.MODELS.values():
        assert all(f"{n} (optional)" in doc["paths"]["/v2/models/{name}"]["get"]["description"] for n in model.optional)


def model_of(key: str) -> str:
    """The model an example is for: the longest model name its key starts with (then "_")."""
    return max((m for m in kserve.MODELS if key.startswith(f"{m}_")), key=len)


def v2_examples(doc: dict, path: str = "/v2/models/{name}/infer") -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["examples"]


@pytest.mark.parametrize("path", ["/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"])
def test_v2_examples_answer_200_as_documented(client, doc, path):
    """Each example, sent to the model its key names, is answered 200 with a valid inference_response."""
    validator = jsonschema.Draft4Validator(json_schema(doc, "inference_response"))
    assert {model_of(key) for key in v2_examples(doc, path)} == set(kserve.MODELS)
    for key, example in v2_examples(doc, path).items():
        model = model_of(key)
        jsonschema.Draft4Validator(json_schema(doc, "inference_request")).validate(example["value"])
        resp = client.post(path.format(name=model, version="1"), json=example["value"])
        assert resp.status_code == 200, (key, resp.get_json())
        validator.validate(resp.get_json())
        assert resp.get_json()["model_name"] == model


def test_worked_example_answers_its_known_values(client, doc):
    body = v2_examples(doc)["attention_worked_example"]["value"]
    outputs = {o["name"]: o for o in client.post("/v2/models/attention/infer", json=body).get_json()["outputs"]}
    assert outputs["out"]["shape"] == [3, 2] and outputs["weights"]["shape"] == [3, 3]
    assert [round(x, 2) for x in outputs["weights"]["data"]] == [w for row in WORKED_WEIGHTS for w in row]
    assert [round(x, 2) for x in outputs["out"]["data"]] == [o for row in WORKED_OUT for o in row]


def test_v2_binary_extension_as_documented(client, doc):
    """The binary tensor data extension as the document describes it: binary_data_size inputs whose
    bytes follow the JSON header, Inference-Header-Content-Length, binary_data_output; the answer is
    application/octet-stream, its JSON header a valid inference_response."""
    op = doc["paths"]["/v2/models/{name}/infer"]["post"]
    assert "application/octet-stream" in op["requestBody"]["content"]
    assert "application/octet-stream" in op["responses"]["200"]["content"]
    assert "Inference-Header-Content-Length" in {p["name"] for p in op["parameters"]}
    assert "Inference-Header-Content-Length" in op["responses"]["200"]["headers"]
    tensors = {n: np.asarray(t, dtype="<f4") for n, t in (("q", WORKED_Q), ("k", WORKED_Q), ("v", WORKED_V))}
    inputs = [
        {"name": n, "datatype": "FP32", "shape": list(t.shape), "parameters": {"binary_data_size": t.nbytes}} for n, t in tensors.items()
    ]
    header = json.dumps({"inputs": inputs, "parameters": {"causal": True, "binary_data_output": True}}).encode()
    jsonschema.Draft4Validator(json_schema(doc, "inference_request")).validate(json.loads(header))
    resp = client.post(
        "/v2/models/attention/infer",
        data=header + b"".join(t.tobytes() for t in tensors.values()),
        headers={"Inference-Header-Content-Length": str(len(header))},
        content_type="application/octet-stream",
    )
    assert resp.status_code == 200 and resp.mimetype == "application/octet-stream"
    size = int(resp.headers["Inference-Header-Content-Length"])
    head = json.loads(resp.data[:size])
    jsonschema.Draft4Validator(json_schema(doc, "inference_response")).validate(head)
    out, weights = head["outputs"]
    assert out["parameters"]["binary_data_size"] + weights["parameters"]["binary_data_size"] == len(resp.data) - size
    got = np.frombuffer(resp.data[size : size + out["parameters"]["binary_data_size"]], "<f4").reshape(out["shape"])
    np.testing.assert_allclose(got, WORKED_OUT, atol=0.01)


@pytest.mark.parametrize(
    ("parameters", "valid"),
    [
        ({"window": "1,0"}, True),
        ({"window": [1, 0]}, True),
        ({"window": "1;0"}, False),
        ({"causal": "top_left"}, True),
        ({"causal": 1}, False),
        ({"priority": 3}, True),
        ({"nope": 1}, False),
    ],
    ids=["window-text", "window-list", "window-bad-text", "causal-top-left", "causal-1", "priority", "unknown"],
)
def test_v2_parameter_schemas_agree_with_the_server(client, doc, parameters, valid):
    body = {**v2_examples(doc)["attention_worked_example"]["value"], "parameters": parameters}
    assert jsonschema.Draft4Validator(json_schema(doc, "inference_request")).is_valid(body) == valid
    assert (client.post("/v2/models/attention/infer", json=body).status_code == 200) == valid


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v2/models/nope/infer", {"inputs": []}, 404),
        ("/v2/models/attention/versions/2", None, 404),
        ("/v2/models/attention/infer", b"nope", 400),
        ("/v2/models/attention/infer", {"inputs": [{"name": "q"}]}, 400),  # the protocol's status for an invalid request
    ],
    ids=["no-model", "no-version", "not-json", "invalid"],
)
def test_v2_errors_match_the_protocol_error_schema(client, doc, path, body, status):
    validator = jsonschema.Draft4Validator(json_schema(doc, "inference_error_response"))
    method = "post" if path.endswith("infer") else "get"
    resp = client.open(path, method=method.upper(), **({"data": body} if isinstance(body, bytes) else {"json": body}))
    assert resp.status_code == status
    validator.validate(resp.get_json())
    template = re.sub(r"/models/[^/]+", "/models/{name}", path).replace("/versions/2", "/versions/{version}")
    assert str(status) in doc["paths"][template][method]["responses"]
    assert resp.headers["X-Error-Code"]


@pytest.mark.parametrize(("name", "schema_cls"), [("AttentionRequest", AttentionRequest), ("MhaRequest", MhaRequest)])
def test_request_schemas_come_from_marshmallow(doc, name, schema_cls):
    schema = doc["components"]["schemas"][name]
    fields = schema_cls().fields
    assert set(schema["properties"]) == set(fields)
    assert set(schema["required"]) == {n for n, f in fields.items() if f.required}
    assert schema["additionalProperties"] is False  # unknown fields are refused
    for n, f in fields.items():
        assert schema["properties"][n]["description"] == f.metadata["description"]


def test_options_are_typed_as_the_schema_checks_them(doc):
    props = doc["components"]["schemas"]["AttentionRequest"]["properties"]
    assert props["causal"]["enum"] == [False, True, "top_left", "bottom_right"]
    assert props["dtype"]["enum"] == ["float32", "float64", None]
    assert props["scale"]["minimum"] == 0 and props["scale"]["exclusiveMinimum"] is True
    assert props["q"]["allOf"] == [{"$ref": "#/components/schemas/Tensor"}]
    assert props["mask"]["allOf"] == [{"$ref": "#/components/schemas/MaskTensor"}]
    assert props["key_lengths"]["allOf"] == [{"$ref": "#/components/schemas/IntTensor"}]
    schemas = doc["components"]["schemas"]
    assert [t["title"] for t in schemas["Tensor"]["oneOf"]] == ["nested", "flat", "b64"]
    assert [t["title"] for t in schemas["IntTensor"]["oneOf"]] == ["scalar", "nested", "flat", "b64"]  # key_lengths may be rank 0
    assert "bool" not in schemas["Tensor"]["oneOf"][2]["properties"]["dtype"]["enum"]


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("q", [[1.5, 2]], True),
        ("q", [[True, 2]], False),
        ("q", {"shape": [1], "dtype": "bool", "b64": "AQ=="}, False),
        ("mask", [[True, False, True]], True),
        ("mask", [[0, 1, 1]], True),
        ("mask", [[True, 0, 1]], False),
        ("mask", [[2]], False),
        ("key_lengths", 3, True),
        ("key_lengths", [2.5], False),
        ("key_lengths", {"shape": [1], "dtype": "float32", "b64": "AAAAAA=="}, False),
    ],
    ids=[
        "q-floats",
        "q-bool",
        "q-b64-bool",
        "mask-bools",
        "mask-01",
        "mask-mixed",
        "mask-2",
        "lengths-scalar",
        "lengths-fraction",
        "lengths-b64-float",
    ],
)
def test_tensor_schemas_agree_with_the_server(client, doc, field, value, valid):
    """What the document calls valid for a tensor field is what the server accepts from it."""
    name = {"q": "Tensor", "mask": "MaskTensor", "key_lengths": "IntTensor"}[field]
    assert jsonschema.Draft4Validator(json_schema(doc, name)).is_valid(value) == valid
    body = {"q": [[1.5, 2]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1], [2], [3]], field: value}
    resp = client.post("/attention", json=body)
    assert (resp.status_code == 200) == valid, resp.get_json()


@pytest.mark.parametrize("path", ["/attention", "/mha"])
def test_documented_examples_answer_200_as_documented(client, doc, path):
    examples = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["examples"]
    validator = jsonschema.Draft4Validator(json_schema(doc, "ComputeResponse"))
    assert examples
    for name, example in examples.items():
        resp = client.post(path, json=example["value"])
        assert resp.status_code == 200, (name, resp.get_json())
        validator.validate(resp.get_json())


def test_errors_match_the_error_schema(client, doc):
    validator = jsonschema.Draft4Validator(json_schema(doc, "Error"))
    for resp in (client.post("/attention", json={"q": [[1]]}), client.post("/attention", data="nope"), client.get("/no-such-page")):
        assert resp.status_code >= 400
        validator.validate(resp.get_json())


def test_limits_match_the_limits_schema(client, doc):
    jsonschema.Draft4Validator(json_schema(doc, "Limits")).validate(client.get("/limits").get_json())


def test_api_keys_add_a_security_scheme():
    app = create_app(Settings(api_keys=("secret",), warmup=False))
    doc = app.test_client().get("/openapi.json").get_json()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearer": []}]
    assert "401" in doc["paths"]["/v2/models/{name}/infer"]["post"]["responses"]
    assert "401" not in doc["paths"]["/v2/models/{name}"]["get"]["responses"]  # metadata needs no key


def asset_urls(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', html)


def test_docs_page_loads_its_assets_from_the_service(client):
    resp = client.get("/docs")
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    html = resp.get_data(as_text=True)
    assert "SwaggerUIBundle" in html and "validatorUrl: null" in html  # no call to the public validator
    urls = asset_urls(html)
    assert {"docs/swagger-ui.css", "docs/swagger-ui-bundle.js", "docs/swagger-ui-standalone-preset.js"} <= set(urls)
    for url in urls:
        assert not urlsplit(url).netloc, f"{url} is not served by the service"
        asset = client.get(urljoin("/docs", url))
        assert asset.status_code == 200, url
        assert asset.data == (swagger_ui_path / url.removeprefix("docs/")).read_bytes()  # the package's own file
    assert client.get(urljoin("/docs", "docs/swagger-ui-bundle.js")).mimetype in {"text/javascript", "application/javascript"}
    assert client.get(urljoin("/docs", "docs/swagger-ui.css")).mimetype == "text/css"
    spec_url = re.search(r'url: "([^"]+)"', html).group(1)
    assert client.get(urljoin("/docs", spec_url)).status_code == 200


@pytest.mark.parametrize("path", ["/docs/index.html", "/docs/../service/config.py", "/docs/swagger-ui.js.map"])
def test_only_the_listed_assets_are_served(client, path):
    resp = client.get(path)
    assert resp.status_code == 404 and resp.get_json()["error"]["code"] == "not_found"


def test_landing_page_links_resolve(client):
    resp = client.get("/")
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    urls = asset_urls(resp.get_data(as_text=True))
    assert {"docs", "openapi.json", "limits", "v2", "playground"} <= set(urls)
    for url in urls:
        assert client.get(urljoin("/", url)).status_code == 200, url


def _csp(resp) -> dict[str, list[str]]:
    """The Content-Security-Policy header as {directive: [sources]}."""
    policy = resp.headers.get("Content-Security-Policy", "")
    return {d.split()[0]: d.split()[1:] for d in policy.split(";") if d.strip()}


@pytest.mark.parametrize("path", ["/", "/docs", "/playground"])
def test_html_pages_carry_a_content_security_policy(client, path):
    """The HTML pages once came with no security header at all: any page could be
    framed (clickjacking the docs' "Try it out"), and nothing stopped a script injected into one
    from running or loading from elsewhere. Now: scripts from the service only (plus, by hash, the
    page's own inline script), no plugins, no framing, and nosniff."""
    resp = client.get(path)
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    csp = _csp(resp)
    assert csp.get("default-src") == ["'self'"] and csp.get("frame-ancestors") == ["'none'"] and csp.get("object-src") == ["'none'"]
    assert "'unsafe-inline'" not in csp["script-src"] and "'unsafe-eval'" not in csp["script-src"]
    for script in re.findall(r"<script>(.*?)</script>", resp.get_data(as_text=True), re.S):  # inline: allowed by hash only
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp["script-src"]
    assert resp.headers["X-Content-Type-Options"] == "nosniff" and resp.headers["X-Frame-Options"] == "DENY"


@pytest.mark.parametrize("path", ["/limits", "/openapi.json", "/no-such-page"])
def test_json_answers_are_not_sniffed(client, path):
    """A JSON answer (an error's too, which names what the client sent) is never read as HTML."""
    resp = client.get(path)
    assert resp.mimetype == "application/json" and resp.headers["X-Content-Type-Options"] == "nosniff"
    assert "Content-Security-Policy" not in resp.headers


# --- /docs in a browser (headless Chromium, as the playground's tests drive it) ----------------


@pytest.mark.live
def test_docs_page_lists_every_operation_and_runs_the_v2_worked_example(browser, live_server):  # noqa: F811 - the fixture
    """Swagger UI renders the document: every operation under its tag, the /v2 ones under the
    protocol's; "Try it out" on the infer operation sends its first example and is answered 200."""
    doc = requests.get(f"{live_server}/openapi.json", timeout=30).json()
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    urls, problems = [], []
    page.on("request", lambda r: urls.append(r.url))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{live_server}/docs")
    page.wait_for_selector(".opblock")
    shown = page.eval_on_selector_all(
        ".opblock",
        "els => els.map(e => [e.querySelector('.opblock-summary-method').textContent.toLowerCase(),"
        " e.querySelector('.opblock-summary-path').dataset.path, e.closest('.opblock-tag-section').querySelector('.opblock-tag').dataset.tag])",
    )
    assert sorted((m, p) for m, p, _ in shown) == sorted(operations(doc))
    assert {(m, p) for m, p, tag in shown if tag == "Open Inference Protocol"} == V2_OPERATIONS

    infer = page.locator(".opblock", has=page.locator(".opblock-summary-path[data-path='/v2/models/{name}/infer']"))
    infer.locator(".opblock-summary").click()
    infer.locator("button.try-out__btn").click()
    options = infer.locator("select.examples-select-element option").all_inner_texts()
    assert options == [e["summary"] for e in v2_examples(doc).values()]
    with page.expect_response(lambda r: r.url.endswith("/v2/models/attention/infer")) as sent:
        infer.locator("button.execute").click()
    assert sent.value.status == 200, sent.value.text()
    assert sent.value.request.post_data_json == v2_examples(doc)["attention_worked_example"]["value"]
    context.close()
    assert all(u.startswith(live_server + "/") for u in urls), [u for u in urls if not u.startswith(live_server)]
    assert not problems, problems


# --- the /v2 envelope: what the document calls valid is what the server takes ---------------------

_MISSING = object()
_VALID = {"id": _MISSING, "q datatype": "FP32", "q encoding": "data", "q extra key": _MISSING, "parameters": {}, "outputs": _MISSING}
_ENVELOPE_VALUES = {  # per place in an infer request: values the document takes and values it refuses
    "id": st.sampled_from([_MISSING, "req-1", 3, None, ["a"]]),
    "q datatype": st.sampled_from(["FP32", "FP64", "BF16", "fp32", None, 1]),
    "q encoding": st.sampled_from(["data", "binary", "binary size as text", "negative size", "both", "neither", "shared memory"]),
    "q extra key": st.sampled_from([_MISSING, ("data_type", "FP32"), ("parameters_", {})]),
    "parameters": st.dictionaries(
        st.sampled_from(["causal", "return_weights", "scale", "window", "binary_data_output", "priority", "timeout", "casual"]),
        st.sampled_from([True, False, 0, 1, -1, 2.5, "1,0", "1;0", [1, 0], [1], "top_left", "x", None, {}]),
        max_size=3,
    ),
    "outputs": st.sampled_from(
        [
            _MISSING,
            [],
            [{"name": "out"}],
            [{"name": "out", "parameters": {"binary_data": False}}],
            [{"name": "out", "parameters": {"binary_data": 1}}],
            [{"name": "out", "parameters": {"classification": 2}}],
            [{"name": "out", "shape": [3, 2]}],
            [{"name": "lse"}, {"name": "out"}],
            [{"name": "attn"}],
            [{"name": ["out"]}],
            ["out"],
            {"name": "out"},
        ]
    ),
}


def _envelope(choice: dict) -> tuple[dict, bytes, dict]:
    """The worked example's infer request with these choices: (JSON header, binary data, headers)."""
    q: dict = {"name": "q", "datatype": choice["q datatype"], "shape": [3, 2]}
    q_bytes = np.asarray(WORKED_Q, "<f8" if choice["q datatype"] == "FP64" else "<f4").tobytes()
    size = {"binary": len(q_bytes), "binary size as text": str(len(q_bytes)), "negative size": -1, "both": len(q_bytes)}
    blob = q_bytes if choice["q encoding"] in size else b""
    if choice["q encoding"] in size:
        q["parameters"] = {"binary_data_size": size[choice["q encoding"]]}
    if choice["q encoding"] in ("data", "both"):
        q["data"] = WORKED_Q
    if choice["q encoding"] == "shared memory":
        q["parameters"] = {"shared_memory_region": "r", "shared_memory_byte_size": 24}
    if choice["q extra key"] is not _MISSING:
        q[choice["q extra key"][0]] = choice["q extra key"][1]
    rest = [{"name": n, "datatype": "FP32", "shape": [3, 2], "data": d} for n, d in (("k", WORKED_Q), ("v", WORKED_V))]
    header = {"inputs": [q, *rest], "parameters": choice["parameters"]}
    for key in ("id", "outputs"):
        if choice[key] is not _MISSING:
            header[key] = choice[key]
    return header, blob, ({"Inference-Header-Content-Length": str(len(json.dumps(header)))} if blob else {})


def _refused_anyway(header: dict) -> bool:
    """Valid as the document says, refused for what JSON Schema cannot say: an input with both or
    neither of data and binary_data_size, an output its parameters turn off."""
    q, outputs = header["inputs"][0], header.get("outputs", [])
    return ("data" in q) == ("binary_data_size" in q.get("parameters", {})) or (
        header["parameters"].get("return_weights") is False and any(o.get("name") == "weights" for o in outputs)
    )


@functools.cache
def _v2_app() -> tuple[Flask, dict]:
    app = create_app(Settings(warmup=False))
    return app, app.test_client().get("/openapi.json").get_json()


@settings(max_examples=300, deadline=None)
@given(place=st.sampled_from(list(_ENVELOPE_VALUES)), data=st.data())
def test_the_document_describes_the_v2_envelope(place, data):
    """The worked example's infer request, one place of it changed: if the server answers it, it is
    valid per the document's inference_request; one the document calls valid is answered (but for what JSON Schema cannot say: _refused_anyway); one it
    calls invalid is refused 400, its message naming the field X-Error-Field names."""
    app, doc = _v2_app()
    header, blob, headers = _envelope({**_VALID, place: data.draw(_ENVELOPE_VALUES[place], label=place)})
    valid = jsonschema.Draft4Validator(json_schema(doc, "inference_request")).is_valid(header)
    resp = app.test_client().post("/v2/models/attention/infer", data=json.dumps(header).encode() + blob, headers=headers)
    if resp.status_code == 200:
        assert valid, header
        return
    assert resp.status_code == 400, (resp.status_code, resp.data[:300])
    assert not valid or _refused_anyway(header), (header, resp.get_json())
    message, field = resp.get_json()["error"], resp.headers.get("X-Error-Field")
    if not valid:
        assert field and urllib.parse.unquote(field).removesuffix("s") in message, (header, message, field)
