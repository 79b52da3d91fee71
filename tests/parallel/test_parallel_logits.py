"""Tensor (TP), pipeline (PP) and TP x PP parallel logits equal the single-process native
backend's (fp32) for prefill and tree-verify steps, with gloo and one process per rank."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rope_configs import GEMMA3_ROPE, PARTIAL_ROPE, PHI3_TOKENS, llama3_rope
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    OPTConfig,
    Phi3Config,
    Qwen3Config,
)

from specinfer.models.native import NativeBackend

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenario import OPTIONS, steps  # noqa: E402

TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configs():
    common = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256
    )
    return {
        # GQA: 2 key/value heads, one per tensor rank; 97 tokens: vocabulary shards of 49 and 48; 3 layers: stages of
        # 2 and 1
        "llama-gqa": LlamaConfig(**common, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False),
        # biases everywhere (row-parallel biases must count once), tied embeddings
        "opt": OPTConfig(**common, ffn_dim=96, word_embed_proj_dim=64),
        # q/k norms (replicated on every rank), head_dim apart from hidden / heads, tied embeddings
        "qwen3": Qwen3Config(
            **common, intermediate_size=96, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True
        ),
        # Llama 3.2: tied embeddings, llama3 RoPE
        "llama3.2-tied": LlamaConfig(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=llama3_rope(8.0),
        ),
        # fused qkv_proj and gate_up_proj in the checkpoint, split by heads / MLP columns per rank; RoPE on 3/4 of each
        # head
        "phi3": Phi3Config(
            **common, **PHI3_TOKENS, intermediate_size=96, num_key_value_heads=2, rope_parameters=PARTIAL_ROPE
        ),
        # norms on the sublayer outputs (after the all-reduce of o_proj / down_proj), scaled embeddings (after the
        # vocabulary-parallel all-reduce), soft-caps (attention per rank's heads, logits after the all-gather),
        # windows of 6
        "gemma2": Gemma2Config(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
        # q/k norms, local and global RoPE; the global layer last, so a second stage that took the first layer's
        # window fails
        "gemma3": Gemma3TextConfig(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
        ),
    }


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_configs()[request.param]).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a term counted twice or dropped shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single(checkpoint) -> list[list[torch.Tensor]]:
    backend = NativeBackend.load(checkpoint, OPTIONS)
    return steps(backend, backend.vocab_size)


def run_parallel(
    checkpoint: Path, tp: int, pp: int, out: Path, kv_block_size: int = 0, offload: bool = False
) -> list[list[torch.Tensor]]:
    port = free_port()
    args = [str(checkpoint), str(tp), str(pp), "RANK", str(port), str(out), str(kv_block_size), str(int(offload))]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "scenario.py"), *(str(rank) if a == "RANK" else a for a in args)],
            stderr=subprocess.PIPE,
        )
        for rank in range(tp * pp)
    ]
    errors = []
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            errors.append(f"rank {rank} exited {p.returncode}:\n{err.decode(errors='replace')[-3000:]}")
    assert not errors, "\n".join(errors)
    return torch.load(out)


# every layout on the GQA Llama; OPT (biases: row-parallel ones must count once; layer norms; tied embeddings) and the
# newer families under TP
CASES = [
    ("llama-gqa", 2, 1),
    ("llama-gqa", 1, 2),
    ("llama-gqa", 2, 2),
    ("opt", 2, 1),
    ("qwen3", 2, 1),
    ("llama3.2-tied", 2, 1),
    ("phi3", 2, 1),
]
CASES += [("gemma2", 2, 1), ("gemma3", 2, 1), ("gemma3", 1, 2)]


# KV blocks of 3 tokens on every rank (tables from rank 0, moves replayed in physical rows)
PAGED_CASES = [("llama-gqa", 2, 1, 3), ("llama-gqa", 2, 2, 3), ("gemma3", 2, 1, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp"), CASES, indirect=["checkpoint"], ids=[f"{m}-tp{t}xpp{p}" for m, t, p in CASES]
)
def test_parallel_logits_equal_single_process(checkpoint, single, tp, pp, tmp_path):
    assert_same_logits(run_parallel(checkpoint, tp, pp, tmp_path / "logits.pt"), single)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp", "block"),
    PAGED_CASES,
    indirect=["checkpoint"],
    ids=[f"{m}-tp{t}xpp{p}-kvblock{b}" for m, t, p, b in PAGED_CASES],
)
def test_paged_parallel_logits_equal_single_process(checkpoint, single, tp, pp, block, tmp_path):
    """Against the single-process backend on contiguous slots."""
    assert_same_logits(run_parallel(checkpoint, tp, pp, tmp_path / "logits.pt", block), single)


# offloading under TP and PP: each rank streams its own shard's layers (docs/offloading.md)
OFFLOAD_CASES = [("llama-gqa", 2, 1), ("llama-gqa", 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp"),
    OFFLOAD_CASES,
    indirect=["checkpoint"],
    ids=[f"{m}-tp{t}xpp{p}-offload" for m, t, p in OFFLOAD_CASES],
)
def test_offloaded_parallel_logits_equal_single_process(checkpoint, single, tp, pp, tmp_path):
    """Against the single-process backend with every layer resident."""
    assert_same_logits(run_parallel(checkpoint, tp, pp, tmp_path / "logits.pt", offload=True), single)


def assert_same_logits(parallel: list[list[torch.Tensor]], single: list[list[torch.Tensor]]) -> None:
    assert len(parallel) == len(single)
    for step, (got_step, want_step) in enumerate(zip(parallel, single, strict=True)):
        assert len(got_step) == len(want_step)
        for got, want in zip(got_step, want_step, strict=True):
            assert got.shape == want.shape, f"step {step}"
            if want.numel():
                rel = float((got - want).abs().max() / want.abs().max())
                assert rel < TOL, f"step {step}: relative error {rel:.2e}"
