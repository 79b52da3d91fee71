"""The cost model's view of a step's verify calls: their shapes (:func:`call_shape`: tree nodes and the prompts a
request's first step computes, with their context work). Pure functions of the jobs
(:class:`~specinfer.core.iteration.VerifySpec`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specinfer.core.costs import VerifyShape
from specinfer.core.iteration import VerifySpec


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
