"""Offloading inference (issue 19, :mod:`specinfer.models.native.offload`): offloaded logits equal the
resident model's bit for bit (fp32, the same products on copies of the same weights), every pass reads
the staged copies, greedy speculative output equals transformers, the device-byte accounting and the
flags' refusals; on a GPU (``gpu`` marker) peak device memory stays within the reserve and the KV cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracles import hf_greedy
from transformers import AutoModelForCausalLM, OPTConfig

from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.acceptance import node_values
from specinfer.core.costs import CostTable, StepCosts
from specinfer.core.planner import OFFLOAD_PLANNER, PlanInput, plan_batch
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.llm_verifier.__main__ import build_parser, native_options
from specinfer.llm_verifier.__main__ import main as llm_verifier_main
from specinfer.models.interface import TreeForward
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.offload import (
    OffloadBudget,
    OffloadedLayers,
    check_reserve,
    layer_bytes,
    model_budget,
    offload_budget,
    tensor_bytes,
)
from specinfer.models.native.weights import build_weights, read_state_dict

OPTIONS = NativeOptions(kv_cache_bytes=1 << 26, max_seq_len=256, attention="torch", gemm="linear")
OFFLOADED = dataclasses.replace(OPTIONS, offload=True)
TREE_TOKENS, TREE_PARENTS = [0, 5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2, 4]


@pytest.fixture(scope="module")
def opt_checkpoint(tmp_path_factory):
    """A tiny OPT: biases and LayerNorm weights in every layer, so staging covers the optional fields."""
    torch.manual_seed(0)
    cfg = OPTConfig(
        vocab_size=97,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    )
    path = tmp_path_factory.mktemp("opt")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _steps(backend: NativeBackend, vocab: int) -> list[torch.Tensor]:
    """A batch of prefills, then two tree-verify steps on top of them (each accepting a path): every step's logits."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    out = backend.forward_tree(
        [TreeForward(f"r{i}", [], p, list(range(-1, len(p) - 1))) for i, p in enumerate(prompts)]
    )
    for step in range(2):
        items = [
            TreeForward(
                f"r{i}", p[:-1], [p[-1]] + [(t * (i + 3) + step) % vocab for t in TREE_TOKENS[1:]], TREE_PARENTS
            )
            for i, p in enumerate(prompts)
        ]
        out += backend.forward_tree(items)
        prompts = [list(it.context_tokens) + [it.tokens[0], it.tokens[1], it.tokens[3], 11] for it in items]
    return out


@pytest.mark.parametrize("block", [0, 4], ids=["slots", "kvblocks4"])
@pytest.mark.parametrize("which", ["pycode-a", "opt"])
def test_offloaded_logits_equal_resident_and_come_from_the_staging_buffers(which, block, model_pair, opt_checkpoint):
    path = model_pair.llm if which == "pycode-a" else opt_checkpoint
    # per operation both (offloaded layers never run fused: specinfer.models.native.fused), so the same kernels
    resident = NativeBackend.load(path, dataclasses.replace(OPTIONS, kv_block_size=block, fused_layers=False))
    offloaded = NativeBackend.load(path, dataclasses.replace(OFFLOADED, kv_block_size=block))
    model = offloaded.runner.model
    layers = model.layers
    assert isinstance(layers, OffloadedLayers) and len(layers) == offloaded.spec.layers
    # every matrix product of a decoder layer must read a staging buffer, never the host layers
    staging = {t.data_ptr() for s in layers.staging for t in dataclasses.asdict(s).values() if t is not None}
    host = {t.data_ptr() for h in layers.host for t in dataclasses.asdict(h).values() if t is not None}
    read: list[int] = []
    linear = model.linear
    model.linear = lambda x, w, b=None: (read.append(w.data_ptr()), linear(x, w, b))[1]
    want, got = _steps(resident, resident.vocab_size), _steps(offloaded, offloaded.vocab_size)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)  # fp32, the same kernels on copies of the same weights: bit-identical
    assert read and not set(read) & host
    assert {p for p in read if p in staging} == staging & {
        t.data_ptr() for s in layers.staging for t in (s.qkv_w, s.o_w, s.up_w, s.down_w)
    }
    passes = 3  # one prefill, two verify steps
    assert layers.copies == 1 + passes * len(
        layers
    )  # the first pass copies layer 0 itself, then each layer prefetches the next


