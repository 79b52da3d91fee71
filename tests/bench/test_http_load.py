"""bench/http_load.py end to end on a short run: both paths serve every stream without errors, the
ABBA phases are all counted, and the JSON holds the figures BENCHMARKS.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_http_load_runs_both_paths_without_errors(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in ("def add(a, b):\n", "class Point:\n    def __init__(self", "import os\n")
        )
    )
    out = tmp_path / "load.json"
    cmd = [
        sys.executable,
        str(REPO / "bench/http_load.py"),
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
        "--prompts",
        str(prompts),
    ]
    cmd += ["--streams", "3", "--seconds", "4", "--warmup-seconds", "1", "--new-tokens", "8", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("grpc: 2 s") == 2 and proc.stdout.count("http: 2 s") == 2, proc.stdout
    result = json.loads(out.read_text())
    for path in ("grpc", "http"):
        s = result[path]
        assert s["errors"] == {} and s["requests"] >= 3, s
        assert s["tokens"] == 8 * s["requests"]  # EOS ignored: every request runs to max_tokens
        assert s["tokens_per_s"] > 0 and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] > 0
        # chunks that arrive in one read are microseconds apart: a median gap may round to 0.0 ms
        assert s["itl_ms"]["p99"] >= s["itl_ms"]["p50"] >= 0 and s["itl_ms"]["p99"] > 0
        assert s["seconds"] >= 4  # two halves of 2 s, each waiting for its requests in flight
    assert result["http_vs_grpc_tokens_per_s"] > 0
