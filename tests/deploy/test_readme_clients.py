"""The README's "Deploy" section: its Python client generation command works as written."""

from __future__ import annotations

import shlex
import subprocess
import sys

from .artifacts import REPO


def readme_command(prefix: str) -> list[str]:
    deploy = REPO.joinpath("README.md").read_text().split("## Deploy", 1)[1]
    (line,) = [line for line in deploy.splitlines() if line.startswith(f"mkdir -p gen && {prefix}")]
    return shlex.split(line.removeprefix("mkdir -p gen && "))


def test_python_client_generation(tmp_path):
    command = readme_command("python -m grpc_tools.protoc")
    (tmp_path / "protos").symlink_to(REPO / "protos")
    (tmp_path / "gen").mkdir()
    subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, check=True, timeout=60)
    stubs = (tmp_path / "gen/specinfer/v1/api_pb2_grpc.py").read_text()
    assert "class SpecInferStub" in stubs and (tmp_path / "gen/specinfer/v1/api_pb2.pyi").is_file()
