"""The iteration bookkeeping both drivers share (specinfer.core.iteration): jobs, random streams, commits."""

from __future__ import annotations

import numpy as np

from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
from specinfer.core.call_shapes import call_shape
from specinfer.core.costs import VerifyShape
from specinfer.core.iteration import (
    VERIFY_STREAM,
    Running,
    VerifySpec,
    draft_specs,
    draft_stream,
    step_rng,
    verify_specs,
)
from specinfer.core.requests import GenerationRequest, SpeculationConfig, StepStats


def running(rid: str, ssms: tuple[int, ...] | None, max_new_tokens: int = 10, seed: int = 5) -> Running:
    spec = None if ssms is None else SpeculationConfig(ExpansionConfig((2, 2, 1)), ssms=ssms)
    return Running(
        GenerationRequest(rid, (4, 5, 6), max_new_tokens, SamplingParams(temperature=1.0), spec, stop_token_ids=(9,)),
        seed,
    )


def test_draft_jobs_follow_each_requests_ssms_and_streams():
    a, b, c = running("a", (0,)), running("b", (0, 1)), running("c", None)
    a.commit(a.outcome(DraftTree(TokenTree.root_only(6)), (), 7, None))
    assert [s.request_id for s in draft_specs([a, b, c], 0)] == ["a", "b"]
    (job,) = draft_specs([a, b, c], 1)
    assert (job.request_id, job.context_tokens, job.root_token, job.seed, job.step, job.stream) == (
        "b",
        [4, 5],
        6,
        5,
        0,
        draft_stream(1),
    )
    (first,) = draft_specs([a], 0)
    assert (first.context_tokens, first.root_token, first.step, first.stream) == ([4, 5, 6], 7, 1, draft_stream(0))
    assert first.rng().random() == step_rng(5, 1, 1).random() == np.random.default_rng([5, 1, 1]).random()
    # two tokens to go: the bonus token comes on top of the tree, so it is one level deep
    (short,) = draft_specs([running("d", (0,), max_new_tokens=2)], 0)
    assert short.expansion.widths == (2,)


def test_verify_jobs_merge_in_order_or_verify_the_root_alone():
    a, b = running("a", (0, 1)), running("b", None)
    t0 = DraftTree(TokenTree((6, 1), (-1, 0)))
    t1 = DraftTree(TokenTree((6, 2), (-1, 0)))
    ja, jb = verify_specs([a, b], {"a": [t0, t1]})
    assert ja.draft.tree.tokens == (6, 1, 2) and (ja.context_tokens, ja.seed, ja.step) == ([4, 5], 5, 0)
    assert jb.draft.tree == TokenTree.root_only(6)
    assert ja.rng().random() == step_rng(5, 0, VERIFY_STREAM).random()


def test_commit_stops_counts_and_adds_up():
    r = running("a", (0,), max_new_tokens=10)
    tree = DraftTree(TokenTree((6, 1, 2), (-1, 0, 1)))
    step = r.outcome(tree, (1, 2), 3, eos_token_id=2)
    assert (step.tokens, step.finish_reason, step.stats) == ((1, 2), "eos", StepStats(1, 2, 3, 2))
    step = r.outcome(tree, (1, 9), 3, eos_token_id=None)
    assert (step.tokens, step.finish_reason) == ((1, 9), "stop")
    go = r.outcome(tree, (1, 2), 3, eos_token_id=None)
    assert go.finish_reason is None and go.stats == StepStats(llm_steps=1, accepted=2, tree_size=3, committed=3)
    cut = go.stopped_at(1)
    assert (cut.tokens, cut.finish_reason, cut.stats.committed) == ((1,), "stop", 1)
    r.commit(go)
    r.commit(cut)
    assert r.output == [1, 2, 3, 1] and r.remaining == 6
    assert r.stats == StepStats(llm_steps=2, accepted=4, tree_size=6, committed=4)


def test_a_calls_shape_counts_the_prompts_it_prefilled_less_their_cached_tokens():
    """Tree nodes attend to the request's context and root; a prompt's computed tokens are rows too, each attending
    to the prompt tokens before it; those the prefix cache held are neither."""
    chain = DraftTree(TokenTree((6, 1, 2, 3), (-1, 0, 1, 2)))

    def job(rid: str, context: int, step: int) -> VerifySpec:
        return VerifySpec(rid, list(range(context)), chain, SamplingParams(), 5, step)

    decoding = [job("a", 20, 3), job("b", 30, 7)]
    assert call_shape(decoding, {}) == VerifyShape(8, 4 * 21 + 4 * 31)
    assert call_shape(decoding, {"a": 10}) == call_shape(decoding, {}), "a request past its prompt prefills nothing"
    admitting = [*decoding, job("new", 24, 0)]
    assert call_shape(admitting, {}) == VerifyShape(12 + 24, 4 * 21 + 4 * 31 + 4 * 25 + 24 * 23 // 2)
    cached = VerifyShape(12 + 8, 4 * 21 + 4 * 31 + 4 * 25 + 24 * 23 // 2 - 16 * 15 // 2)
    assert call_shape(admitting, {"new": 16}) == cached
