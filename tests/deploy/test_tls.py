"""TLS, mTLS and tokens in the deployments: docker-compose.tls.yml, deploy/k8s/components/tls (and
overlays/tls), deploy/tls/make-certs.sh and the commands deploy/README.md gives for the Secrets.
They agree with each other: every file a service is told about is mounted in it and is the right
one, the script makes every file the secrets read, with the names the services are dialled by,
and the probes speak TLS. That the services start and serve with them: the tls case of
test_compose.py::test_compose_services_start_as_local_processes."""

from __future__ import annotations

import copy
import ipaddress
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID

from specinfer.serving import healthcheck
from specinfer.serving.config import env_name

from .artifacts import (
    K8S,
    KUSTOMIZATIONS,
    MAKE_CERTS,
    REPO,
    SERVICES,
    compose,
    image_for,
    make_certs,
    secret_files,
    settings,
)
from .kustomize import render
from .test_kubernetes import KUBERNETES_VERSIONS, WORKLOADS, by_kind, service_of

Obj = dict[str, Any]
OURS = ("request-manager", "ssm-worker", "llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu")
HEALTHCHECK = ["python", "-m", "specinfer.serving.healthcheck"]
# the variables that name TLS files and tokens, and the file each must be (by the script's names;
# <service>: the service's own certificate)
SERVER = {"SPECINFER_TLS_CERT": "<service>.crt", "SPECINFER_TLS_KEY": "<service>.key"}
EXPECTED = {
    "request-manager": {
        **SERVER,
        "SPECINFER_AUTH_TOKEN_FILE": "auth-token",
        "SPECINFER_TLS_CA": "ca.crt",
        "SPECINFER_TLS_CLIENT_CERT": "<service>.crt",
        "SPECINFER_TLS_CLIENT_KEY": "<service>.key",
        "SPECINFER_INTERNAL_TOKEN_FILE": "internal-token",
    },
    "ssm-worker": {**SERVER, "SPECINFER_TLS_CLIENT_CA": "ca.crt", "SPECINFER_INTERNAL_TOKEN_FILE": "internal-token"},
    "llm-verifier": {**SERVER, "SPECINFER_TLS_CLIENT_CA": "ca.crt", "SPECINFER_INTERNAL_TOKEN_FILE": "internal-token"},
}
# the health check's flags for a port that asks for a client certificate: the files the server itself uses
PROBE_FLAGS = {
    "--tls-ca": "SPECINFER_TLS_CLIENT_CA",
    "--tls-client-cert": "SPECINFER_TLS_CERT",
    "--tls-client-key": "SPECINFER_TLS_KEY",
}
TLS_VARIABLES = {v for files in EXPECTED.values() for v in files}
# Kubernetes: the key of the service's own Secret (specinfer-tls-<service>) holding each file; the
# tokens are keys of specinfer-tokens named as the files
SECRET_KEYS = {"<service>.crt": "tls.crt", "<service>.key": "tls.key", "ca.crt": "ca.crt"}


def expected_file(service: str, name: str) -> str:
    return name.replace("<service>", service)


def flags(command: list[str]) -> dict[str, str]:
    rest = command[len(HEALTHCHECK) :]
    assert len(rest) % 2 == 0 and all(f.startswith("--") for f in rest[::2]), command
    return dict(zip(rest[::2], rest[1::2], strict=True))


def test_every_tls_variable_is_a_setting_of_its_service():
    for service, variables in EXPECTED.items():
        assert set(variables) <= set(settings(service)), (service, sorted(set(variables) - set(settings(service))))


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-client-cert"])
def test_the_health_check_reads_the_request_managers_tls_variables(flag, monkeypatch, tmp_path, capsys):
    """The request manager's container health check has no flags: it finds the CA (and client
    certificate) in the variables that configure the request manager's own calls."""
    variable = env_name(flag)
    assert variable in settings("request-manager")
    monkeypatch.setenv(variable, str(tmp_path / "missing.pem"))
    with pytest.raises(SystemExit) as exc:
        healthcheck.main(["127.0.0.1:1"])
    assert exc.value.code == 2 and flag.removeprefix("--") in capsys.readouterr().err


def test_without_the_tls_files_nothing_changes():
    """Plain `docker compose up` and the other overlays: no TLS, no tokens, no secrets mounted."""
    document = compose()
    assert "secrets" not in document
    for name in OURS:
        assert "secrets" not in document["services"][name]
        assert not TLS_VARIABLES & set(document["services"][name]["environment"]), name
    for overlay in ("base", "cpu-dev", "gpu", "multi-gpu"):
        for workload in (o for o in render(KUSTOMIZATIONS[overlay]) if o["kind"] in WORKLOADS):
            pod = workload["spec"]["template"]["spec"]
            assert not [v for v in pod.get("volumes", []) if "secret" in v], (overlay, workload["metadata"]["name"])
            assert not TLS_VARIABLES & {v["name"] for c in pod["containers"] for v in c.get("env", [])}, overlay


