"""Logprobs of the committed tokens: what the LLM's own forward over the whole text gives, whatever the speculation
(static trees, adaptive trees, none), the sampling (greedy, seeded, multi-step) and the stop conditions (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import TEST_DEVICE  # tests/devices.py
from test_stochastic_engine import free_speculation  # tests/test_stochastic_engine.py
from transformers import AutoModelForCausalLM

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.head_gate import HeadGateConfig
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import MAX_LOGPROBS
from specinfer.core.sampling import token_logprob
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.models.on_device import token_logprobs

NEW_TOKENS = 24
TOP = 5


@pytest.fixture(scope="module")
def setup(model_pair):
    eos = eos_token_id(model_pair.llm)
    models = [
        load_backend(p, "model", "float32", TEST_DEVICE, backend="native", kv_cache_bytes=1 << 28)
        for p in (model_pair.llm, model_pair.ssm)
    ]
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    # adaptive requests speculate every step (the speculation gate does not measure, a frozen cost model makes nodes
    # almost free): the test checks the logprobs of tokens speculation committed, which a loaded machine's gate or
    # measured costs may otherwise turn off (in a CI run, adaptive multi-step sampling verified roots alone)
    planner = PlannerConfig(max_nodes=8, speculation_gate=HeadGateConfig(measure=False))
    config = EngineConfig(eos_token_id=eos, planner=planner)
    engine = SpeculativeEngine(models[0], models[1:], config, free_speculation())
    return engine, hf, model_pair.prompts[:6]


def _oracle(hf, prompt, output):
    """log-softmax of the LLM's logits before each output token, from one forward over prompt and output."""
    with torch.inference_mode():
        logits = hf(torch.tensor([[*prompt, *output]])).logits[0, len(prompt) - 1 : -1]  # [len(output), V]
    return torch.log_softmax(logits.double(), dim=-1)


SPECULATIONS = {
    "none": None,
    "static": SpeculationConfig(ExpansionConfig.parse("1,1,3,1,1")),
    "adaptive": SpeculationConfig(None),
}
SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7),
    "mss": SamplingParams(temperature=0.9, top_k=40, seed=7, verification="mss"),
}


@pytest.mark.parametrize("speculation", SPECULATIONS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_logprobs_are_the_llms_own(setup, speculation, sampling):
    engine, hf, prompts = setup
    requests = [
        GenerationRequest(
            f"{speculation}-{sampling}-{i}",
            tuple(p),
            NEW_TOKENS,
            sampling=SAMPLINGS[sampling],
            speculation=SPECULATIONS[speculation],
            logprobs=TOP if i % 2 == 0 else 0,  # a batch mixes counts
        )
        for i, p in enumerate(prompts)
    ]
    requests.append(GenerationRequest("none-asked", tuple(prompts[0]), 8, speculation=SPECULATIONS[speculation]))
    results = engine.generate(requests)
    assert results[-1].logprobs == []
    steps = 0
    for request, result in zip(requests[:-1], results[:-1], strict=True):
        assert [lp.token for lp in result.logprobs] == result.output_tokens
        expected = _oracle(hf, request.prompt_tokens, result.output_tokens)
        for k, lp in enumerate(result.logprobs):
            assert lp.logprob == pytest.approx(expected[k, lp.token].item(), abs=2e-4)
            assert len(lp.top) == request.logprobs
            if lp.top:
                values = [v for _, v in lp.top]
                assert values == sorted(values, reverse=True)
                for token, value in lp.top:
                    assert value == pytest.approx(expected[k, token].item(), abs=2e-4)
                # the best alternatives: no token outside them is more likely than the last one (up to rounding)
                assert expected[k].topk(TOP).values[-1].item() == pytest.approx(values[-1], abs=2e-4)
            if sampling == "greedy":
                assert lp.logprob == pytest.approx(expected[k].max().item(), abs=2e-4)
        steps += result.llm_steps
    if speculation != "none":
        assert sum(len(r.output_tokens) for r in results[:-1]) > steps  # speculation committed several a step


def test_logprobs_follow_the_stop_conditions(setup):
    """A step cut by EOS, a stop token or the length keeps the logprobs of the tokens it commits alone."""
    engine, _, prompts = setup
    spec = SpeculationConfig(ExpansionConfig.parse("2,2,2"))
    free = engine.generate([GenerationRequest("free", tuple(prompts[1]), NEW_TOKENS, speculation=spec, logprobs=1)])[0]
    stop = free.output_tokens[5]
    cut = engine.generate(
        [
            GenerationRequest(
                "stop", tuple(prompts[1]), NEW_TOKENS, speculation=spec, stop_token_ids=(stop,), logprobs=1
            ),
            GenerationRequest("length", tuple(prompts[1]), 7, speculation=spec, logprobs=1),
        ]
    )
    for result in cut:
        assert [lp.token for lp in result.logprobs] == result.output_tokens
        n = len(result.output_tokens)
        expected = [lp.logprob for lp in free.logprobs[:n]]
        assert [lp.logprob for lp in result.logprobs] == pytest.approx(expected, abs=1e-4)
    assert cut[0].finish_reason == "stop" and cut[1].finish_reason == "length" and len(cut[1].output_tokens) == 7


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_a_count_out_of_range_names_the_field(bad):
    with pytest.raises(InvalidArgument) as err:
        GenerationRequest("x", (1, 2), 4, logprobs=bad)
    assert err.value.field == "logprobs"


def test_device_logprobs_equal_the_reference():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(7, 50)).astype(np.float32) * 3
    rows[3, 10] = rows[3, 11] = rows[3].max() + 1  # a tie: the lower index first
    tokens = rng.integers(0, 50, size=7)
    chosen, ids, values = token_logprobs(torch.from_numpy(rows), torch.from_numpy(tokens), 4)
    for r in range(7):
        logprob, top = token_logprob(rows[r], int(tokens[r]), 4)
        assert chosen[r].item() == pytest.approx(logprob, abs=1e-5)
        assert ids[r].tolist() == [t for t, _ in top]
        assert values[r].tolist() == pytest.approx([v for _, v in top], abs=1e-5)
    assert ids[3, :2].tolist() == [10, 11]
    assert len(token_logprobs(torch.from_numpy(rows), torch.from_numpy(tokens), 0)) == 1


def test_a_vocabulary_smaller_than_the_count_gives_all_its_tokens():
    """20 alternatives asked of a 12-token vocabulary: the 12, most likely first."""
    from specinfer.models.reference import ReferenceBackend
    from specinfer.models.tiny import tiny_llama

    llm = ReferenceBackend(tiny_llama(12, 32, 1, 2, 2, seed=3))
    engine = SpeculativeEngine(llm, [ReferenceBackend(tiny_llama(12, 32, 1, 2, 2, seed=4))], EngineConfig())
    spec = SpeculationConfig(ExpansionConfig.parse("2,1"))
    (result,) = engine.generate([GenerationRequest("tiny", (1, 2, 3), 6, speculation=spec, logprobs=MAX_LOGPROBS)])
    assert [lp.token for lp in result.logprobs] == result.output_tokens
    for lp in result.logprobs:
        assert sorted(t for t, _ in lp.top) == list(range(12))
        assert sum(np.exp(v) for _, v in lp.top) == pytest.approx(1.0, abs=1e-5)
