"""deploy/k8s: the base and every overlay render, validate against the Kubernetes OpenAPI schema,
and agree with the images, the services' settings and each other (selectors, ports, env); the
scale-out facts (replicas, disruption budgets, leases, the Redis choices) hold in each."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .artifacts import (
    HTTP_PORTS,
    K8S,
    KUSTOMIZATIONS,
    PORTS,
    REDIS,
    REQUIRED,
    SERVICES,
    SOCKET_PORTS,
    image_key,
    images,
    public_ports,
    rendered,
    settings,
)
from .kustomize import load_documents, render

# the oldest Kubernetes the manifests are for (gRPC probes are GA since 1.27) and the newest schema
# kubernetes-validate ships
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# ids other than "gpu": tests/conftest.py skips every test with a "gpu" keyword where there is no CUDA device
NAMES = [pytest.param(name, id=f"k8s-{name}") for name in KUSTOMIZATIONS]
# created by the operator before `kubectl apply -k` (deploy/README.md), so absent from the render
TLS_SECRETS = {("Secret", f"specinfer-tls-{service}") for service in SERVICES} | {("Secret", "specinfer-tokens")}
GPU_CLUSTER = {("Secret", "specinfer-redis"), ("PersistentVolumeClaim", "specinfer-models")}
EXTERNAL = {
    "gpu": GPU_CLUSTER,
    "multi-gpu": GPU_CLUSTER,
    "tls": GPU_CLUSTER | TLS_SECRETS,
    "external-redis": GPU_CLUSTER,  # its Secret holds the URL too
    "redis-cluster": GPU_CLUSTER,
    "base": {("PersistentVolumeClaim", "specinfer-models")},
}
# LLM verifier replicas: one GPU group each where there are GPUs, more than one
VERIFIER_REPLICAS = {
    "base": 1,
    "cpu-dev": 1,
    "gpu": 2,
    "multi-gpu": 2,
    "tls": 2,
    "external-redis": 2,
    "redis-cluster": 2,
}

Obj = dict[str, Any]


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(workload, container) for every container of every Deployment, StatefulSet and Job."""
    return [(o, c) for o in objects if o["kind"] in WORKLOADS for c in o["spec"]["template"]["spec"]["containers"]]


