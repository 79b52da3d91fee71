"""A short run of bench/soak.py in CI: 64 concurrent streams against a stack with a small queue.
Every error is the deliberate RESOURCE_EXHAUSTED (and some are), requests keep finishing, every
process survives, and memory is sampled. The 60 s soak in BENCHMARKS.md is the same script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]


def test_64_streams_only_deliberate_refusals(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(40)))
    out = tmp_path / "soak.json"
    command = [
        sys.executable,
        str(REPO / "bench/soak.py"),
        *("--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--prompts", str(prompts)),
        *(
            "--streams",
            "64",
            "--seconds",
            "8",
            "--new-tokens",
            "8",
            "--max-batch",
            "16",
            "--max-queue",
            "8",
            "--sample-seconds",
            "1",
        ),
        *("--json", str(out)),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["unexpected_errors"] == 0 and set(summary["errors"]) <= {"RESOURCE_EXHAUSTED"}
    assert summary["errors"].get("RESOURCE_EXHAUSTED", 0) > 0, "64 streams never met the queue bound (16 + 8 places)"
    assert summary["requests_finished"] >= 16 and summary["tokens"] == 8 * summary["requests_finished"]
    assert all(summary["processes_alive_at_end"].values())
    assert {"llm-verifier", "ssm-worker-0", "request-manager"} <= set(summary["memory"])
    assert summary["per_token_ms"]["p99"] >= summary["per_token_ms"]["p50"] > 0
