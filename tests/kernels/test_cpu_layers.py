"""The fused CPU decoder layers (kernels/cpu_layers.c, specinfer.models.native.fused) against the model's own
per-operation layers, and their row invariance: a verified tree's rows equal one-token steps bit for bit, and a
request's rows do not depend on what else is in its batch (a mixed step is split, specinfer.models.native.step).

The configurations are the Llama family's variants the C layers take: q/k/v biases and sliding-window layers
(Qwen2), per-head q/k norms (Qwen3), partial RoPE (Phi-3), grouped-query attention (2, 3 and 4 query heads a KV
head: kernels/cpu_kernels.h's attend_row_group); each with dense fp32 and bf16
weights and our int4 and int8 block layouts.
"""

from __future__ import annotations

import pytest
import torch
from rope_configs import PARTIAL_ROPE  # tests/rope_configs.py
from test_model_families import COMMON  # tests/test_model_families.py: the tiny configs' common shape
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

from specinfer.kernels import cpu_layers, cpu_qgemm
from specinfer.models.interface import TreeForward
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.fused import row_cap
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.step import PackedStep, StepRequest, fused_served, split_for_fused

pytestmark = pytest.mark.skipif(
    cpu_qgemm.unavailable_reason() is not None, reason=f"C kernels: {cpu_qgemm.unavailable_reason()}"
)

GQA3_64 = {**COMMON, "hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, attention_bias=True),
    "qwen2-window": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3-qk-norm": lambda: Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "phi3-partial-rope": lambda: Phi3Config(**COMMON, num_key_value_heads=4, rope_parameters=PARTIAL_ROPE),
    # three query heads a KV head, heads of 64 (SmolLM2's): the attention's widest grouped path
    "llama-gqa3-64": lambda: LlamaConfig(**GQA3_64),
}
WEIGHTS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int4"), ("float32", "int8"), ("bfloat16", "int4")]
PROMPT = [5, 17, 33, 9, 60, 21, 44, 8, 71, 30, 12]
TREE = ([40, 41, 50, 51, 52, 53], [-1, 0, 0, 1, 3, 2])  # branches 40-41-51-52 and 40-50-53


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


def _load(path, dtype: str, quantize: str, fused: bool = True, block: int = 4) -> NativeBackend:
    options = NativeOptions(
        dtype=getattr(torch, dtype),
        kv_cache_bytes=1 << 24,
        kv_block_size=block,
        quantize=quantize,
        gemm="linear",
        fused_layers=fused,
        prefix_caching=False,  # a hit would make the rest of a prompt a served chunk: the steps' prompts would differ
    )
    backend = NativeBackend.load(path, options)
    if quantize != "none":  # our block layouts go through the C layers wherever they run
        assert (backend._local_model().fused is not None) == fused
    return backend


def _tree(backend: NativeBackend, rid: str) -> torch.Tensor:
    """The logits of TREE's nodes behind PROMPT (the prompt computed first, in the same call).  # [6, vocab]"""
    return backend.forward_tree([TreeForward(rid, PROMPT, *TREE)])[0]


