"""Draft-head trees (:mod:`specinfer.models.head_drafter`): the verifier drafts a request's next tree as it verifies.

A step whose head gate (:mod:`specinfer.core.head_gate`) says so asks the verifier, for each adaptive request
that allows the head, for the next step's tree from the bonus token (:class:`~specinfer.core.iteration.HeadDraft`);
the next step proposes it, merged with the other drafts and cut the same way, if the request's committed tokens
end where it was drafted (a stop string may have cut them). Once the head's trees have had as many tokens
accepted per step as every SSM's, a request with its head tree at hand drafts no SSM tree (its tree is drafted
already; SSM passes are not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from specinfer.core.acceptance import MAX_SLOTS
from specinfer.core.adaptive import AdaptiveSpeculation, Context
from specinfer.core.drafter import NO_PROPOSAL, Drafter, DrafterKey, Drafts, DraftStep, Models, Proposal
from specinfer.core.drafts import DraftTree
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.head_gate import HeadGate
from specinfer.core.iteration import HeadDraft, Running, StepOutcome, VerifySpec
from specinfer.core.planner import PlannerConfig

if TYPE_CHECKING:  # the engine core imports the drafters
    from specinfer.core.engine_core import Verdict


class VerifierHeadDrafter(Drafter):
    """The verifier's draft head as a drafter (see the module docstring). ``gate``: when steps ask the head for
    next trees; None until a step could ask it."""

    name = "head"

    def __init__(self, models: Models) -> None:
        self.enabled = models.head  # the verifier has a draft head
        # a request's head tree for its next step, with the committed length it was drafted for
        self._trees: dict[str, tuple[int, DraftTree]] = {}
        # a request's head tree as the last cut before verification kept it: (nodes, depth), which sizes
        # the next one (a head draft costs a pass per depth over its frontier, verified or not)
        self._kept: dict[str, tuple[int, int]] = {}
        self.gate: HeadGate | None = None  # built with the adaptive state (its config is the planner's)
        self._step_gate: HeadGate | None = None  # the gate this step asked, and its answer
        self._asked = False

    def narrow(
        self, batch: Sequence[Running], contexts: Sequence[Context], adaptive: AdaptiveSpeculation
    ) -> Sequence[Context]:
        if self._trees and adaptive.outdrafts_ssms(self.name):
            # a request with its head tree at hand drafts no SSM tree this step: the head's proposals have been
            # accepted at least as well as any SSM's, and its tree is drafted already (SSM passes are not)
            ready = {r.request_id for r in batch if self._tree_for(r) is not None}
            return [replace(c, ssms=()) if c.request_id in ready else c for c in contexts]
        return contexts

    async def propose(self, step: DraftStep) -> Proposal:
        """Each request's head tree for this step (:meth:`_tree_for`); the stored trees go either way."""
        if step.adaptive is None:
            return NO_PROPOSAL
        trees: dict[str, list[tuple[DrafterKey, DraftTree]]] = {}
        for r in step.batch:
            tree = self._tree_for(r)
            self._trees.pop(r.request_id, None)
            if tree is not None:
                trees[r.request_id] = [(self.name, tree)]
        return Proposal(trees)

    def verifying(
        self,
        batch: Sequence[Running],
        drafted: Drafts,
        jobs: Sequence[VerifySpec],
        adaptive: AdaptiveSpeculation | None,
    ) -> Sequence[VerifySpec]:
        for rid, pairs in drafted.items():
            for drafter, tree in pairs:
                if drafter == self.name:
                    self._kept[rid] = (len(tree.tree), int(tree.tree.depths.max()))
        self._step_gate = self._gate(batch, adaptive)
        self._asked = self._step_gate is not None and self._step_gate.decide(len(batch))
        if not self._asked:  # no trees this step, but the head keeps up with what it commits
            return [self._keep_up(r, job) for r, job in zip(batch, jobs, strict=True)] if self.enabled else jobs
        assert adaptive is not None  # a gate is only built for an adaptive step
        return [self._ask(r, job, adaptive) for r, job in zip(batch, jobs, strict=True)]

    def observe(self, r: Running, job: VerifySpec, verdict: Verdict, outcome: StepOutcome) -> None:
        if verdict.next_tree is not None and outcome.finish_reason is None:
            # valid while the request's committed tokens end where the head drafted from
            committed = len(job.context_tokens) + 1 + len(verdict.accepted_tokens) + 1
            self._trees[r.request_id] = (committed, verdict.next_tree)

    def stepped(self, batch_size: int, committed_tokens: int, seconds: float, measured: bool) -> None:
        if self._step_gate is not None and measured:
            self._step_gate.observe(batch_size, self._asked, committed_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._trees.pop(request_id, None)
        self._kept.pop(request_id, None)

    def _tree_for(self, r: Running) -> DraftTree | None:
        """The head tree the request's last verification drafted for this step, if its committed tokens are
        those it was drafted after (a stop string may have cut them)."""
        stored = self._trees.get(r.request_id)
        if stored is None:
            return None
        length, tree = stored
        if r.committed_len == length and tree.tree.tokens[0] == r.last_token and len(tree.tree) > 1:
            return tree
        return None

    def _gate(self, batch: Sequence[Running], adaptive: AdaptiveSpeculation | None) -> HeadGate | None:
        """The head gate, where this step may ask the head for next trees: the verifier has one and a
        request of the batch drafts adaptively with it (None: this step has nothing to decide)."""
        if adaptive is None or not self.enabled:
            return None
        if any(_drafts_with_head(r) for r in batch):
            if self.gate is None:
                self.gate = HeadGate(adaptive.config.head_gate)
            return self.gate
        return None

    def _ask(self, r: Running, job: VerifySpec, adaptive: AdaptiveSpeculation) -> VerifySpec:
        """``job``, asking the verifier's head for the next step's tree where the request allows it (where no tree
        fits, the head keeps up)."""
        if not _drafts_with_head(r):
            return job
        curve = adaptive.edge(self.name).knot_values()
        budget = head_budget(adaptive.config, curve, r.remaining, self._kept.get(r.request_id))
        return replace(job, head=HeadDraft(budget, r.request.speculation.draft_support, r.request.constraint))

    @staticmethod
    def _keep_up(r: Running, job: VerifySpec) -> VerifySpec:
        """``job``, asking the head, where the request drafts with it, to take the step's features and draft nothing
        (:class:`~specinfer.core.iteration.HeadDraft` without a budget): steps that do not ask it for trees (its gate
        or the speculation gate measuring without it) would otherwise leave a hole of the newest pairs in its
        context, and after a block of them its trees committed ~1.1 tokens per step where it commits ~1.7 asked
        every step (SmolLM2-135M-Instruct's head, BENCHMARKS.md). No constraint: nothing is drafted to mask."""
        if not _drafts_with_head(r):
            return job
        return replace(job, head=HeadDraft(None, r.request.speculation.draft_support))


def _drafts_with_head(r: Running) -> bool:
    """Whether the request drafts adaptively with the verifier's head (its speculation allows it)."""
    speculation = r.request.speculation
    return speculation is not None and speculation.adaptive and speculation.head


def head_budget(
    limits: PlannerConfig, curve: tuple[float, ...], remaining: int, kept: tuple[int, int] | None = None
) -> TreeBudget | None:
    """The budget of a draft head's next tree for a request with ``remaining`` tokens to go before this step,
    within the planner's ``limits``, valued on the head's edge ``curve``; None when no tree fits. Its depth
    stops short of the tokens left after this step commits at least one. ``kept``: (nodes, depth) of the
    request's last head tree after the cut before verification
    (:meth:`~specinfer.core.adaptive.AdaptiveSpeculation.select`), which sizes the next: twice its nodes and two
    depths more, within the limits (the cut keeps what pays; drafting far more than it keeps costs a head pass
    per depth for nothing, which at large batches outweighs what the head adds). None: the limits."""
    nodes, depth = limits.max_nodes, limits.max_depth
    if kept is not None:
        nodes = min(nodes, max(4, 2 * kept[0] + 2))
        depth = min(depth, max(2, kept[1] + 2))
    depth = min(depth, remaining - 2)
    if depth <= 0 or nodes < 2:
        return None
    return TreeBudget(nodes, depth, min(MAX_SLOTS, nodes - 1), 0.0, curve)
