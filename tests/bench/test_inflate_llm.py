"""bench/inflate_llm.py on the bundled demo LLM: the copy has the asked shape (wider residual stream, more and
regrouped heads, a wider MLP, ghost layers) and computes the same logits as the original."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
DEMO_LLM = REPO / "models/demo/llm"


def test_inflated_copy_has_the_shape_and_the_logits_of_the_original(tmp_path):
    out = tmp_path / "inflated"
    # demo LLM: hidden 256, 4 query / 4 KV heads of 64, MLP 688, 4 layers, tied embeddings (4096 x 256)
    shape = ["--hidden", "384", "--heads", "8", "--kv-heads", "4", "--mlp-dim", "1024", "--params", "12e6"]
    cmd = [sys.executable, str(REPO / "bench/inflate_llm.py"), str(DEMO_LLM), str(out), *shape]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 real + 2 ghost layers" in run.stdout, run.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (384, 8, 4)
    assert (config["head_dim"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 1024, 6)
    assert (out / "tokenizer.json").read_bytes() == (DEMO_LLM / "tokenizer.json").read_bytes()

    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))  # [2, 40]
    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(DEMO_LLM, dtype=torch.float32)(tokens).logits  # [2, 40, V]
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits  # [2, 40, V]
    # the same sums over more (zero) terms: float rounding apart, the same logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
