"""The pure core (``specinfer.core``) needs no torch: its tests collect and pass in a Python where
``import torch`` fails.

Every core test module is collected without torch; the fast tests run there too (the slow statistical
ones run in the main suite, with torch installed, and exercise the same code).

A pytest plugin put on ``PYTHONPATH`` installs an import hook before any conftest or test module
is imported: every ``import torch`` (or of a submodule) then raises ModuleNotFoundError, as where
torch is not installed. (``sys.modules["torch"] = None`` would not do: libraries such as SciPy
probe ``sys.modules["torch"]`` for tensor types and break on the None.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE_TESTS = (
    "tests/test_tree.py",
    "tests/test_verify.py",
    "tests/test_sampling.py",
    "tests/test_adaptive_core.py",
    "tests/test_kv_budget.py",
    "tests/test_suffix.py",
    "tests/test_engine_core.py",
    "tests/test_admission.py",
    "tests/test_constraints.py",
)  # the tests of specinfer.core
NO_TORCH_PLUGIN = """
import sys


class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideTorch())
"""


def test_core_tests_pass_without_torch(tmp_path):
    (tmp_path / "no_torch.py").write_text(NO_TORCH_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    blocked = subprocess.run([sys.executable, "-c", "import no_torch, torch"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr, blocked.stderr
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no_torch",
        "-p",
        "no:cacheprovider",
        "-q",
        "-m",
        "not slow",
        *CORE_TESTS,
    ]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout and "error" not in run.stdout, run.stdout[-4000:]
