"""deploy/kubernetes: kustomize renders both overlays, every object is valid against the Kubernetes
API schemas (and the ServiceMonitor against its CRD's), and what the manifests say agrees with the
service they run: health and metrics routes, settings, metric names, the image's user and port,
docker-compose.yml, the Grafana dashboard file, and the drain on SIGTERM.

Tools: kubectl (its built-in kustomize renders the overlays; CI's machine image has it, and
.ci/run fetches it otherwise), kubernetes-validate (the API's JSON schemas, per Kubernetes
version), cloudcoil-models-prometheus-operator (the ServiceMonitor CRD's schema, as pydantic
models generated from it) and promtool (the prometheus-adapter rules' PromQL).
"""

from __future__ import annotations

import ast
import base64
import copy
import functools
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from test_deploy import tool

from app.config import ENV_PREFIX, Settings
from app.http.endpoints import health
from app.http.endpoints import metrics as metrics_route
from tests.test_fetch import COMMIT, Hub, argos_package, hub, marian, translate  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
SCRIPT = KUBE / "base" / "fetch_model.py"  # the init container's command
OVERLAYS = ("cpu", "gpu")
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "nmt.json"
ADAPTER_VALUES = KUBE / "prometheus-adapter" / "values.yaml"
# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30", latest_version())

Doc = dict[str, Any]


# -- rendering -------------------------------------------------------------------------------------


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    """``kubectl kustomize`` of an overlay: what ``kubectl apply -k`` would send."""
    proc = subprocess.run(
        [tool("kubectl"), "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def one(docs: tuple[Doc, ...], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def pod_spec(docs: tuple[Doc, ...]) -> Doc:
    spec: Doc = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def translator(docs: tuple[Doc, ...]) -> Doc:
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] == "translator"]
    return container


def env(container: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.fixture(params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> tuple[Doc, ...]:
    return render(request.param)


# -- schemas ---------------------------------------------------------------------------------------


def closed(schema: Any) -> Any:
    """``schema`` with unknown properties refused wherever properties are listed, as the API server
    refuses unknown fields of a CRD with a structural schema (pydantic's schema leaves them open)."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator from the CRD's schema, for the custom resources we use."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    schema = closed(ServiceMonitor.model_json_schema(by_alias=True, mode="validation"))
    return {("monitoring.coreos.com/v1", "ServiceMonitor"): jsonschema.Draft202012Validator(schema)}


def validate(doc: Doc) -> None:
    """Raises unless ``doc`` is valid for every Kubernetes version we target (unknown fields
    refused), or against its CRD's schema; a kind with no schema at all is an error too."""
    crd = crd_validators().get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        crd.validate(doc)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_overlays_render_and_every_object_is_valid(docs: tuple[Doc, ...]) -> None:
    kinds = {d["kind"] for d in docs}
    assert {
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "ConfigMap",
    } <= kinds
    for doc in docs:
        try:
            validate(doc)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {getattr(e, 'message', e)}")


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("Deployment", ["spec", "template", "spec", "containers", 0, "livenessProbe", "httpGet", "path"], 3),
        ("Deployment", ["spec", "template", "spec", "containers", 0, "readinesProbe"], {}),  # a typo
        ("HorizontalPodAutoscaler", ["spec", "metrics", 0, "pods", "target", "type"], ["AverageValue"]),
        ("PodDisruptionBudget", ["spec", "maxUnavailabel"], 1),
        ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], "5 seconds"),
        ("ServiceMonitor", ["spec", "endpoints", 0, "scheme"], "ftp"),
        ("ServiceMonitor", ["spec", "endpoints", 0, "portName"], "http"),  # not a field
    ],
)
def test_the_validators_refuse_broken_objects(kind: str, path: list[str | int], value: Any) -> None:
    """The validation above can fail: one wrong value or unknown field is refused."""
    doc = copy.deepcopy(one(render("cpu"), kind))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


# -- the pod ---------------------------------------------------------------------------------------


def route_paths(router: Any) -> set[str]:
    return {r.path for r in router.routes}


