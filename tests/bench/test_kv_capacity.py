"""bench/kv_capacity.py end to end on the small pair: with the same KV bytes, contiguous slots run
as many requests at once as they have slots, KV blocks run more, and the JSON holds the rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kv_blocks_hold_more_requests_than_slots(model_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": "def add(a, b):\n    return a + b\n" * 8}) + "\n" for _ in range(4)))
    out = tmp_path / "cap.json"
    # a budget of 2.5 slots (a slot: the model's positions + 256 rows, in fp32): 2 slots; blocks of 8
    # tokens hold all 6 requests at once
    cfg = json.loads((model_pair.llm / "config.json").read_text())
    token_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    slot = cfg["max_position_embeddings"] + 256
    budget = str(int(2.5 * slot * token_bytes))
    cmd = [
        sys.executable,
        str(REPO / "bench/kv_capacity.py"),
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
        "--prompts",
        str(prompts),
    ]
    cmd += [
        "--requests",
        "6",
        "--context",
        "48",
        "--new-tokens",
        "4",
        "--kv-cache-bytes",
        budget,
        "--block-sizes",
        "8",
        "--speculation",
        "none",
    ]
    cmd += ["--dtype", "float32", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    slots, blocks = json.loads(out.read_text())["rows"]
    assert (
        slots["layout"] == "slots"
        and slots["pool"] == f"2 x {slot} tokens"
        and slots["most_running"] == 2
        and slots["iterations"] >= 3 * 4
    )
    assert (
        blocks["layout"] == "blocks 8" and blocks["most_running"] == 6 and blocks["iterations"] == 4
    )  # all at once, 4 steps
    assert slots["preemptions"] == blocks["preemptions"] == 0
