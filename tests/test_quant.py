"""Weight-only quantization (issue 51, item 2; :mod:`specinfer.models.native.quant`): each packed product against
its plain reference (``F.linear`` on the dequantized weight), the rounding bound, the refusals, and on the demo LLM:
int8 logits close to the plain model's, greedy speculation on quantized weights equal to incremental decoding of
the same weights (fp32 activations, contiguous and paged KV, SSM drafting), offloaded quantized layers equal to
resident ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.kernels import cpu_qgemm
from specinfer.models.interface import TreeForward
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.quant import (
    LAYER_MATRICES,
    QuantizedWeight,
    check_quantize,
    dequantize_int4,
    dequantize_int8,
    pad_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    reference_weight,
)

CPU = torch.device("cpu")
OPTIONS = NativeOptions(kv_cache_bytes=1 << 26, max_seq_len=256, attention="torch", gemm="linear")
SCHEMES = [("int8", 32), ("int4", 32), ("int4", 128)]
BLOCKS = pytest.mark.skipif(
    cpu_qgemm.unavailable_reason() is not None, reason=f"our CPU kernels: {cpu_qgemm.unavailable_reason()}"
)
# PyTorch's kernels for every scheme; ours for int8 and int4 in groups of 32 (their block)
KERNELS = [(*s, "torch") for s in SCHEMES] + [pytest.param(*s, "blocks", marks=BLOCKS) for s in SCHEMES[:2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(64, 256), (100, 688)], ids=["whole", "padded"])  # 100 rows, 688 inputs: padded
@pytest.mark.parametrize("scheme, group, kernel", KERNELS)
def test_quantized_products_equal_their_reference(scheme, group, kernel, shape, dtype):
    """PyTorch's kernels against ``F.linear`` on the dequantized weight; ours (int8, int4 in groups of 32) against
    their own reference (activations quantized per block as the C code does), and within 2 % of the former."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(*shape, generator=gen) * 0.05).to(dtype)  # [out, in]
    b = torch.randn(shape[0], generator=gen).to(dtype)
    q = quantize(w, scheme, group, CPU, blocks=kernel == "blocks")
    assert q.shape == shape and q.dtype == dtype and (q.blocks_dtype is not None) == (kernel == "blocks")
    ref = reference_weight(w, scheme, group)  # [out, in]
    for rows in (1, 5, 130):
        x = torch.randn(rows, shape[1], generator=gen).to(dtype)
        got, want = q.linear(x, b), F.linear(x.float(), ref.float(), b.float())  # [rows, out]
        assert got.shape == (rows, shape[0]) and got.dtype == dtype and got.is_contiguous()
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the kernel rounds its output to bf16
        if kernel == "blocks":
            exact = cpu_qgemm.reference_linear(x, scheme, q.packed, q.scales) + b.double()  # [rows, out] float64
            assert (got.double() - exact).abs().max() <= tol * exact.abs().max(), (scheme, rows)
            tol = 2e-2  # the activations' int8 rounding
        assert (got.float() - want).abs().max() <= tol * want.abs().max(), (scheme, rows)


def test_rounding_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen)  # rows of different ranges
    q8, scales = quantize_int8(w)
    assert q8.dtype == torch.int8 and int(q8.abs().max()) == 127
    assert ((dequantize_int8(q8, scales) - w).abs() <= scales[:, None] / 2 + 1e-6).all()
    q4, s4, z4 = quantize_int4(w, 32)
    assert q4.min() >= 0 and q4.max() <= 15
    err = (dequantize_int4(q4, s4, z4, 32) - w).abs().reshape(48, 8, 32)  # [out, groups, group]
    assert (err <= s4.abs()[..., None] / 2 + 1e-6).all()
    # a weight already on the int4 grid (a GGUF Q4_1 model's) comes back as it was, up to fp32 rounding
    on_grid = dequantize_int4(q4, s4, z4, 32)
    assert torch.allclose(dequantize_int4(*quantize_int4(on_grid, 32), 32), on_grid, rtol=0, atol=1e-6)


