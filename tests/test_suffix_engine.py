"""Model-free suffix drafting (:mod:`specinfer.core.suffix`) through the in-process engine on the
bundled demo pair, fp32: greedy output equals transformers' whether suffix trees are verified alone or
merged with an SSM's; suffix trees are really drafted and accepted on text that repeats; seeded
(coupled) sampling with them equals plain decoding; a request can turn them off.
"""

from __future__ import annotations

import dataclasses

import pytest
from oracles import hf_greedy, hf_seeded_sampling  # tests/oracles.py
from test_stochastic_engine import free_speculation  # tests/test_stochastic_engine.py

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id, load_backend

NEW_TOKENS = 40
SPECS = {
    "suffix-alone": SpeculationConfig(None, ssms=(), suffix=True),
    "suffix-and-ssm": SpeculationConfig(None, ssms=(0,), suffix=True),
    "ssm-alone": SpeculationConfig(None, ssms=(0,), suffix=False),
}


@pytest.fixture(scope="module")
def setup(model_pair):
    # text that repeats: each prompt twice over, so its ending has occurred before
    prompts = [tuple(p[:24]) * 2 for p in model_pair.prompts[:4]]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS, ignore_eos=True)
    llm, ssm = (
        load_backend(p, "model", "float32", backend="native", kv_cache_bytes=1 << 27)
        for p in (model_pair.llm, model_pair.ssm)
    )
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos_token_id(model_pair.llm)), free_speculation())
    return model_pair, prompts, expected, engine


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_is_transformers_with_suffix_trees(setup, name):
    _, prompts, expected, engine = setup
    requests = [
        GenerationRequest(f"{name}-{i}", p, NEW_TOKENS, speculation=SPECS[name], ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(requests)
    assert [list(r.output_tokens) for r in results] == expected
    steps = sum(r.llm_steps for r in results)
    assert steps < len(prompts) * NEW_TOKENS * 0.8, (
        f"{name}: {steps} steps for {len(prompts) * NEW_TOKENS} tokens: trees accepted too little"
    )


def test_suffix_trees_are_drafted_and_accepted_only_where_allowed(setup):
    _, prompts, _, engine = setup
    edges = engine.adaptive.edges["suffix"]
    before = edges.drafted.sum(), edges.accepted.sum()
    engine.generate([GenerationRequest("off", prompts[0], NEW_TOKENS, speculation=SPECS["ssm-alone"], ignore_eos=True)])
    assert (edges.drafted.sum(), edges.accepted.sum()) == pytest.approx(
        before, rel=0.01
    )  # decays a little, gains nothing
    engine.generate(
        [GenerationRequest("on", prompts[0], NEW_TOKENS, speculation=SPECS["suffix-alone"], ignore_eos=True)]
    )
    assert edges.accepted.sum() > before[1] + 5, "the suffix drafter's nodes were verified and accepted"
    totals = engine.adaptive.totals
    assert 0 < totals.drafter_accepted["suffix"] <= totals.drafter_proposed["suffix"]
    assert totals.drafter_steps["suffix"] > 0


def test_seeded_sampling_with_suffix_trees_is_plain_decodings(setup):
    model_pair, prompts, _, engine = setup
    params = SamplingParams(temperature=0.7)
    seeds = (3, 4)
    expected = hf_seeded_sampling(model_pair.llm, prompts[:2], seeds, params, NEW_TOKENS, ignore_eos=True)
    requests = [
        GenerationRequest(
            f"seeded-{i}", p, NEW_TOKENS, dataclasses.replace(params, seed=s), SPECS["suffix-and-ssm"], ignore_eos=True
        )
        for i, (p, s) in enumerate(zip(prompts[:2], seeds, strict=True))
    ]
    assert [list(r.output_tokens) for r in engine.generate(requests)] == expected


def test_a_request_drafting_from_nothing_is_refused():
    with pytest.raises(InvalidArgument, match=r"speculation\.ssms"):
        SpeculationConfig(None, ssms=(), suffix=False, head=False)
    with pytest.raises(InvalidArgument, match=r"speculation\.ssms"):  # static trees are an SSM's
        SpeculationConfig(ExpansionConfig((2, 1)), ssms=(), suffix=True)
