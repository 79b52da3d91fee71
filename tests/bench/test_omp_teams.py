"""bench/omp_teams.py end to end on the demo LLM: a row per kind of work in a second thread, each from its own process,
with the main thread's time a token before and after it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_omp_teams_bench_prints_a_row_per_work():
    cmd = [sys.executable, str(REPO / "bench/omp_teams.py"), "--new-tokens", "4", "--rounds", "1", "--threads", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| ([a-z, 0-9]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    names = ["nothing", "parallel sum", "small sum", "decoding, 1 thread", "decoding, 2 threads"]
    assert [r[0] for r in rows] == names, proc.stdout
    assert all(float(before) > 0 and float(after) > 0 for _, before, after, _ in rows), proc.stdout
