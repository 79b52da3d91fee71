"""Speculative sampling through the engine is lossless on a real (tiny, random) model.

Vocabulary 12, temperature 1, trees of width >= 2: the empirical joint distribution of the
first three generated tokens must match the LLM's own sampling distribution, computed exactly
by enumerating every prefix. A verifier that always accepts must fail the same test.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

import numpy as np
import pytest
import torch
from stats import chi_square_pvalue

from specinfer.core import ExpansionConfig, SamplingParams, VerifyResult, process_logits
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.engine import engine as engine_module
from specinfer.models.interface import TreeForward
from specinfer.models.reference import ReferenceBackend
from specinfer.models.tiny import tiny_llama

VOCAB = 12
PROMPT = (3, 7, 5)
N_TOKENS = 3
SAMPLES = 20000


@pytest.fixture(scope="module")
def models():
    llm = tiny_llama(VOCAB, 32, 2, 4, 2, seed=11)
    with torch.no_grad():  # milder logits than the default tiny model: every token stays likely
        llm.lm_head.weight.mul_(0.08)
    ssm_a = tiny_llama(VOCAB, 32, 1, 4, 2, seed=12)
    ssm_b = tiny_llama(VOCAB, 32, 1, 4, 2, seed=13)
    for m in (ssm_a, ssm_b):
        with torch.no_grad():
            m.lm_head.weight.mul_(0.08)
    return llm, ssm_a, ssm_b


def exact_joint(llm, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens) under plain sampling from the LLM."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        prefixes = list(probs)
        with torch.inference_mode():
            logits = llm(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].numpy()
        nxt = {}
        for prefix, row in zip(prefixes, logits, strict=True):
            dist = process_logits(row, params)
            for t in range(VOCAB):
                nxt[prefix + (t,)] = probs[prefix] * dist[t]
        probs = nxt
    return probs


def sample_engine(engine: SpeculativeEngine, params: SamplingParams, spec: SpeculationConfig, batch: int = 2500) -> Counter:
    counts: Counter = Counter()
    for start in range(0, SAMPLES, batch):
        requests = [
            GenerationRequest(
                f"s{start + i}", PROMPT, N_TOKENS, SamplingParams(params.temperature, params.top_k, params.top_p, seed=start + i), spec, ignore_eos=True
            )
            for i in range(batch)
        ]
        for res in engine.generate(requests):
            counts[tuple(res.output_tokens[:N_TOKENS])] += 1
    return counts


def always_accept_verify(llm, jobs):
    """Deliberately wrong verification: accepts the first drafted child at every node."""
    logits = llm.forward_tree([TreeForward(j.request_id, j.context, j.draft.tree.tokens, j.draft.tree.parents) for j in jobs])
    results = []
    for job, node_logits in zip(jobs, logits, strict=True):
        tree, u, path = job.draft.tree, 0, []
        while tree.children[u]:
            u = tree.children[u][0]
            path.append(u)
        p = process_logits(node_logits[u].numpy(), job.sampling)
        results.append(VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path), int(job.rng().choice(p.size, p=p))))
    return results


CASES = {
    "one-ssm-width-3": (SamplingParams(temperature=1.0), SpeculationConfig(ExpansionConfig((3, 2)), ssms=(0,))),
    "two-ssms-merged": (SamplingParams(temperature=1.0), SpeculationConfig(ExpansionConfig((2, 2)), ssms=(0, 1))),
}


def _engine(models):
    llm, a, b = models
    return SpeculativeEngine(ReferenceBackend(llm), [ReferenceBackend(a), ReferenceBackend(b)], EngineConfig(max_batch=2500))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_llm_sampling(models, case):
    params, spec = CASES[case]
    counts = sample_engine(_engine(models), params, spec)
    assert sum(counts.values()) == SAMPLES
    pvalue = chi_square_pvalue(counts, exact_joint(models[0], params))
    assert pvalue > 0.001, f"p-value {pvalue}"


@pytest.mark.slow
def test_always_accepting_verifier_fails(models, monkeypatch):
    monkeypatch.setattr(engine_module, "verify_trees", always_accept_verify)
    params, spec = CASES["one-ssm-width-3"]
    counts = sample_engine(_engine(models), params, spec)
    assert chi_square_pvalue(counts, exact_joint(models[0], params)) < 1e-6


def test_exact_joint_is_a_distribution(models):
    probs = exact_joint(models[0], SamplingParams(temperature=1.0))
    assert np.isclose(sum(probs.values()), 1.0)
    assert len(probs) == VOCAB**N_TOKENS
    assert set(probs) == set(product(range(VOCAB), repeat=N_TOKENS))
