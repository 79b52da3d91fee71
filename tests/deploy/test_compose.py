"""docker-compose.yml (and with docker-compose.tls.yml merged over it): valid against the compose
specification, consistent with the images and the services' settings, and its command lines start
the services (run here as local processes)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.resources
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import yaml

from specinfer.request_manager.state.redis_server import EmbeddedRedis, free_tcp_port
from specinfer.serving.security import ClientAuth, ClientTls
from specinfer.v1 import api_pb2, api_pb2_grpc, internal_pb2, internal_pb2_grpc

from .artifacts import (
    HTTP_PORTS,
    PORTS,
    REPO,
    REQUIRED,
    SOCKET_PORTS,
    STACKS,
    compose,
    compose_raw,
    image_for,
    image_key,
    images,
    make_certs,
    public_ports,
    secret_files,
    settings,
)

HEALTHCHECK = ["CMD", "python", "-m", "specinfer.serving.healthcheck"]
VERIFIERS = ("llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu")  # one per profile
OURS = ("request-manager", "ssm-worker", *VERIFIERS)
STACK_IDS = [pytest.param(stack, id=f"compose-{stack}") for stack in STACKS]


def compose_schema() -> dict[str, Any]:
    """The compose specification's JSON schema (compose-spec/compose-spec, schema/compose-spec.json),
    as check-jsonschema vendors it (`check-jsonschema --builtin-schema vendor.compose-spec`)."""
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


def validate(document: dict[str, Any]) -> None:
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(document)


@pytest.mark.parametrize("stack", STACK_IDS)
def test_compose_file_validates_against_the_compose_spec(stack):
    for name in STACKS[stack]:  # each file alone (an override file is a compose file too)
        validate(yaml.safe_load((REPO / name).read_text()))
    validate(compose_raw(stack))
    validate(
        compose(
            {"SPECINFER_MODELS": "/srv/models", "SPECINFER_IMAGE_TAG": "0.2.0", "SPECINFER_TLS_DIR": "/srv/tls"}, stack
        )
    )


def test_the_schema_check_catches_mistakes():
    for service, key, value in (
        ("ssm-worker", "imag", "x"),
        ("llm-verifier", "deploy", {"resources": {"reservations": {"gpus": 1}}}),
    ):
        document = copy.deepcopy(compose_raw())
        document["services"][service][key] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(document)
    document = copy.deepcopy(compose_raw("tls"))
    document["services"]["ssm-worker"]["secrets"][0]["targt"] = "tls.crt"
    with pytest.raises(jsonschema.ValidationError):
        validate(document)


@pytest.mark.parametrize("stack", STACK_IDS)
def test_services_and_profiles(stack):
    services = compose(stack=stack)["services"]
    assert set(services) == {"redis", *OURS}
    assert {name: s.get("profiles") for name, s in services.items() if s.get("profiles")} == {
        "llm-verifier": ["gpu"],
        "llm-verifier-multi-gpu": ["multi-gpu"],
        "llm-verifier-cpu": ["cpu"],
    }
    # whichever profile runs, the verifier answers as llm-verifier
    assert services["llm-verifier-cpu"]["networks"]["default"]["aliases"] == ["llm-verifier"]
    assert services["llm-verifier-multi-gpu"]["networks"]["default"]["aliases"] == ["llm-verifier"]
    gpu = services["llm-verifier"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert [name for name, s in services.items() if "deploy" in s] == ["llm-verifier", "llm-verifier-multi-gpu"]
    # --scale ssm-worker=N and --scale <verifier>=N need services without a fixed container name or host port
    for name in ("ssm-worker", *VERIFIERS):
        assert not {"container_name", "ports", "hostname"} & set(services[name]), name
        assert "replicas" not in services[name].get("deploy", {}), name  # --scale decides


@pytest.mark.parametrize("stack", STACK_IDS)
def test_every_verifier_replica_answers_as_llm_verifier(stack):
    """Compose's DNS answers a name with one address per container holding it as service name or
    network alias: dns:///llm-verifier:50053 finds every replica of whichever verifier runs."""
    services = compose(stack=stack)["services"]
    for name in VERIFIERS:
        names = {name, *services[name].get("networks", {}).get("default", {}).get("aliases", [])}
        assert "llm-verifier" in names, name
        assert set(services[name].get("networks", {"default": None})) == {"default"}, (
            name
        )  # the request manager's network
    assert "networks" not in services["request-manager"]


