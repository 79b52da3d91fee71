"""bench/attention_cpu.py: the form it times against the SDPA path computes the same attention, and the bench runs
end to end (op rows, and the demo LLM's decoding with the two forms swapped, whose tokens it reports equal)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specinfer.kernels import build_paged_tree_metadata, tree_attention

REPO = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("attention_cpu", REPO / "bench/attention_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("nodes", "prefix"), [(1, 40), (5, 40), (6, 0)])
def test_the_replaced_form_is_the_same_attention(nodes: int, prefix: int) -> None:
    bench = load_bench()
    gen = torch.Generator().manual_seed(nodes)
    blocks = -(-(prefix + nodes) // 16)
    k, v = (torch.randn(blocks, 16, 2, 64, generator=gen) for _ in range(2))
    q = torch.randn(nodes, 6, 64, generator=gen)
    parents = [-1, *range(nodes - 1)] if nodes < 5 else [-1, 0, 0, 1, 2, 2][:nodes]
    meta = build_paged_tree_metadata([parents], [prefix], [list(range(blocks))[::-1]], 16, "cpu")
    expected = tree_attention(q, k, v, meta, impl="ref")
    assert (bench.copied_sdpa(q, k, v, meta) - expected).abs().max() < 1e-5
    assert (tree_attention(q, k, v, meta, impl="torch") - expected).abs().max() < 1e-5


def test_attention_bench_runs() -> None:
    cmd = [sys.executable, str(REPO / "bench/attention_cpu.py"), "--heads", "4", "--kv-heads", "2"]
    cmd += ["--contexts", "16", "--tree", "4", "--rounds", "1", "--threads", "1"]
    cmd += ["--llm", str(REPO / "models/demo/llm"), "--dtype", "float32", "--context", "16", "--new-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = re.findall(r"^\| (float32|bfloat16) \| (\d+) \| 16 \| ([\d.]+) \| ([\d.]+) \|", proc.stdout, re.M)
    assert [(d, n) for d, n, _, _ in ops] == [("float32", "1"), ("float32", "4"), ("bfloat16", "1"), ("bfloat16", "4")]
    decoded = re.findall(
        r"^\| (copies \+ enable_gqa|folded, in place) \| ([\d.]+) \| [\d.]+ \| (\d+) \| (\w+) \|$", proc.stdout, re.M
    )
    assert [name for name, *_ in decoded] == ["copies + enable_gqa", "folded, in place"], proc.stdout
    assert all(outputs == "1" and same == "True" for _, _, outputs, same in decoded), proc.stdout  # fp32: exact
