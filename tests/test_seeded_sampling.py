"""A seed fixes the draw: seeded sampled requests (coupled verification, specinfer.core.coupled)
give, token for token, what plain decoding with the same seed gives, whatever speculation does:
static trees, adaptive trees, several SSMs merged, batched among other requests (fp32, the bundled
demo pair). The oracle is transformers' own plain decoding by the same Gumbel-max rule."""

from __future__ import annotations

import dataclasses

import pytest
from oracles import hf_seeded_sampling  # tests/oracles.py
from test_stochastic_engine import free_speculation  # tests/test_stochastic_engine.py

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id, load_backend

NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=1.0, top_p=0.95)
SEEDS = (7, 8, 9, 10, 11, 12)


@pytest.fixture(scope="module")
def pair(model_pair):
    prompts = [tuple(p) for p in model_pair.prompts[: len(SEEDS)]]
    expected = hf_seeded_sampling(model_pair.llm, prompts, SEEDS, PARAMS, NEW_TOKENS)
    eos = eos_token_id(model_pair.llm)
    models = [
        load_backend(p, "model", "float32", backend="native", kv_cache_bytes=1 << 28)
        for p in (model_pair.llm, model_pair.ssm, model_pair.ssm2)
    ]
    # speculation priced as free (frozen): adaptive requests always draft trees, which the test needs
    return (
        prompts,
        expected,
        SpeculativeEngine(models[0], models[1:], EngineConfig(eos_token_id=eos), free_speculation()),
    )


SPECULATIONS = {
    "none": None,
    "paper-tree": SpeculationConfig(ExpansionConfig.parse("1,1,3,1,1,1,1,1"), ssms=(0,)),
    "wide": SpeculationConfig(ExpansionConfig((3, 2, 2)), ssms=(0,)),
    "two-ssms-merged": SpeculationConfig(ExpansionConfig((2, 2, 1)), ssms=(0, 1)),
    "adaptive": SpeculationConfig(None, ssms=(0,)),
    "adaptive-two-ssms": SpeculationConfig(None, ssms=(0, 1)),
    "adaptive-without-suffix": SpeculationConfig(None, ssms=(0,), suffix=False),
}


@pytest.mark.parametrize("name", list(SPECULATIONS))
def test_seeded_output_is_plain_decodings_whatever_the_speculation(pair, name):
    prompts, expected, engine = pair
    spec = SPECULATIONS[name]
    seeded = [
        GenerationRequest(f"{name}-{i}", p, NEW_TOKENS, dataclasses.replace(PARAMS, seed=s), spec)
        for i, (p, s) in enumerate(zip(prompts, SEEDS, strict=True))
    ]
    # mixed with requests of other kinds in the same batches: greedy, unseeded sampling, MSS
    others = [
        GenerationRequest(f"{name}-greedy", prompts[0], NEW_TOKENS, SamplingParams(), spec),
        GenerationRequest(f"{name}-unseeded", prompts[1], NEW_TOKENS, PARAMS, spec),
        GenerationRequest(
            f"{name}-mss", prompts[2], NEW_TOKENS, dataclasses.replace(PARAMS, seed=1, verification="mss"), spec
        ),
    ]
    results = engine.generate(others[:2] + seeded + others[2:])
    by_id = {r.request_id: r for r in results}
    assert [list(by_id[r.request_id].output_tokens) for r in seeded] == expected
    if spec is not None:
        steps = sum(by_id[r.request_id].llm_steps for r in seeded)
        assert steps < sum(map(len, expected)), "speculation accepted nothing: the test would not exercise trees"


def test_coupled_is_the_default_for_seeded_requests_only():
    assert SamplingParams(temperature=1.0, seed=3).coupled and not SamplingParams(temperature=1.0).coupled
    assert SamplingParams(temperature=1.0, verification="coupled").coupled
    assert not SamplingParams(temperature=1.0, seed=3, verification="mss").coupled
    assert not SamplingParams(seed=3).coupled  # greedy needs no noise


def test_cli_seeded_generation_equals_no_speculation(model_pair, capsys):
    from specinfer.cli import main

    common = [
        "generate",
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(model_pair.ssm),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "24",
    ]
    sampling = ["--temperature", "1", "--top-p", "0.95", "--seed", "21"]
    outputs = []
    for extra in ([], ["--no-speculation"], ["--expansion", "2,2,1"]):
        assert main([*common, *sampling, *extra, "def main("]) == 0
        outputs.append(capsys.readouterr().out.split("\n---")[0])  # the text, without the statistics
    assert outputs[0] == outputs[1] == outputs[2]
