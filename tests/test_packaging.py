"""setup.py's packaging rule: ``src/specinfer`` is ``specinfer``, ``kernels/`` is ``specinfer.kernels``, every
``services/<name>/`` is ``specinfer.<name>``, subpackages follow their folders. The rule installs every Python
package of the repository under that name, in the editable install the tests run from and in a wheel."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RULE = runpy.run_path(str(REPO / "setup.py"))  # the rule's functions; run_path does not run setup()
# what the images copy to build the package (docker/*.Dockerfile)
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "src", "kernels", "services"]


def folders_by_name() -> dict[str, Path]:
    """Every folder with an ``__init__.py`` below the roots, named as the rule says, found here from the folders
    themselves (not through setuptools)."""
    roots = {"specinfer": REPO / "src/specinfer", "specinfer.kernels": REPO / "kernels"}
    roots |= {f"specinfer.{d.name}": d for d in sorted((REPO / "services").iterdir()) if (d / "__init__.py").is_file()}
    return {
        ".".join([name, *init.parent.relative_to(root).parts]): init.parent
        for name, root in roots.items()
        for init in root.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_service_folder_is_a_package():
    """A folder of services/ without an __init__.py would silently not be installed."""
    folders = [d for d in (REPO / "services").iterdir() if d.is_dir() and d.name != "__pycache__"]
    assert len(folders) >= 3
    for folder in folders:
        assert (folder / "__init__.py").is_file(), f"services/{folder.name}/ has no __init__.py"


def test_the_rule_names_every_package_by_its_folder():
    """setup.py's package list is every folder with an __init__.py below the roots (a package folder below a
    folder without one would be left out: it fails here), and its folders are the roots."""
    expected = folders_by_name()
    assert {"specinfer.v1", "specinfer.request_manager.scheduling", "specinfer.models.native.parallel"} <= set(expected)
    assert sorted(RULE["packages"](REPO)) == sorted(expected)
    for name, folder in RULE["package_dirs"](REPO).items():
        assert expected[name] == REPO / folder


def test_the_editable_install_imports_each_package_from_its_folder():
    """The installed ``specinfer`` (``pip install -e .``, scripts/env.sh) finds every package where the rule puts
    it, and its modules import: the request manager's subpackages, the services, the kernels."""
    expected = folders_by_name()
    code = (
        "import importlib, importlib.util, sys\n"
        "for name in sys.argv[1:]:\n"
        "    print(name, importlib.util.find_spec(name).origin)\n"
        "import specinfer.request_manager.__main__, specinfer.request_manager.scheduling.scheduler\n"
        "import specinfer.ssm_worker.servicer, specinfer.llm_verifier.servicer, specinfer.kernels.tree_attention\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *expected], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    origins = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    for name, folder in expected.items():
        assert Path(origins[name]) == folder / "__init__.py", f"{name} imports from {origins[name]}"


@pytest.mark.timeout(240)
def test_a_wheel_holds_every_package_and_module(tmp_path):
    """A wheel built from what the images copy (docker/*.Dockerfile) holds every module of every package under
    the rule's name, the generated protobuf code (``specinfer.v1``) included."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, source]
    out = subprocess.run(command, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("specinfer-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for name, folder in folders_by_name().items():
        for module in folder.glob("*.py"):
            assert "/".join([*name.split("."), module.name]) in files, f"the wheel lacks {name}.{module.stem}"
    assert {"specinfer/v1/api_pb2.py", "specinfer/request_manager/scheduling/scheduler.py"} <= files
    # compiled on first use
    assert {
        "specinfer/kernels/cpu_qgemm.c",
        "specinfer/kernels/cpu_layers.c",
        "specinfer/kernels/cpu_rows.c",
        "specinfer/kernels/cpu_kernels.h",
    } <= files
