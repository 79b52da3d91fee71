"""Sampling with draft-head trees keeps the LLM's distribution: multi-step speculative sampling and coupled
verification on trees merged from an SSM's, the text's own (suffix) and a draft head's
(:mod:`specinfer.models.head_drafter`), chi-square against the exact joint of plain sampling; and the
negative control, head trees whose recorded draft distribution is not the one their tokens were drawn
from, fails."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stats import chi_square_pvalue  # noqa: E402  tests/stats.py
from test_stochastic_engine import (  # noqa: E402  tests/test_stochastic_engine.py
    ADAPTIVE_KEEP,
    ADAPTIVE_PLANNER,
    CONTROL_SAMPLES,
    exact_joint,
    free_speculation,
    marginal,
    sample_engine,
    tiny_models,
)

from specinfer.core import SamplingParams  # noqa: E402
from specinfer.core.drafts import DraftGroup  # noqa: E402
from specinfer.core.head_gate import HeadGateConfig  # noqa: E402
from specinfer.core.sampling import SparseDist  # noqa: E402
from specinfer.engine import EngineConfig, SpeculationConfig, SpeculativeEngine  # noqa: E402
from specinfer.models import drafting, verification  # noqa: E402
from specinfer.models.draft_head import DraftHead, HeadConfig, save_head  # noqa: E402
from specinfer.models.head_drafter import with_head  # noqa: E402
from specinfer.models.loading import load_backend  # noqa: E402

SAMPLES = 3000
MSS = SamplingParams(temperature=1.0, verification="mss")
MERGED = SpeculationConfig(None, ssms=(0,), suffix=True, head=True)
# no SSM: the first step verifies its root alone, so the second step's tree, the head's, decides every
# request's second token (merged with an SSM's, many requests commit both kept tokens in their first step)
HEAD_ALONE = SpeculationConfig(None, ssms=(), suffix=False, head=True)
CASES = {
    "mss-merged": (MSS, MERGED),
    "coupled-merged": (SamplingParams(temperature=0.9, top_k=8, verification="coupled"), MERGED),
    "mss-head-alone": (MSS, HEAD_ALONE),
}


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def _head_engine(models, tmp_path) -> SpeculativeEngine:
    """The tiny LLM and SSM on the native backend, the LLM with a random head whose drafts are confident
    (its predicted features scaled up: far from the LLM's mild distributions, so a wrong q shows)."""
    for name, model in (("llm", models[0]), ("ssm", models[1])):
        model.save_pretrained(tmp_path / name)
    llm, ssm = (load_backend(tmp_path / n, n, "float32", "cpu", "native", 1 << 24) for n in ("llm", "ssm"))
    torch.manual_seed(3)
    head = DraftHead(
        HeadConfig(llm.feature_dim, llm.vocab_size, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=24)
    )
    with torch.no_grad():
        head.out.weight.mul_(1000.0)  # q nearly one-hot on the head's choice
    save_head(head, tmp_path / "head")
    # every step asks for head trees (the default gate measures steps without them too)
    planner = dataclasses.replace(ADAPTIVE_PLANNER, head_gate=HeadGateConfig(measure=False))
    config = EngineConfig(max_batch=SAMPLES, planner=planner)
    return SpeculativeEngine(with_head(llm, tmp_path / "head"), [ssm], config, free_speculation())


def _sample(engine: SpeculativeEngine, params: SamplingParams, spec: SpeculationConfig, samples: int):
    counts = sample_engine(engine, params, spec, batch=samples, samples=samples, keep=ADAPTIVE_KEEP)
    assert sum(counts.values()) == samples
    totals = engine.adaptive.totals
    assert totals.drafter_steps.get("head", 0) > samples // 10, "head trees were verified"
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_merged_head_ssm_suffix_sampling_matches_llm_sampling(models, tmp_path, case):
    params, spec = CASES[case]
    counts = _sample(_head_engine(models, tmp_path), params, spec, SAMPLES)
    pvalue = chi_square_pvalue(counts, marginal(exact_joint(models[0], params), ADAPTIVE_KEEP))
    assert pvalue > 0.001, f"p-value {pvalue}"


def uniform_q_head_drafts(original):
    """Deliberately wrong: head trees keep their drawn tokens but record a uniform q over each draw's support."""

    def wrong(head, jobs, results, features, grammars=None):
        out = original(head, jobs, results, features, grammars)
        for i, r in enumerate(out):
            if r.next_tree is None:
                continue
            groups = tuple(
                DraftGroup(g.parent, g.children, SparseDist(g.q.tokens, np.full(g.q.tokens.size, 1 / g.q.tokens.size)))
                for g in r.next_tree.groups
            )
            out[i] = dataclasses.replace(r, next_tree=dataclasses.replace(r.next_tree, groups=groups))
        return out

    return wrong


@pytest.mark.slow
def test_head_trees_with_a_wrong_draft_distribution_fail(models, tmp_path, monkeypatch):
    # verify_trees calls head_drafts by its name in the verification module
    monkeypatch.setattr(verification, "head_drafts", uniform_q_head_drafts(drafting.head_drafts))
    params, spec = CASES["mss-head-alone"]
    counts = _sample(_head_engine(models, tmp_path), params, spec, CONTROL_SAMPLES)
    assert chi_square_pvalue(counts, marginal(exact_joint(models[0], params), ADAPTIVE_KEEP)) < 1e-6