def test_probes_use_the_health_routes(docs: tuple[Doc, ...]) -> None:
    container = translator(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["path"] for p in probes.values()} <= route_paths(health.api)
    # Liveness never depends on the model (an overloaded or reloading pod is not restarted);
    # readiness does (503 while no worker runs).
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health/live"
    assert probes["readinessProbe"]["path"] == "/health/ready"
    assert all(p["port"] in ports for p in probes.values())
    # uvicorn answers nothing until the workers have loaded and compiled (~75 s on 2 cores
    # without a cache): the startup probe must wait well beyond that before restarting.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"EXPOSE {ports['http']}" in dockerfile


def test_drain_fits_in_the_grace_period(docs: tuple[Doc, ...]) -> None:
    """preStop, then uvicorn's drain: every request in flight is answered (or 504) within
    NMT_REQUEST_TIMEOUT_S, then the workers stop; all before the kubelet's SIGKILL."""
    spec, container = pod_spec(docs), translator(docs)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    timeout = float(
        env(container).get("NMT_REQUEST_TIMEOUT_S", Settings.model_fields["request_timeout_s"].default)
    )
    assert pre_stop >= 5  # endpoints and load balancers forget the pod meanwhile
    # + stopping the workers: 14 s after the last answer, measured on 2 busy cores.
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + timeout + 15


def image_user() -> int:
    """The uid the Dockerfile's runtime stage creates and runs as."""
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = int(dockerfile.split("useradd")[1].split("--uid")[1].split()[0])
    assert "USER nmt" in dockerfile
    return uid