def test_greedy_speculative_output_with_offload_equals_transformers(model_pair):
    prompts = model_pair.prompts[:3]
    expected = hf_greedy(model_pair.llm, prompts, 12)
    llm = NativeBackend.load(model_pair.llm, OFFLOADED)
    ssm = NativeBackend.load(model_pair.ssm, OPTIONS)
    engine = SpeculativeEngine(
        llm, [ssm], EngineConfig(eos_token_id=eos_token_id(model_pair.llm), planner=OFFLOAD_PLANNER)
    )
    spec = SpeculationConfig(ExpansionConfig.parse("2,2,1"), ssms=(0,))
    results = engine.generate(
        [GenerationRequest(f"o{i}", tuple(p), 12, speculation=spec) for i, p in enumerate(prompts)]
    )
    assert [r.output_tokens for r in results] == expected
    assert llm.runner.model.layers.copies > 0


# -- accounting ----------------------------------------------------------------------------


def test_accounting_is_two_largest_layers_plus_resident_weights():
    assert offload_budget([10, 30, 20], 7) == OffloadBudget(staging=60, resident=7)
    assert offload_budget([10, 30, 20], 7).device_bytes == 67
    check_reserve(OffloadBudget(60, 7), 0)  # no bound
    check_reserve(OffloadBudget(60, 7), 67)
    with pytest.raises(InvalidArgument, match=r"offload-reserve-bytes.*67 bytes = 60 .* \+ 7") as err:
        check_reserve(OffloadBudget(60, 7), 66)
    assert err.value.field == "offload-reserve-bytes"
    with pytest.raises(InvalidArgument, match=">= 0"):
        check_reserve(OffloadBudget(60, 7), -1)
    t = torch.zeros(3, 4)
    assert tensor_bytes([t, t, None, torch.zeros(2, dtype=torch.float16)]) == 48 + 4  # a tied tensor counts once


def test_model_budget_and_refusal_at_load(model_pair):
    spec_weights = build_weights(
        NativeBackend.load(model_pair.llm, OFFLOADED).spec,
        read_state_dict(model_pair.llm),
        torch.float32,
        torch.device("cpu"),
    )
    budget = model_budget(spec_weights)
    # pycode-a: 6 identical layers, tied embeddings (one [vocab, hidden] table) and the final norm resident
    assert budget.staging == 2 * layer_bytes(spec_weights.layers[0])
    assert budget.resident == spec_weights.embed.numel() * 4 + spec_weights.final_norm_w.numel() * 4
    NativeBackend.load(model_pair.llm, dataclasses.replace(OFFLOADED, offload_reserve_bytes=budget.device_bytes))
    with pytest.raises(InvalidArgument, match="offload-reserve-bytes") as err:
        NativeBackend.load(
            model_pair.llm, dataclasses.replace(OFFLOADED, offload_reserve_bytes=budget.device_bytes - 1)
        )
    assert err.value.field == "offload-reserve-bytes"


def test_layers_of_different_shapes_are_refused(opt_checkpoint):
    weights = build_weights(
        NativeBackend.load(opt_checkpoint, OPTIONS).spec,
        read_state_dict(opt_checkpoint),
        torch.float32,
        torch.device("cpu"),
    )
    odd = dataclasses.replace(weights.layers[1], up_w=torch.zeros(8, 64))
    with pytest.raises(ValueError, match="one shape"):
        OffloadedLayers([weights.layers[0], odd], torch.device("cpu"))


# -- flags ---------------------------------------------------------------------------------


def test_verifier_flags_reach_the_native_options(monkeypatch):
    args = build_parser().parse_args(["--llm", "x", "--offload", "true", "--offload-reserve-bytes", "1000"])
    assert (args.offload, args.offload_reserve_bytes) == (True, 1000)
    monkeypatch.setenv("SPECINFER_OFFLOAD", "1")
    assert build_parser().parse_args(["--llm", "x"]).offload is True

    @dataclasses.dataclass
    class Launch:
        local_rank: int = 0

    options = native_options(
        build_parser().parse_args(["--llm", "x", "--dtype", "float32", "--offload-reserve-bytes", "5"]), Launch()
    )
    assert options.offload and options.offload_reserve_bytes == 5