def test_multi_gpu_profile_reserves_a_gpu_per_rank():
    """One rank per GPU: tensor x pipeline ranks = the GPUs reserved, and the split fits the
    verifier's settings (NCCL needs more shared memory than Docker's default 64 MB)."""
    service = compose()["services"]["llm-verifier-multi-gpu"]
    env = service["environment"]
    ranks = int(env["SPECINFER_TENSOR_PARALLEL"]) * int(env["SPECINFER_PIPELINE_PARALLEL"])
    (devices,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == {"driver": "nvidia", "count": ranks, "capabilities": ["gpu"]} and ranks > 1
    assert env["SPECINFER_DEVICE"] == "cuda" and service["shm_size"]


@pytest.mark.parametrize("stack", STACK_IDS)
def test_only_the_request_manager_publishes_ports(stack):
    """Its gRPC and HTTP ports, each from a variable of its own."""
    services = compose(stack=stack)["services"]
    assert {name: s["ports"] for name, s in services.items() if "ports" in s} == {
        "request-manager": ["50051:50051", "8000:8000"]
    }
    published = compose({"SPECINFER_PUBLIC_PORT": "8443", "SPECINFER_PUBLIC_HTTP_PORT": "8080"}, stack)["services"][
        "request-manager"
    ]["ports"]
    assert published == ["8443:50051", "8080:8000"]
    assert [int(p.split(":")[1]) for p in published] == public_ports("request-manager")


@pytest.mark.parametrize("stack", STACK_IDS)
def test_images_are_the_dockerfiles_targets(stack):
    for name in OURS:
        service = compose(stack=stack)["services"][name]
        built = image_for(service["build"])
        named = images()[image_key(service["image"])]
        assert (built.dockerfile, built.target, built.variant) == (named.dockerfile, named.target, named.variant), name
        assert service["image"].startswith(f"specinfer/{built.service}:0.1.0")
        assert service["image"].endswith(f"-{built.variant}") if built.variant else ":" in service["image"]
        assert "command" not in service and "entrypoint" not in service, "the image's ENTRYPOINT starts the service"
        assert service["build"]["context"] == "."
    assert (
        compose({"SPECINFER_IMAGE_PREFIX": "ghcr.io/me", "SPECINFER_IMAGE_TAG": "1.0"})["services"]["ssm-worker"][
            "image"
        ]
        == "ghcr.io/me/ssm-worker:1.0-cpu"
    )


@pytest.mark.parametrize("stack", STACK_IDS)
def test_every_variable_is_a_setting_and_every_required_one_is_set(stack):
    for name in OURS:
        service = compose(stack=stack)["services"][name]
        image = image_for(service["build"])
        env = {**image.env(), **service["environment"]}
        ours = {k for k in env if k.startswith("SPECINFER_")}
        assert set(service["environment"]) == {k for k in service["environment"] if k.startswith("SPECINFER_")}
        assert ours <= set(settings(image.service)), (name, sorted(ours - set(settings(image.service))))
        assert REQUIRED[image.service] <= {k for k, v in env.items() if v}, (
            name,
            sorted(REQUIRED[image.service] - set(env)),
        )
        assert env["SPECINFER_HOST"] == "0.0.0.0"
        assert env["SPECINFER_PORT"] == str(PORTS[image.service]) and image.stage.expose == public_ports(image.service)
        assert env.get("SPECINFER_HTTP_PORT") == (
            str(HTTP_PORTS[image.service]) if image.service in HTTP_PORTS else None
        )
        if image.variant:
            assert env["SPECINFER_DEVICE"] == image.variant


@pytest.mark.parametrize("stack", STACK_IDS)
def test_health_checks_and_start_order(stack):
    services = compose(stack=stack)["services"]
    for name in OURS:
        test = services[name]["healthcheck"]["test"]
        # the image's HEALTHCHECK, plus flags only (the TLS files): it dials 127.0.0.1:$SPECINFER_PORT
        assert test[:4] == HEALTHCHECK == ["CMD", *image_for(services[name]["build"]).stage.healthcheck]
        assert all(flag.startswith("--") for flag in test[4::2]) and len(test[4:]) % 2 == 0, (name, test)
        assert len(test) == 4 or stack == "tls"
    assert services["redis"]["healthcheck"]["test"]
    depends = services["request-manager"]["depends_on"]
    assert set(depends) == {"redis", "ssm-worker", "llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu"}
    assert all(d["condition"] == "service_healthy" for d in depends.values())
    # one verifier per profile: neither may be required
    assert not any(depends[name]["required"] for name in ("llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu"))


@pytest.mark.parametrize("stack", STACK_IDS)
def test_models_are_mounted_read_only(stack):
    for name in OURS:
        service = compose({"SPECINFER_MODELS": "/srv/models"}, stack)["services"][name]
        assert service["volumes"] == [{"type": "bind", "source": "/srv/models", "target": "/models", "read_only": True}]
        paths = [
            v
            for k, v in service["environment"].items()
            if k in ("SPECINFER_SSM", "SPECINFER_LLM", "SPECINFER_MODEL_DIR")
        ]
        assert paths and all("/models/" in p for p in paths)
    assert compose(stack=stack)["services"]["ssm-worker"]["volumes"][0]["source"] == "./models/demo"


@pytest.mark.parametrize("stack", STACK_IDS)
@pytest.mark.parametrize("variables", [{}, {"SPECINFER_REDIS_PASSWORD": "s3cret"}])
def test_redis_and_the_request_manager_share_the_password(variables, stack):
    services = compose(variables, stack)["services"]
    command = services["redis"]["command"]
    password = command[command.index("--requirepass") + 1]
    assert password == variables.get("SPECINFER_REDIS_PASSWORD", "specinfer-local")
    assert services["request-manager"]["environment"]["SPECINFER_REDIS_PASSWORD"] == password
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == password
    assert services["request-manager"]["environment"]["SPECINFER_REDIS_URL"] == "redis://redis:6379/0"


@pytest.mark.parametrize("stack", STACK_IDS)
def test_the_request_manager_finds_every_worker_and_verifier_replica(stack):
    env = compose(stack=stack)["services"]["request-manager"]["environment"]
    assert env["SPECINFER_SSM_WORKERS"] == f"dns:///ssm-worker:{PORTS['ssm-worker']}"
    assert env["SPECINFER_VERIFIER"] == f"dns:///llm-verifier:{PORTS['llm-verifier']}"


# -- the compose command lines, run as local processes ----------------------------------------------

# a shared test machine: one torch thread and a small KV pool per process (the only overrides)
TEST_OVERRIDES = {"SPECINFER_TORCH_THREADS": "1", "SPECINFER_KV_CACHE_BYTES": str(256 << 20)}


def local_command(
    name: str, variables: dict[str, str], replace: dict[str, str], stack: str = "default"
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment compose gives ``name`` (profile cpu), for this machine:
    the image's ENTRYPOINT from this virtual environment, its SPECINFER_* ENV plus the service's
    environment, with the container's names and paths replaced (``replace``: substrings) and each
    /run/secrets/ file by the host file its secret reads."""
    service = compose(variables, stack)["services"][name]
    image = image_for(service["build"])
    env = {k: v for k, v in image.env().items() if k.startswith("SPECINFER_")}
    env.update(service["environment"])
    if image.service != "request-manager":
        env.update(TEST_OVERRIDES)
    assert env["SPECINFER_METRICS_PORT"] == "9464"
    env["SPECINFER_METRICS_PORT"] = "0"  # containers each have their own 9464; processes on one host do not
    if image.service in SOCKET_PORTS:  # the same for the model services' sockets
        assert env["SPECINFER_SOCKET_PORT"] == str(SOCKET_PORTS[image.service])
        env["SPECINFER_SOCKET_PORT"] = "0"
    for old, new in replace.items():
        env = {k: v.replace(old, new) for k, v in env.items()}
    secrets = secret_files(stack, name, variables)
    env = {k: secrets.get(v, v) for k, v in env.items()}
    script = Path(sys.executable).parent / image.stage.entrypoint[0]
    return [str(script), *image.stage.entrypoint[1:], *service.get("command", [])], {**os.environ, **env}


def local_healthcheck(name: str, variables: dict[str, str], stack: str, address: str) -> list[str]:
    """The service's compose health check, for this machine: this interpreter, the secrets' host
    files, and ``address`` (in the container: 127.0.0.1:$SPECINFER_PORT, its default)."""
    test = compose(variables, stack)["services"][name]["healthcheck"]["test"]
    assert test[:4] == HEALTHCHECK
    secrets = secret_files(stack, name, variables)
    return [sys.executable, *test[2:4], *(secrets.get(arg, arg) for arg in test[4:]), address]


@contextlib.contextmanager
def serving(
    name: str, command: list[str], env: dict[str, str], variables: dict[str, str], stack: str, logs: Path
) -> Iterator[Any]:
    """``command`` started by the test harness (which adds --host, --port 0 and --port-file), once
    the service's own compose health check passes against it (over TLS in the tls stack, where the
    harness's plaintext wait would not do); stopped at the end, exit code 0."""
    from services.harness import start_service  # tests/services/harness.py

    svc = start_service(command, name, env, logs)
    deadline = time.monotonic() + 90
    try:
        while True:
            if svc.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} did not pass its health check (exit code {svc.process.poll()})\n{svc.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                svc.address = svc.address or f"127.0.0.1:{int(svc.port_file.read_text())}"
            if (
                svc.address
                and subprocess.run(
                    local_healthcheck(name, variables, stack, svc.address), env=env, capture_output=True, timeout=30
                ).returncode
                == 0
            ):
                break
            time.sleep(0.2)
    except BaseException:
        svc.kill()
        raise
    try:
        yield svc
    except BaseException:
        svc.kill()
        raise
    code = svc.stop()
    assert code == 0, f"{name}: exit code {code} after SIGTERM\n{svc.log_tail()}"


def http_get(url: str, context: ssl.SSLContext | None, key: str = "") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def verify_socket_speaks_tls(manager_env: dict[str, str], verifier: str) -> None:
    """The verifier's verify socket takes the request manager's TLS files and internal token, as its gRPC port
    does, and refuses a client without the token or without a certificate."""
    from specinfer.serving.socket_calls import SocketUnary

    tls = ClientTls.from_files(*(manager_env[f"SPECINFER_TLS_{n}"] for n in ("CA", "CLIENT_CERT", "CLIENT_KEY")))
    token = Path(manager_env["SPECINFER_INTERNAL_TOKEN_FILE"]).read_text().strip()
    manager = ClientAuth(tls, token)
    with manager.channel(verifier) as channel:
        info = internal_pb2_grpc.LlmVerifierStub(channel).GetInfo(
            internal_pb2.LlmInfoRequest(), timeout=10, metadata=manager.metadata
        )
    assert info.socket_port > 0
    host = verifier.rpartition(":")[0]

    async def calls() -> None:
        call = SocketUnary(host, info.socket_port, internal_pb2.VerifyResponse, manager)
        assert not (await call(internal_pb2.VerifyRequest(), 10)).results  # nothing to verify: an empty answer
        call.close()
        for auth, code in (
            (ClientAuth(tls, "wrong"), grpc.StatusCode.UNAUTHENTICATED),
            (ClientAuth(ClientTls.from_files(tls.ca), token), grpc.StatusCode.UNAVAILABLE),  # mTLS: no certificate
        ):
            refused = SocketUnary(host, info.socket_port, internal_pb2.VerifyResponse, auth)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused(internal_pb2.VerifyRequest(), 10)
            assert err.value.code() == code

    asyncio.run(calls())


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACK_IDS)
def test_compose_services_start_as_local_processes(model_pair, tmp_path, stack):
    """The stack's command lines and environments serve: the health checks pass, the request manager
    finds the worker and the verifier and generates, over gRPC and HTTP. In the tls stack, with the
    certificates and tokens deploy/tls/make-certs.sh makes: every port refuses plaintext, the
    workers' and the verifier's refuse a client without a certificate, the public API a caller
    without the token."""
    from specinfer.serving.healthcheck import check

    variables = {"SPECINFER_REDIS_PASSWORD": "compose-test-password"}
    tls = stack == "tls"
    if tls:
        if not shutil.which("openssl"):
            pytest.skip("deploy/tls/make-certs.sh needs openssl")
        variables["SPECINFER_TLS_DIR"] = str(make_certs(tmp_path / "tls"))
    models = tmp_path / "models"
    models.mkdir()
    (models / "llm").symlink_to(model_pair.llm)
    (models / "ssm").symlink_to(model_pair.ssm)
    head = model_pair.llm.parent / "head"  # the bundled pair's draft head, which compose's default names
    if (head / "config.json").is_file():
        (models / "head").symlink_to(head)
    else:
        variables["SPECINFER_HEAD"] = ""  # a pair without one: none, as a user's models without head/ set it
    paths = {"/models/": f"{models}/", "/home/specinfer/": f"{tmp_path}/"}
    redis_command = compose(variables, stack)["services"]["redis"]["command"]
    password = redis_command[redis_command.index("--requirepass") + 1]
    logs = tmp_path / "logs"
    logs.mkdir()
    worker_command, worker_env = local_command("ssm-worker", variables, paths, stack)
    verifier_command, verifier_env = local_command("llm-verifier-cpu", variables, paths, stack)
    assert worker_env["SPECINFER_SSM"] == f"ssm={models}/ssm" and verifier_env["SPECINFER_LLM"] == f"llm={models}/llm"
    with (
        EmbeddedRedis(tmp_path / "redis", transport="tcp", password=password) as redis,
        serving("ssm-worker", worker_command, worker_env, variables, stack, logs) as worker,
        serving("llm-verifier-cpu", verifier_command, verifier_env, variables, stack, logs) as verifier,
    ):
        replace = {
            **paths,
            "redis:6379": f"127.0.0.1:{redis.port}",
            "llm-verifier:50053": verifier.address,
            "ssm-worker:50052": worker.address,
        }
        command, env = local_command("request-manager", variables, replace, stack)
        assert env["SPECINFER_SSM_WORKERS"] == f"dns:///{worker.address}"  # the DNS code path, on a numeric name
        assert env["SPECINFER_VERIFIER"] == f"dns:///{verifier.address}"
        assert env["SPECINFER_HTTP_PORT"] == "8000"
        env["SPECINFER_HTTP_PORT"] = str(
            free_tcp_port()
        )  # 8000 is the container's own; on this host another process may hold it
        with serving("request-manager", command, env, variables, stack, logs) as rm:
            auth, context = ClientAuth(), None
            if tls:
                secrets = Path(variables["SPECINFER_TLS_DIR"])
                auth = ClientAuth(
                    ClientTls.from_files(str(secrets / "ca.crt")), (secrets / "auth-token").read_text().strip()
                )
                context = ssl.create_default_context(cafile=str(secrets / "ca.crt"))
                for svc in (worker, verifier, rm):
                    assert check(svc.address, timeout=5) == "UNAVAILABLE", svc.name  # plaintext: no handshake
                for svc in (worker, verifier):  # mTLS: the CA alone is not enough
                    assert (
                        check(svc.address, timeout=5, tls=ClientTls.from_files(str(secrets / "ca.crt")))
                        == "UNAVAILABLE"
                    ), svc.name
            with auth.channel(rm.address) as ch:
                stub = api_pb2_grpc.SpecInferStub(ch)
                if tls:
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=10)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                info = stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=10, metadata=auth.metadata)
                assert list(info.ssms) == ["ssm"] and info.has_tokenizer and info.default_speculation == "auto"
                # one short generation: trees drafted by the worker found through DNS (size > 1: not the root alone;
                # a static tree, since the adaptive default may rightly decline to speculate on this machine)
                static = api_pb2.SpeculationParams(expansion=[1, 1, 3])
                request = api_pb2.GenerateRequest(
                    text="def main():\n", max_new_tokens=8, ignore_eos=True, speculation=static
                )
                *_, last = stub.Generate(request, timeout=30, metadata=auth.metadata)
                assert last.finished.usage.completion_tokens == 8 and last.finished.usage.mean_tree_size > 1
            if tls:
                verify_socket_speaks_tls(env, verifier.address)
            # the HTTP API on the port the stack sets: HTTPS with the gRPC port's certificate in the tls stack
            base = f"{'https' if tls else 'http'}://127.0.0.1:{env['SPECINFER_HTTP_PORT']}"
            assert http_get(f"{base}/health", context) == (200, {"status": "ok"})  # probes need no key
            if tls:
                assert http_get(f"{base}/v1/models", context)[0] == 401
            status, models_list = http_get(f"{base}/v1/models", context, auth.token)
            assert status == 200 and [m["id"] for m in models_list["data"]] == ["llm"]
