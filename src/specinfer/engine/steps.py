"""The two model-side halves of an iteration, shared by the in-process engine and the services.

- :func:`draft_trees`: one SSM grows a draft tree per job, all jobs batched through the model
  depth by depth (the SSM worker's ``Speculate``).
- :func:`verify_trees`: one batched LLM forward over every tree, then greedy verification or
  multi-step speculative sampling per job (the LLM verifier's ``Verify``).

Jobs are :class:`~specinfer.core.iteration.DraftSpec` / :class:`~specinfer.core.iteration.VerifySpec`;
each draws from the random stream its spec names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from specinfer.core import (
    BestFirstTreeBuilder,
    DraftTree,
    Proposal,
    TreeBuilder,
    VerifyResult,
    draw_without_replacement,
    process_logits,
    sparsify,
    top_k_tokens,
    verify_greedy,
    verify_stochastic,
)
from specinfer.core.coupled import PositionNoise, coupled_children, verify_coupled
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.models.interface import CausalLM, TreeForward


def propose_children(logits: torch.Tensor, width: int, job: DraftSpec, rng: np.random.Generator, depth: int) -> tuple[list[int], object]:
    """Children (at ``depth`` below the root) of one node: top-k under greedy decoding; under sampling,
    drawn without replacement from the sparse processed distribution q, which is returned with them:
    from ``rng`` (MSS), or by Gumbel-top-k with the position noise of their sequence index (coupled)."""
    if job.sampling.greedy:
        return top_k_tokens(logits.numpy(), width), None
    q = sparsify(process_logits(logits.numpy(), job.sampling), job.draft_support)
    if job.sampling.coupled:
        return coupled_children(q, job.seed, len(job.context) + depth, width), q
    return draw_without_replacement(q, width, rng), q


def propose_slots(logits: torch.Tensor, width: int, job: DraftSpec, rng: np.random.Generator, depth: int) -> Proposal:
    """A dynamic tree's proposal at one node: the children as :func:`propose_children` drafts them,
    and the slot probabilities that score them. Under greedy decoding they come from the SSM's own
    softmax (temperature 1), the confidence in each of its top-k tokens."""
    tokens, q = propose_children(logits, width, job, rng, depth)
    if q is None:
        x = logits.double()
        probs = torch.softmax(x - x.max(), dim=-1).numpy()  # [V]
        return Proposal(tuple(tokens), None, tuple(float(probs[t]) for t in tokens))
    return Proposal(tuple(tokens), q, tuple(float(p) for p in q.probs[:width]))


def draft_trees(ssm: CausalLM, jobs: Sequence[DraftSpec], on_pass: Callable[[int, float], None] | None = None) -> list[DraftTree]:
    """One draft tree per job, in job order: static jobs grow their expansion, budgeted ones a
    best-first dynamic tree. ``on_pass(frontier_tokens, seconds)`` hears of every SSM pass."""
    builders = {
        i: (TreeBuilder(job.root_token, job.expansion) if job.expansion is not None else BestFirstTreeBuilder(job.root_token, job.budget))
        for i, job in enumerate(jobs)
    }
    rngs = [job.rng() for job in jobs]  # one generator per job for all its depths
    depths = [1] * len(jobs)  # the depth of the children each job's next pass drafts (a pass per depth)
    out: dict[int, DraftTree] = {}
    while builders:
        started = time.perf_counter()  # a pass costs its Python work too: building the items, drafting the children
        order = list(builders)
        items = []
        for i in order:
            frontier = builders[i].frontier()
            items.append(TreeForward(jobs[i].request_id, jobs[i].context, builders[i].tokens_of(frontier), builders[i].parents_of(frontier)))
        logits = ssm.forward_tree(items)
        for i, node_logits in zip(order, logits, strict=True):
            b = builders[i]
            if isinstance(b, BestFirstTreeBuilder):
                b.expand([propose_slots(row, b.width(), jobs[i], rngs[i], depths[i]) for row in node_logits])
            else:
                b.expand([propose_children(row, b.width(), jobs[i], rngs[i], depths[i]) for row in node_logits])
            depths[i] += 1
            if b.done:
                out[i] = b.build()
                del builders[i]
        if on_pass is not None:
            on_pass(sum(len(it.tokens) for it in items), time.perf_counter() - started)
    return [out[i] for i in range(len(jobs))]


def verify_trees(llm: CausalLM, jobs: Sequence[VerifySpec]) -> list[VerifyResult]:
    """Accepted path and bonus token per job, in job order."""
    logits = llm.forward_tree([TreeForward(j.request_id, j.context, j.draft.tree.tokens, j.draft.tree.parents) for j in jobs])
    results = []
    for job, node_logits in zip(jobs, logits, strict=True):
        if job.sampling.greedy:
            results.append(verify_greedy(job.draft.tree, node_logits.argmax(dim=-1).numpy()))
            continue
        target = lambda node, lg=node_logits, params=job.sampling: process_logits(lg[node].numpy(), params)  # noqa: E731
        if job.sampling.coupled:  # the root is the last committed token, at sequence index len(context)
            results.append(verify_coupled(job.draft.tree, target, PositionNoise(job.seed, node_logits.shape[-1]), len(job.context)))
        else:
            results.append(verify_stochastic(job.draft, target, job.rng()))
    return results