@pytest.mark.parametrize("block", ["Q4_0", "Q4_1"])
def test_gguf_4_bit_blocks_come_back_as_the_file_holds_them(block):
    """llama.cpp's own quantizer (the ``gguf`` package's, as a GGUF file's blocks are written) on random weights,
    dequantized as a reader does; int4 holds exactly those weights in float32, and its packed product (Q4_0 blocks
    have negative scales where a block's largest magnitude is positive) equals F.linear on them."""
    gguf = pytest.importorskip("gguf")
    kind = getattr(gguf.GGMLQuantizationType, block)
    gen = torch.Generator().manual_seed(2)
    plain = torch.randn(96, 320, generator=gen) * 0.05  # [out, in] 10 blocks of 32 per row
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(plain.numpy(), kind), kind).copy())
    assert not torch.equal(w, plain)
    q, scales, zeros = quantize_int4(w, 32)
    assert torch.equal(dequantize_int4(q, scales, zeros, 32), w)
    if block == "Q4_0":  # blocks spanning q = 0 to 15 are held by the min-max range, the others as Q4_0 blocks
        assert (zeros == 0).float().mean() > 0.5 and (scales < 0).any()
    packed = quantize(w, "int4", 32, CPU, blocks=False)
    x = torch.randn(7, 320, generator=gen)
    want = F.linear(x, w)
    assert (packed.linear(x) - want).abs().max() <= 1e-5 * want.abs().max()
    # our CPU kernels' layout holds the file's blocks exactly too (their d and m are float16, as in the file)
    assert torch.equal(cpu_qgemm.unpack_int4(*cpu_qgemm.pack_int4(q, scales, zeros)), w)


@BLOCKS
def test_gguf_q8_0_blocks_come_back_as_the_file_holds_them():
    """llama.cpp's Q8_0 quantizer on random weights, dequantized as a reader does: our kernels' int8 layout (a
    float16 scale per block of 32) holds exactly those weights."""
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType.Q8_0
    plain = torch.randn(64, 320, generator=torch.Generator().manual_seed(5)) * 0.05
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(plain.numpy(), kind), kind).copy())
    assert not torch.equal(w, plain)
    qs, d = cpu_qgemm.quantize_int8(w)
    assert torch.equal((qs.float().reshape(64, 10, 32) * d.float()[..., None]).reshape(64, 320), w)


def test_padding_adds_zero_rows_and_columns_only():
    w = torch.randn(100, 688)
    p = pad_int4(w, 128)
    assert p.shape == (112, 768) and torch.equal(p[:100, :688], w) and not p[100:].any() and not p[:, 688:].any()


def test_refusals_name_the_flag(model_pair):
    with pytest.raises(InvalidArgument, match=r"quantize.*int3"):
        check_quantize("int3", 32, torch.float32, CPU)
    with pytest.raises(InvalidArgument, match="group size"):
        check_quantize("int4", 16, torch.float32, CPU)
    with pytest.raises(InvalidArgument, match="bfloat16"):  # refused before anything touches the device
        check_quantize("int4", 32, torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="quantize"):
        NativeOptions(quantize="int3")
    with pytest.raises(InvalidArgument, match=r"quantize.*native backend"):
        load_backend(model_pair.llm, "llm", "float32", backend="reference", quantize="int8")
    with pytest.raises(InvalidArgument, match="quantize"):
        load_backend(model_pair.llm, "llm", "float32", quantize="fp4")


@pytest.fixture(scope="module")
def backends(model_pair):
    """The demo LLM plain and quantized (fp32 activations)."""
    return {
        scheme: NativeBackend.load(model_pair.llm, dataclasses.replace(OPTIONS, quantize=scheme))
        for scheme in ("none", "int8", "int4")
    }


