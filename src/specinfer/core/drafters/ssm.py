"""SSM drafts: the small speculative models the executor runs, as one drafter.

Each SSM drafts the static trees of the requests that name it and the dynamic trees the plan gave it
(:func:`~specinfer.core.iteration.draft_specs`), all in one executor call; its trees carry its index as their
drafter key, in SSM order. Its passes' seconds teach the cost model where there is one.
"""

from __future__ import annotations

from specinfer.core.drafter import NO_PROPOSAL, Drafter, DrafterKey, DraftStep, Models, Proposal
from specinfer.core.drafts import DraftTree
from specinfer.core.iteration import draft_specs


class SsmDrafter(Drafter):
    """Every SSM of the executor (see the module docstring); its trees' keys are the SSMs' indices."""

    name = "ssm"

    def __init__(self, models: Models) -> None:
        self.executor = models.executor

    async def propose(self, step: DraftStep) -> Proposal:
        jobs = {i: specs for i in range(step.num_ssms) if (specs := draft_specs(step.batch, i, step.choices))}
        if not jobs:
            return NO_PROPOSAL
        round_ = await self.executor.draft(jobs)
        seconds = predicted = 0.0
        for ssm, tokens, secs in round_.passes:
            seconds += secs
            if step.learning is not None:
                predicted += step.learning.costs.draft_seconds(ssm, tokens)  # before this pass teaches it
                step.learning.observe_draft(ssm, tokens, secs)
        trees: dict[str, list[tuple[DrafterKey, DraftTree]]] = {}
        for ssm in sorted(round_.trees):
            for rid, tree in round_.trees[ssm].items():
                trees.setdefault(rid, []).append((ssm, tree))
        return Proposal(trees, seconds, predicted)
