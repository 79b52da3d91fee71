"""Adaptive speculation (``speculation: auto``): the state both drivers keep between iterations.

:class:`AdaptiveSpeculation` owns the cost model (:mod:`specinfer.core.costs`), one acceptance
model per SSM and per request (:mod:`specinfer.core.acceptance`), an edge calibration per drafter
(:mod:`specinfer.core.drafter`: an SSM by its index, another kind by its name) and the previous plan. Each
iteration a driver asks it for a plan (:meth:`AdaptiveSpeculation.plan`, which calls the pure
:func:`~specinfer.core.planner.plan_batch`), drafts the dynamic trees the plan names, lets it cut
the greedy requests' trees to the nodes worth verifying (:meth:`AdaptiveSpeculation.select`, which
calls :func:`~specinfer.core.planner.select_nodes`), verifies, and hands back what happened
(:meth:`observe_step`, :meth:`observe_verify`, :meth:`observe_draft`). No I/O; the drivers time
their own calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specinfer.core.acceptance import (
    DEFAULT_SLOT_PRIOR,
    MAX_POSITIONS,
    MAX_SLOTS,
    EdgeCalibration,
    NodeValues,
    SlotAcceptance,
    node_values,
    step_outcomes,
)
from specinfer.core.costs import NO_TOKENS, StepCosts, VerifyShape
from specinfer.core.drafter import DrafterKey
from specinfer.core.drafts import DraftTree
from specinfer.core.dynamic_trees import TreeBudget, tree_values
from specinfer.core.merge import merge_with_maps
from specinfer.core.planner import (
    BatchPlan,
    DraftedNodes,
    PlanInput,
    PlannerConfig,
    RequestPlan,
    plan_batch,
    select_nodes,
)


@dataclass(frozen=True)
class Choice:
    """What one request drafts this iteration: SSM ``ssm`` grows a dynamic tree within ``budget``."""

    ssm: int
    budget: TreeBudget
    predicted_accepted: float


@dataclass
class Totals:
    """Counters since start, for metrics and tests: steps planned to speculate, predicted and realised
    accepted tokens of those steps, drafted nodes, nodes cut before verification (:meth:`AdaptiveSpeculation.select`),
    accepted tokens by depth (per-position acceptance), and per drafter."""

    speculative_steps: int = 0
    predicted_accepted: float = 0.0
    accepted: int = 0
    drafted: int = 0
    cut: int = 0
    position_accepted: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITIONS))
    # per drafter key (an SSM's index or a drafter's name): draft tokens verified, accepted tokens that were on
    # its tree, verify steps it proposed in (its tokens per step there: 1 + accepted / steps)
    drafter_proposed: dict[DrafterKey, int] = field(default_factory=dict)
    drafter_accepted: dict[DrafterKey, int] = field(default_factory=dict)
    drafter_steps: dict[DrafterKey, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Drafted:
    """A request whose drafted trees may be cut before verification: committed length ``context_len`` and
    its trees by drafter key (:data:`~specinfer.core.drafter.DrafterKey`), which verification merges."""

    request_id: str
    context_len: int
    drafts: tuple[tuple[DrafterKey, DraftTree], ...]


@dataclass(frozen=True)
class Context:
    """What the planner needs of one request in the batch (the drivers' request objects differ)."""

    request_id: str
    context_len: int  # committed tokens
    remaining: int  # tokens it may still generate
    ssms: tuple[int, ...]  # the SSMs it allows


KEPT_SHARE_RATE = 0.1  # weight of one cut in an SSM's kept-share average
KEPT_SHARE_RECOVERY = 0.02  # per iteration an SSM drafts nothing, its kept share moves this much back toward 1
KEPT_SHARE_FLOOR = 0.02


class AdaptiveSpeculation:
    """See the module docstring. ``slot_priors[s]``: SSM s's prior slot acceptance (e.g. from its tuning).

    *Kept share* (``kept_share[s]``): a moving average, per SSM, of the share of its drafted trees'
    predicted value that :meth:`select` kept for verification. The plan works from average
    acceptances and a cost model; the cut works from the nodes really drafted. Where the cut keeps
    dropping what the plan asked for (on a CPU at batch 4, say, where extra verify tokens cost more
    than unsure nodes return), the planner's node values are scaled by the kept share, which falls
    until the planner stops drafting at all, so the batch stops paying for SSM passes and plans
    whose nodes are all cut. An SSM that drafts nothing recovers toward 1 by
    :data:`KEPT_SHARE_RECOVERY` per iteration, so it is tried again now and then (the load or the
    text may have changed). Where the cut keeps what was drafted (batch 1), the share stays near 1
    and the plans are unchanged.
    """

    def __init__(self, costs: StepCosts, config: PlannerConfig, slot_priors: Mapping[int, Sequence[float]]) -> None:
        self.costs = costs
        self.config = config
        self.ssm_slots = {s: SlotAcceptance(p, prior_weight=32.0, decay=0.999) for s, p in slot_priors.items()}
        # every drafter's trees are scored like an SSM's: their edge curve is learned the same way (another
        # drafter's calibration starts with its first tree: edge())
        self.edges: dict[DrafterKey, EdgeCalibration] = {s: EdgeCalibration() for s in slot_priors}
        self._requests: dict[tuple[str, int], SlotAcceptance] = {}
        self._predicted: dict[str, float] = {}
        self.kept_share = {s: 1.0 for s in slot_priors}
        self.previous: BatchPlan | None = None
        self.totals = Totals()
        self._plans = 0
        self._step_costs = costs  # what this iteration plans and cuts with (optimistic on exploring ones)

    def _slots(self, request_id: str, ssm: int) -> SlotAcceptance:
        key = (request_id, ssm)
        if key not in self._requests:
            prior = self.ssm_slots[ssm].rates() if ssm in self.ssm_slots else DEFAULT_SLOT_PRIOR
            self._requests[key] = SlotAcceptance(prior, prior_weight=6.0, decay=0.9)
        return self._requests[key]

    def plan(
        self, batch: Sequence[Context], fixed: VerifyShape = NO_TOKENS, prompts: VerifyShape = NO_TOKENS
    ) -> dict[str, Choice]:
        """This iteration's choices by request ID (a request left out verifies its root alone); ``fixed`` and
        ``prompts`` as :func:`~specinfer.core.planner.plan_batch` takes them."""
        cfg = self.config
        inputs = []
        for c in batch:
            options = {}
            for s in c.ssms:
                if s in self.ssm_slots:
                    v = node_values(self._slots(c.request_id, s).rates(), cfg.max_nodes - 1, cfg.max_depth)
                    options[s] = NodeValues(v.values * self.kept_share[s], v.depths, v.parents)
            inputs.append(PlanInput(c.request_id, c.context_len, c.remaining, options))
        previous = self.previous.extra_nodes if self.previous is not None else None
        self._plans += 1
        explore = cfg.explore_costs > 0 and self._plans % cfg.explore_costs == 0
        self._step_costs = self.costs.optimistic() if explore else self.costs
        plan = plan_batch(inputs, self._step_costs, cfg, fixed, None if explore else previous, prompts)
        self.previous = plan
        remaining = {c.request_id: c.remaining for c in batch}
        curves = self._edge_curves()
        choices = {}
        for rid, rp in plan.requests.items():
            if rp.ssm is None:
                self._predicted.pop(rid, None)
                continue
            self.totals.speculative_steps += 1
            self._predicted[rid] = rp.predicted_accepted
            choices[rid] = Choice(
                rp.ssm, self._budget(rp, plan.min_value, remaining[rid], curves[rp.ssm]), rp.predicted_accepted
            )
        drafting = {c.ssm for c in choices.values()}
        for s, share in self.kept_share.items():
            if s not in drafting:
                self.kept_share[s] = share + KEPT_SHARE_RECOVERY * (1.0 - share)
        return choices

    def _edge_curves(self) -> dict[DrafterKey, tuple[float, ...]]:
        """Each drafter's edge curve, fitted once per call of :meth:`plan` or :meth:`select`, not per request."""
        return {s: edges.knot_values() for s, edges in self.edges.items()}

    def edge(self, drafter: DrafterKey) -> EdgeCalibration:
        """The edge calibration of ``drafter``'s trees (a new one, uncalibrated, for a drafter not seen yet)."""
        if drafter not in self.edges:
            self.edges[drafter] = EdgeCalibration()
        return self.edges[drafter]

    def _budget(self, rp: RequestPlan, min_value: float, remaining: int, edge_curve: tuple[float, ...]) -> TreeBudget:
        # one depth of slack: a confident step may grow a chain deeper than the average plan, but
        # never past the request's token budget (the bonus token comes on top of the tree)
        depth = min(self.config.max_depth, rp.depth + 1, remaining - 1)
        return TreeBudget(rp.nodes, max(1, depth), min(MAX_SLOTS, rp.nodes - 1), min_value, edge_curve)

    def outdrafts_ssms(self, drafter: DrafterKey, min_steps: int = 8) -> bool:
        """Whether ``drafter``'s trees have had as many tokens accepted per step as every SSM's (each measured
        over at least ``min_steps`` steps; an SSM not yet measured keeps drafting, so it is)."""
        t = self.totals

        def per_step(key: DrafterKey) -> float | None:
            steps = t.drafter_steps.get(key, 0)
            return t.drafter_accepted.get(key, 0) / steps if steps >= min_steps else None

        mine = per_step(drafter)
        ssms = [per_step(s) for s in self.ssm_slots]
        return mine is not None and all(v is not None and mine >= v for v in ssms)

    def select(
        self,
        drafted: Sequence[Drafted],
        fixed: VerifyShape = NO_TOKENS,
        fixed_committed: float = 0.0,
        spent_seconds: float = 0.0,
        prompts: VerifyShape = NO_TOKENS,
    ) -> dict[str, list[tuple[DrafterKey, DraftTree]]]:
        """Each request's trees cut to the nodes worth verifying (:func:`~specinfer.core.planner.select_nodes`,
        whose arguments these are), by request ID, as (drafter, tree) pairs. The cut is made on the trees
        merged: a node's predicted acceptance is its value under its drafter's edge acceptance
        (:func:`~specinfer.core.dynamic_trees.tree_values`), the likelier one where two drafters proposed it; each
        drafter's tree then keeps its nodes the cut kept. Only for greedy and coupled requests (see
        :meth:`DraftTree.subtree`)."""
        for d in drafted:
            for s, _ in d.drafts:
                self.edge(s)
        curves = self._edge_curves()
        nodes, sources = [], []
        for d in drafted:
            merged, maps = merge_with_maps([t.tree for _, t in d.drafts])
            values = np.zeros(len(merged))
            own = [
                np.array(tree_values(t.tree.parents, t.scores, curves.get(s, ())), dtype=np.float64)
                for s, t in d.drafts
            ]
            for m, v in zip(maps, own, strict=True):
                np.maximum.at(values, m, v)
            nodes.append(
                DraftedNodes(d.request_id, d.context_len, values[1:], np.asarray(merged.parents[1:], dtype=np.int64))
            )
            sources.append((maps, own))
        keep = select_nodes(nodes, self._step_costs, fixed, fixed_committed, spent_seconds, prompts)
        out = {}
        drafted_value: dict[DrafterKey, float] = {}
        kept_value: dict[DrafterKey, float] = {}
        for d, n, (maps, own) in zip(drafted, nodes, sources, strict=True):
            kept = set(keep[d.request_id])
            self.totals.cut += len(n.values) + 1 - len(kept)
            pairs = []
            for (drafter, tree), m, v in zip(d.drafts, maps, own, strict=True):
                mine = [i for i in range(len(tree.tree)) if m[i] in kept]
                pairs.append((drafter, tree if len(mine) == len(tree.tree) else tree.subtree(mine)))
                drafted_value[drafter] = drafted_value.get(drafter, 0.0) + float(v[1:].sum())
                kept_value[drafter] = kept_value.get(drafter, 0.0) + float(v[mine[1:]].sum())
            out[d.request_id] = pairs
            if d.request_id in self._predicted:  # the prediction is now that of the nodes kept
                self._predicted[d.request_id] = float(sum(n.values[k - 1] for k in kept if k > 0))
        for drafter, total in drafted_value.items():
            if drafter in self.kept_share and total > 0.0:
                share = self.kept_share[drafter] + KEPT_SHARE_RATE * (
                    kept_value[drafter] / total - self.kept_share[drafter]
                )
                self.kept_share[drafter] = max(KEPT_SHARE_FLOOR, share)
        return out

    def observe_step(
        self, request_id: str, drafts: Mapping[DrafterKey, DraftTree], accepted_tokens: Sequence[int]
    ) -> None:
        """One verify step of a request: each drafter's tree (by drafter key) and the tokens accepted."""
        predicted = self._predicted.pop(request_id, None)
        if predicted is not None:
            self.totals.predicted_accepted += predicted
            self.totals.accepted += len(accepted_tokens)
        for drafter, draft in drafts.items():
            outcome = step_outcomes(draft, accepted_tokens)
            t = self.totals
            t.drafted += len(draft.tree) - 1
            t.position_accepted += outcome.depth_hits
            t.drafter_proposed[drafter] = t.drafter_proposed.get(drafter, 0) + len(draft.tree) - 1
            t.drafter_accepted[drafter] = t.drafter_accepted.get(drafter, 0) + int(outcome.depth_hits.sum())
            t.drafter_steps[drafter] = t.drafter_steps.get(drafter, 0) + 1
            self.edge(drafter).observe(outcome)
            if drafter in self.ssm_slots:
                self.ssm_slots[drafter].observe(outcome)
                self._slots(request_id, drafter).observe(outcome)

    def observe_verify(self, shape: VerifyShape, seconds: float) -> None:
        """One verify call's time (:func:`~specinfer.core.call_shapes.call_shape`)."""
        self.costs.observe_verify(shape, seconds)

    def observe_draft(self, ssm: int, frontier_tokens: int, seconds: float) -> None:
        self.costs.observe_draft(ssm, frontier_tokens, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """Seconds of one iteration outside the model calls (planning, verification maths, bookkeeping)."""
        self.costs.observe_overhead(seconds)

    def forget(self, request_id: str) -> None:
        self._predicted.pop(request_id, None)
        for key in [k for k in self._requests if k[0] == request_id]:
            del self._requests[key]
