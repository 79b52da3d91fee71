"""The cost model's view of a step's verify calls: their shapes (:func:`call_shape`: tree nodes and the prompts a
request's first step computes, with their context work) and the seconds the speculation gate scores a step by
(:func:`gate_seconds`). Pure functions of the jobs (:class:`~specinfer.core.iteration.VerifySpec`) and the model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specinfer.core.costs import StepCosts, VerifyShape
from specinfer.core.iteration import VerifySpec

MIN_TREE_SHARE = 0.2  # the least share of a verify call left to its trees, for the gate to score it (gate_seconds)


def prefills(jobs: Sequence[VerifySpec]) -> bool:
    """Whether a verify call over ``jobs`` also prefilled a prompt (some request's first step)."""
    return any(j.step == 0 for j in jobs)


def call_shape(jobs: Sequence[VerifySpec], cached: Mapping[str, int]) -> VerifyShape:
    """The cost-model shape of one verify call over ``jobs``: its tree tokens, and the prompt tokens it prefilled
    (a request's first step computes its context, less the tokens ``cached`` (by request ID) in the prefix cache),
    with their context work: a tree node attends to its request's context and root, a prompt token to the prompt
    tokens before it. Rows are rows to the model's matrix products whether a tree or a prompt brought them, so
    every call, a request's first step too, is a sample of the one model: at a large batch most steps admit a
    prompt, and a model fitted from the others alone would not learn the sizes such a batch verifies."""
    tree = _tree_shape(jobs)
    prompts = [(len(j.context_tokens), cached.get(j.request_id, 0)) for j in jobs if j.step == 0]
    if not prompts:
        return tree
    return VerifyShape(
        tree.tokens + sum(p - h for p, h in prompts),
        tree.context_work + sum(p * (p - 1) // 2 - h * (h - 1) // 2 for p, h in prompts),
    )


def _tree_shape(jobs: Sequence[VerifySpec]) -> VerifyShape:
    """The tree tokens of ``jobs`` and their context work (each node attends to its request's context and root)."""
    return VerifyShape(
        sum(len(j.draft.tree) for j in jobs), sum(len(j.draft.tree) * (len(j.context_tokens) + 1) for j in jobs)
    )


def gate_seconds(
    timings: Sequence[tuple[Sequence[VerifySpec], float]], seconds: float, costs: StepCosts, cached: Mapping[str, int]
) -> float | None:
    """The step's ``seconds`` the speculation gate scores, given its verify calls (jobs, seconds): less what each
    call's prompts would have cost it without speculation, their tokens ``cached`` (by request ID) in the prefix cache
    not computed. The cost model prices it (a call of the roots and the prompts, less the roots alone) as a share of
    the call (right if the model's scale is off). Without speculation that is the prompts' share of the call; with
    it, what the trees add on top of the prompts stays in the score: where rows cost more as a call grows, a tree
    beside a prompt costs more than alone, and that is speculation's cost. None with no call, or where a call's
    prompts take more than 1 - :data:`MIN_TREE_SHARE` of it."""
    if not timings:
        return None
    prefill = 0.0
    for jobs, call_seconds in timings:
        if not prefills(jobs):
            continue
        shape, tree = call_shape(jobs, cached), _tree_shape(jobs)
        roots = VerifyShape(len(jobs), sum(len(j.context_tokens) + 1 for j in jobs))  # the call without speculation
        unspeculated = VerifyShape(
            shape.tokens - tree.tokens + roots.tokens, shape.context_work - tree.context_work + roots.context_work
        )
        with_prompts = costs.verify_seconds(shape)
        added = costs.verify_seconds(unspeculated) - costs.verify_seconds(roots)  # the prompts' cost there
        share = added / with_prompts if with_prompts > 0 else 0.0
        if share > 1.0 - MIN_TREE_SHARE:
            return None
        prefill += call_seconds * share
    return seconds - prefill if seconds > prefill else None