def service_of(container: Obj) -> str | None:
    """Which specinfer service a container runs (None: not one of ours, e.g. Redis)."""
    image = images().get(image_key(container["image"]))
    return image.service if image else None


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def environment(objects: list[Obj], container: Obj) -> dict[str, str]:
    """The container's variables: the image's ENV, then envFrom ConfigMaps, then env (Kubernetes'
    precedence); values from Secrets read ``<secret:name/key>``."""
    config_maps = by_kind(objects, "ConfigMap")
    image = images()[image_key(container["image"])]
    out = dict(image.env())
    for source in container.get("envFrom", []):
        out.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        out[var["name"]] = f"<secret:{ref['name']}/{ref['key']}>" if ref else var["value"]
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schema(name, version):
    objects = rendered(name)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_catches_mistakes():
    deployment = copy.deepcopy(by_kind(rendered("base"), "Deployment")["ssm-worker"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50052
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(by_kind(rendered("base"), "Deployment")["ssm-worker"])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50052"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def _kustomize_version() -> tuple[int, ...] | None:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    found = re.search(r"v(\d+)\.(\d+)", json.loads(out.stdout or "{}").get("kustomizeVersion", ""))
    return tuple(int(x) for x in found.groups()) if found else None


@pytest.mark.parametrize("name", NAMES)
def test_the_renderer_agrees_with_kubectl_kustomize(name):
    version = _kustomize_version()
    if version is None or version < (5, 0):
        pytest.skip("needs kubectl with kustomize >= 5 (the renderer in tests/deploy/kustomize.py stands in for it)")
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = [doc for doc in yaml.safe_load_all(out) if doc]

    def ident(o: Obj) -> tuple[str, str, str]:
        return o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]

    assert sorted(map(ident, rendered(name))) == sorted(map(ident, theirs))
    assert {ident(o): o for o in rendered(name)} == {ident(o): o for o in theirs}


@pytest.mark.parametrize("name", NAMES)
def test_selectors_match_the_pods(name):
    objects = rendered(name)
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in WORKLOADS}
    for w in workloads.values():
        if w["kind"] != "Job":  # a Job's selector is generated
            assert matches(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])

    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n, w in workloads.items() if matches(selector, w["spec"]["template"]["metadata"]["labels"])]

    for svc in by_kind(objects, "Service").values():
        assert len(selected(svc["spec"]["selector"])) == 1, svc["metadata"]["name"]
    for pdb in by_kind(objects, "PodDisruptionBudget").values():
        assert selected(pdb["spec"]["selector"]["matchLabels"]) == [pdb["metadata"]["name"]]
    for name_, w in workloads.items():  # pods spread over nodes count their own workload's pods
        for spread in w["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert selected(spread["labelSelector"]["matchLabels"]) == [name_]
    for policy in by_kind(objects, "NetworkPolicy").values():
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        assert selected(selector), policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                assert "podSelector" in peer or "namespaceSelector" in peer, policy["metadata"]["name"]
                if "podSelector" in peer:  # a peer in this namespace must be one of our pods
                    assert selected(peer["podSelector"]["matchLabels"]), policy["metadata"]["name"]
    for hpa in by_kind(objects, "HorizontalPodAutoscaler").values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in workloads
        assert "replicas" not in workloads[target["name"]]["spec"], "the HPA owns the replica count"
    for sts in by_kind(objects, "StatefulSet").values():
        assert by_kind(objects, "Service")[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


METRICS_PORT = 9464
HEALTHCHECK = ["python", "-m", "specinfer.serving.healthcheck"]


def probe_port(container: Obj, probe: Obj, env: dict[str, str]) -> tuple[str, int]:
    """(kind, port number) a probe checks: ``grpc`` health, ``tcp`` connect, ``http`` GET, or ``exec``
    of the image's health check, which dials 127.0.0.1:$SPECINFER_PORT when given no address
    (``env``: the container's variables)."""
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    if "grpc" in probe:
        return "grpc", probe["grpc"]["port"]
    if "tcpSocket" in probe:
        return "tcp", named.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
    if "httpGet" in probe:
        assert probe["httpGet"]["path"] == "/health"
        return "http", named.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
    command = probe["exec"]["command"]
    assert command[:3] == HEALTHCHECK and all(a.startswith("--") for a in command[3::2]), (
        command
    )  # flags only: no address
    return "exec", int(env["SPECINFER_PORT"])


@pytest.mark.parametrize("name", NAMES)
def test_ports_agree(name):
    """Container ports = SPECINFER_PORT (grpc) and SPECINFER_HTTP_PORT (http, the request manager) =
    the image's EXPOSE = the ports of the probes, Services and NetworkPolicies; the metrics port =
    SPECINFER_METRICS_PORT = the scrape annotation = its NetworkPolicy's port."""
    objects = rendered(name)
    seen = set()
    for workload, container in containers(objects):
        service = service_of(container)
        if service is None:
            continue
        seen.add(service)
        port = PORTS[service]
        public = public_ports(service)
        env = environment(objects, container)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named == {"grpc": port, "metrics": METRICS_PORT} | (
            {"http": HTTP_PORTS[service]} if service in HTTP_PORTS else {}
        ) | ({"socket": SOCKET_PORTS[service]} if service in SOCKET_PORTS else {})
        assert env["SPECINFER_PORT"] == str(port)
        assert env.get("SPECINFER_SOCKET_PORT") == (str(SOCKET_PORTS[service]) if service in SOCKET_PORTS else None)
        assert env.get("SPECINFER_HTTP_PORT") == (str(HTTP_PORTS[service]) if service in HTTP_PORTS else None)
        assert env["SPECINFER_METRICS_PORT"] == str(METRICS_PORT)
        assert workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
        probes = {
            probe: probe_port(container, container[probe], env)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        if service == "request-manager":
            # ready when HTTP /health says so (start-up done, the verifier reachable); alive while the gRPC port accepts
            assert probes == {
                "startupProbe": ("tcp", port),
                "readinessProbe": ("http", HTTP_PORTS[service]),
                "livenessProbe": ("tcp", port),
            }
        else:
            assert {kind for kind, _ in probes.values()} <= {"grpc", "exec"} and {p for _, p in probes.values()} == {
                port
            }, probes
        assert images()[image_key(container["image"])].stage.expose == public
        labels = workload["spec"]["template"]["metadata"]["labels"]
        services = [s for s in by_kind(objects, "Service").values() if matches(s["spec"]["selector"], labels)]
        assert services, service
        for s in services:
            assert sorted(p["port"] for p in s["spec"]["ports"]) == sorted(public), s["metadata"]["name"]
            for p in s["spec"]["ports"]:
                assert named.get(p["targetPort"], p["targetPort"]) == p["port"]
        policies = [
            p
            for p in by_kind(objects, "NetworkPolicy").values()
            if p["spec"]["podSelector"].get("matchLabels") and matches(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        assert sorted(
            sorted(q["port"] for rule in p["spec"]["ingress"] for q in rule["ports"]) for p in policies
        ) == sorted([sorted(public), [METRICS_PORT]])
    assert seen == set(SERVICES)


@pytest.mark.parametrize("name", NAMES)
def test_every_variable_is_a_setting_and_every_required_one_is_set(name):
    objects = rendered(name)
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for _, container in containers(objects):
        service = service_of(container)
        if service is None:
            continue
        env = environment(objects, container)
        ours = {k for k in env if k.startswith("SPECINFER_")}
        assert ours <= set(settings(service)), (service, sorted(ours - set(settings(service))))
        assert REQUIRED[service] <= {k for k, v in env.items() if v}, (service, sorted(REQUIRED[service] - set(env)))
        assert env["SPECINFER_HOST"] == "0.0.0.0"
        for var in container.get("env", []):  # set in the pod spec: SPECINFER_* only (the image sets the rest)
            assert var["name"].startswith("SPECINFER_")
        for var in container.get("env", []) + container.get("envFrom", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef") or var.get("configMapRef")
            if ref:
                kind = "ConfigMap" if "configMapRef" in var else "Secret"
                assert (kind, ref["name"]) in present | EXTERNAL.get(name, set()), ref
    for cm in by_kind(objects, "ConfigMap").values():  # fixed in the Deployments, next to the ports
        assert not {"SPECINFER_HOST", "SPECINFER_PORT", "SPECINFER_HTTP_PORT"} & set(cm["data"]), cm["metadata"]["name"]


@pytest.mark.parametrize("name", NAMES)
def test_images_run_the_dockerfiles_entry_points(name):
    for _, container in containers(rendered(name)):
        assert not container["image"].endswith(":latest") and ":" in container["image"]
        if service_of(container) is None:
            assert container["image"].startswith("redis:")
            continue
        assert "command" not in container and "args" not in container, "the image's ENTRYPOINT starts the service"
        image = images()[image_key(container["image"])]
        assert container["name"] == image.service
        assert image.stage.user == "10001:10001"


def test_gpu_overlay_puts_the_models_on_gpus():
    for name in KUSTOMIZATIONS:
        device = "cpu" if name in ("base", "cpu-dev") else "cuda"
        objects = rendered(name)
        for _, container in containers(objects):
            service = service_of(container)
            limits = container["resources"].get("limits", {})
            if service in ("ssm-worker", "llm-verifier"):
                env = environment(objects, container)
                assert env["SPECINFER_DEVICE"] == device
                assert images()[image_key(container["image"])].variant == device
                # one GPU per rank of the verifier (tensor x pipeline parallel)
                ranks = int(env.get("SPECINFER_TENSOR_PARALLEL", 1)) * int(env.get("SPECINFER_PIPELINE_PARALLEL", 1))
                assert ranks == 1 or (service == "llm-verifier" and name == "multi-gpu")
                assert limits.get("nvidia.com/gpu") == (ranks if device == "cuda" else None)
                # torch's default thread count is the node's, not the container's: keep them equal
                assert environment(objects, container)["SPECINFER_TORCH_THREADS"] == str(limits["cpu"])
            else:
                assert "nvidia.com/gpu" not in limits


# (pods, port) -> the pods of this namespace that may connect there, by the Redis the overlay uses:
# the request manager reaches the model services and Redis; Redis Cluster nodes also reach each
# other (replication on 6379, the cluster bus on 16379) and the Job that forms the cluster reaches them
INTERNAL = {
    ("ssm-worker", 50052): {"request-manager"},
    ("ssm-worker", 50062): {"request-manager"},  # its socket
    ("llm-verifier", 50053): {"request-manager"},
    ("llm-verifier", 50063): {"request-manager"},  # its socket
}
REDIS_INGRESS = {
    "single": {("redis", 6379): {"request-manager"}},
    "external": {},
    "cluster": {
        ("redis-cluster", 6379): {"request-manager", "redis-cluster", "redis-cluster-create"},
        ("redis-cluster", 16379): {"redis-cluster"},
    },
}


@pytest.mark.parametrize("name", NAMES)
def test_each_internal_port_is_open_only_to_the_pods_that_use_it(name):
    policies = by_kind(rendered(name), "NetworkPolicy")
    deny = policies.pop("default-deny-ingress")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    public = policies.pop("request-manager-public-api")  # gRPC and HTTP, from anywhere
    assert public["spec"]["ingress"] == [
        {"ports": [{"port": port, "protocol": "TCP"} for port in public_ports("request-manager")]}
    ]
    metrics = policies.pop("metrics-from-monitoring")  # the metrics port only, from one other namespace
    assert metrics["spec"]["ingress"] == [
        {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
        }
    ]
    allowed: dict[tuple[str, int], set[str]] = {}
    for policy in policies.values():
        target = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in policy["spec"]["ingress"]:
            peers = set()
            for peer in rule["from"]:  # specinfer pods of this namespace, by name
                assert set(peer) == {"podSelector"}, policy["metadata"]["name"]
                labels = peer["podSelector"]["matchLabels"]
                assert (
                    set(labels) == {"app.kubernetes.io/name", "app.kubernetes.io/part-of"}
                    and labels["app.kubernetes.io/part-of"] == "specinfer"
                )
                peers.add(labels["app.kubernetes.io/name"])
            for port in rule["ports"]:
                assert port["protocol"] == "TCP"
                allowed.setdefault((target, port["port"]), set()).update(peers)
    assert allowed == INTERNAL | REDIS_INGRESS[REDIS.get(name, "single")]


@pytest.mark.parametrize("name", NAMES)
def test_the_request_manager_finds_the_others_through_headless_services(name):
    """Every SSM worker and every verifier replica through a headless Service (one DNS record per
    ready pod), and the Redis the overlay chose: the base's single Redis, an external one (its URL in
    the Secret), or the Redis Cluster (through any node, with the cluster client)."""
    objects = rendered(name)
    services = by_kind(objects, "Service")
    env = environment(
        objects, by_kind(objects, "Deployment")["request-manager"]["spec"]["template"]["spec"]["containers"][0]
    )
    for variable, service in (("SPECINFER_SSM_WORKERS", "ssm-worker"), ("SPECINFER_VERIFIER", "llm-verifier")):
        assert env[variable] == f"dns:///{service}:{PORTS[service]}"
        assert services[service]["spec"]["clusterIP"] == "None"
    assert env["SPECINFER_REDIS_PASSWORD"] == "<secret:specinfer-redis/password>"
    statefulsets = by_kind(objects, "StatefulSet")
    redis = REDIS.get(name, "single")
    if redis == "single":
        assert env["SPECINFER_REDIS_URL"] == "redis://redis:6379/0" and "SPECINFER_REDIS_CLUSTER" not in env
        assert set(statefulsets) == {"redis"}
        container = statefulsets["redis"]["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
        assert {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"]}["REDIS_PASSWORD"] == {
            "name": "specinfer-redis",
            "key": "password",
        }
    elif redis == "external":
        assert env["SPECINFER_REDIS_URL"] == "<secret:specinfer-redis/url>" and "SPECINFER_REDIS_CLUSTER" not in env
        assert (
            "SPECINFER_REDIS_URL" not in by_kind(objects, "ConfigMap")["specinfer-request-manager"]["data"]
        )  # one place says where Redis is
        assert not statefulsets and "redis" not in services
    else:
        assert env["SPECINFER_REDIS_URL"] == "redis://redis-cluster:6379" and env["SPECINFER_REDIS_CLUSTER"] == "1"
        assert set(statefulsets) == {"redis-cluster"} and services["redis-cluster"]["spec"]["clusterIP"] == "None"
        assert "redis" not in services


@pytest.mark.parametrize("name", NAMES)
def test_replicas_disruption_budgets_and_leases(name):
    """Two request managers, and a drain never takes the last; each owns its requests through a
    lease the other adopts them after. Verifier replicas: more than one wherever there are GPUs,
    replaced one at a time without a GPU more than they hold. Every model service and Redis Cluster
    loses at most one pod to a drain."""
    objects = rendered(name)
    deployments = by_kind(objects, "Deployment")
    budgets = {n: b["spec"] for n, b in by_kind(objects, "PodDisruptionBudget").items()}
    assert deployments["request-manager"]["spec"]["replicas"] == 2
    assert budgets["request-manager"]["minAvailable"] == 1 and "maxUnavailable" not in budgets["request-manager"]
    env = environment(objects, deployments["request-manager"]["spec"]["template"]["spec"]["containers"][0])
    assert float(env["SPECINFER_LEASE_SECONDS"]) > 0
    assert "SPECINFER_OWNER" not in env  # the host name, i.e. the pod's name: unique per pod, new for a replacement
    verifier = deployments["llm-verifier"]["spec"]
    assert verifier["replicas"] == VERIFIER_REPLICAS[name]
    assert verifier["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    expected = {"ssm-worker", "llm-verifier"} | ({"redis-cluster"} if REDIS.get(name) == "cluster" else set())
    assert {n: b.get("maxUnavailable") for n, b in budgets.items() if n != "request-manager"} == dict.fromkeys(
        expected, 1
    )


def redis_part(objects: list[Obj]) -> tuple[dict[tuple[str, str], Obj], dict[str, str]]:
    """The objects of the Redis the request managers use (names with "redis", the password Secret
    aside) and the request manager's Redis settings."""
    env = environment(
        objects, by_kind(objects, "Deployment")["request-manager"]["spec"]["template"]["spec"]["containers"][0]
    )
    ours = {
        (o["kind"], o["metadata"]["name"]): o
        for o in objects
        if "redis" in o["metadata"]["name"] and o["kind"] != "Secret"
    }
    return ours, {k: v for k, v in env.items() if k.startswith("SPECINFER_REDIS")}


@pytest.mark.parametrize("component", [c for c in REDIS if c != "single"])
@pytest.mark.parametrize("overlay", [pytest.param(name, id=f"k8s-{name}") for name in ("cpu-dev", "multi-gpu", "tls")])
def test_the_redis_components_apply_to_every_overlay(component, overlay, tmp_path):
    """deploy/README.md says to list components/external-redis or components/redis-cluster in any
    overlay: rendered so, the result validates and has the same Redis as overlays/<component>."""
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    relative = {
        "resources": [os.path.relpath(KUSTOMIZATIONS[overlay], tmp_path)],
        "components": [os.path.relpath(K8S / "components" / component, tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(kustomization | relative)
    )  # kustomize refuses absolute paths
    objects = render(tmp_path)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[0], strict=True)
    assert redis_part(objects) == redis_part(rendered(component))
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} - set(redis_part(objects)[0]) == {
        (o["kind"], o["metadata"]["name"])
        for o in rendered(overlay)
        if "redis" not in o["metadata"]["name"] or o["kind"] == "Secret"
    }
    if (_kustomize_version() or (0,)) >= (5, 0):
        out = subprocess.run(
            ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert sorted((o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out) if o) == sorted(
            (o["kind"], o["metadata"]["name"]) for o in objects
        )


@pytest.mark.parametrize("overlay", [pytest.param(name, id=f"k8s-{name}") for name in ("cpu-dev", "gpu")])
def test_each_overlay_has_one_settings_file(overlay):
    """What users change lives in the overlay's settings.yaml: the three ConfigMaps (models, token
    tree, batch limits), the request manager's and the verifier's replicas and the SSM workers'
    autoscaling bounds."""
    patches = load_documents(K8S / "overlays" / overlay / "settings.yaml")
    assert {(p["kind"], p["metadata"]["name"]) for p in patches} == {
        ("ConfigMap", "specinfer-request-manager"),
        ("ConfigMap", "specinfer-ssm-worker"),
        ("ConfigMap", "specinfer-llm-verifier"),
        ("Deployment", "request-manager"),
        ("Deployment", "llm-verifier"),
        ("HorizontalPodAutoscaler", "ssm-worker"),
    }
    data = {p["metadata"]["name"]: p.get("data", {}) for p in patches if p["kind"] == "ConfigMap"}
    assert {"SPECINFER_MODEL_DIR", "SPECINFER_EXPANSION", "SPECINFER_MAX_BATCH"} <= set(
        data["specinfer-request-manager"]
    )
    assert "SPECINFER_SSM" in data["specinfer-ssm-worker"] and "SPECINFER_LLM" in data["specinfer-llm-verifier"]