def _branch_steps(backend: NativeBackend, rid: str) -> torch.Tensor:
    """The logits of TREE's nodes each from one-token steps down its branch.  # [6, vocab]"""
    tokens, parents = TREE
    rows = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        for depth, token in enumerate(path):
            out = backend.forward_tree([TreeForward(f"{rid}{i}", PROMPT + path[:depth], [token], [-1])])[0]
        rows.append(out[0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype, quantize", WEIGHTS)
def test_fused_layers_equal_the_per_operation_layers(checkpoint, dtype, quantize):
    fused, ops = _load(checkpoint, dtype, quantize), _load(checkpoint, dtype, quantize, fused=False)
    if fused._local_model().fused is None:
        pytest.skip("dense weights go through the C layers on AVX2 and AVX-512 CPUs only")
    a, b = _tree(fused, "r"), _tree(ops, "r")
    # fp32 dense: rounding only; bf16 and quantized activations: one rounding step apart at most on some inputs
    exact = (dtype, quantize) == ("float32", "none")
    assert (a - b).abs().max() <= (1e-4 if exact else 0.05) * b.abs().max()
    if exact:
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype, quantize", WEIGHTS)
@pytest.mark.parametrize("block", [0, 4])
def test_a_verified_tree_equals_one_token_steps_bit_for_bit(checkpoint, dtype, quantize, block):
    backend = _load(checkpoint, dtype, quantize, block=block)
    if backend._local_model().fused is None:
        pytest.skip("dense weights go through the C layers on AVX2 and AVX-512 CPUs only")
    assert torch.equal(_tree(backend, "t"), _branch_steps(backend, "s"))


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_a_request_in_a_mixed_batch_gets_its_own_logits(checkpoint, quantize):
    """A verify step beside another request's prompt (a step split in two) equals the same step alone."""
    backend = _load(checkpoint, "float32", quantize)
    if backend._local_model().fused is None:
        pytest.skip("dense weights go through the C layers on AVX2 and AVX-512 CPUs only")
    for rid in ("a", "c"):  # the same history for a and c: the prompt alone, one node pending
        backend.forward_tree([TreeForward(rid, PROMPT[:-1], [PROMPT[-1]], [-1])])
    alone = backend.forward_tree([TreeForward("a", PROMPT, [40, 41], [-1, 0])])[0]
    beside_a_prompt = backend.forward_tree(
        [TreeForward("c", PROMPT, [40, 41], [-1, 0]), TreeForward("b", [9, 8, 7, 6, 5, 4, 3], [7], [-1])]
    )[0]
    assert torch.equal(beside_a_prompt, alone)


def test_split_for_fused_runs_prompts_first_and_keeps_every_row():
    decode = StepRequest(kv_start=0, cached=20, chain=(), tokens=(7, 8), parents=(-1, 0))
    prompt = StepRequest(kv_start=100, cached=0, chain=(1, 2, 3), tokens=(4,), parents=(-1,))
    step = PackedStep.from_trees([decode, prompt])
    assert fused_served(step) == [True, True, True], "no row cap: a short prompt goes in the same pass"
    assert split_for_fused(step) is None
    capped = fused_served(step, max_rows=8)  # a row cap: the prompt's chain per operation, first
    assert capped == [True, False, True]
    (first, rows1, logits1), (second, rows2, logits2) = split_for_fused(step, capped)
    assert first.seg_prefix == (0,) and rows1 == [2, 3, 4] and second.seg_prefix == (20, 3) and rows2 == [0, 1, 5]
    assert sorted(rows1 + rows2) == list(range(len(step.tokens)))
    assert sorted(logits1 + logits2) == list(range(len(step.logit_rows)))
    for part, rows in ((first, rows1), (second, rows2)):
        assert part.tokens == tuple(step.tokens[r] for r in rows)
        assert part.cache_rows == tuple(step.cache_rows[r] for r in rows)
    assert split_for_fused(PackedStep.from_trees([decode])) is None  # nothing to split
    # a served chunk of a request's context before its own tree of more than 64 rows: not split (order matters)
    big = StepRequest(kv_start=0, cached=20, chain=(1, 2), tokens=tuple(range(70)), parents=(-1, *range(69)))
    assert split_for_fused(PackedStep.from_trees([big, prompt])) is None


def test_models_the_c_layers_do_not_run_stay_per_operation(checkpoint):
    assert _load(checkpoint, "float32", "int4", fused=False)._local_model().fused is None
    triton = NativeOptions(kv_cache_bytes=1 << 24, quantize="int4", attention="triton")
    assert NativeBackend.load(checkpoint, triton)._local_model().fused is None


@pytest.mark.parametrize("block", [0, 4])
def test_a_steps_segments_give_what_its_attention_metadata_gives(checkpoint, block):
    """The fused layers build each row's visible keys from the step's segments in C (the runner's path for a step
    they serve whole); the same step through its attention metadata gives the same logits, bit for bit: a verify
    tree behind pending nodes, and a context chain behind a cached prefix longer than Qwen2's window."""
    backend = _load(checkpoint, "float32", "int4", block=block)
    model, pool, cpu = backend._local_model(), backend.runner.pool, torch.device("cpu")
    tables = ((3, 1, 4, 0, 2, 5), (7, 9, 8, 6)) if block else ((), ())
    step = PackedStep.from_trees(
        [
            StepRequest(0, 12, (), (5, 6, 7), (-1, 0, 1, 1), tables[0]),
            StepRequest(0 if block else 40, 9, (1, 2), (3,), (-1,), tables[1]),
        ],
        block,
    )
    tokens, positions, rows, logit_rows = step.tensors(cpu)
    by_segments = model.forward(tokens, positions, rows, step.segments(), pool, logit_rows)
    by_metadata = model.forward(tokens, positions, rows, step.metadata(cpu), pool, logit_rows)
    assert torch.equal(by_segments, by_metadata)
    with pytest.raises(ValueError, match="query row"):
        model.fused.run(model.embed(tokens[:2], positions[:2]), positions[:2], rows[:2], step.segments(), pool)


def _llama_spec(hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec.from_config(
        LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, vocab_size=1000,
        ).to_dict()
    )  # fmt: skip


def test_dense_steps_of_many_rows_leave_the_c_layers_on_avx512_cpus_only():
    """AVX2 CPUs, our int4/int8 layouts and bf16 on AMX tiles: no cap. Otherwise on AVX-512 CPUs (PyTorch's GEMMs
    faster on many rows): a small model's C layers take verify steps of many rows, a 1B-shaped model's only one-row
    steps; a step above the cap leaves wholly."""
    demo, one_b = _llama_spec(256, 688, 4, 4, 4), _llama_spec(2048, 8192, 16, 32, 8)
    f32, bf16, int4 = cpu_layers.DENSE_F32, cpu_layers.DENSE_BF16, cpu_layers.INT4
    assert row_cap(demo, f32, "AVX2", False) is None and row_cap(one_b, int4, "AVX512", False) is None
    assert row_cap(one_b, bf16, "AVX512", True) is None  # AMX tiles: many rows cost about one
    assert 8 <= row_cap(demo, f32, "AVX512", True) <= 64 and row_cap(one_b, bf16, "AVX512", False) == 1
    tree = StepRequest(kv_start=0, cached=20, chain=(), tokens=(7, 8, 9), parents=(-1, 0, 0))
    prompt = StepRequest(kv_start=100, cached=0, chain=(1, 2, 3), tokens=(4,), parents=(-1,))
    step = PackedStep.from_trees([tree, prompt])
    assert fused_served(step) == [True, True, True]  # no cap: the prompt's chain in the same pass
    # a cap: the tree's 3 rows and the prompt's last token (after its chain, which stays per operation): 4 rows served
    assert fused_served(step, 4) == [True, False, True]
    assert fused_served(step, 3) == [False, False, False]


def test_a_step_above_the_row_cap_runs_per_operation(checkpoint, monkeypatch):
    backend = _load(checkpoint, "float32", "none")
    fused = backend._local_model().fused
    if fused is None:
        pytest.skip("dense weights go through the C layers on AVX2 and AVX-512 CPUs only")
    calls = []
    run = fused.run
    monkeypatch.setattr(fused, "run", lambda *args: calls.append(args[0].shape[0]) or run(*args))
    fused.max_rows = 5
    _tree(backend, "big")  # the prompt per operation, then 6 nodes: above the cap
    backend.forward_tree([TreeForward("small", PROMPT, [40, 41], [-1, 0])])
    assert calls == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(64, 96), (37, 200), (16, 32), (1000, 72)])
