"""docker-compose.yml: valid against the compose specification, consistent with the images and the
services' settings, and its command lines start the services (run here as local processes)."""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from specinfer.request_manager.redis_server import EmbeddedRedis
from specinfer.v1 import api_pb2, api_pb2_grpc

from .artifacts import PORTS, REQUIRED, compose, compose_raw, image_for, image_key, images, settings

HEALTHCHECK = ["CMD", "python", "-m", "specinfer.serving.healthcheck"]
OURS = ("request-manager", "ssm-worker", "llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu")


def compose_schema() -> dict[str, Any]:
    """The compose specification's JSON schema (compose-spec/compose-spec, schema/compose-spec.json),
    as check-jsonschema vendors it (`check-jsonschema --builtin-schema vendor.compose-spec`)."""
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


def validate(document: dict[str, Any]) -> None:
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(document)


def test_compose_file_validates_against_the_compose_spec():
    validate(compose_raw())
    validate(compose({"SPECINFER_MODELS": "/srv/models", "SPECINFER_IMAGE_TAG": "0.2.0"}))


def test_the_schema_check_catches_mistakes():
    for service, key, value in (("ssm-worker", "imag", "x"), ("llm-verifier", "deploy", {"resources": {"reservations": {"gpus": 1}}})):
        document = copy.deepcopy(compose_raw())
        document["services"][service][key] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(document)


def test_services_and_profiles():
    services = compose()["services"]
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
    # --scale ssm-worker=N needs a service without a fixed container name or host port
    assert "container_name" not in services["ssm-worker"] and "ports" not in services["ssm-worker"]


