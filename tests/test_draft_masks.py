"""Drafts masked by the grammar inside the drafters (fp32, the bundled demo models): no node an SSM or the LLM's
draft head drafts is a token the request's grammar forbids after its path, under JSON-schema and regex constraints,
greedy and sampled, static and dynamic trees; a sampled node's q gives mass to allowed tokens alone and sums to one;
nothing is drafted below EOS. The same jobs drafted without the grammar do hold forbidden nodes (so the checks can
fail). The drafter's states follow the committed output (advanced, or rebuilt when it is not a prefix) and go when
their request is forgotten."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
from specinfer.core.constraints import Constraint, Grammars, allows
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.grammar_states import DraftGrammars
from specinfer.core.iteration import DraftSpec, HeadDraft, VerifySpec
from specinfer.core.tree import path_below_root
from specinfer.models.drafting import draft_trees
from specinfer.models.head_drafter import with_head
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.models.verification import verify_trees

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex": Constraint("regex", r"(the|a) [a-z]{1,8}( (and|or) [a-z]{1,8}){0,3}\."),
}
SAMPLINGS = {
    "greedy": SamplingParams(),
    "mss": SamplingParams(temperature=1.0, verification="mss"),
    "coupled": SamplingParams(temperature=0.8, top_p=0.95, verification="coupled"),
}
WIDE = ExpansionConfig((4, 3, 2, 1))
BUDGET = TreeBudget(24, 5, 4, 0.0)


@pytest.fixture(scope="module")
def setup(model_pair):
    eos = eos_token_id(model_pair.llm)
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 26)
    ssm = load_backend(model_pair.ssm, "ssm", "float32", backend="native", kv_cache_bytes=1 << 26)
    grammars = Grammars((model_pair.llm / "tokenizer.json").read_text(), llm.vocab_size, eos)
    return llm, ssm, grammars, [tuple(p) for p in model_pair.prompts[:2]]


def job(rid: str, prompt, output, constraint, sampling, expansion=WIDE, budget=None) -> DraftSpec:
    committed = [*prompt, *output]
    return DraftSpec(
        rid, committed[:-1], committed[-1], expansion, sampling, 8, 7, len(output), 1, budget, len(prompt), constraint
    )


def forbidden_nodes(grammars: Grammars, constraint: Constraint, output, draft: DraftTree) -> list[int]:
    """The nodes of ``draft`` the grammar does not reach (tree root: the last committed token, ``output`` the
    committed output): a token it forbids after its parent's path, a node below one, or below EOS
    (:func:`~specinfer.core.constraints.tree_masks`, tested against a brute-force walk in tests/test_constraints.py)."""
    walked = grammars.state(constraint, output).tree(draft.tree.tokens, draft.tree.parents)
    return [u for u, ok in enumerate(walked.reachable) if not ok]


def check_q(grammars: Grammars, constraint: Constraint, output, draft: DraftTree) -> None:
    """Every sampled group's q: allowed tokens only, summing to one."""
    state = grammars.state(constraint, output)
    for g in draft.groups:
        assert g.q is not None
        row = state.after([path_below_root(draft.tree.tokens, draft.tree.parents, g.parent)])[0]
        assert all(allows(row, int(t)) for t in g.q.tokens), "q gives mass to a forbidden token"
        assert g.q.probs.sum() == pytest.approx(1.0)


def drafted_along(ssm, grammars, drafter, rid, prompt, constraint, sampling, steps=4, **shape):
    """Draft ``steps`` times, committing each tree's first path between drafts (so the drafter's state advances);
    yields (output, draft)."""
    output: list[int] = []
    for _ in range(steps):
        (draft,) = draft_trees(ssm, [job(rid, prompt, output, constraint, sampling, **shape)], None, drafter)
        yield list(output), draft
        tokens, parents = draft.tree.tokens, draft.tree.parents
        first = [u for u in range(1, len(tokens)) if parents[u] == 0]
        if not first or tokens[first[0]] == grammars.eos:
            return
        output.append(tokens[first[0]])


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_no_ssm_draft_node_is_forbidden(setup, name, sampling, shape):
    _llm, ssm, grammars, prompts = setup
    constraint, params = CONSTRAINTS[name], SAMPLINGS[sampling]
    kwargs = {"expansion": None, "budget": BUDGET} if shape == "dynamic" else {}
    drafter = DraftGrammars(grammars)
    unmasked_forbidden = 0
    for p, prompt in enumerate(prompts):
        rid = f"{name}-{sampling}-{shape}-{p}"
        for output, draft in drafted_along(ssm, grammars, drafter, rid, prompt, constraint, params, **kwargs):
            assert len(draft.tree) > 1
            assert forbidden_nodes(grammars, constraint, output, draft) == []
            if not params.greedy:
                check_q(grammars, constraint, output, draft)
            (free,) = draft_trees(ssm, [job(rid, prompt, output, constraint, params, **kwargs)])
            unmasked_forbidden += len(forbidden_nodes(grammars, constraint, output, free))
        ssm.release(rid)
        drafter.forget(rid)
    assert len(drafter) == 0
    assert unmasked_forbidden > 0, "the same drafts without the grammar hold forbidden nodes"


