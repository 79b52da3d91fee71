"""Constrained speculative sampling has the constrained distribution: the LLM's, with the tokens the grammar forbids
after each path set to -inf before sampling (chi-square against the exact joint of the first tokens, on the tiny
12-token models of tests/test_stochastic_engine.py and a 12-token tokenizer, one letter per token). Under multi-step
speculative sampling (the trees kept whole: forbidden nodes are always rejected) and coupled verification (seeded: the
trees pruned), and under a grammar with a certain token (appended below the trees' leaves), the drafts masked by the
grammar inside the drafters (each node's q the SSM's masked distribution). Negative controls: verification that
ignores the masks, MSS trees of unmasked drafts pruned after their draws (a cut that depends on the drawn tokens
biases the residuals), and masked drafts that record the SSM's unmasked q, must all fail."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from stats import chi_square_pvalue  # tests/stats.py
from test_stochastic_engine import N_TOKENS, PROMPT, VOCAB, tiny_models
from test_stochastic_engine import exact_joint as stochastic_joint  # tests/test_stochastic_engine.py
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core import grammar_states as grammar_states_module
from specinfer.core.constraints import Constraint, Grammars, GrammarState, allowed_tokens
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models import verification
from specinfer.models.reference import ReferenceBackend

EOS = VOCAB - 1  # "</s>"; the letters a..k are tokens 0..10
CONSTRAINT = Constraint("regex", "[a-f]([a-c]|[g-i])[a-k]")  # three tokens, each position forbidding some
CERTAIN = Constraint("regex", "[a-f]g[a-k]")  # the second token certain: appended to the trees, never drafted
SAMPLES = 8000
CONTROL_SAMPLES = 4000
SPEC = SpeculationConfig(ExpansionConfig((3, 2)), ssms=(0, 1))


def letters_tokenizer() -> str:
    """tokenizer.json of one token per letter a..k, then EOS."""
    tok = Tokenizer(models.BPE(vocab={**{c: i for i, c in enumerate("abcdefghijk")}, "</s>": EOS}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return tok.to_str()


@pytest.fixture(scope="module")
def setup():
    llm, a, b = tiny_models()
    grammars = Grammars(letters_tokenizer(), VOCAB, EOS)
    return (llm, a, b), grammars


def exact_joint(
    llm, grammars: Grammars, params: SamplingParams, constraint: Constraint = CONSTRAINT
) -> dict[tuple[int, ...], float]:
    """P(the N_TOKENS tokens) under constrained plain sampling: each step's logits masked by the grammar, then
    processed (temperature, top-k, top-p) and sampled."""
    return stochastic_joint(
        llm, params, lambda prefix: allowed_tokens(grammars.state(constraint, prefix).mask(), VOCAB)
    )


def sample(
    models_, grammars: Grammars, params: SamplingParams, samples: int, constraint: Constraint = CONSTRAINT
) -> Counter:
    llm, a, b = models_
    engine = SpeculativeEngine(
        ReferenceBackend(llm),
        [ReferenceBackend(a), ReferenceBackend(b)],
        EngineConfig(max_batch=2000),
        grammars=grammars,
    )
    counts: Counter = Counter()
    for start in range(0, samples, 2000):
        requests = [
            GenerationRequest(
                f"s{start + i}",
                PROMPT,
                N_TOKENS,
                dataclasses.replace(params, seed=start + i),
                SPEC,
                constraint=constraint,
            )
            for i in range(min(2000, samples - start))
        ]
        for res in engine.generate(requests):
            counts[tuple(res.output_tokens)] += 1
    return counts


CASES = {
    "mss": SamplingParams(temperature=1.0, verification="mss"),
    "mss-top-p": SamplingParams(temperature=0.8, top_p=0.9, verification="mss"),
    "coupled": SamplingParams(temperature=1.0, verification="coupled"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [*CASES, "mss-certain", "coupled-certain"])
def test_constrained_speculative_sampling_has_the_constrained_distribution(setup, case):
    """The ``-certain`` cases under a grammar with a certain token, which the trees get below their leaves."""
    models_, grammars = setup
    params = CASES[case.removesuffix("-certain")]
    constraint = CERTAIN if case.endswith("-certain") else CONSTRAINT
    counts = sample(models_, grammars, params, SAMPLES, constraint)
    pvalue = chi_square_pvalue(counts, exact_joint(models_[0], grammars, params, constraint))
    assert pvalue > 0.001, f"p-value {pvalue}"


@pytest.mark.slow
def test_verification_blind_to_the_masks_fails(setup, monkeypatch):
    """The drafts pruned and masked as usual, but the verifier samples from the unmasked distribution."""
    monkeypatch.setattr(verification, "_masked", lambda rows, jobs, starts: rows)
    monkeypatch.setattr(GrammarState, "advance", lambda self, tokens: None)  # it would refuse the first stray token
    models_, grammars = setup
    params = CASES["mss"]
    counts = sample(models_, grammars, params, CONTROL_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(models_[0], grammars, params)) < 1e-6


@pytest.mark.slow
def test_mss_trees_pruned_after_their_draws_fail(setup, monkeypatch):
    """MSS trees cut to the nodes the grammar allows, as greedy ones are: the cut depends on the drawn tokens. The
    drafts unmasked (as a drafter without the LLM's tokenizer drafts), or there would be nothing to cut."""
    real = grammar_states_module.GrammarStates.constrain
    monkeypatch.setattr(grammar_states_module.DraftGrammars, "states", lambda self, jobs: {})

    def prune_always(self, batch, jobs, rows):
        prunable = [dataclasses.replace(j, sampling=dataclasses.replace(j.sampling, temperature=0.0)) for j in jobs]
        pruned = real(self, batch, prunable, rows)
        return [dataclasses.replace(p, sampling=j.sampling) for p, j in zip(pruned, jobs, strict=True)]

    monkeypatch.setattr(grammar_states_module.GrammarStates, "constrain", prune_always)
    models_, grammars = setup
    params = CASES["mss"]
    counts = sample(models_, grammars, params, CONTROL_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(models_[0], grammars, params)) < 1e-6