def _prefill_logits(backend: NativeBackend, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt token's logits  # [sum of lengths, vocab]"""
    items = [TreeForward(f"p{i}", [], p, list(range(-1, len(p) - 1))) for i, p in enumerate(prompts)]
    out = torch.cat(backend.forward_tree(items))
    for item in items:
        backend.release(item.request_id)
    return out


def test_quantized_layers_hold_fewer_bytes_and_keep_the_head_plain(backends):
    plain, int8, int4 = (backends[s].runner.model.w for s in ("none", "int8", "int4"))
    for name in LAYER_MATRICES:
        w = getattr(plain.layers[0], name)
        q8, q4 = getattr(int8.layers[0], name), getattr(int4.layers[0], name)
        assert isinstance(q8, QuantizedWeight) and isinstance(q4, QuantizedWeight) and q8.shape == q4.shape == w.shape
        plain_bytes = w.numel() * w.element_size()
        assert sum(t.numel() * t.element_size() for t in q8.tensors().values()) < plain_bytes / 3.5
        assert sum(t.numel() * t.element_size() for t in q4.tensors().values()) < plain_bytes / 5
    assert isinstance(int8.lm_head, torch.Tensor) and torch.equal(int8.lm_head, plain.lm_head)
    assert int8.matrices() == [int8.lm_head]  # the products whose form a plan measures: the plain ones
    # the model's own logits read an int8 copy of the head where our CPU kernels serve (drafts fold the plain one)
    blocks = cpu_qgemm.unavailable_reason() is None
    assert plain.logits_head is None
    for w in (int8, int4):
        assert (w.logits_head is not None) == blocks
        if blocks:
            assert w.logits_head.scheme == "int8" and w.logits_head.shape == tuple(plain.lm_head.shape)


def test_int8_logits_close_to_plain(backends, model_pair):
    prompts = model_pair.prompts[:4]
    plain = _prefill_logits(backends["none"], prompts)  # [T, vocab]
    # int8: 1 % of the largest logit with PyTorch's kernels (weights alone rounded), 2 % with ours, which round the
    # activations to int8 per block of 32 as well (llama.cpp's Q8_0 products)
    int8_bound = 0.01 if backends["int8"].runner.model.w.layers[0].qkv_w.blocks_dtype is None else 0.02
    for scheme, bound, agree in (("int8", int8_bound, 0.98), ("int4", 0.1, 0.85)):
        got = _prefill_logits(backends[scheme], prompts)
        assert (got - plain).abs().max() <= bound * plain.abs().max(), scheme
        assert (got.argmax(-1) == plain.argmax(-1)).float().mean() >= agree, scheme


@pytest.mark.parametrize("block", [0, 3], ids=["slots", "kvblocks3"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_speculation_on_quantized_weights_equals_incremental(scheme, block, model_pair):
    """The same quantized weights decoded one token at a time and verified in trees drafted by a quantized SSM."""
    options = dataclasses.replace(OPTIONS, quantize=scheme, kv_block_size=block)
    llm = NativeBackend.load(model_pair.llm, options)
    ssm = NativeBackend.load(model_pair.ssm, options)
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos_token_id(model_pair.llm)))
    prompts = model_pair.prompts[:2]
    incremental = engine.generate([GenerationRequest(f"i{i}", tuple(p), 16) for i, p in enumerate(prompts)])
    spec = SpeculationConfig(ExpansionConfig.parse("1,2,1,1"))
    speculative = engine.generate(
        [GenerationRequest(f"s{i}", tuple(p), 16, speculation=spec) for i, p in enumerate(prompts)]
    )
    for a, b in zip(incremental, speculative, strict=True):
        assert b.output_tokens == a.output_tokens
    assert sum(len(r.output_tokens) for r in speculative) > sum(r.llm_steps for r in speculative)  # drafts accepted


def test_offloaded_quantized_layers_equal_resident(backends, model_pair):
    # offloaded layers run per operation (never the fused C layers, whose model also takes its final norm in C)
    resident = NativeBackend.load(model_pair.llm, dataclasses.replace(OPTIONS, quantize="int4", fused_layers=False))
    offloaded = NativeBackend.load(model_pair.llm, dataclasses.replace(OPTIONS, quantize="int4", offload=True))
    layers = offloaded.runner.model.layers
    assert isinstance(layers.host[0].qkv_w, QuantizedWeight)
    copies = layers.copies
    prompts = model_pair.prompts[:3]
    assert torch.equal(_prefill_logits(offloaded, prompts), _prefill_logits(resident, prompts))
    assert layers.copies > copies  # the pass read staged copies of the quantized layers