def test_the_drafters_state_follows_the_committed_output(setup):
    """A state advanced along the output and one rebuilt for an output that is not its extension give the masks a
    fresh state gives."""
    _llm, _ssm, grammars, prompts = setup
    constraint = CONSTRAINTS["schema"]
    drafter = DraftGrammars(grammars)
    text = grammars.tokenizer.tokenize_str('{"name":"ab","age":3')  # compact JSON
    for output in (text[:2], text[:5], text[:3], text[:7]):  # forwards, back (rebuilt), forwards
        (state,) = drafter.states([job("r", prompts[0], output, constraint, SAMPLINGS["greedy"])]).values()
        expected = grammars.state(constraint, output).after([()])
        assert np.array_equal(state.after([()]), expected)
    drafter.forget("r")
    assert len(drafter) == 0


def test_a_complete_grammar_drafts_eos_alone(setup):
    _llm, ssm, grammars, prompts = setup
    constraint = Constraint("regex", "ab")
    output = grammars.tokenizer.tokenize_str("ab")
    (draft,) = draft_trees(
        ssm, [job("done", prompts[0], output, constraint, SAMPLINGS["greedy"])], None, DraftGrammars(grammars)
    )
    ssm.release("done")
    assert draft.tree.tokens[1:] == (grammars.eos,), "EOS alone, and nothing below it"


@pytest.mark.parametrize("sampling", ["greedy", "mss"])
def test_no_head_draft_node_is_forbidden(setup, model_pair, sampling):
    """The LLM's draft head drafts the next step's tree below the bonus token: masked by the constraint its
    :class:`HeadDraft` carries."""
    llm, _ssm, grammars, prompts = setup
    headed = with_head(llm, model_pair.llm.parent / "head", model_pair.llm)
    constraint, params = CONSTRAINTS["schema"], SAMPLINGS[sampling]
    unmasked_forbidden = 0
    for masked in (True, False):
        drafter = DraftGrammars(grammars) if masked else None
        for p, prompt in enumerate(prompts):
            rid = f"head-{sampling}-{masked}-{p}"
            root = DraftTree(TokenTree((prompt[-1],), (-1,)), ())
            masks = grammars.state(constraint).after([()])  # [1, W] the bonus token is allowed
            spec = VerifySpec(
                rid, list(prompt[:-1]), root, params, 3, 0, HeadDraft(BUDGET, 8, constraint), None, len(prompt), masks
            )
            (result,) = verify_trees(headed, [spec], drafter)
            headed.release(rid)
            output = [result.bonus_token]
            assert allows(masks[0], result.bonus_token)
            assert result.next_tree is not None and len(result.next_tree.tree) > 1
            bad = forbidden_nodes(grammars, constraint, output, result.next_tree)
            if masked:
                assert bad == []
                if not params.greedy:
                    check_q(grammars, constraint, output, result.next_tree)
            else:
                unmasked_forbidden += len(bad)
    assert unmasked_forbidden > 0, "the head's unmasked drafts hold forbidden nodes"


def test_a_workers_ssms_keep_their_own_grammar_states_and_forget_them_on_release(setup, model_pair):
    """Two SSMs of one worker draft the same constrained request at once (each in its model thread): each walks its
    own grammar state, so both drafts are what a drafter alone draws, with no forbidden node; Release forgets the
    states under each model's lock."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from specinfer import wire, wire_jobs
    from specinfer.serving.metrics import ModelMetrics
    from specinfer.ssm_worker.servicer import SsmWorkerServicer
    from specinfer.v1 import internal_pb2

    _llm, _ssm, grammars, prompts = setup
    ssms = {n: load_backend(model_pair.ssm, "ssm", "float32", backend="native", kv_cache_bytes=1 << 26) for n in "ab"}
    worker = SsmWorkerServicer(ssms, ModelMetrics(CollectorRegistry(), "ssm_worker"), grammars=grammars)
    constraint, output = CONSTRAINTS["schema"], grammars.tokenizer.tokenize_str('{"name":"')
    spec = job("both", prompts[0], output, constraint, SAMPLINGS["greedy"])

    async def speculate(name: str) -> DraftTree:
        context = wire_jobs.context_to_proto(spec.request_id, spec.context_tokens, 0)
        item = wire_jobs.draft_job_to_proto(spec, context)
        response = await worker.Speculate(internal_pb2.SpeculateRequest(ssm=name, items=[item]), None)
        (result,) = response.results
        return wire.draft_from_proto(result.tree)

    async def run():
        drafts = await asyncio.gather(*(speculate(n) for n in "ab"))
        held = [len(worker._grammars[n]) for n in "ab"]
        await worker.Release(internal_pb2.ReleaseRequest(request_ids=[spec.request_id]), None)
        return drafts, held

    drafts, held = asyncio.run(run())
    (alone,) = draft_trees(_ssm, [spec], None, DraftGrammars(grammars))
    _ssm.release(spec.request_id)
    for draft in drafts:
        assert draft.tree == alone.tree
        assert forbidden_nodes(grammars, constraint, output, draft) == []
    assert held == [1, 1], "each SSM walked its own state of the request"
    assert [len(worker._grammars[n]) for n in "ab"] == [0, 0]