def test_pods_run_non_root_with_a_read_only_root_filesystem(docs: tuple[Doc, ...]) -> None:
    """The "restricted" Pod Security Standard, which the namespace enforces."""
    spec = pod_spec(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == image_user()
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for container in spec["initContainers"] + spec["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
    namespace = one(docs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert all(
        d["metadata"].get("namespace") == namespace["metadata"]["name"] for d in docs if d is not namespace
    )


def mount_of(container: Doc, volumes: dict[str, Doc], path: str) -> tuple[Doc, Doc]:
    """The volume mount (and its volume) that holds ``path`` in ``container``: the deepest."""
    mounts = [m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on the read-only root filesystem of {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, volumes[mount["name"]]


def test_what_the_service_writes_is_on_writable_volumes(docs: tuple[Doc, ...]) -> None:
    spec, container = pod_spec(docs), translator(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    settings = env(container)
    # The compile cache (NMT_COMPILE_CACHE_DIR), the keys' usage (NMT_DATA_DIR) and, under $TMPDIR,
    # Prometheus' multiprocess directory (app/monitoring/metrics.py: tempfile.mkdtemp) and the C++
    # compiler's files.
    for path in (settings["NMT_COMPILE_CACHE_DIR"], settings["NMT_DATA_DIR"], settings.get("TMPDIR", "/tmp")):
        mount, volume = mount_of(container, volumes, path)
        assert not mount.get("readOnly", False), path
        assert "emptyDir" in volume, path
    assert "TMPDIR" not in settings  # the default, /tmp, is what is mounted
    assert "PROMETHEUS_MULTIPROC_DIR" not in settings  # app/monitoring/metrics.py sets it itself


def value_of(container: Doc, name: str) -> Any:
    """The value (or valueFrom) of ``name`` in ``container``'s environment."""
    (found,) = [e for e in container["env"] if e["name"] == name]
    return found.get("value", found.get("valueFrom"))


def test_the_models_come_from_a_volume_filled_by_the_init_container(docs: tuple[Doc, ...]) -> None:
    spec, container = pod_spec(docs), translator(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    settings = env(container)
    (fetcher,) = spec["initContainers"]
    # The translator serves every model directory of the volume, and finds the named ones there
    # again (verified against their records) in the store the init container fetched them into.
    store = value_of(fetcher, "NMT_MODEL_STORE")
    assert settings["NMT_MODEL_DIR"] == settings["NMT_MODEL_STORE"] == store
    mount, volume = mount_of(container, volumes, store)
    assert mount.get("readOnly") is True  # the translator only reads it
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume  # not the image
    fetcher_mount, fetcher_volume = mount_of(fetcher, volumes, store)
    assert fetcher_volume is volume and not fetcher_mount.get("readOnly", False)
    # Both read the same names; the translator never downloads (a model missing from the volume
    # stops its start with one line).
    assert value_of(container, "NMT_MODELS") == value_of(fetcher, "NMT_MODELS")
    assert settings["HF_HUB_OFFLINE"] == "1"
    # What the fetch writes (huggingface_hub's cache and home, $HOME, $TMPDIR) is on writable
    # volumes: the root filesystem is read-only.
    for name in ("HF_HOME", "HF_HUB_CACHE", "HOME", "TMPDIR"):
        path = value_of(fetcher, name)
        written, written_volume = mount_of(fetcher, volumes, path)
        assert not written.get("readOnly", False) and "emptyDir" in written_volume, name
        # The hub's downloads, in the models volume, are hidden from the translator's listing.
        if name.startswith("HF_") and written_volume is volume:
            assert Path(path).relative_to(store).parts[0].startswith("."), name
    # The init container runs the script of base/fetch_model.py, carried by a generated ConfigMap
    # mounted where the command expects it, with the image's Python: the project's own fetcher.
    assert fetcher["command"][:-1] == ["python"]
    assert "ENV PATH=/opt/venv/bin:$PATH" in (REPO / "Dockerfile").read_text()  # the project's venv
    script = Path(fetcher["command"][-1])
    script_mount, script_volume = mount_of(fetcher, volumes, str(script))
    configmap = one(docs, "ConfigMap", script_volume["configMap"]["name"])
    assert configmap["data"][script.name] == (KUBE / "base" / "fetch_model.py").read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(configmap["data"][script.name]))
        if isinstance(node, ast.ImportFrom)
    }
    assert {"model.fetch", "model.directory"} <= imported
    # Its source: a ConfigMap whose name carries a hash of its content (configMapGenerator), so
    # that new names or a new URL roll the pods out.
    sources = {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for c in (fetcher, container)
        for e in c["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    (source,) = sources
    assert one(docs, "ConfigMap", source)["data"] == {"models": "", "url": "", "sha256": ""}
    assert source.startswith("nmt-model-")
    # A token for gated repositories, when its Secret exists; the pod starts without it.
    assert value_of(fetcher, "HF_TOKEN")["secretKeyRef"]["optional"] is True


def test_settings_and_resources_fit_the_device(docs: tuple[Doc, ...]) -> None:
    container = translator(docs)
    settings = env(container)
    unknown = {n for n in settings if n.startswith(ENV_PREFIX)} - {
        ENV_PREFIX + f.upper() for f in Settings.model_fields
    }
    assert not unknown, f"not settings of app/config.py: {unknown}"
    Settings.model_validate(
        {k.removeprefix(ENV_PREFIX).lower(): v for k, v in settings.items() if k.startswith(ENV_PREFIX)}
    )
    resources = container["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), kind
    # The service would count the node's cores, not the container's: workers x threads are set
    # to what the pod requests.
    assert int(settings["NMT_REPLICAS"]) * int(settings["NMT_THREADS"]) <= int(resources["requests"]["cpu"])
    spec = pod_spec(docs)
    image = container["image"]
    if settings["NMT_DEVICE"] == "cuda":
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert spec["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert image == "nmt-service:cuda"
    else:
        assert settings["NMT_DEVICE"] == "cpu"
        assert "nvidia.com/gpu" not in resources["limits"] and "nodeSelector" not in spec
        assert image == "nmt-service:cpu"
    assert all(c["image"] == image for c in spec["initContainers"])  # the fetcher runs the same image


def test_the_overlays_agree_with_docker_compose() -> None:
    """Same images, and the same settings where compose sets them."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for overlay, service in (("cpu", "translator"), ("gpu", "translator-gpu")):
        container = translator(render(overlay))
        assert container["image"] == services[service]["image"]
        compose_env = {k: str(v) for k, v in services[service]["environment"].items()}
        if service == "translator-gpu":  # YAML merge (<<) gives it the shared values too
            compose_env = {**services["translator"]["environment"], **compose_env}
        # (Values compose takes from the user's environment, NMT_MODELS="${NMT_MODELS:-}", are the
        # user's choice at `docker compose up`, not settings of the file; in Kubernetes the Redis
        # URL, which holds a password, comes from a Secret.)
        compose_env = {k: v for k, v in compose_env.items() if "${" not in str(v)}
        # The proxies trusted to name the client are each deployment's own network's: both name some.
        assert compose_env.pop("FORWARDED_ALLOW_IPS") and env(container)["FORWARDED_ALLOW_IPS"]
        assert {k: env(container)[k] for k in compose_env} == compose_env, overlay
        for name, key in (("NMT_REDIS_URL", "redis-url"), ("NMT_DATABASE_URL", "database-url")):
            (url,) = [e for e in container["env"] if e["name"] == name]
            assert url["valueFrom"]["secretKeyRef"] == {"name": "nmt-stores", "key": key, "optional": True}


# -- Service, ServiceMonitor, PodDisruptionBudget, dashboard ----------------------------------------


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def test_service_monitor_and_budget_select_the_pods(docs: tuple[Doc, ...]) -> None:
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert matches(service["spec"]["selector"], pod_labels)
    assert matches(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in translator(docs)["ports"]}
    monitor = one(docs, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] in route_paths(metrics_route.api)
    # The compose deployment's Prometheus scrapes as often.
    compose_prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert endpoint["interval"] == compose_prometheus["global"]["scrape_interval"]


def test_dashboard_configmap_is_the_dashboard_file(docs: tuple[Doc, ...]) -> None:
    (configmap,) = [
        d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"].get("labels", {})
    ]
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


# -- the autoscaler and its metric -----------------------------------------------------------------


@functools.cache
def app_metrics() -> dict[str, str]:
    """Name -> type (Counter, Gauge, Histogram) of every metric app/monitoring/metrics.py defines."""
    found = {}
    for node in ast.walk(ast.parse((REPO / "app" / "monitoring" / "metrics.py").read_text())):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Name) and func.id in {"Counter", "Gauge", "Histogram"}:
            assert isinstance(node, ast.Call)
            name = node.args[0]
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            found[name.value] = func.id
    assert "nmt_requests_total" in found
    return found


def adapter_rules() -> list[Doc]:
    rules: list[Doc] = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return rules


def series_name(rule: Doc) -> str:
    return str(rule["seriesQuery"]).split("{")[0].strip("'\" ")


def test_adapter_rules_serve_gauges_of_the_service() -> None:
    rules = adapter_rules()
    assert rules
    for rule in rules:
        name = series_name(rule)
        # A gauge: an average of a counter or histogram series would mean nothing.
        assert app_metrics().get(name) == "Gauge", f"{name} is not a gauge of app/monitoring/metrics.py"
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        assert rule["name"]["as"] == name


def test_autoscaler_scales_on_the_queue_with_cpu_as_fallback(docs: tuple[Doc, ...]) -> None:
    hpa, deployment = one(docs, "HorizontalPodAutoscaler"), one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    served = {rule["name"]["as"] for rule in adapter_rules()}
    pods = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert [p["metric"]["name"] for p in pods] == ["nmt_queue_depth_sentences"]
    assert {p["metric"]["name"] for p in pods} <= served
    # Below the point where a pod refuses work: a queue that could never average the target
    # would never scale.
    max_queue = int(env(translator(docs))["NMT_MAX_QUEUE"])
    assert 0 < float(pods[0]["target"]["averageValue"]) < max_queue
    cpu = [m["resource"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    assert [(r["name"], r["target"]["type"]) for r in cpu] == [("cpu", "Utilization")]
    assert "cpu" in translator(docs)["resources"]["requests"]  # utilization is of the request
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def expand(query: str, series: str, matchers: str, group_by: str) -> str:
    """prometheus-adapter's template expansion of a rule's metricsQuery."""
    return (
        query.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", group_by)
    )


def test_adapter_queries_give_each_pod_its_average_over_a_minute(tmp_path: Path) -> None:
    """The rules' PromQL, expanded as the adapter does for a request about two pods, run by
    promtool on series that change within the minute: one value per pod of its namespace, the
    minute's average rather than the last sample."""
    tests = []
    for rule in adapter_rules():
        series = series_name(rule)
        tests.append(
            {
                "interval": "15s",
                "input_series": [
                    # Samples at 0, 15, ..., 120 s; the minute before 120 s averages 200 (whether
                    # or not the sample at 60 s counts), its last sample is 300.
                    {
                        "series": f'{series}{{namespace="nmt",pod="a"}}',
                        "values": "0 0 0 0 200 100 300 100 300",
                    },
                    {"series": f'{series}{{namespace="nmt",pod="b"}}', "values": "5x8"},
                    {"series": f'{series}{{namespace="nmt",pod="c"}}', "values": "900x8"},
                    {"series": f'{series}{{namespace="other",pod="a"}}', "values": "900x8"},
                ],
                "promql_expr_test": [
                    {
                        "expr": expand(rule["metricsQuery"], series, 'namespace="nmt",pod=~"a|b"', "pod"),
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": '{pod="a"}', "value": 200},
                            {"labels": '{pod="b"}', "value": 5},
                        ],
                    }
                ],
            }
        )
    (tmp_path / "rules.yml").write_text("groups: []\n")
    (tmp_path / "test.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": tests}))
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- The trial overlay with Redis ---------------------------------------------------------------------


def test_the_stores_overlay_runs_redis_and_gives_the_translators_its_url() -> None:
    """overlays/stores: the CPU overlay unchanged, plus a Redis (non-root, read-only root filesystem)
    behind a Service, and the nmt-stores Secret whose URL names that Service, its port and the
    password Redis is started with: the Secret the translator's NMT_REDIS_URL reads."""
    docs = render("stores")
    for doc in docs:
        validate(doc)
    cpu = render("cpu")
    extra = ("redis", "postgres", "nmt-stores")
    assert [d for d in docs if d["metadata"]["name"] not in extra] == list(cpu)
    redis, service = one(docs, "Deployment", "redis"), one(docs, "Service", "redis")
    pod = redis["spec"]["template"]
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert not matches(one(cpu, "Service")["spec"]["selector"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "nmt-stores")["data"].items()}
    url = urlparse(secret["redis-url"])
    (port,) = service["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", port["port"])
    assert url.password == secret["redis-password"]
    (password,) = [e for e in container["env"] if e["name"] == "REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "nmt-stores", "key": "redis-password"}
    assert "$(REDIS_PASSWORD)" in container["args"]
    translators = tuple(d for d in docs if d["metadata"]["name"] not in ("redis", "postgres"))
    (redis_url,) = [e for e in translator(translators)["env"] if e["name"] == "NMT_REDIS_URL"]
    assert redis_url["valueFrom"]["secretKeyRef"]["name"] == "nmt-stores"


def test_the_stores_overlay_runs_postgresql_and_gives_the_translators_its_url() -> None:
    """overlays/stores: a PostgreSQL (non-root, read-only root filesystem, one at a time on its
    data) behind a Service, and the Secret's database URL naming that Service, its port, the user and
    database PostgreSQL is made with and the password it is given: the URL NMT_DATABASE_URL reads."""
    docs = render("stores")
    postgres, service = one(docs, "Deployment", "postgres"), one(docs, "Service", "postgres")
    pod = postgres["spec"]["template"]
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert not matches(one(docs, "Service", "nmt-service")["spec"]["selector"], pod["metadata"]["labels"])
    assert postgres["spec"]["strategy"]["type"] == "Recreate"
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert re.fullmatch(r"postgres:\d+\.\d+-alpine", container["image"])
    secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "nmt-stores")["data"].items()}
    url = urlparse(secret["database-url"])
    (port,) = service["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port) == ("postgresql", "postgres", port["port"])
    made = {e["name"]: e for e in container["env"]}
    assert (url.username, url.path) == (made["POSTGRES_USER"]["value"], "/" + made["POSTGRES_DB"]["value"])
    assert url.password == secret["postgres-password"]
    assert made["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "nmt-stores",
        "key": "postgres-password",
    }
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert made["PGDATA"]["value"].startswith("/var/lib/postgresql/data/") and "/var/run/postgresql" in mounts
