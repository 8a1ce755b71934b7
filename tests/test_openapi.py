"""The OpenAPI document, the /docs page and the landing page."""

from __future__ import annotations

import base64
import copy
import hashlib
import re
from urllib.parse import urljoin, urlsplit

import jsonschema
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_30
from swagger_ui_bundle import swagger_ui_path

from schemas import AttentionRequest, MhaRequest
from service.config import Settings
from service.web import create_app


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


def test_document_lists_the_served_operations(app, doc):
    served = {rule.rule for rule in app.url_map.iter_rules()}
    ops = {path for path in ("/healthz", "/readyz", "/limits", "/metrics") if path in served}  # /metrics: once ops lands
    assert {"/healthz", "/readyz", "/limits"} <= ops
    assert set(doc["paths"]) == {"/attention", "/mha"} | ops
    for path in ("/attention", "/mha"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "413", "415", "422", "503", "504"}
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ComputeResponse"}
        assert op["responses"]["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
        assert op["responses"]["503"]["headers"]["Retry-After"]["required"] is True


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
    """The HTML pages came with no security header at all (attack round three): any page could be
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
