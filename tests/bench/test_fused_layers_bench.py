"""bench/fused_layers.py end to end on the repository's demo LLM (int8, which the C layers run wherever our CPU
kernels do): a row for each path, their ratio, and the two paths' greedy tokens equal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specinfer.kernels import cpu_qgemm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cpu_qgemm.unavailable_reason() is not None, reason="our CPU kernels do not run here")
def test_fused_layers_bench_times_both_paths_and_compares_their_tokens():
    cmd = [sys.executable, str(REPO / "bench/fused_layers.py"), "--quantize", "int8", "--threads", "1"]
    cmd += ["--count", "1", "--prompt-tokens", "16", "--new-tokens", "6", "--rounds", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^\| (fused|per operation) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \|$", proc.stdout, re.M))
    assert set(rows) == {"fused", "per operation"} and all(float(v) > 0 for v in rows.values()), proc.stdout
    assert "greedy tokens equal: yes" in proc.stdout, proc.stdout
