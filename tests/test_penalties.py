"""Presence, frequency and repetition penalties: speculative output equals decoding without speculation under the
same penalties, token for token (greedy and seeded coupled sampling), whatever the tree (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import TEST_DEVICE  # tests/devices.py
from oracles import hf_plain_decoding  # tests/oracles.py
from transformers import AutoModelForCausalLM

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.sampling import penalize
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import load_backend

NEW_TOKENS = 24
PROMPTS = 4


@pytest.fixture(scope="module")
def setup(model_pair):
    models = [
        load_backend(p, "model", "float32", TEST_DEVICE, backend="native", kv_cache_bytes=1 << 28)
        for p in (model_pair.llm, model_pair.ssm)
    ]
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    return SpeculativeEngine(models[0], models[1:], EngineConfig(eos_token_id=None)), hf, model_pair.prompts[:PROMPTS]


PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.4},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "negative": {"presence_penalty": -1.0},
}
SPECULATIONS = {
    "none": None,
    "static": SpeculationConfig(ExpansionConfig.parse("1,1,3,1,1")),
    "adaptive": SpeculationConfig(None),
}


@pytest.fixture(scope="module")
def oracles(setup):
    _, hf, prompts = setup
    out = {}
    for name, penalties in PENALTIES.items():
        for sampled in (False, True):
            params = (
                SamplingParams(temperature=0.8, top_p=0.95, seed=11, **penalties)
                if sampled
                else SamplingParams(**penalties)
            )
            seed = 11 if sampled else None
            out[name, sampled] = [hf_plain_decoding(hf, p, params, seed, NEW_TOKENS) for p in prompts]
    plain = [hf_plain_decoding(hf, p, SamplingParams(), None, NEW_TOKENS) for p in prompts]
    return out, plain


@pytest.mark.parametrize("speculation", SPECULATIONS)
@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_with_penalties_equals_hf_plain_decoding(setup, oracles, speculation, penalties, sampled):
    engine, _, prompts = setup
    expected, plain = oracles
    kwargs = PENALTIES[penalties]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, **kwargs) if sampled else SamplingParams(**kwargs)
    requests = [
        GenerationRequest(f"{penalties}-{sampled}-{i}", tuple(p), NEW_TOKENS, params, SPECULATIONS[speculation])
        for i, p in enumerate(prompts)
    ]
    # the same batch holds requests without penalties: theirs stay the LLM's plain greedy output
    requests += [
        GenerationRequest(f"plain-{i}", tuple(p), NEW_TOKENS, speculation=SPECULATIONS[speculation])
        for i, p in enumerate(prompts[:2])
    ]
    results = engine.generate(requests)
    assert [r.output_tokens for r in results[:PROMPTS]] == expected[penalties, sampled]
    assert [r.output_tokens for r in results[PROMPTS:]] == plain[:2]
    if not sampled:
        assert expected[penalties, sampled] != plain, "the penalty changed nothing: the test would not see it"


def test_the_repetition_penalty_is_transformers_own(setup, oracles):
    """An independent check of the reference: transformers' repetition_penalty gives the same greedy tokens."""
    _, hf, prompts = setup
    expected, _ = oracles
    with torch.inference_mode():
        for prompt, want in zip(prompts, expected["repetition", False], strict=True):
            out = hf.generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                repetition_penalty=1.4,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert out[0, len(prompt) :].tolist() == want


def test_mss_sampling_with_penalties_runs(setup):
    engine, _, prompts = setup
    params = SamplingParams(temperature=1.0, verification="mss", frequency_penalty=2.0)
    result = engine.generate([GenerationRequest("mss", tuple(prompts[0]), NEW_TOKENS, params, SPECULATIONS["static"])])[
        0
    ]
    assert len(result.output_tokens) == NEW_TOKENS


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_out_of_range_penalties_name_their_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_penalize_reference():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt [0], output [1, 1, 3]: repetition on 0, 1, 3; frequency 2x on 1, 1x on 3; presence on 1 and 3
    got = penalize(logits, [0], [1, 1, 3], params)
    assert got.tolist() == [1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5]
