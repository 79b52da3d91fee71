"""bench/bench_service.py end to end on a small pair: a stack per batch size serves every method,
the in-process engine runs the same ones, and every greedy output equals incremental decoding's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_service_rows_and_greedy_outputs_agree(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in ("def add(a, b):\n", "class Point:\n    def __init__(self", "import os\n")
        )
    )
    cmd = [
        sys.executable,
        str(REPO / "bench/bench_service.py"),
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
    ]
    cmd += [
        "--prompts",
        str(prompts),
        "--count",
        "3",
        "--new-tokens",
        "6",
        "--batch",
        "1,2",
        "--methods",
        "none;auto;1,1,3",
        "--threads",
        "1",
    ]
    cmd += ["--kv-cache-bytes", str(1 << 26)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[-1].strip().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (b, p, m) for b in ("1", "2") for p in ("services", "in-process") for m in ("none", "auto", "1,1,3")
    }
    for batch, path, method, seconds, rate, versus, latency, steps, same in rows:
        assert float(seconds) > 0 and float(rate) > 0 and float(latency) > 0
        assert same == "3/3", (batch, path, method)  # greedy: every method gives incremental decoding's tokens
        if method == "none":
            assert versus == "1.00" and int(steps) == 3 * 6
        if method == "1,1,3":  # a trained pair's SSM agrees with its LLM often
            assert int(steps) < 3 * 6, "the static tree accepted something"
