"""Logit biases, presence, frequency and repetition penalties, and min-p: speculative output equals decoding without
speculation under the same settings, token for token (greedy and seeded coupled sampling), whatever the tree (fp32)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from devices import TEST_DEVICE  # tests/devices.py
from oracles import hf_plain_decoding  # tests/oracles.py
from transformers import AutoModelForCausalLM

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams, process_logits
from specinfer.core.sampling import adjust_logits
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


# what each case adds to the sampling parameters; "bias" is built from the plain outputs (oracles)
ADJUSTMENTS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.4},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "negative": {"presence_penalty": -1.0},
    "bias": None,
    "min-p": {"min_p": 0.2},  # after the temperature: greedy decoding keeps its argmax
    "bias-and-penalties": None,
}
SPECULATIONS = {
    "none": None,
    "static": SpeculationConfig(ExpansionConfig.parse("1,1,3,1,1")),
    "adaptive": SpeculationConfig(None),
}
SEED = 11


def _params(sampled: bool, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=SEED, **kwargs) if sampled else SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def oracles(setup):
    """(plain decoding of every case, the kwargs of every case, plain decoding without adjustments)."""
    _, hf, prompts = setup
    plain = {
        sampled: [hf_plain_decoding(hf, p, _params(sampled), SEED if sampled else None, NEW_TOKENS) for p in prompts]
        for sampled in (False, True)
    }
    # ban the most common token of the plain greedy outputs and of the seeded ones, favour the greedy ones' second
    greedy = [t for t, _ in Counter(t for out in plain[False] for t in out).most_common(2)]
    seeded = Counter(t for out in plain[True] for t in out).most_common(1)[0][0]
    banned = dict.fromkeys([greedy[0], seeded], -100.0)
    bias = {"logit_bias": (*banned.items(), (greedy[1], 2.0)) if greedy[1] not in banned else tuple(banned.items())}
    kwargs = {name: k if k is not None else bias for name, k in ADJUSTMENTS.items()}
    kwargs["bias-and-penalties"] = {**bias, **ADJUSTMENTS["all"]}
    out = {}
    for name, k in kwargs.items():
        for sampled in (False, True):
            params = _params(sampled, **k)
            out[name, sampled] = [
                hf_plain_decoding(hf, p, params, SEED if sampled else None, NEW_TOKENS) for p in prompts
            ]
    return out, kwargs, plain


@pytest.mark.parametrize("speculation", SPECULATIONS)
@pytest.mark.parametrize("case", ADJUSTMENTS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_with_adjusted_logits_equals_plain_decoding(setup, oracles, speculation, case, sampled):
    engine, _, prompts = setup
    expected, kwargs, plain = oracles
    params = _params(sampled, **kwargs[case])
    requests = [
        GenerationRequest(f"{case}-{sampled}-{i}", tuple(p), NEW_TOKENS, params, SPECULATIONS[speculation])
        for i, p in enumerate(prompts)
    ]
    # the same batch holds requests without adjustments: theirs stay the LLM's plain greedy output
    requests += [
        GenerationRequest(f"plain-{i}", tuple(p), NEW_TOKENS, speculation=SPECULATIONS[speculation])
        for i, p in enumerate(prompts[:2])
    ]
    results = engine.generate(requests)
    assert [r.output_tokens for r in results[:PROMPTS]] == expected[case, sampled]
    assert [r.output_tokens for r in results[PROMPTS:]] == plain[False][:2]
    if not (case == "min-p" and not sampled):
        assert expected[case, sampled] != plain[sampled], "the case changed nothing: the test would not see it"
    if case == "bias":
        banned = {t for t, b in kwargs[case]["logit_bias"] if b == -100.0}
        assert all(not banned & set(r.output_tokens) for r in results[:PROMPTS])


def test_the_repetition_penalty_is_transformers_own(setup, oracles):
    """An independent check of the reference: transformers' repetition_penalty gives the same greedy tokens."""
    _, hf, prompts = setup
    expected, _, _ = oracles
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
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-3, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
    ],
)
def test_out_of_range_penalties_name_their_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_adjust_logits_reference():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt [0], output [1, 1, 3]: repetition on 0, 1, 3; frequency 2x on 1, 1x on 3; presence on 1 and 3
    got = adjust_logits(logits, [0], [1, 1, 3], params)
    assert got.tolist() == [1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5]
    # the bias comes first: token 2 biased to 1.5 is then seen by the repetition penalty (prompt [2]) as positive
    biased = adjust_logits(logits, [2], [], SamplingParams(repetition_penalty=2.0, logit_bias=((2, 1.0),)))
    assert biased.tolist() == [2.0, -1.0, 0.75, 3.0]


def test_min_p_reference():
    """min-p keeps the tokens at least min_p times as likely as the best after the temperature."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    # at temperature 2 the distribution is flatter: 0.05 is now within a quarter of the best
    assert (process_logits(logits, SamplingParams(temperature=2.0, min_p=0.25)) > 0).all()