def test_the_dense_products_are_row_invariant_and_near_pytorchs(dtype, n, k):
    """Each row of a many-row product equals that row alone, bit for bit, on whichever tiles this CPU has (AVX2,
    AVX-512, AMX: ``cpu_layers.amx()``), with outputs and inputs past whole tiles; and near PyTorch's fp32 product
    of the same bf16-rounded inputs (the layers' bf16 inputs are bf16 values)."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(dtype)  # [n, k]
    x = torch.randn(40, k).to(dtype).float()  # [40, k] fp32, bf16 values where dtype is bf16
    y = cpu_layers.dense_linear(x, w)  # [40, n]
    for r in (0, 15, 16, 17, 39):
        assert torch.equal(cpu_layers.dense_linear(x[r : r + 1], w)[0], y[r])
    assert torch.allclose(y, x @ w.float().T, rtol=1e-4, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_kind", ["dense", "int8"])
def test_final_logits_equal_the_norm_then_the_head_bit_for_bit(dtype, head_kind):
    """The step's final norm and LM head in one call (``cpu_layers.final_logits``, what a fused model's ``head``
    runs, on the kernels' team) give what ``rms_norm_rows`` then the head's product give on the gathered rows: a
    dense head's ``dense_linear``, an int8 head's (the quantized models' logits head) OpenMP product of
    ``cpu_qgemm.linear``; a row outside h, and rows wider than the head, are refused."""
    from specinfer.models.native.quant import pack_blocks

    torch.manual_seed(7)
    h = torch.randn(9, 72).to(dtype)  # [T, hidden]
    norm, plain = torch.rand(72) + 0.5, torch.randn(50, 72).to(dtype)  # [hidden] fp32, [vocab, hidden]
    rows = torch.tensor([8, 0, 3, 3])  # [N]: any order, repeats allowed
    normed = cpu_layers.rms_norm_rows(h[rows], norm, 1e-5)  # [N, hidden] in h's dtype
    keep = []
    if head_kind == "dense":
        head = cpu_layers.weight(plain, cpu_layers.weight_kind(plain), None, keep)
        expected = cpu_layers.dense_linear(normed, plain)  # [N, vocab]
    else:
        q = pack_blocks(plain.float(), "int8")  # hidden 72 padded to 96 inputs
        head = cpu_layers.weight(q, cpu_layers.weight_kind(q), None, keep)
        expected = cpu_qgemm.linear(normed, "int8", q.packed, q.scales, torch.float32)
    assert torch.equal(cpu_layers.final_logits(h, rows, norm, 1e-5, head), expected)
    assert torch.equal(cpu_layers.weight_linear(normed, head), expected)
    with pytest.raises(IndexError, match="logit row"):
        cpu_layers.final_logits(h, torch.tensor([9]), norm, 1e-5, head)
    with pytest.raises(ValueError, match="inputs against a weight"):  # rows wider than the head reads
        cpu_layers.weight_linear(torch.randn(2, 100), head)
