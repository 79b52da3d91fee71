"""bench/incremental_floor.py end to end on the repository's demo LLM: the table has the decode row
and one row per matrix-product form, each with a positive time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_incremental_floor_prints_every_row():
    cmd = [sys.executable, str(REPO / "bench/incremental_floor.py"), "--llm", str(REPO / "models/demo/llm")]
    # enough decode steps that the whole step (a difference of two timings) stands above the timings' noise
    cmd += ["--dtype", "float32", "--threads", "1", "--new-tokens", "32", "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|", proc.stdout, re.M))
    assert set(rows) == {
        "decode, no speculation (whole step)",
        "products alone: F.linear",
        "products alone: transposed (w @ x.T)",
        "products alone: matrix-vector (torch.mv)",
        "products alone: the plan measured at load",
    }, proc.stdout
    assert all(float(ms) > 0 for ms in rows.values())
