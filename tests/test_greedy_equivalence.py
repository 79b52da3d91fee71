"""Greedy speculative output equals ``transformers`` greedy ``generate`` token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE  # tests/devices.py
from transformers import AutoModelForCausalLM

from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id, load_backend

NEW_TOKENS = 48
NUM_PROMPTS = 20


@pytest.fixture(scope="module")
def expected(model_pair):
    prompts = model_pair.prompts[:NUM_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    eos = eos_token_id(model_pair.llm)
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
            expected.append(out[0, len(ids) :].tolist())
    return prompts, expected, eos


# native-paged: the native backend on a paged KV pool of 3-token KV blocks (trees cross block boundaries)
@pytest.fixture(scope="module", params=["reference", "native", "native-paged"])
def setup(request, model_pair, expected):
    prompts, tokens, eos = expected
    backend, _, paged = request.param.partition("-")
    models = [
        load_backend(
            p, "model", "float32", TEST_DEVICE, backend=backend, kv_cache_bytes=1 << 28, kv_block_size=3 if paged else 0
        )
        for p in (model_pair.llm, model_pair.ssm, model_pair.ssm2)
    ]
    return prompts, tokens, SpeculativeEngine(models[0], models[1:], EngineConfig(eos_token_id=eos))


def _truncate_at_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize(
    "expansion, ssms",
    [
        ("1,1,1,1", (0,)),
        ("1,1,3,1,1,1,1,1", (0,)),
        ("2,2,2", (0,)),
        ("4,2,1", (0,)),
        ("1,1,3,1,1,1,1,1", (0, 1)),
        ("2,2,2", (1,)),
    ],
)
def test_batched_speculation_equals_hf_greedy(setup, expansion, ssms):
    prompts, expected, engine = setup
    spec = SpeculationConfig(ExpansionConfig.parse(expansion), ssms=ssms)
    requests = [
        GenerationRequest(f"{expansion}-{ssms}-{i}", tuple(p), NEW_TOKENS, speculation=spec)
        for i, p in enumerate(prompts)
    ]
    assert len({len(p) for p in prompts}) > 1, "the batch must mix prompt lengths"
    results = engine.generate(requests)
    eos = engine.config.eos_token_id
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.output_tokens == _truncate_at_eos(exp, eos), f"prompt {i} differs"
        assert sum(s.committed for s in res.steps) == len(res.output_tokens)
    tokens_per_step = sum(len(r.output_tokens) for r in results) / sum(r.llm_steps for r in results)
    assert tokens_per_step > 1.0  # speculation accepted something


def test_incremental_and_continuous_batching(setup):
    """No speculation for some requests, requests joining mid-way: same tokens."""
    prompts, expected, engine = setup
    spec = SpeculationConfig(ExpansionConfig.parse("2,1,1"))
    first = [
        GenerationRequest(f"cb-{i}", tuple(p), NEW_TOKENS, speculation=None if i % 2 else spec)
        for i, p in enumerate(prompts[:4])
    ]
    late = [
        GenerationRequest(f"cb-late-{i}", tuple(p), NEW_TOKENS, speculation=spec) for i, p in enumerate(prompts[4:8])
    ]
    for r in first:
        engine.add(r)
    done = {}
    for step in range(1000):
        if step == 3:
            for r in late:
                engine.add(r)
        for res in engine.step():
            done[res.request_id] = res
        if not engine.has_work:
            break
    for i, r in enumerate(first + late):
        exp = expected[i]
        assert done[r.request_id].output_tokens == _truncate_at_eos(exp, engine.config.eos_token_id)
    assert all(s.tree_size == 1 for s in done["cb-1"].steps)
    assert not engine.llm.cached_requests(), "finished requests must free their KV caches"
