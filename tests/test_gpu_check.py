"""scripts/gpu_check.sh --dry-run on the CPU: the GPU bring-up script's steps in their order, the CUDA ones
reported as skipped, and its plumbing really run (the import layout with a wheel the machine lacks unpacked,
the machine report, the collection of every test the CUDA steps run, a benchmark, the summary), so the script
cannot rot between the rare GPU sessions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = [
    "layout",
    "env",
    "collect-gpu-tests",
    "kernel-tests",
    "graphs",
    "native-vs-transformers",
    "precision",
    "greedy-equivalence",
    "stack",
    "bench-tree-attention",
    "inflate-7b",
    "verify-step-7b",
    "compare-7b",
    "offload",
    "kernel-tests-rest",
]
CPU_STEPS = {"layout", "env", "collect-gpu-tests", "precision", "bench-tree-attention"}


def probe_wheel(folder: Path) -> None:
    """A pure-Python wheel of a distribution no machine has, and one of an old pytest (the test's own is newer: not
    unpacked)."""
    with zipfile.ZipFile(folder / "pytest-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("pytest/__init__.py", "raise ImportError('the old pytest of the probe was unpacked')\n")
    with zipfile.ZipFile(folder / "specinfer_gpu_probe-0.1-py3-none-any.whl", "w") as zf:
        zf.writestr("specinfer_gpu_probe/__init__.py", "VALUE = 7\n")
        zf.writestr(
            "specinfer_gpu_probe-0.1.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: specinfer-gpu-probe\nVersion: 0.1\n",
        )


def dry_run(tmp_path: Path, **env: str) -> tuple[Path, dict]:
    """``gpu_check.sh --dry-run`` with ``env`` added; its output folder and summary."""
    gpu = tmp_path / "gpu"
    (gpu / "wheels").mkdir(parents=True)
    probe_wheel(gpu / "wheels")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, SPECINFER_GPU_DIR=str(gpu), TMPDIR=str(tmp_path), **env)
    done = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "--dry-run", str(out)],
        env=env,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "summary.json").read_text())


def test_gpu_check_dry_run(tmp_path):
    out, summary = dry_run(tmp_path)
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS
    assert {s: status[s] for s in CPU_STEPS} == dict.fromkeys(CPU_STEPS, "ok"), summary["steps"]
    assert all(status[s] == "skipped (no CUDA)" for s in STEPS if s not in CPU_STEPS)
    assert summary["dry_run"] and not summary["failed"] and summary["env"]["cuda"] is False
    layout = (out / "layout.log").read_text()
    assert "unpacked 1 missing or older distribution(s): specinfer_gpu_probe" in layout and "import layout ok" in layout
    collected = (out / "collect-gpu-tests.log").read_text()
    for test in (
        "test_gpu_score_options",
        "test_gpu_paged_score_options",
        "test_gpu_large_batch",
        "test_stack_with_the_verifier_on_cuda_equals_transformers",
    ):
        assert test in collected
    precision = (out / "precision.log").read_text()  # the CPU columns filled, the device's empty
    number = r"\d\.\d\de-\d\d"
    assert re.search(rf"^\| gemma2-capped \| {number} \| {number} \| - \| - \| - \|$", precision, re.M), precision
    assert "| 1 | 16 | 64 | sdpa |" in (out / "bench-tree-attention.log").read_text()
    assert "| kernel-tests | skipped (no CUDA) |" in (out / "summary.md").read_text()
    assert not list(tmp_path.glob("specinfer-gpu-check.*")), "the work folder is removed"


def test_only_the_selected_steps_run(tmp_path):
    """SPECINFER_GPU_CHECK_ONLY (a rerun of what failed): layout and env always, the named steps, no other."""
    _, summary = dry_run(tmp_path, SPECINFER_GPU_CHECK_ONLY="stack kernel-tests")
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS
    assert status["layout"] == status["env"] == "ok"
    assert status["stack"] == status["kernel-tests"] == "skipped (no CUDA)"
    others = set(STEPS) - {"layout", "env", "stack", "kernel-tests"}
    assert {status[s] for s in others} == {"skipped (not selected)"}, status