def test_multi_gpu_profile_reserves_a_gpu_per_rank():
    """One rank per GPU: tensor x pipeline ranks = the GPUs reserved, and the split fits the
    verifier's settings (NCCL needs more shared memory than Docker's default 64 MB)."""
    service = compose()["services"]["llm-verifier-multi-gpu"]
    env = service["environment"]
    ranks = int(env["SPECINFER_TENSOR_PARALLEL"]) * int(env["SPECINFER_PIPELINE_PARALLEL"])
    (devices,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == {"driver": "nvidia", "count": ranks, "capabilities": ["gpu"]} and ranks > 1
    assert env["SPECINFER_DEVICE"] == "cuda" and service["shm_size"]


def test_only_the_request_manager_publishes_a_port():
    services = compose()["services"]
    assert {name: s["ports"] for name, s in services.items() if "ports" in s} == {"request-manager": ["50051:50051"]}
    assert compose({"SPECINFER_PUBLIC_PORT": "8443"})["services"]["request-manager"]["ports"] == ["8443:50051"]


def test_images_are_the_dockerfiles_targets():
    for name in OURS:
        service = compose()["services"][name]
        built = image_for(service["build"])
        named = images()[image_key(service["image"])]
        assert (built.dockerfile, built.target, built.variant) == (named.dockerfile, named.target, named.variant), name
        assert service["image"].startswith(f"specinfer/{built.service}:0.1.0")
        assert service["image"].endswith(f"-{built.variant}") if built.variant else ":" in service["image"]
        assert "command" not in service and "entrypoint" not in service, "the image's ENTRYPOINT starts the service"
        assert service["build"]["context"] == "."
    assert compose({"SPECINFER_IMAGE_PREFIX": "ghcr.io/me", "SPECINFER_IMAGE_TAG": "1.0"})["services"]["ssm-worker"]["image"] == "ghcr.io/me/ssm-worker:1.0-cpu"


def test_every_variable_is_a_setting_and_every_required_one_is_set():
    for name in OURS:
        service = compose()["services"][name]
        image = image_for(service["build"])
        env = {**image.env(), **service["environment"]}
        ours = {k for k in env if k.startswith("SPECINFER_")}
        assert set(service["environment"]) == {k for k in service["environment"] if k.startswith("SPECINFER_")}
        assert ours <= set(settings(image.service)), (name, sorted(ours - set(settings(image.service))))
        assert REQUIRED[image.service] <= {k for k, v in env.items() if v}, (name, sorted(REQUIRED[image.service] - set(env)))
        assert env["SPECINFER_HOST"] == "0.0.0.0"
        assert env["SPECINFER_PORT"] == str(PORTS[image.service]) and image.stage.expose == [PORTS[image.service]]
        if image.variant:
            assert env["SPECINFER_DEVICE"] == image.variant


def test_health_checks_and_start_order():
    services = compose()["services"]
    for name in OURS:
        assert services[name]["healthcheck"]["test"] == HEALTHCHECK == ["CMD", *image_for(services[name]["build"]).stage.healthcheck]
    assert services["redis"]["healthcheck"]["test"]
    depends = services["request-manager"]["depends_on"]
    assert set(depends) == {"redis", "ssm-worker", "llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu"}
    assert all(d["condition"] == "service_healthy" for d in depends.values())
    # one verifier per profile: neither may be required
    assert not any(depends[name]["required"] for name in ("llm-verifier", "llm-verifier-multi-gpu", "llm-verifier-cpu"))


def test_models_are_mounted_read_only():
    for name in OURS:
        service = compose({"SPECINFER_MODELS": "/srv/models"})["services"][name]
        assert service["volumes"] == [{"type": "bind", "source": "/srv/models", "target": "/models", "read_only": True}]
        paths = [v for k, v in service["environment"].items() if k in ("SPECINFER_SSM", "SPECINFER_LLM", "SPECINFER_MODEL_DIR")]
        assert paths and all("/models/" in p for p in paths)
    assert compose()["services"]["ssm-worker"]["volumes"][0]["source"] == "./models/demo"


@pytest.mark.parametrize("variables", [{}, {"SPECINFER_REDIS_PASSWORD": "s3cret"}])
def test_redis_and_the_request_manager_share_the_password(variables):
    services = compose(variables)["services"]
    command = services["redis"]["command"]
    password = command[command.index("--requirepass") + 1]
    assert password == variables.get("SPECINFER_REDIS_PASSWORD", "specinfer-local")
    assert services["request-manager"]["environment"]["SPECINFER_REDIS_PASSWORD"] == password
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == password
    assert services["request-manager"]["environment"]["SPECINFER_REDIS_URL"] == "redis://redis:6379/0"


def test_the_request_manager_finds_every_ssm_worker_replica():
    env = compose()["services"]["request-manager"]["environment"]
    assert env["SPECINFER_SSM_WORKERS"] == f"dns:///ssm-worker:{PORTS['ssm-worker']}"
    assert env["SPECINFER_VERIFIER"] == f"llm-verifier:{PORTS['llm-verifier']}"


# -- the compose command lines, run as local processes ----------------------------------------------

# a shared test machine: one torch thread and a small KV pool per process (the only overrides)
TEST_OVERRIDES = {"SPECINFER_TORCH_THREADS": "1", "SPECINFER_KV_CACHE_BYTES": str(256 << 20)}


def local_command(name: str, variables: dict[str, str], replace: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment compose gives ``name`` (profile cpu), for this machine:
    the image's ENTRYPOINT from this virtual environment, its SPECINFER_* ENV plus the service's
    environment, with the container's names and paths replaced (``replace``: substrings)."""
    service = compose(variables)["services"][name]
    image = image_for(service["build"])
    env = {k: v for k, v in image.env().items() if k.startswith("SPECINFER_")}
    env.update(service["environment"])
    if image.service != "request-manager":
        env.update(TEST_OVERRIDES)
    assert env["SPECINFER_METRICS_PORT"] == "9464"
    env["SPECINFER_METRICS_PORT"] = "0"  # containers each have their own 9464; processes on one host do not
    for old, new in replace.items():
        env = {k: v.replace(old, new) for k, v in env.items()}
    script = Path(sys.executable).parent / image.stage.entrypoint[0]
    return [str(script), *image.stage.entrypoint[1:], *service.get("command", [])], {**os.environ, **env}


@pytest.mark.slow
def test_compose_services_start_as_local_processes(model_pair, tmp_path):
    from services.harness import running_services  # tests/services/harness.py

    variables = {"SPECINFER_REDIS_PASSWORD": "compose-test-password"}
    models = tmp_path / "models"
    models.mkdir()
    (models / "llm").symlink_to(model_pair.llm)
    (models / "ssm").symlink_to(model_pair.ssm)
    paths = {"/models/": f"{models}/", "/home/specinfer/": f"{tmp_path}/"}
    redis_command = compose(variables)["services"]["redis"]["command"]
    password = redis_command[redis_command.index("--requirepass") + 1]
    logs = tmp_path / "logs"
    logs.mkdir()
    (worker_command, worker_env), (verifier_command, verifier_env) = (local_command(name, variables, paths) for name in ("ssm-worker", "llm-verifier-cpu"))
    assert worker_env["SPECINFER_SSM"] == f"ssm={models}/ssm" and verifier_env["SPECINFER_LLM"] == f"llm={models}/llm"
    with (
        EmbeddedRedis(tmp_path / "redis", transport="tcp", password=password) as redis,
        running_services([worker_command], ["ssm-worker"], env=worker_env, workdir=logs, startup_timeout=90) as (worker,),
        running_services([verifier_command], ["llm-verifier"], env=verifier_env, workdir=logs, startup_timeout=90) as (verifier,),
    ):
        replace = {**paths, "redis:6379": f"127.0.0.1:{redis.port}", "llm-verifier:50053": verifier.address, "ssm-worker:50052": worker.address}
        command, env = local_command("request-manager", variables, replace)
        assert env["SPECINFER_SSM_WORKERS"] == f"dns:///{worker.address}"  # the DNS code path, on a numeric name
        with running_services([command], ["request-manager"], env=env, workdir=logs, startup_timeout=60) as (rm,), grpc.insecure_channel(rm.address) as ch:
            stub = api_pb2_grpc.SpecInferStub(ch)
            info = stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=10)
            assert list(info.ssms) == ["ssm"] and info.has_tokenizer and info.default_speculation == "auto"
            # one short generation: trees drafted by the worker found through DNS (size > 1: not the root alone; a static
            # tree, since the adaptive default may rightly decline to speculate on this machine)
            static = api_pb2.SpeculationParams(expansion=[1, 1, 3])
            request = api_pb2.GenerateRequest(text="def main():\n", max_new_tokens=8, ignore_eos=True, speculation=static)
            *_, last = stub.Generate(request, timeout=30)
            assert last.finished.usage.completion_tokens == 8 and last.finished.usage.mean_tree_size > 1
