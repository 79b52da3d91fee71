"""The deployment artifacts as data, for the tests: Dockerfile stages, the compose file (with its
variables at their defaults), rendered kustomize folders, and the settings each service reads
(from its own argparse parser)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from specinfer.serving.config import ENV_PREFIX, env_name

from .kustomize import render

REPO = Path(__file__).resolve().parents[2]
IMAGE_PREFIX = "specinfer"
DOCKERFILES = {
    "request-manager": REPO / "docker/request-manager.Dockerfile",
    "model-service": REPO / "docker/model-service.Dockerfile",
}
K8S = REPO / "deploy/k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu-dev": K8S / "overlays/cpu-dev",
    "gpu": K8S / "overlays/gpu",
    "multi-gpu": K8S / "overlays/multi-gpu",
    "tls": K8S / "overlays/tls",
    "external-redis": K8S / "overlays/external-redis",
    "redis-cluster": K8S / "overlays/redis-cluster",
}
# which Redis the request managers use: the base's single Redis StatefulSet unless the overlay has
# components/external-redis or components/redis-cluster
REDIS = {"external-redis": "external", "redis-cluster": "cluster"}
SERVICES = ("request-manager", "ssm-worker", "llm-verifier")
PORTS = {"request-manager": 50051, "ssm-worker": 50052, "llm-verifier": 50053}  # gRPC
HTTP_PORTS = {"request-manager": 8000}  # the request manager's OpenAI-compatible HTTP API
SOCKET_PORTS = {"ssm-worker": 50062, "llm-verifier": 50063}  # the model services' sockets (SPECINFER_SOCKET_PORT)


def public_ports(service: str) -> list[int]:
    """The ports ``service`` serves its API on (the image's EXPOSE); metrics are not among them."""
    return [PORTS[service], *(extra[service] for extra in (HTTP_PORTS, SOCKET_PORTS) if service in extra)]


# settings a deployment must give each service: the defaults are for one machine (127.0.0.1,
# an embedded Redis, no SSM) or there is none
REQUIRED = {
    "request-manager": {
        "SPECINFER_HOST",
        "SPECINFER_PORT",
        "SPECINFER_VERIFIER",
        "SPECINFER_SSM_WORKERS",
        "SPECINFER_MODEL_DIR",
        "SPECINFER_REDIS_URL",
    },
    "ssm-worker": {"SPECINFER_HOST", "SPECINFER_PORT", "SPECINFER_SSM"},
    "llm-verifier": {"SPECINFER_HOST", "SPECINFER_PORT", "SPECINFER_LLM"},
}


# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    default: Any


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """No SPECINFER_* variables while parsers are built (they read their defaults from there)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _parsers() -> dict[str, Callable]:
    from specinfer.llm_verifier.__main__ import build_parser as llm_verifier
    from specinfer.request_manager.config import RequestManagerConfig
    from specinfer.ssm_worker.__main__ import build_parser as ssm_worker

    return {"request-manager": RequestManagerConfig.parser, "ssm-worker": ssm_worker, "llm-verifier": llm_verifier}


@cache
def settings(service: str) -> dict[str, Setting]:
    """The settings ``service`` reads, by environment variable."""
    with clean_environment():
        parser = _parsers()[service]()
    out = {}
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        if flags:
            out[env_name(flags[0])] = Setting(flags[0], env_name(flags[0]), action.default)
    return out


# -- Dockerfiles ------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    named: bool  # FROM ... AS name: a build target
    env: dict[str, str] = field(default_factory=dict)  # with the parent stage's
    entrypoint: list[str] = field(default_factory=list)
    expose: list[int] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    user: str = ""


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, args = line.strip().partition(" ")
            out.append((instruction.upper(), " ".join(args.split())))
    return out


def dockerfile_stages(path: Path) -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for instruction, args in dockerfile_instructions(path):
        if instruction == "FROM":
            words = args.split()
            named = len(words) > 2 and words[1].upper() == "AS"
            name = words[2] if named else f"stage{len(stages)}"
            parent = stages.get(words[0])
            stage = Stage(name, words[0], named, env=dict(parent.env) if parent else {})
            if parent:
                stage.entrypoint, stage.expose, stage.healthcheck, stage.user = (
                    parent.entrypoint,
                    parent.expose,
                    parent.healthcheck,
                    parent.user,
                )
            stages[name] = stage
            continue
        if stage is None:  # global ARGs
            continue
        if instruction == "ENV":
            stage.env.update(word.split("=", 1) for word in shlex.split(args))
        elif instruction == "ENTRYPOINT":
            stage.entrypoint = json.loads(args)
        elif instruction == "EXPOSE":
            stage.expose = [int(p) for p in args.split()]
        elif instruction == "HEALTHCHECK":
            stage.healthcheck = json.loads(args[args.index("CMD") + 3 :])
        elif instruction == "USER":
            stage.user = args
    return stages


@dataclass(frozen=True)
class Image:
    """What one image (Dockerfile target and variant) runs."""

    service: str
    dockerfile: Path
    target: str | None
    variant: str | None
    stage: Stage

    def env(self) -> dict[str, str]:
        return {k: v.replace("${VARIANT}", self.variant or "") for k, v in self.stage.env.items()}


def image_for(build: dict[str, Any]) -> Image:
    """The image a compose ``build`` section builds."""
    dockerfile = REPO / build.get("context", ".") / build["dockerfile"]
    stages = dockerfile_stages(dockerfile)
    target = build.get("target")
    stage = stages[target] if target else list(stages.values())[-1]
    service = script_service(stage.entrypoint[0])
    return Image(service, dockerfile, target, build.get("args", {}).get("VARIANT"), stage)


@cache
def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def script_service(script: str) -> str:
    """``specinfer-ssm-worker`` -> ``ssm-worker`` (the service whose ``main`` the script runs)."""
    module = console_scripts()[script].split(":")[0]  # specinfer.ssm_worker.__main__
    return module.split(".")[1].replace("_", "-")


# -- compose ----------------------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def _substitute(m: re.Match, variables: dict[str, str]) -> str:
    value = variables.get(m.group(1))
    if m.group(2) == "-":  # ${NAME-default}: the default only when unset (empty stays empty)
        return m.group(3) if value is None else value
    return value or m.group(3) or ""  # ${NAME:-default}: also when empty; ${NAME}: empty when unset


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's ``${NAME}`` / ``${NAME:-default}`` / ``${NAME-default}`` with ``variables``."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: _substitute(m, variables), value).replace("$$", "$")
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    return value


# the stacks users run: `docker compose -f FILE -f FILE ...`, merged in this order
STACKS = {"default": ("docker-compose.yml",), "tls": ("docker-compose.yml", "docker-compose.tls.yml")}
# compose's merge rules (compose-spec 13-merge.md) for what our files use: mappings merge, these
# replace, and service secrets merge by target; other sequences raise (a file that starts merging
# one fails here instead of being merged differently from compose)
REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}


def _service_secrets(items: list[Any]) -> dict[str, dict[str, Any]]:
    long = [{"source": i} if isinstance(i, str) else i for i in items]
    return {i.get("target", i["source"]): i for i in long}


def merge_compose(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merge_compose(base[k], v, (*path, k)) if k in base else v for k, v in override.items()}}
    if isinstance(base, list):
        service_path = path[2:] if path[:1] == ("services",) else None
        if service_path in REPLACED:
            return override
        if service_path == ("secrets",):
            merged = _service_secrets(base)
            for target, item in _service_secrets(override).items():
                merged[target] = {**merged.get(target, {}), **item}
            return list(merged.values())
        raise NotImplementedError(
            f"merging {'.'.join(path)}: only the merge rules this repository's compose files use are implemented"
        )
    return override


def compose_raw(stack: str = "default") -> dict[str, Any]:
    """The stack's compose files merged, before interpolation."""
    documents = [yaml.safe_load((REPO / name).read_text()) for name in STACKS[stack]]
    merged = documents[0]
    for document in documents[1:]:
        merged = merge_compose(merged, document)
    return merged


def compose(variables: dict[str, str] | None = None, stack: str = "default") -> dict[str, Any]:
    """The stack as ``docker compose config`` would see it with ``variables`` in the environment."""
    return interpolate(compose_raw(stack), variables or {})


def secret_files(stack: str, service: str, variables: dict[str, str] | None = None) -> dict[str, str]:
    """Where ``service``'s compose secrets appear in its container (``/run/secrets/<target>``) ->
    the host file each one is read from."""
    document = compose(variables, stack)
    defined = document.get("secrets", {})
    mounted = _service_secrets(document["services"][service].get("secrets", []))
    return {f"/run/secrets/{target}": defined[item["source"]]["file"] for target, item in mounted.items()}


# -- TLS material -----------------------------------------------------------------------------

MAKE_CERTS = REPO / "deploy/tls/make-certs.sh"


def make_certs(folder: Path, *names: str) -> Path:
    """Run deploy/tls/make-certs.sh into ``folder`` (extra names of the request manager: ``names``)."""
    subprocess.run(
        ["bash", str(MAKE_CERTS), "-o", str(folder), *names], check=True, capture_output=True, text=True, timeout=60
    )
    return folder


# -- Kubernetes -------------------------------------------------------------------------------


def rendered(name: str) -> list[dict[str, Any]]:
    return render(KUSTOMIZATIONS[name])


@cache
def images() -> dict[str, Image]:
    """Every image the Dockerfiles build, by name and variant: ``specinfer/<service>`` (the request
    manager) or ``specinfer/<service>:<variant>`` (the model services, one per
    requirements/torch-<variant>.txt). Tags are ``<version>`` and ``<version>-<variant>``."""
    variants = sorted(p.stem.removeprefix("torch-") for p in (REPO / "requirements").glob("torch-*.txt"))
    out = {}
    for dockerfile in DOCKERFILES.values():
        stages = dockerfile_stages(dockerfile)
        varies = any(ins == "ARG" and args.startswith("VARIANT") for ins, args in dockerfile_instructions(dockerfile))
        for stage in stages.values():
            if not stage.entrypoint:  # only the stages that run something are images
                continue
            service = script_service(stage.entrypoint[0])
            target = stage.name if stage.named else None
            for variant in variants if varies else [None]:
                key = f"{IMAGE_PREFIX}/{service}" + (f":{variant}" if variant else "")
                out[key] = Image(service, dockerfile, target, variant, stage)
    return out


def image_key(reference: str) -> str:
    """``specinfer/ssm-worker:0.1.0-cpu`` -> ``specinfer/ssm-worker:cpu``; no variant: the bare name."""
    name, _, tag = reference.partition(":")
    variant = tag.rpartition("-")[2] if "-" in tag else ""
    return f"{name}:{variant}" if variant else name