def test_load_backend_refusals(model_pair):
    with pytest.raises(InvalidArgument, match="needs --offload"):
        load_backend(model_pair.llm, "llm", "float32", offload_reserve_bytes=10)
    with pytest.raises(InvalidArgument, match="native backend"):
        load_backend(model_pair.llm, "llm", "float32", backend="reference", offload=True)
    with pytest.raises(InvalidArgument, match=">= 0"):
        load_backend(model_pair.llm, "llm", "float32", offload=True, offload_reserve_bytes=-1)
    llm = load_backend(model_pair.llm, "llm", "float32", kv_cache_bytes=1 << 26, offload=True)
    assert isinstance(llm.runner.model.layers, OffloadedLayers)


def test_verifier_with_too_small_a_reserve_exits_2(model_pair, tmp_path, capsys, restore_logging):
    port_file = tmp_path / "port"
    argv = [
        "--llm",
        str(model_pair.llm),
        "--offload",
        "1",
        "--offload-reserve-bytes",
        "1000",
        "--calibrate-tokens",
        "0",
        "--port-file",
        str(port_file),
    ]
    assert llm_verifier_main(argv) == 2
    assert "offload-reserve-bytes" in capsys.readouterr().err
    assert not port_file.exists()


# -- the planner on an offloaded cost table ------------------------------------------------------


def test_flat_expensive_verify_steps_get_far_larger_trees():
    """The planner takes the measured step cost like any other: an offloaded verify step (a transfer of
    the model, 1 s, almost flat in tokens) makes trees as large as the caps allow, a resident one (10 ms
    plus 1 ms a token) keeps them small. The draft costs are the same (the SSM stays on the device)."""
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    drafts = {0: CostTable({b: 0.002 + 0.00005 * b for b in buckets})}
    offloaded = StepCosts(CostTable({b: 1.0 + 0.0005 * b for b in buckets}), 0.0, drafts)
    resident = StepCosts(CostTable({b: 0.01 + 0.001 * b for b in buckets}), 0.0, dict(drafts))
    rates = (0.7, 0.15, 0.08, 0.04)
    config = OFFLOAD_PLANNER

    def plan(costs):
        inp = PlanInput("a", 100, 500, {0: node_values(rates, config.max_nodes - 1, config.max_depth)})
        return plan_batch([inp], costs, config)

    big, small = plan(offloaded), plan(resident)
    assert big.requests["a"].nodes >= 4 * small.requests["a"].nodes
    assert big.requests["a"].nodes > 32  # past the resident default cap (PlannerConfig().max_nodes)
    assert big.predicted_tokens_per_second > 2.5 / offloaded.verify_table(1)  # > 2.5x incremental offloaded decoding


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_peak_device_memory_stays_within_the_reserve_and_kv_cache(model_pair):
    device = torch.device("cuda")
    resident = NativeBackend.load(model_pair.llm, dataclasses.replace(OPTIONS, device="cuda"))
    want = _steps(resident, resident.vocab_size)
    del resident
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host = build_weights(
        NativeBackend.load(model_pair.llm, OFFLOADED).spec,
        read_state_dict(model_pair.llm),
        torch.float32,
        torch.device("cpu"),
    )
    reserve = model_budget(host).device_bytes
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    offloaded = NativeBackend.load(
        model_pair.llm, dataclasses.replace(OFFLOADED, device="cuda", offload_reserve_bytes=reserve)
    )
    got = _steps(offloaded, offloaded.vocab_size)
    torch.cuda.synchronize()
    activations = 64 << 20  # a few prefill tokens' activations and logits on a 256-wide model: far less
    assert torch.cuda.max_memory_allocated(device) - base <= reserve + OPTIONS.kv_cache_bytes + activations
    for w, g in zip(want, got, strict=True):
        assert float((w - g.to(w.device)).abs().max() / w.abs().max()) <= 1e-6
