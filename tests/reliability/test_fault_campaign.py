"""The randomized fault campaign (bench/fault_campaign.py), 20 rounds: kill -9 and SIGSTOP of random
subsets of the stack's processes mid-stream, restarts in random order (some killed again during
their start-up), clients reattaching. Every output exact, nothing lost or duplicated, no process or
Redis left behind. The 200-round run and its figures: BENCHMARKS.md, "Resilience"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.reliability


def test_twenty_rounds_of_random_faults_lose_nothing(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": list(p)}) + "\n" for p in model_pair.prompts[:8]))
    cmd = [
        sys.executable,
        str(REPO / "bench/fault_campaign.py"),
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
    ]
    cmd += [
        "--prompts",
        str(prompts),
        "--rounds",
        "20",
        "--streams",
        "8",
        "--seed",
        "1",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rounds = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    assert summary["rounds"] == len(rounds) == 20
    assert summary["requests"] == 160 and summary["exact"] == 160, proc.stdout[-3000:]
    assert summary["duplicated"] == 0 and summary["lost"] == 0
    assert summary["orphans"] == 0
    # the faults were real: every kind happened, while the streams were running, and clients had to reattach
    kinds = " ".join(summary["faults"])
    for kind in ("ssm-worker", "llm-verifier kill", "stop", "request-manager kill", "kill+redis", "during start-up"):
        assert kind in kinds, summary["faults"]
    assert all(r["unfinished_at_fault"] > 0 for r in rounds)
    assert summary["retries"] > 0
