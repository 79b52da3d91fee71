"""bench/prefix_cache.py end to end on the small LLM: with prefix caching the later requests take the
shared prefix's full KV blocks (without, none), both modes generate the same tokens, and the JSON
holds the rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_later_requests_reuse_the_shared_prefix(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"text": f"def add_{i}(a, b):\n    return a + b * {i}\n" * 8}) + "\n" for i in range(4))
    )
    out = tmp_path / "prefix.json"
    cmd = [sys.executable, str(REPO / "bench/prefix_cache.py"), "--llm", str(model_pair.llm), "--prompts", str(prompts)]
    cmd += [
        "--requests",
        "4",
        "--prefix",
        "64",
        "--suffix",
        "8",
        "--new-tokens",
        "3",
        "--kv-block-size",
        "16",
        "--kv-cache-bytes",
        "60000000",
    ]
    cmd += ["--dtype", "float32", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x lower with prefix caching" in proc.stdout
    off, on = json.loads(out.read_text())["rows"]
    assert (off["prefix_caching"], on["prefix_caching"]) == ("off", "on")
    # a 71-token context (the last prompt token roots the tree): 4 full blocks of 16, all of the prefix
    assert off["later_cached_prompt_tokens"] == 0 and on["later_cached_prompt_tokens"] == 64
    assert all(r["first_ttft_s"] > 0 and r["later_ttft_median_s"] > 0 for r in (off, on))