# -- Compose ------------------------------------------------------------------------------------


def test_compose_tls_gives_every_service_its_files():
    """Each service's TLS variables name /run/secrets files that are mounted in it and read the
    right host file: its own certificate and key, the CA, the tokens it needs and no others."""
    variables = {"SPECINFER_TLS_DIR": "/srv/tls"}
    document = compose(variables, "tls")
    used: set[str] = set()
    for name in OURS:
        service = document["services"][name]
        image = image_for(service["build"])
        mounted = secret_files("tls", name, variables)
        env = {k: v for k, v in service["environment"].items() if k in TLS_VARIABLES}
        assert set(env) == set(EXPECTED[image.service]), name
        for variable, path in env.items():
            assert mounted[path] == f"/srv/tls/{expected_file(image.service, EXPECTED[image.service][variable])}", (
                name,
                variable,
            )
        test = service["healthcheck"]["test"][1:]
        assert test[:3] == HEALTHCHECK
        probe = flags(test)
        if (
            image.service == "request-manager"
        ):  # its port asks for no client certificate; the probe reads SPECINFER_TLS_CA
            assert probe == {}
        else:
            assert probe == {flag: env[variable] for flag, variable in PROBE_FLAGS.items()}, name
        assert set(mounted) == set(env.values()) | set(probe.values()), (
            name,
            "mounted but unused, or used but not mounted",
        )
        used |= {item["source"] for item in service["secrets"]}
    assert used == set(document["secrets"]), "every secret is mounted somewhere"
    assert all(set(secret) == {"file"} for secret in document["secrets"].values()), "file secrets only: no value inline"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if not shutil.which("openssl"):
        pytest.skip("deploy/tls/make-certs.sh needs openssl")
    return make_certs(tmp_path_factory.mktemp("tls") / "secrets", "api.example.com", "203.0.113.7")


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_make_certs_makes_every_file_the_compose_secrets_read(certs):
    document = compose({"SPECINFER_TLS_DIR": str(certs)}, "tls")
    assert all(Path(secret["file"]).is_file() for secret in document["secrets"].values())
    # readable by the containers' uid through the bind mounts, other host users kept out by the folder
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    for path in certs.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == (0o600 if path.name == "ca.key" else 0o644), path.name
    tokens = [(certs / name).read_text().strip() for name in ("internal-token", "auth-token")]
    assert all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens) and tokens[0] != tokens[1]
    # a second run does not overwrite them
    out = subprocess.run(["bash", str(MAKE_CERTS), "-o", str(certs)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not empty" in out.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_make_certs_names_each_service_as_it_is_dialled(certs, service):
    """Signed by the CA, for server and client authentication, with the names Compose and
    Kubernetes give the service and 127.0.0.1, which the health check in its container dials."""
    ca, cert = load(certs / "ca.crt"), load(certs / f"{service}.crt")
    assert cert.issuer == ca.subject and ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns, ips = set(names.get_values_for_type(x509.DNSName)), set(names.get_values_for_type(x509.IPAddress))
    assert {service, f"{service}.specinfer.svc", f"{service}.specinfer.svc.cluster.local", "localhost"} <= dns
    assert ipaddress.ip_address("127.0.0.1") in ips
    if service == "request-manager":  # the public Service, and the names given on the command line
        assert {"request-manager-public", "request-manager-public.specinfer.svc", "api.example.com"} <= dns
        assert ipaddress.ip_address("203.0.113.7") in ips
    else:
        assert "api.example.com" not in dns
    private = load_pem_private_key((certs / f"{service}.key").read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.public_key() == cert.public_key()


# -- Kubernetes ---------------------------------------------------------------------------------


def pod_files(pod: Obj, container: Obj) -> dict[str, tuple[str, str, int]]:
    """Every file the container sees from a Secret: path -> (Secret, key, mode); mounts read-only."""
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    out = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"])
        if secret is None:
            continue
        assert mount.get("readOnly") is True, mount
        assert "items" in secret or secret["secretName"].startswith("specinfer-tls-"), (
            "name the keys of a Secret shared by pods"
        )
        keys = (
            {i["key"]: i["path"] for i in secret["items"]}
            if "items" in secret
            else {k: k for k in ("tls.crt", "tls.key", "ca.crt")}
        )
        for key, path in keys.items():
            out[f"{mount['mountPath']}/{path}"] = (secret["secretName"], key, secret["defaultMode"])
    return out


def tls_checks(objects: list[Obj]) -> None:
    """What the tls Component guarantees, on a rendered kustomization that has it."""
    seen = set()
    for workload in (o for o in objects if o["kind"] in WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            service = service_of(container)
            if service is None:
                continue
            seen.add(service)
            files = pod_files(pod, container)
            env = {v["name"]: v["value"] for v in container["env"] if v["name"] in TLS_VARIABLES}
            assert set(env) == set(EXPECTED[service]), service
            for variable, path in env.items():
                secret, key, mode = files[path]
                template = EXPECTED[service][variable]
                wanted = (
                    (f"specinfer-tls-{service}", SECRET_KEYS[template])
                    if template in SECRET_KEYS
                    else ("specinfer-tokens", template)
                )
                assert (secret, key) == wanted, (service, variable)
                assert mode in (0o400, 0o440), (
                    f"{service}: mode {mode:o}: owner root and the pods' group (fsGroup) only"
                )
            tokens = {key for secret, key, _ in files.values() if secret == "specinfer-tokens"}
            assert tokens == {v for k, v in EXPECTED[service].items() if k.endswith("TOKEN_FILE")}, (
                f"{service}: only the tokens it needs"
            )
            assert pod["securityContext"]["fsGroup"] == 10001
            probes = {name: container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert not [name for name, probe in probes.items() if "grpc" in probe], (
                f"{service}: grpc probes cannot speak TLS"
            )
            if service == "request-manager":
                assert probes["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
                assert "tcpSocket" in probes["startupProbe"] and "tcpSocket" in probes["livenessProbe"]
            else:
                for name, probe in probes.items():
                    command = probe["exec"]["command"]
                    assert command[:3] == HEALTHCHECK and flags(command) == {
                        f: env[v] for f, v in PROBE_FLAGS.items()
                    }, (service, name)
                    assert probe["timeoutSeconds"] >= 5, (
                        f"{service} {name}: a Python start within the default 1 s is not sure"
                    )
    assert seen == set(SERVICES)


def test_tls_overlay_mounts_each_service_its_files_and_probes_over_tls():
    tls_checks(render(KUSTOMIZATIONS["tls"]))


# ids other than "gpu": tests/conftest.py skips every test with a "gpu" keyword where there is no CUDA device
@pytest.mark.parametrize("overlay", [pytest.param(name, id=f"k8s-{name}") for name in ("cpu-dev", "gpu", "multi-gpu")])
def test_the_tls_component_applies_to_every_overlay(overlay, tmp_path):
    """deploy/README.md says to list components/tls in any overlay: rendered so, the result
    validates and has everything the tls overlay has."""
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    kustomization |= {"resources": [str(KUSTOMIZATIONS[overlay])], "components": [str(K8S / "components/tls")]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = render(tmp_path)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[0], strict=True)
    tls_checks(objects)
    plain = render(KUSTOMIZATIONS[overlay])
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [(o["kind"], o["metadata"]["name"]) for o in plain]


def test_the_checks_catch_a_missing_mount():
    objects = copy.deepcopy(render(KUSTOMIZATIONS["tls"]))
    worker = by_kind(objects, "Deployment")["ssm-worker"]["spec"]["template"]["spec"]
    worker["containers"][0]["volumeMounts"] = [
        m for m in worker["containers"][0]["volumeMounts"] if m["name"] != "tokens"
    ]
    with pytest.raises(KeyError):
        tls_checks(objects)


def readme_secrets() -> dict[str, dict[str, str]]:
    """The `kubectl create secret generic` commands of deploy/README.md's "TLS and tokens": Secret -> {key: file}."""
    section = (REPO / "deploy/README.md").read_text().split("## TLS and tokens\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        found = re.match(r"kubectl -n specinfer create secret generic (\S+) (.*)$", line)
        if found:
            out[found[1]] = dict(re.findall(r"--from-file=([^=\s]+)=(\S+)", found[2]))
    return out


def test_the_documented_secrets_are_those_the_tls_overlay_mounts(certs):
    """Names and keys as the overlay mounts them, filled from the files make-certs.sh writes (the
    documented paths are its default folder): each service's Secret from its own certificate."""
    documented = readme_secrets()
    mounted: dict[str, set[str]] = {}
    for workload in by_kind(render(KUSTOMIZATIONS["tls"]), "Deployment").values():
        pod = workload["spec"]["template"]["spec"]
        for secret, key, _ in pod_files(pod, pod["containers"][0]).values():
            mounted.setdefault(secret, set()).add(key)
    assert {name: set(keys) for name, keys in documented.items()} == mounted
    default = MAKE_CERTS.parent / "secrets"
    for name, keys in documented.items():
        for key, path in keys.items():
            file = Path(path)
            assert file.parent == default.relative_to(REPO) and (certs / file.name).is_file(), path
            files = {
                k: expected_file(name.removeprefix("specinfer-tls-"), template) for template, k in SECRET_KEYS.items()
            }
            assert file.name == files.get(key, key), (name, key, path)
