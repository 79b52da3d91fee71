"""Admission and preemption by KV blocks in the in-process engine (specinfer.core.kv_budget): with
KV pools too small for the batch, requests are preempted and re-admitted (their caches rebuilt
from their committed tokens), and what is generated does not change: greedy output equals
transformers', and seeded sampling on a static tree draws the same tokens as with room for all."""

from __future__ import annotations

import pytest
import torch
from oracles import hf_greedy  # tests/oracles.py

from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.sampling import SamplingParams
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.kv_pool import KVPool
from specinfer.models.native.spec import ModelSpec

NEW_TOKENS = 40
NUM_PROMPTS = 12
TREE_ROWS = 40  # the LLM's tree rows per request (NativeOptions.max_tree_nodes): the adaptive planner's 32 nodes fit
DRAFT_ROWS = 256  # the SSM's: an adaptive draft expands up to 1 + 8 passes x 31 nodes (core.kv_budget.step_rows)


def backend(
    path, max_seq_len: int, block_size: int, requests_at_longest: float, tree_rows: int = TREE_ROWS
) -> NativeBackend:
    """A native backend whose KV pool holds ``requests_at_longest`` requests of ``max_seq_len`` +
    ``tree_rows`` rows (paged with ``block_size``-token KV blocks; 0: contiguous slots)."""
    spec = ModelSpec.from_dir(path)
    rows = int((max_seq_len + tree_rows) * requests_at_longest)
    options = NativeOptions(
        torch.float32,
        "cpu",
        KVPool.bytes_per_token(spec, torch.float32) * rows,
        max_seq_len,
        "torch",
        tree_rows,
        "linear",
        block_size,
    )
    return NativeBackend.load(path, options)


@pytest.fixture(scope="module")
def pair(model_pair):
    prompts = [tuple(p) for p in model_pair.prompts[:NUM_PROMPTS]]
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    eos = eos_token_id(model_pair.llm)
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS)
    return model_pair, prompts, longest, expected, eos


def tight_engine(model_pair, longest: int, eos, ssm_room: float = 1.5, llm_room: float = 1.5) -> SpeculativeEngine:
    """The LLM's pool holds about ``llm_room`` requests at their longest, for a batch of NUM_PROMPTS:
    they run together while short, and the newest are preempted as contexts grow. The SSM's pool holds
    ``ssm_room`` requests of its longest drafts."""
    llm = backend(model_pair.llm, longest, 3, llm_room)
    ssm = backend(model_pair.ssm, longest, 5, ssm_room, DRAFT_ROWS)
    return SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos))


@pytest.mark.parametrize("speculation", ["none", "auto", "1,1,3,1"])
def test_greedy_output_is_transformers_with_preemption(pair, speculation):
    model_pair, prompts, longest, expected, eos = pair
    spec = (
        None
        if speculation == "none"
        else SpeculationConfig(None if speculation == "auto" else ExpansionConfig.parse(speculation))
    )
    requests = [GenerationRequest(f"r{i}", p, NEW_TOKENS, speculation=spec) for i, p in enumerate(prompts)]
    # an adaptive draft may expand 249 nodes (core.kv_budget.step_rows), so a tight SSM pool would
    # run such requests one at a time: the LLM's pool is what makes them preempt
    # and adaptive requests are admitted with room for the planner's largest tree (up to TREE_ROWS rows
    # each), so fewer run at once: a smaller LLM pool makes the running ones outgrow it
    auto = speculation == "auto"
    engine = tight_engine(
        model_pair, longest, eos, ssm_room=NUM_PROMPTS + 1 if auto else 1.5, llm_room=1.2 if auto else 1.5
    )
    results = engine.generate(requests)
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.output_tokens == exp, f"prompt {i} differs"
    assert engine.preemptions > 0, "the pools were meant to be too small for the batch"
    assert engine.llm.kv_blocks_free == engine.llm.kv_budget.blocks  # every block back once all finished


def test_adaptive_drafts_never_overflow_a_tight_ssm_pool(pair):
    """The SSM's cache keeps every node a best-first draft expands, more than the tree it returns:
    admission counts those rows, so no draft runs out of KV blocks (it did when it counted the tree)."""
    model_pair, prompts, longest, expected, eos = pair
    engine = tight_engine(model_pair, longest, eos, ssm_room=1.5)
    results = engine.generate(
        [GenerationRequest(f"t{i}", p, NEW_TOKENS, speculation=SpeculationConfig(None)) for i, p in enumerate(prompts)]
    )
    assert [r.output_tokens for r in results] == expected
    assert engine.ssms[0].kv_blocks_free == engine.ssms[0].kv_budget.blocks


def test_contiguous_slots_are_one_block_each(pair):
    """Slots (kv_block_size 0) admit by the same rule, one block per request: with room for one
    and a half requests at their longest, one runs at a time, and none is ever preempted."""
    model_pair, prompts, longest, expected, eos = pair
    llm = backend(model_pair.llm, longest, 0, 1.5)
    assert llm.kv_budget.blocks == 1 and llm.kv_budget.block_size == longest + TREE_ROWS
    engine = SpeculativeEngine(llm, [], EngineConfig(eos_token_id=eos))
    results = engine.generate([GenerationRequest(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(prompts[:3])])
    assert [r.output_tokens for r in results] == expected[:3] and engine.preemptions == 0


def test_seeded_sampling_draws_the_same_tokens_with_preemption(pair):
    model_pair, prompts, longest, _, eos = pair
    spec = SpeculationConfig(ExpansionConfig.parse("1,1,3,1"))
    requests = [
        GenerationRequest(f"s{i}", p, NEW_TOKENS, SamplingParams(temperature=1.0, seed=100 + i), spec, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    tight = tight_engine(model_pair, longest, eos)
    room = NUM_PROMPTS + 1
    roomy = SpeculativeEngine(
        backend(model_pair.llm, longest, 3, room),
        [backend(model_pair.ssm, longest, 5, room, DRAFT_ROWS)],
        EngineConfig(eos_token_id=eos),
    )
    got, want = tight.generate(requests), roomy.generate(requests)
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert [r.output_tokens for r in got] == [r.output_tokens for r in want]


def test_a_request_that_cannot_fit_alone_is_refused(pair):
    model_pair, prompts, longest, _, eos = pair
    engine = tight_engine(model_pair, longest, eos)
    with pytest.raises(InvalidArgument, match="KV cache") as err:
        engine.add(
            GenerationRequest(
                "big", prompts[0], NEW_TOKENS, speculation=SpeculationConfig(ExpansionConfig.parse("8,8,8"))
            )
        )
    assert err.value.field == "max_new_tokens"
