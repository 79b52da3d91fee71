"""bench/concurrency.py end to end on a short run: a row per method at the concurrency asked and the speed against
``none`` beside each, on a stack without prefix caching by default (every row takes the same prompts in the same
order: with the cache the rows after the first would find them computed) or with it and every prompt computed once
before the first row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("caching", ["off", "on"])
def test_concurrency_prints_a_row_per_method(model_pair, caching):
    cmd = [sys.executable, str(REPO / "bench/concurrency.py"), "--llm", str(model_pair.llm)]
    cmd += ["--ssm", str(model_pair.ssm), "--concurrency", "2", "--methods", "default,none"]
    cmd += ["--seconds", "2", "--settle-seconds", "1", "--warmup-seconds", "1", "--new-tokens", "8"]
    cmd += ["--dtype", "float32"] + (["--prefix-caching", "on"] if caching == "on" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"prefix caching {caching}" in proc.stdout, proc.stdout
    rows = dict(re.findall(r"^\| 2 \| (default|none) \| (.*)$", proc.stdout, re.M))
    assert set(rows) == {"default", "none"}, proc.stdout
    none = [c.strip() for c in rows["none"].split("|")]
    assert float(none[0]) > 0 and none[4] == "1.00", none  # tokens/s, and none against itself
