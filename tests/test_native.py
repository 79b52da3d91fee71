"""The native backend matches ``transformers`` logits (fp32) for prefill and tree-verify steps."""

from __future__ import annotations

import pytest
import torch
from devices import on_test_device  # tests/devices.py
from rope_configs import GEMMA3_ROPE, PARTIAL_ROPE, PHI3_LONGROPE, PHI3_TOKENS, gemma3_multimodal, llama3_rope
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from specinfer.models.interface import TreeForward
from specinfer.models.native import KVCacheFull, NativeBackend, NativeOptions
from specinfer.models.native.gemm import packing_available
from specinfer.models.native.step import PackedStep, StepRequest

TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (``a``: ours, on the test device; ``b``: transformers', on the CPU)"""
    return float((a.cpu() - b).abs().max() / b.abs().max())


LLAMA3_ROPE = llama3_rope(8.0)


def _tiny_configs():
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    gemma = dict(common, pad_token_id=0, bos_token_id=2, eos_token_id=1)  # Gemma's token ids
    gemma3_layers = dict(
        gemma, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    )
    return {
        "llama-gqa": LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False),
        "llama3-rope": LlamaConfig(**common, num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
        # Llama 3.2 (1B/3B): tied embeddings, head_dim 64 of 2048 / 32 heads, 4:1 GQA, llama3 RoPE
        "llama3.2-tied": LlamaConfig(
            **common, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
        ),
        "mistral": MistralConfig(**common, num_key_value_heads=2, sliding_window=512),
        # a window of 6 bites inside the prompts and trees (the kernel masks, the cache keeps every key)
        "mistral-window": MistralConfig(**common, num_key_value_heads=2, sliding_window=6),
        # Qwen3 with use_sliding_window: a window on the layers from max_window_layers on, full attention below
        "qwen3-mixed-window": Qwen3Config(
            **common, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1
        ),
        "qwen2": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
        # Qwen3 (0.6B): head_dim set apart from hidden / heads (128 of 1024 / 16), q/k RMSNorm, no qkv
        # bias, tied embeddings
        "qwen3": Qwen3Config(**common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        # Qwen3 with attention_bias (q/k/v/o biases), untied
        "qwen3-bias": Qwen3Config(
            **common, num_key_value_heads=1, head_dim=8, attention_bias=True, tie_word_embeddings=False
        ),
        # Phi-3-mini-128k: fused qkv_proj and gate_up_proj, LongRoPE (exact up to its switch, 64 here)
        "phi3-longrope": Phi3Config(
            **common,
            **PHI3_TOKENS,
            num_key_value_heads=4,
            original_max_position_embeddings=64,
            rope_parameters=PHI3_LONGROPE,
        ),
        # Phi-4-mini (model_type phi3): GQA, RoPE on the leading 3/4 of each head, tied embeddings
        "phi3-partial-rope": Phi3Config(
            **common, **PHI3_TOKENS, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=PARTIAL_ROPE
        ),
        # Gemma 2 (2B: 8 heads, 4 KV heads, head_dim 256 apart from hidden / heads, query_pre_attn_scalar 256): local
        # and global layers alternating, the real soft-caps (50 on attention scores, 30 on logits), tied embeddings
        "gemma2": Gemma2Config(**gemma, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6),
        # caps small enough to bite on a tiny random model's scores and logits
        "gemma2-capped": Gemma2Config(
            **gemma,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=0.5,
        ),
        # Gemma 3 1B: 4 heads, 1 KV head, head_dim 256, q/k norms, local RoPE base 10k / global 1M, 5 local : 1 global
        # (here local, global, local), tied embeddings
        "gemma3": Gemma3TextConfig(
            **gemma3_layers, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=5
        ),
        # Gemma 3 4B+: linear RoPE scaling (factor 8) on the global layers only
        "gemma3-linear-rope": Gemma3TextConfig(
            **gemma3_layers, num_key_value_heads=2, head_dim=16, sliding_window=7, rope_parameters=GEMMA3_ROPE
        ),
        # the multimodal checkpoint (model_type gemma3): its text model, the vision tower left aside
        "gemma3-multimodal": gemma3_multimodal(
            Gemma3TextConfig(
                **gemma3_layers, num_key_value_heads=2, head_dim=16, sliding_window=6, rope_parameters=GEMMA3_ROPE
            )
        ),
        "opt": OPTConfig(
            vocab_size=97,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
        "opt-project": OPTConfig(
            vocab_size=97,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
        ),
        # LayerNorm after each sublayer and no final norm, like opt-350m
        "opt-post-norm": OPTConfig(
            vocab_size=97,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
    }


def save_tiny_checkpoint(name: str, path):
    """The tiny random model ``name`` of :func:`_tiny_configs`, saved to ``path``; returns transformers' fp32 model
    loaded back from it (the oracle). Also scripts/gpu_precision.py's models."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_configs()[name]).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a forgotten term shows
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    # eager: the attention as the model defines it. transformers' SDPA attention drops Gemma 2's attention soft-cap,
    # and releases before 5.23 (5.17 on the first GPU machine) chose it for Gemma 2: that was the 1.6e-4 gap on CUDA
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def tiny_prompts() -> list[list[int]]:
    """The prompts the prefill test (and scripts/gpu_precision.py) feed the tiny models."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (1, 9, 40, 23)]


@pytest.fixture(scope="module", params=list(_tiny_configs()))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_checkpoint(request.param, path)


def _node_sequences(item: TreeForward) -> list[list[int]]:
    """Context + root-to-node tokens of every node of ``item``'s tree."""
    seqs = []
    for node in range(len(item.tokens)):
        path, u = [], node
        while u >= 0:
            path.append(item.tokens[u])
            u = item.parents[u]
        seqs.append(list(item.context_tokens) + path[::-1])
    return seqs


def _hf_last_logits(hf, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])


@pytest.mark.parametrize(
    ("gemm", "kv_block_size"),
    [("linear", 0), ("transposed", 0), ("packed", 0), ("linear", 3)],
    ids=["linear", "transposed", "packed", "paged"],
)
def test_prefill_and_tree_steps_match_transformers(checkpoint, gemm, kv_block_size):
    """Every form of the matrix products (see specinfer.models.native.gemm: the packed one where this CPU's oneDNN
    packs the dtype), and KV blocks of 3 tokens (a sliding window then starts mid-block), give transformers' logits."""
    path, hf = checkpoint
    if gemm == "packed" and (on_test_device(NativeOptions()).device != "cpu" or not packing_available(torch.float32)):
        pytest.skip("the packed form is oneDNN's, on a CPU that packs fp32")
    native = NativeBackend.load(
        path,
        on_test_device(
            NativeOptions(kv_cache_bytes=1 << 24, attention="torch", gemm=gemm, kv_block_size=kv_block_size)
        ),
    )
    prompts = tiny_prompts()
    # prefill: the whole prompt as a chain (context empty) -> logits after every token
    chains = native.forward_tree(
        [TreeForward(f"r{i}", [], p, list(range(-1, len(p) - 1))) for i, p in enumerate(prompts)]
    )
    for p, logits in zip(prompts, chains, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert _rel(logits, ref) < TOL
    # tree verify on top of the cached prompts: root = last prompt token, branches
    tokens, parents = [0, 5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2, 4]
    for step in range(2):
        items = []
        for i, p in enumerate(prompts):
            tree_tokens = [p[-1]] + [(t * (i + 3) + step) % 97 for t in tokens[1:]]
            items.append(TreeForward(f"r{i}", p[:-1], tree_tokens, parents))
        out = native.forward_tree(items)
        for item, logits in zip(items, out, strict=True):
            assert _rel(logits, _hf_last_logits(hf, _node_sequences(item))) < TOL
        # accept node 3's path (root, 1, 3) + a bonus token: the next context adopts it
        prompts = [list(item.context_tokens) + [item.tokens[0], item.tokens[1], item.tokens[3], 11] for item in items]


def test_incremental_expansion_and_cache_rebuild(checkpoint):
    """SSM-style calls (root, then frontier nodes attached to earlier ones) and a context that
    diverges from the cache (truncation) both give transformers' logits."""
    path, hf = checkpoint
    native = NativeBackend.load(path, on_test_device(NativeOptions(kv_cache_bytes=1 << 24, attention="torch")))
    ctx = list(range(10, 30))
    root = native.forward_tree([TreeForward("a", ctx[:-1], [ctx[-1]], [-1])])[0]
    assert _rel(root, _hf_last_logits(hf, [ctx])) < TOL
    kids = native.forward_tree([TreeForward("a", ctx[:-1], [40, 41], [0, 0])])[0]
    assert _rel(kids, _hf_last_logits(hf, [ctx + [40], ctx + [41]])) < TOL
    grand = native.forward_tree([TreeForward("a", ctx[:-1], [50], [2])])[0]
    assert _rel(grand, _hf_last_logits(hf, [ctx + [41, 50]])) < TOL
    # the context moved on along 41 then diverged from the cache further back
    new_ctx = ctx[:5] + [1, 2, 3]
    out = native.forward_tree([TreeForward("a", new_ctx, [4], [-1])])[0]
    assert _rel(out, _hf_last_logits(hf, [new_ctx + [4]])) < TOL
    adopted = native.forward_tree([TreeForward("a", ctx + [41], [50], [-1])])[0]
    assert _rel(adopted, _hf_last_logits(hf, [ctx + [41, 50]])) < TOL


def test_packed_step_layout():
    """Request a: 3 cached context tokens, a chain of 2, 2 pending nodes, 2 new ones; request b: a new tree only."""
    step = PackedStep.from_trees(
        [
            StepRequest(kv_start=100, cached=3, chain=[7, 8], tokens=[5, 6], parents=[-1, 0, 1, 0]),
            StepRequest(kv_start=0, cached=4, chain=[], tokens=[1, 2, 3], parents=[-1, 0, 0]),
        ]
    )
    assert step.tokens == (7, 8, 5, 6, 1, 2, 3)
    assert step.positions == (3, 4, 7, 6, 4, 5, 5)  # chain after the cached context; nodes at context + depth
    assert step.cache_rows == (103, 104, 107, 108, 4, 5, 6)  # new nodes behind the pending ones
    assert step.seg_parents == ((-1, 0), (-1, 0, 1, 0), (-1, 0, 0))
    assert (step.seg_prefix, step.seg_starts, step.seg_queries) == ((3, 5, 4), (100, 100, 0), (2, 2, 3))
    assert step.logit_rows == (2, 3, 4, 5, 6)
    with pytest.raises(ValueError, match="only the first"):
        PackedStep.from_trees([StepRequest(kv_start=0, cached=1, chain=[], tokens=[1, 2], parents=[-1, -1])])


def test_packed_step_runs_without_the_backend(checkpoint):
    """A prefill chain and a tree on top of it in one packed step, run by the backend's runner
    directly: the tree's logits are transformers'."""
    path, hf = checkpoint
    native = NativeBackend.load(path, on_test_device(NativeOptions(kv_cache_bytes=1 << 24, attention="torch")))
    context, tokens, parents = list(range(3, 20)), [20, 21, 22, 23], [-1, 0, 0, 2]
    step = PackedStep.from_trees(
        [StepRequest(kv_start=native.pool.slot_len, cached=0, chain=context, tokens=tokens, parents=parents)]
    )
    logits = native.runner.run(step)
    assert _rel(logits, _hf_last_logits(hf, _node_sequences(TreeForward("x", context, tokens, parents)))) < TOL


def test_kv_budget_is_enforced(checkpoint):
    path, _ = checkpoint
    native = NativeBackend.load(path, NativeOptions(kv_cache_bytes=1 << 20, max_seq_len=64, max_tree_nodes=0))
    slots = native.max_requests
    assert slots >= 1
    for i in range(slots):
        native.forward_tree([TreeForward(f"r{i}", [], [1, 2], [-1, 0])])
    with pytest.raises(KVCacheFull):
        native.forward_tree([TreeForward("one-too-many", [], [1], [-1])])
    native.release("r0")
    native.forward_tree([TreeForward("one-too-many", [], [1], [-1])])


def test_shared_pair_logits_match_transformers(model_pair):
    """The LLM of the test pair (the trained one when present): prefill and a tree-verify step."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32).eval()
    native = NativeBackend.load(
        model_pair.llm, on_test_device(NativeOptions(kv_cache_bytes=1 << 26, max_seq_len=512, attention="torch"))
    )
    prompts = [p[:200] for p in model_pair.prompts[:3]]
    out = native.forward_tree([TreeForward(f"s{i}", [], p, list(range(-1, len(p) - 1))) for i, p in enumerate(prompts)])
    for p, logits in zip(prompts, out, strict=True):
        with torch.no_grad():
            assert _rel(logits, hf(torch.tensor([p])).logits[0]) < TOL
    parents = [-1, 0, 0, 1, 2, 2]
    vocab = native.vocab_size
    items = [
        TreeForward(f"s{i}", p[:-1], [p[-1]] + [t % vocab for t in (17, 99, 5, 300, 42)], parents)
        for i, p in enumerate(prompts)
    ]
    for item, logits in zip(items, native.forward_tree(items), strict=True):
        assert _rel(logits, _hf_last_logits(hf, _node_sequences(item))) < TOL
