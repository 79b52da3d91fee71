"""bench/bench_step.py end to end on the repository's demo LLM, with ``--profile``: a timing row per tree size,
and a profile row for the smallest and largest tree whose operator counts and host time are real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_step_times_and_profiles_each_tree():
    cmd = [sys.executable, str(REPO / "bench/bench_step.py"), "--llm", str(REPO / "models/demo/llm")]
    cmd += ["--runtimes", "native", "--dtype", "float32", "--threads", "1", "--batch", "1", "--prefix", "16"]
    cmd += ["--nodes", "1,4,16", "--steps", "2", "--warmup", "1", "--profile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    timed = re.findall(r"^\| 1 \| 16 \| (\d+) \| ([\d.]+) \| ([\d.]+)x \|$", proc.stdout, re.M)
    assert [t[0] for t in timed] == ["1", "4", "16"] and all(float(t[1]) > 0 for t in timed), proc.stdout
    profiled = re.findall(
        r"^\| native \| 1 \| 16 \| (\d+) \| [\d.]+ \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (.+) \|$", proc.stdout, re.M
    )
    assert [p[0] for p in profiled] == ["1", "16"], proc.stdout
    for _, calls, host_ms, device_ms, top in profiled:
        # a real count: dozens of operator calls a step where the fused C layers run the 4 layers (the embedding, the
        # step's tensors, the LM head's output), hundreds per operation; on the CPU no device time
        assert int(calls) > 20 and float(host_ms) > 0 and float(device_ms) == 0 and "aten::" in top
