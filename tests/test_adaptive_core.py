"""Adaptive speculation's pure core: best-first dynamic trees, acceptance models, the cost model, the planner.

No torch: these run where only the pure core is installed (see tests/test_torch_free.py).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core import BestFirstTreeBuilder, DraftGroup, DraftTree, Proposal, SparseDist, TokenTree, TreeBudget
from specinfer.core.acceptance import (
    DEFAULT_SLOT_PRIOR,
    MAX_POSITIONS,
    MAX_SLOTS,
    EdgeCalibration,
    SlotAcceptance,
    StepOutcomes,
    node_values,
    nondecreasing,
    slot_prior_from_agreement,
    step_outcomes,
)
from specinfer.core.adaptive import KEPT_SHARE_FLOOR, AdaptiveSpeculation, Context, Drafted
from specinfer.core.costs import CostTable, StepCosts, VerifyShape
from specinfer.core.drafters.head import head_budget
from specinfer.core.dynamic_trees import EDGE_KNOTS, MIN_SCORE, edge_values, slot_probabilities, tree_values
from specinfer.core.planner import DraftedNodes, PlanInput, PlannerConfig, plan_batch, select_nodes

VOCAB = 8

# -- best-first dynamic trees ------------------------------------------------------------


@st.composite
def budgets(draw) -> TreeBudget:
    nodes = draw(st.integers(2, 20))
    depth = draw(st.integers(1, 6))
    width = draw(st.integers(1, 4))
    min_score = draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2]))
    # an edge curve: none (the identity), or any non-decreasing one, flat stretches included
    steps = draw(
        st.lists(st.sampled_from([0.0, 0.0, 0.05, 0.1, 0.3]), min_size=len(EDGE_KNOTS), max_size=len(EDGE_KNOTS))
    )
    curve = tuple(float(v) for v in np.minimum(1.0, np.cumsum(steps))) if draw(st.booleans()) else ()
    return TreeBudget(nodes, depth, width, min_score, curve)


class Slot:
    """The test's own record of one drafted slot (numbered in draft order, slot 0 the root)."""

    def __init__(self, token: int, parent: int, score: float, depth: int, value: float = 1.0) -> None:
        self.token, self.parent, self.score, self.depth, self.value = token, parent, score, depth, value
        self.children: list[int] = []  # draw order


def _random_proposal(data, width: int, ties: bool) -> Proposal:
    """Up to ``width`` distinct tokens (sometimes fewer: a small support), with slot probabilities
    best first, and a q the builder must hand back untouched."""
    k = data.draw(st.integers(0, width) if data.draw(st.booleans()) else st.just(width))
    tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k, unique=True))
    prob = st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]) if ties else st.floats(0.0, 1.0, allow_nan=False)
    probs = sorted(data.draw(st.lists(prob, min_size=k, max_size=k)), reverse=True)
    extra = data.draw(st.lists(st.floats(0.0, 1.0), max_size=2))  # more slot probs than tokens is allowed
    q = SparseDist(np.array(tokens, dtype=np.int64), np.full(k, 1.0 / max(1, k)))
    return Proposal(tuple(tokens), q, tuple(probs) + tuple(extra))


def _drive(builder: BestFirstTreeBuilder, propose) -> tuple[list[Slot], dict[int, Proposal], list[int], int]:
    """Run ``builder`` to completion like draft_trees does, simulating the SSM's cache: the i-th
    node sent gets index i, and a sent node's parent must name its index there.
    Returns the slots, each expanded slot's proposal, the slots in the order sent, and the rounds."""
    slots = [Slot(builder.tokens_of([0])[0], -1, 1.0, 0)]
    proposals: dict[int, Proposal] = {}
    sent: list[int] = []
    rounds = 0
    while not builder.done:
        frontier = builder.frontier()
        assert frontier, "a builder that is not done has a frontier"
        assert len(set(frontier)) == len(frontier)
        assert all(0 <= s < len(slots) and s not in proposals for s in frontier), (
            "only drafted, unexpanded slots are expanded"
        )
        assert builder.tokens_of(frontier) == [slots[s].token for s in frontier]
        cache_parents = builder.parents_of(frontier)
        for s, p in zip(frontier, cache_parents, strict=True):
            assert p == (-1 if slots[s].parent < 0 else sent.index(slots[s].parent)), (
                "parents are numbered by the order nodes were sent"
            )
        sent.extend(frontier)
        props = [propose(s, slots) for s in frontier]
        builder.expand(props)
        rounds += 1
        for s, prop in zip(frontier, props, strict=True):
            proposals[s] = prop
            for token, p in zip(prop.tokens[: builder.width()], prop.slot_probs, strict=False):
                p = min(1.0, max(0.0, p))
                edge = float(np.interp(p, EDGE_KNOTS, builder.budget.edge_curve)) if builder.budget.edge_curve else p
                slots[s].children.append(len(slots))
                slots.append(Slot(token, s, slots[s].score * p, slots[s].depth + 1, slots[s].value * edge))
    return slots, proposals, sent, rounds


def _tree_slots(draft: DraftTree, slots: list[Slot]) -> list[int]:
    """Each tree node's slot, found by its token path (the tree is a trie of the drafted slots)."""
    out = [0]
    for i in range(1, len(draft.tree)):
        parent_slot = out[draft.tree.parents[i]]
        match = [c for c in slots[parent_slot].children if slots[c].token == draft.tree.tokens[i]]
        assert len(match) == 1, f"tree node {i} is no drafted slot"
        out.append(match[0])
    return out


def _best(slots: list[Slot], budget: TreeBudget) -> set[int]:
    eligible = [
        i
        for i in range(1, len(slots))
        if slots[i].value >= budget.min_score and slots[i].value > 0.0 and slots[i].score >= MIN_SCORE
    ]
    return {0, *sorted(eligible, key=lambda i: (-slots[i].value, i))[: budget.nodes - 1]}


def _check_tree(builder: BestFirstTreeBuilder, slots, proposals, rounds) -> tuple[DraftTree, list[int]]:
    budget = builder.budget
    draft = builder.build()
    tree = draft.tree
    assert all(tree.parents[i] < i for i in range(1, len(tree))), "parents precede children"
    assert len(tree) <= budget.nodes
    assert int(tree.depths.max()) <= budget.depth
    assert rounds <= budget.depth
    mine = _tree_slots(draft, slots)
    assert set(mine) == _best(slots, budget), "the tree is the best nodes-1 slots by (value, draft order)"
    assert len(draft.scores) == len(tree) and draft.scores[0] == 1.0
    values = tree_values(tree.parents, draft.scores, budget.edge_curve)
    for i in range(1, len(tree)):
        assert draft.scores[i] == slots[mine[i]].score
        assert draft.scores[i] <= draft.scores[tree.parents[i]]
        assert np.isclose(values[i], slots[mine[i]].value), "the manager recovers each node's value from the scores"
    covered = []
    for u in range(len(tree)):
        kids = [mine[c] for c in tree.children[u]]
        drafted = slots[mine[u]].children
        assert sorted(kids) == drafted[: len(kids)], "a node's children are a prefix of its slots in draw order"
        groups = draft.groups_at(u)
        if not kids:
            assert not groups
            continue
        assert len(groups) == 1
        group = groups[0]
        assert [mine[c] for c in group.children] == sorted(kids), "group children in draw order"
        assert group.q is proposals[mine[u]].q
        covered.extend(group.children)
    assert sorted(covered) == list(range(1, len(tree)))
    # nothing worth drafting was left out: every tree node above the depth cap was expanded, except
    # the weakest one of a full tree (its children could not outrank it)
    weakest = max((i for i in mine[1:]), key=lambda i: (-slots[i].value, i), default=None)
    for s in mine:
        if slots[s].depth < budget.depth and s not in proposals:
            assert len(tree) == budget.nodes and s == weakest, f"slot {s} in the tree was never expanded"
    return draft, mine


@settings(max_examples=300, deadline=None)
@given(budgets(), st.booleans(), st.data())
def test_best_first_tree_on_random_proposals(budget, ties, data):
    builder = BestFirstTreeBuilder(data.draw(st.integers(0, VOCAB - 1)), budget)
    slots, proposals, sent, rounds = _drive(builder, lambda s, slots: _random_proposal(data, builder.width(), ties))
    assert sent[0] == 0 and len(sent) == len(set(sent)) == len(proposals)
    _check_tree(builder, slots, proposals, rounds)


def _true_dist(prefix: tuple[int, ...], seed: int) -> np.ndarray:
    """A fixed next-token distribution per token path (continuous: no ties)."""
    rng = np.random.default_rng([seed, *prefix, len(prefix)])
    return rng.dirichlet(np.full(VOCAB, 0.3))


def _path(slots: list[Slot], s: int) -> tuple[int, ...]:
    out = []
    while s > 0:
        out.append(slots[s].token)
        s = slots[s].parent
    return tuple(out[::-1])


def _greedy_proposal(seed: int, width: int):
    def propose(s, slots):
        p = _true_dist(_path(slots, s), seed)
        top = np.argsort(-p, kind="stable")[:width]
        return Proposal(tuple(int(t) for t in top), None, tuple(float(p[t]) for t in top))

    return propose


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 16), st.integers(1, 4), st.integers(1, 4), st.integers(0, 10**6))
def test_greedy_best_first_tree_is_the_best_tree_of_path_probabilities(nodes, depth, width, seed):
    """With slot probabilities that are the true probabilities, the tree is exactly the brute-force
    best ``nodes - 1`` sequences of the width-``width`` tree by probability (each node's path
    probability), so it holds the top-1 chain as far as that chain is among them."""
    budget = TreeBudget(nodes, depth, width)
    builder = BestFirstTreeBuilder(0, budget)
    slots, proposals, _, rounds = _drive(builder, _greedy_proposal(seed, budget.width))
    _, mine = _check_tree(builder, slots, proposals, rounds)
    # brute force over every sequence of the width-limited tree up to ``depth``
    everything: dict[tuple[int, ...], float] = {}
    level = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, prob in level.items():
            p = _true_dist(prefix, seed)
            for t in np.argsort(-p, kind="stable")[: budget.width]:
                nxt[prefix + (int(t),)] = prob * float(p[t])
        everything.update(nxt)
        level = nxt
    best = sorted(everything, key=lambda k: -everything[k])[: nodes - 1]
    assert {_path(slots, s) for s in mine[1:]} == set(best)
    for s in mine[1:]:
        assert np.isclose(slots[s].score, everything[_path(slots, s)])
    # the top-1 chain: its first step always, and every step of it that is among the best
    chain, prefix = [], ()
    for _ in range(depth):
        prefix = prefix + (int(np.argmax(_true_dist(prefix, seed))),)
        chain.append(prefix)
    assert chain[0] in set(best)
    in_tree = {_path(slots, s) for s in mine}
    for step in chain:
        assert (step in in_tree) == (step in set(best))


def test_confident_drafts_grow_a_chain_and_unsure_ones_a_bush():
    """Slot probs (0.9, 0.05, ...) everywhere: the 5-node tree is the top chain to depth 4; slot
    probs (0.3, 0.3, 0.3): the first depth's three slots come before any grandchild."""
    chain = BestFirstTreeBuilder(0, TreeBudget(5, 8, 3))
    _drive(chain, lambda s, slots: Proposal((1, 2, 3), None, (0.9, 0.05, 0.05)))
    tree = chain.build().tree
    assert tree.tokens == (0, 1, 1, 1, 1) and tree.parents == (-1, 0, 1, 2, 3)
    bush = BestFirstTreeBuilder(0, TreeBudget(5, 8, 3))
    _drive(bush, lambda s, slots: Proposal((1, 2, 3), None, (0.3, 0.3, 0.3)))
    tree = bush.build().tree
    assert tree.parents == (-1, 0, 0, 0, 1) and tree.tokens == (0, 1, 2, 3, 1)
    floor = BestFirstTreeBuilder(0, TreeBudget(8, 8, 3, min_score=0.5))
    _drive(floor, lambda s, slots: Proposal((1, 2, 3), None, (0.9, 0.05, 0.05)))
    assert floor.build().tree.tokens == (0, 1, 1, 1, 1, 1, 1)  # 0.9 ** 6 = 0.53 >= 0.5 > 0.9 ** 7


def test_tree_budget_checks_itself():
    with pytest.raises(ValueError):
        TreeBudget(1, 1)
    with pytest.raises(ValueError):
        TreeBudget(2, 0)
    with pytest.raises(ValueError):
        TreeBudget(4, 2, min_score=1.5)
    for curve in ((0.5,), tuple(reversed(EDGE_KNOTS)), (1.5,) * len(EDGE_KNOTS)):  # wrong length, falling, above 1
        with pytest.raises(ValueError):
            TreeBudget(4, 2, edge_curve=curve)
    assert TreeBudget(3, 2, 4).width == 2 and TreeBudget(30, 2, 4).width == 4
    builder = BestFirstTreeBuilder(0, TreeBudget(3, 1))
    with pytest.raises(ValueError, match="one proposal per frontier node"):
        builder.expand([])
    with pytest.raises(ValueError, match="distinct"):
        builder.expand([Proposal((1, 1), None, (0.5, 0.4))])
    builder.expand([Proposal((1, 2), None, (0.5, 0.4))])
    assert builder.done
    with pytest.raises(RuntimeError):
        builder.expand([])


# -- cost tables -------------------------------------------------------------------------


def test_cost_table_interpolates_and_extrapolates():
    table = CostTable({1: 1.0, 4: 4.0, 16: 10.0})
    assert table.buckets.tolist() == [1, 2, 3, 4, 6, 8, 12, 16]
    assert table(0) == 0.0
    assert np.isclose(table(2), 2.0) and np.isclose(table(3), 3.0) and np.isclose(table(10), 7.0)
    assert np.isclose(table(32), 10.0 + 16 * 0.5), "past the last bucket: the last segment's slope"
    xs = np.array([0, 1, 2, 3, 5, 10, 16, 20, 40])
    assert np.allclose(table.many(xs), [table(x) for x in xs])
    assert CostTable({5: 2.0}).buckets.tolist() == [1, 2, 3, 4, 6]
    assert CostTable({5: 2.0})(100) == 2.0  # one measurement: flat


def test_cost_table_fit_is_monotone_on_noisy_measurements():
    table = CostTable({1: 1.0, 2: 0.8, 3: 1.2, 4: 1.1, 6: 2.0})
    fit = table.fitted()
    assert np.all(np.diff(fit) >= 0)
    assert np.allclose(fit, [0.9, 0.9, 1.15, 1.15, 2.0])  # pooled adjacent violators
    ys = table.many(np.arange(0, 64))
    assert np.all(np.diff(ys) >= -1e-12)


def test_cost_table_online_updates_move_toward_samples_and_clip_outliers():
    # a raw bucket few real calls measured follows their running mean (the seed counts as one, the first call replaces
    # it), clipped to a tenth and twice the prediction; reads go through the monotone fit, which pools a raised bucket
    # with the larger ones below it, weighted by their samples
    table = CostTable({1: 1.0, 4: 1.0, 16: 1.0})
    table.observe(4, 100.0)  # a stall: clipped to twice the prediction
    assert np.allclose(table.seconds, [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    assert np.isclose(table(4), (2.0 * 2.0 + 4.0) / 6.0)  # bucket 4 (weight 2) pooled with 6, 8, 12, 16
    table.observe(4, 1.0)  # the next calls average the stall out
    assert np.isclose(table.seconds[3], 1.5)
    table = CostTable({1: 1.0, 4: 1.0, 16: 1.0})
    table.observe(4, 0.0)  # faster: clipped to a tenth, taken at once on a bucket no real call measured
    assert np.allclose(table.seconds, [1.0, 1.0, 1.0, 0.1, 1.0, 1.0, 1.0, 1.0])
    table.observe(4, 0.05)  # faster again: the running mean of the calls that measured it
    assert np.isclose(table.seconds[3], 0.075)
    table.observe(4, 0.4)  # slower: clipped to twice the prediction (0.075), weight 1/3 (the seed and 2 calls so far)
    assert np.isclose(table.seconds[3], 0.075 + (0.15 - 0.075) / 3)
    before, predicted = table.seconds[3], table(4)
    table.observe(4, 0.0)  # faster: weight 1/4 (the seed and 3 calls so far), clipped to a tenth of the prediction
    assert np.isclose(table.seconds[3], before + (0.1 * predicted - before) / 4)
    table = CostTable({1: 1.0, 4: 1.0, 16: 2.0, 64: 3.0})
    previous = table(4)
    for _ in range(60):
        table.observe(4, 1.5)
        now = table(4)
        assert previous <= now <= 1.5 + 1e-9
        previous = now
    assert abs(table(4) - 1.5) < 0.03
    assert table(16) >= table(4)  # the monotone fit lifts larger sizes with it
    for bad in (float("nan"), -1.0):
        table.observe(4, bad)
    assert np.isclose(table(4), previous)
    # between buckets: both neighbours move, the nearer one more
    table = CostTable({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    table.observe(7.5, 1.8)
    assert table.seconds[5] - 1.0 > table.seconds[4] - 1.0 > 0.0


def test_cost_table_fit_trusts_observed_buckets_over_stale_neighbours():
    """A bucket real steps keep measuring is not dragged toward a stale, higher seed below it."""
    table = CostTable({1: 0.25, 2: 0.30, 4: 0.30, 8: 0.45})  # the seed says 2 tokens cost as much as 4
    for _ in range(40):
        table.observe(4, 0.24)  # what 4-token steps really take
    assert abs(table(4) - 0.24) < 0.01
    assert table(2) <= table(4) + 1e-12 and table(8) > 0.4  # monotone; the unobserved larger bucket keeps its seed


def test_cost_table_grows_past_its_last_bucket():
    table = CostTable({1: 1.0, 4: 2.0})
    assert table.buckets.tolist() == [1, 2, 3, 4]
    predicted = table(20)
    table.observe(20, predicted * 1.5)
    assert table.buckets.tolist() == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert table(20) > predicted
    assert np.isclose(table.as_dict()[4], 2.0)


def test_step_costs_add_context_work_and_learn_new_ssms():
    costs = StepCosts(CostTable({1: 1.0, 8: 2.0}), per_context=0.01, drafts={0: CostTable({1: 0.1, 4: 0.2})})
    assert np.isclose(costs.verify_seconds(VerifyShape(8, 100)), 3.0)
    assert np.allclose(costs.verify_many(np.array([1, 8]), np.array([0, 100])), [1.0, 3.0])
    assert costs.draft_seconds(0, 0) == 0.0 and np.isclose(costs.draft_seconds(0, 4), 0.2)
    assert costs.draft_seconds(1, 4) == 0.0
    costs.observe_draft(1, 4, 0.3)
    assert np.isclose(costs.draft_seconds(1, 4), 0.3)
    costs.observe_verify(VerifyShape(8, 100), 3.0)  # exactly as predicted: nothing moves
    assert np.isclose(costs.verify_seconds(VerifyShape(8, 100)), 3.0)
    assert set(costs.describe()) >= {"verify_seconds", "draft_seconds"}


# -- acceptance models -------------------------------------------------------------------


@given(st.lists(st.floats(-5, 5), min_size=1, max_size=20), st.data())
def test_nondecreasing_is_a_monotone_weighted_fit(values, data):
    weights = data.draw(st.lists(st.floats(0.1, 10), min_size=len(values), max_size=len(values)))
    fit = nondecreasing(values, weights)
    assert len(fit) == len(values)
    assert np.all(np.diff(fit) >= -1e-9)
    assert np.isclose(
        np.dot(fit, weights), np.dot(values, weights), rtol=1e-6, atol=1e-6
    )  # PAV keeps the weighted mean
    if all(a <= b for a, b in itertools.pairwise(values)):
        assert np.allclose(fit, values)


def test_slot_prior_from_agreement():
    assert np.allclose(slot_prior_from_agreement({1: 0.5, 2: 0.7, 3: 0.8, 4: 0.85, 5: 0.9}), (0.5, 0.2, 0.1, 0.05))
    assert slot_prior_from_agreement({}) == DEFAULT_SLOT_PRIOR
    assert slot_prior_from_agreement({2: 0.6, 1: 0.6}) == (0.6, 0.0)
    prior = slot_prior_from_agreement({1: 0.6, 2: 0.75, 3: 0.8})
    slots = SlotAcceptance(prior)
    assert np.allclose(slots.rates()[:3], prior) and slots.rates()[3] == 0.0  # no data: the prior


def _slot_outcome(rng: np.random.Generator, hit_rates) -> StepOutcomes:
    tries, hits = np.zeros(MAX_SLOTS), np.zeros(MAX_SLOTS)
    for k, h in enumerate(hit_rates):
        tries[k] += 1
        if rng.random() < h:
            hits[k] += 1
            break
    return StepOutcomes(tries, hits, np.zeros(0), np.zeros(0, dtype=bool), np.zeros(MAX_POSITIONS))


def test_slot_acceptance_converges_to_the_truth():
    truth = np.array([0.6, 0.3, 0.2, 0.1])
    slots = SlotAcceptance((0.1, 0.1, 0.1, 0.1), prior_weight=8.0, decay=0.999)
    rng = np.random.default_rng(0)
    for _ in range(20000):
        slots.observe(_slot_outcome(rng, truth))
    assert np.allclose(slots.hit_rates(), truth, atol=0.04)
    c = truth * np.concatenate(([1.0], np.cumprod(1 - truth)[:-1]))
    assert np.allclose(slots.rates(), c, atol=0.03)
    # the workload changes: decaying counts follow it
    for _ in range(5000):
        slots.observe(_slot_outcome(rng, [0.9, 0.5, 0.5, 0.5]))
    assert abs(slots.hit_rates()[0] - 0.9) < 0.04


def _edges(probs, hits):
    return StepOutcomes(
        np.zeros(MAX_SLOTS),
        np.zeros(MAX_SLOTS),
        np.asarray(probs, dtype=np.float64),
        np.asarray(hits, dtype=bool),
        np.zeros(MAX_POSITIONS),
    )


def test_edge_calibration_converges_to_the_truth_and_stays_monotone():
    cal = EdgeCalibration(decay=1.0)
    rng = np.random.default_rng(1)
    for _ in range(400):
        p = rng.random(50)
        cal.observe(_edges(p, rng.random(50) < np.sqrt(p)))  # the SSM is underconfident
    curve = cal.curve()
    assert np.all(np.diff(curve) >= 0) and len(cal.knot_values()) == len(EDGE_KNOTS)
    # counted toward the two knots around each probability: a knot averages sqrt over its two
    # neighbouring intervals (exact but for the curvature near 0)
    assert np.allclose(curve[2:], np.sqrt(cal.knots[2:]), atol=0.04)
    assert abs(float(np.interp(0.5, EDGE_KNOTS, curve)) - np.sqrt(0.5)) < 0.04
    # the workload changes: a decaying calibration follows
    moving = EdgeCalibration(decay=0.99)
    for _ in range(300):
        p = rng.random(50)
        moving.observe(_edges(p, rng.random(50) < p))
    for _ in range(300):
        p = rng.random(50)
        moving.observe(_edges(p, rng.random(50) < p**2))  # now overconfident
    assert abs(float(np.interp(0.5, EDGE_KNOTS, moving.curve())) - 0.25) < 0.05
    # the knot values the planner reads are the curve as of the last observation, refitted after each
    before = moving.knot_values()
    assert before == tuple(moving.curve()) and moving.knot_values() is before
    moving.observe(_edges(np.full(50, 0.5), np.ones(50, dtype=bool)))
    assert moving.knot_values() == tuple(moving.curve()) and moving.knot_values() != before
    fresh = EdgeCalibration()
    assert np.allclose(fresh.curve(), EDGE_KNOTS)  # the prior: calibrated
    fresh.observe(_edges([], []))
    assert np.allclose(fresh.curve(), EDGE_KNOTS)  # static trees carry no scores


def test_an_underconfident_ssm_grows_the_chain_once_its_edges_are_known():
    """Slot probs (0.5, 0.2, 0.1) everywhere, 6 nodes: by score the tree is a bush (0.25 for the second
    chain node loses to the 0.2 sibling, and so on); with the edge curve saying 0.5 is worth 0.9
    (and 0.2 worth 0.3), it is the chain of 5."""
    propose = lambda s, slots: Proposal((1, 2, 3), None, (0.5, 0.2, 0.1))  # noqa: E731
    bush = BestFirstTreeBuilder(0, TreeBudget(6, 8, 3))
    _drive(bush, propose)
    assert max(bush.build().tree.depths) < 5
    curve = tuple(float(v) for v in np.interp(EDGE_KNOTS, [0.0, 0.2, 0.5, 1.0], [0.0, 0.3, 0.9, 1.0]))
    chain = BestFirstTreeBuilder(0, TreeBudget(6, 8, 3, edge_curve=curve))
    _drive(chain, propose)
    tree = chain.build()
    assert tree.tree.parents == (-1, 0, 1, 2, 3, 4) and tree.scores[-1] == pytest.approx(0.5**5)


def _brute_force_values(rates, max_depth):
    out = []
    for depth in range(1, max_depth + 1):
        for slots in itertools.product(range(len(rates)), repeat=depth):
            out.append(float(np.prod([rates[k] for k in slots])))
    return sorted(out, reverse=True)


@settings(max_examples=200)
@given(st.lists(st.floats(0.01, 0.99), min_size=1, max_size=4), st.integers(1, 30), st.integers(1, 4))
def test_node_values_are_the_best_first_product_tree(rates, max_nodes, max_depth):
    rates = sorted(rates, reverse=True)
    nv = node_values(rates, max_nodes, max_depth)
    expected = _brute_force_values(rates, max_depth)[:max_nodes]
    assert np.allclose(nv.values, expected)
    assert np.all(np.diff(nv.values) <= 1e-15), "best first"
    for i, (d, p) in enumerate(zip(nv.depths, nv.parents, strict=True)):
        assert p < i
        assert d == (1 if p < 0 else nv.depths[p] + 1) and d <= max_depth
    # each node's children are its first slots: values parent * rates[0], parent * rates[1], ...
    for parent in range(-1, len(nv.values)):
        kids = sorted((nv.values[i] for i in range(len(nv.values)) if nv.parents[i] == parent), reverse=True)
        base = 1.0 if parent < 0 else nv.values[parent]
        assert np.allclose(kids, [base * r for r in rates[: len(kids)]])


def test_node_values_edge_cases():
    assert len(node_values([0.0, 0.0], 5, 3).values) == 0
    assert node_values([0.5, 0.0, 0.2], 2, 1).values.tolist() == [0.5, 0.2]  # zero slots are skipped
    assert len(node_values([0.5], 5, 0).values) == 0
    nv = node_values([0.5], 10, 3)
    assert nv.values.tolist() == [0.5, 0.25, 0.125] and nv.parents.tolist() == [-1, 0, 1]


def _hand_tree(scored: bool = True) -> DraftTree:
    # root 10; children 20, 21, 22 (draw order); node 1 (20) has children 30, 31
    tree = TokenTree((10, 20, 21, 22, 30, 31), (-1, 0, 0, 0, 1, 1))
    groups = (DraftGroup(0, (1, 2, 3), None), DraftGroup(1, (4, 5), None))
    scores = (1.0, 0.5, 0.3, 0.1, 0.25, 0.1) if scored else ()
    return DraftTree(tree, groups, scores)


def test_step_outcomes_on_hand_built_trees():
    # slot probabilities of the hand tree: 0.5, 0.3, 0.1 under the root, 0.5 and 0.2 under node 1
    assert np.allclose(
        slot_probabilities(_hand_tree().tree.parents, _hand_tree().scores), [1.0, 0.5, 0.3, 0.1, 0.5, 0.2]
    )
    out = step_outcomes(_hand_tree(), [21])  # the second child of the root
    assert out.slot_tries.tolist() == [1, 1, 0, 0] and out.slot_hits.tolist() == [0, 1, 0, 0]
    assert out.depth_hits.tolist() == [1] + [0] * (MAX_POSITIONS - 1)
    # the edges tried: the root's children (node 21 has none)
    assert np.allclose(out.edge_probs, [0.5, 0.3, 0.1]) and out.edge_hits.tolist() == [False, True, False]

    out = step_outcomes(_hand_tree(), [20, 31, 99])  # 99 came from another SSM's tree
    assert out.slot_tries.tolist() == [2, 1, 0, 0] and out.slot_hits.tolist() == [1, 1, 0, 0]
    assert out.depth_hits[:3].tolist() == [1, 1, 0]
    assert np.allclose(out.edge_probs, [0.5, 0.3, 0.1, 0.5, 0.2]) and out.edge_hits.tolist() == [
        True,
        False,
        False,
        False,
        True,
    ]

    out = step_outcomes(_hand_tree(), [])  # everything rejected at the root: node 1's children were never tried
    assert out.slot_tries.tolist() == [1, 1, 1, 0] and out.slot_hits.sum() == 0 and out.depth_hits.sum() == 0
    assert np.allclose(out.edge_probs, [0.5, 0.3, 0.1]) and not out.edge_hits.any()

    out = step_outcomes(_hand_tree(scored=False), [20, 30])
    assert out.edge_probs.size == 0 and out.edge_hits.size == 0
    assert out.slot_tries.tolist() == [2, 0, 0, 0] and out.slot_hits.tolist() == [2, 0, 0, 0]


def test_tree_values_are_edge_products():
    tree = _hand_tree()
    assert np.allclose(
        tree_values(tree.tree.parents, tree.scores, ()), tree.scores
    )  # the identity curve: values are scores
    curve = tuple(float(np.sqrt(k)) for k in EDGE_KNOTS)  # an underconfident SSM
    values = tree_values(tree.tree.parents, tree.scores, curve)
    e = edge_values([0.5, 0.3, 0.1, 0.5, 0.2], curve)
    assert np.allclose(values, [1.0, e[0], e[1], e[2], e[0] * e[3], e[0] * e[4]])
    assert tree_values((-1, 0, 1), (1.0, 0.0, 0.0), curve)[2] == 0.0  # under a parent that scored 0


# -- the planner -------------------------------------------------------------------------


def _costs(
    per_token: float, base: float = 1.0, draft: float = 0.0, draft_per_token: float = 0.0, per_context: float = 0.0
) -> StepCosts:
    verify = CostTable({b: base + per_token * (b - 1) for b in (1, 2, 4, 8, 16, 32, 64, 128)})
    drafts = {0: CostTable({b: draft + draft_per_token * b for b in (1, 2, 4, 8, 16, 32, 64, 128)})}
    return StepCosts(verify, per_context, drafts)


DEFAULT_PLANNER = PlannerConfig()


def _input(
    rid: str,
    rates=(0.8, 0.1, 0.05, 0.02),
    remaining: int = 100,
    context: int = 10,
    config: PlannerConfig = DEFAULT_PLANNER,
) -> PlanInput:
    return PlanInput(rid, context, remaining, {0: node_values(rates, config.max_nodes - 1, config.max_depth)})


def test_planner_does_not_speculate_where_it_cannot_pay():
    costs = _costs(per_token=1.0, draft=0.1)  # every extra verify token costs a whole step
    plan = plan_batch([_input(f"r{i}") for i in range(3)], costs, PlannerConfig())
    assert plan.extra_nodes == 0
    assert all(p.nodes == 1 and p.ssm is None and p.depth == 0 for p in plan.requests.values())
    assert np.isclose(plan.predicted_seconds, costs.verify_seconds(VerifyShape(3, 30)))
    assert 0.0 <= plan.min_value <= 1.0


def test_planner_speculates_where_tokens_are_almost_free():
    costs = _costs(per_token=0.001, draft=0.01, draft_per_token=0.0001)
    plan = plan_batch([_input("a", rates=(0.9, 0.05, 0.02, 0.01))], costs, PlannerConfig())
    p = plan.requests["a"]
    assert p.ssm == 0 and p.nodes >= 8 and p.depth >= 4
    assert p.predicted_accepted > 2.0
    assert plan.predicted_tokens_per_second > 1.0 / costs.verify_seconds(VerifyShape(1, 10))
    unsure = plan_batch([_input("a", rates=(0.3, 0.25, 0.2, 0.15))], costs, PlannerConfig()).requests["a"]
    assert unsure.ssm == 0 and unsure.depth < p.depth, "low acceptance: a bushier, shallower tree"


@settings(max_examples=60, deadline=None)
@given(st.floats(0.001, 0.2), st.floats(0.0, 0.02), st.floats(0.3, 0.95), st.integers(2, 16))
def test_larger_batches_never_get_larger_budgets(per_token, draft_per_token, top, batch):
    costs = _costs(per_token=per_token, draft_per_token=draft_per_token)
    rates = (top, (1 - top) * 0.5, (1 - top) * 0.2, (1 - top) * 0.1)
    alone = plan_batch([_input("r0", rates)], costs, PlannerConfig()).requests["r0"].nodes
    plans = plan_batch([_input(f"r{i}", rates) for i in range(batch)], costs, PlannerConfig()).requests
    assert max(p.nodes for p in plans.values()) <= alone


def test_planner_prices_nodes_on_top_of_the_prompts_the_call_computes():
    """A prompt's rows are computed whatever the plan: with a linear cost they change nothing (the plan beside them
    is the plan without); where rows cost more past 32 tokens (flat to 32, as the weights stream, then 50 ms a row),
    a batch of 8 speculates alone but not beside a 48-token prompt, whose rows already take the call past the
    bend, and the plan's predicted seconds leave the prompt out (its cost without speculation)."""
    inputs = [_input(f"r{i}", rates=(0.7, 0.1, 0.05, 0.02)) for i in range(8)]
    prompt = VerifyShape(48, 48 * 47 // 2)
    linear = _costs(per_token=0.002, draft=0.002)
    alone, beside = (
        plan_batch(inputs, linear, PlannerConfig()),
        plan_batch(inputs, linear, PlannerConfig(), prompts=prompt),
    )
    assert alone.requests == beside.requests and np.isclose(alone.predicted_seconds, beside.predicted_seconds)
    bend = StepCosts(CostTable({1: 0.1, 32: 0.1, 64: 1.7, 128: 4.9}), 0.0, {0: CostTable({1: 0.002, 64: 0.002})})
    assert plan_batch(inputs, bend, PlannerConfig()).extra_nodes > 0
    beside = plan_batch(inputs, bend, PlannerConfig(), prompts=prompt)
    assert beside.extra_nodes == 0
    assert np.isclose(beside.predicted_seconds, bend.verify_seconds(VerifyShape(8, 80)) + bend.overhead)


def test_planner_respects_remaining_tokens_and_caps():
    costs = _costs(per_token=0.0001, draft=0.001)
    config = PlannerConfig(max_nodes=6, max_depth=8)
    plans = plan_batch([_input(f"r{n}", remaining=n, config=config) for n in (1, 2, 3, 50)], costs, config).requests
    assert plans["r1"].nodes == 1 and plans["r1"].ssm is None  # the bonus token is the last one it may generate
    for n in (2, 3, 50):
        assert 1 < plans[f"r{n}"].nodes <= config.max_nodes
        assert plans[f"r{n}"].depth <= min(n - 1, config.max_depth)
    assert plans["r2"].depth == 1
    # a depth cap keeps every shallow node, also the siblings ranked after a deeper one (0.5 > 0.25 > 0.1)
    sibling_rates = (0.5, 0.2, 0.1, 0.05)
    plans = plan_batch(
        [_input("r2", sibling_rates, remaining=2), _input("rd", sibling_rates, config=PlannerConfig(max_depth=1))],
        costs,
        config,
    ).requests
    assert (
        plans["r2"].nodes == 5
        and plans["r2"].depth == 1
        and np.isclose(plans["r2"].predicted_accepted, sum(sibling_rates))
    )
    one_deep = plan_batch([_input("rd", sibling_rates)], costs, PlannerConfig(max_depth=1)).requests["rd"]
    assert one_deep.nodes == 5 and one_deep.depth == 1
    shallow = PlannerConfig(max_nodes=32, max_depth=2)
    plan = plan_batch([_input("a", config=shallow)], costs, shallow).requests["a"]
    assert plan.depth <= 2 and plan.nodes > 3


def test_planner_picks_the_better_ssm_per_request():
    costs = _costs(per_token=0.01, draft=0.01)
    costs.drafts[1] = CostTable({1: 0.01, 64: 0.01})
    good, bad = node_values((0.9, 0.05), 31, 8), node_values((0.2, 0.1), 31, 8)
    plans = plan_batch(
        [PlanInput("a", 10, 100, {0: good, 1: bad}), PlanInput("b", 10, 100, {0: bad, 1: good})], costs, PlannerConfig()
    ).requests
    assert plans["a"].ssm == 0 and plans["b"].ssm == 1
    costs.drafts[1] = CostTable({1: 100.0})  # now SSM 1 is far too slow to pay
    plans = plan_batch([PlanInput("b", 10, 100, {0: bad, 1: good})], costs, PlannerConfig()).requests
    assert plans["b"].ssm in (0, None)


def test_planner_hysteresis_keeps_the_previous_size_within_its_margin():
    costs = _costs(per_token=0.02, draft=0.005)
    inputs = [_input("a"), _input("b", rates=(0.6, 0.2, 0.1, 0.05))]
    best = plan_batch(inputs, costs, PlannerConfig())
    assert best.extra_nodes >= 2
    near = plan_batch(inputs, costs, PlannerConfig(), previous_extra=best.extra_nodes - 1)
    assert near.predicted_tokens_per_second >= (1 - 0.05) * best.predicted_tokens_per_second
    assert near.extra_nodes == best.extra_nodes - 1, "within 5%: keep the previous size"
    strict = plan_batch(inputs, costs, PlannerConfig(hysteresis=0.0), previous_extra=best.extra_nodes - 1)
    assert strict.extra_nodes == best.extra_nodes
    far = plan_batch(inputs, costs, PlannerConfig(), previous_extra=0)  # no speculation is much worse here
    assert far.extra_nodes == best.extra_nodes
    assert plan_batch(inputs, costs, PlannerConfig(), previous_extra=10_000).extra_nodes == best.extra_nodes


@pytest.mark.parametrize("prior", [(0.9, 0.05, 0.02, 0.01), (0.3, 0.25, 0.2, 0.15)])
def test_adaptive_budgets_never_draft_past_the_token_budget(prior):
    """The budget's depth slack (one more than the plan's) stops at remaining - 1: the bonus token
    comes on top, so a deeper draft could never be committed."""
    costs = _costs(per_token=1e-4, draft=1e-4)
    adaptive = AdaptiveSpeculation(costs, PlannerConfig(max_nodes=16, max_depth=6), {0: prior})
    choices = adaptive.plan([Context(f"r{n}", 10, n, (0,)) for n in range(1, 10)])
    assert "r1" not in choices
    for n in range(2, 10):
        budget = choices[f"r{n}"].budget
        assert 1 <= budget.depth <= min(n - 1, 6)
        assert budget.nodes <= 16 and budget.max_width <= MAX_SLOTS
    assert choices["r9"].budget.depth >= 2


def test_kept_share_stops_drafting_that_is_always_cut_and_retries_later():
    """Cuts that drop every drafted node pull the SSM's kept share down until the planner stops
    drafting; iterations without drafting bring it back toward 1, so the SSM is tried again; cuts
    that keep what was drafted leave it at 1."""
    # the plan sees extra tokens as cheap (small trees pay), while the batch's real nodes are cut
    costs = StepCosts(CostTable({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.35}), 0.0, {0: CostTable({1: 0.01})}, frozen=True)
    adaptive = AdaptiveSpeculation(costs, PlannerConfig(max_nodes=8, max_depth=4), {0: (0.8, 0.1)})
    batch = [Context("a", 10, 1000, (0,))]
    unsure = DraftTree(
        TokenTree((5, 6, 7), (-1, 0, 1)), (DraftGroup(0, (1,), None), DraftGroup(1, (2,), None)), (1.0, 0.01, 0.001)
    )
    drafting = []
    for _ in range(200):
        choices = adaptive.plan(batch)
        drafting.append(bool(choices))
        if choices:
            [(_, cut)] = adaptive.select([Drafted("a", 10, ((0, unsure),))])["a"]
            assert len(cut.tree) == 1  # nodes of acceptance 0.01 never pay for a verify token
            adaptive.observe_step("a", {0: cut}, [])
    assert drafting[0] and not all(drafting[:60]), "stopped drafting"
    assert any(drafting[60:]), "and tried again later"
    assert KEPT_SHARE_FLOOR <= adaptive.kept_share[0] < 1.0

    adaptive = AdaptiveSpeculation(costs, PlannerConfig(max_nodes=8, max_depth=4), {0: (0.8, 0.1)})
    sure = DraftTree(
        TokenTree((5, 6, 7), (-1, 0, 1)), (DraftGroup(0, (1,), None), DraftGroup(1, (2,), None)), (1.0, 0.95, 0.9)
    )
    for _ in range(50):
        adaptive.plan(batch)
        [(_, kept)] = adaptive.select([Drafted("a", 10, ((0, sure),))])["a"]
        assert len(kept.tree) == 3
    assert adaptive.kept_share[0] == 1.0


# -- cutting drafted trees before verification --------------------------------------------


@st.composite
def scored_trees(draw) -> DraftTree:
    """A random dynamic tree: scores non-increasing along paths, groups listing children in slot order."""
    n = draw(st.integers(1, 14))
    parents, scores, tokens = [-1], [1.0], [0]
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        parents.append(p)
        scores.append(scores[p] * draw(st.floats(0.0, 1.0)))
        tokens.append(i)  # distinct tokens: never two equal siblings
    groups = tuple(
        DraftGroup(p, tuple(c for c in range(1, n) if parents[c] == p), None) for p in range(n) if p in parents[1:]
    )
    return DraftTree(TokenTree(tuple(tokens), tuple(parents)), groups, tuple(scores))


@settings(max_examples=200, deadline=None)
@given(scored_trees(), st.data())
def test_subtree_keeps_paths_groups_and_scores(draft, data):
    n = len(draft.tree)
    keep = {0}
    for i in range(1, n):  # an ancestor-closed random subset
        if draft.tree.parents[i] in keep and data.draw(st.booleans()):
            keep.add(i)
    sub = draft.subtree(sorted(keep))
    kept = sorted(keep)
    assert len(sub.tree) == len(kept)
    assert sub.scores == tuple(draft.scores[k] for k in kept)
    for new, old in enumerate(kept):
        assert sub.tree.tokens[new] == draft.tree.tokens[old]
        if new:
            assert kept[sub.tree.parents[new]] == draft.tree.parents[old]
    listed = sorted(c for g in sub.groups for c in g.children)
    assert listed == list(range(1, len(kept))), "every kept child is in exactly one group"
    for g in sub.groups:
        assert list(g.children) == sorted(g.children), "slot order kept"
    if n > 1:
        with pytest.raises(ValueError):
            draft.subtree([1])  # without the root
    deep = [i for i in range(1, n) if draft.tree.parents[i] != 0]
    if deep:
        with pytest.raises(ValueError):
            draft.subtree([0, deep[0]])  # without its parent


def _drafted(rid: str, values, parents, context: int = 10) -> DraftedNodes:
    return DraftedNodes(rid, context, np.asarray(values, dtype=np.float64), np.asarray(parents, dtype=np.int64))


def _rate(drafted, keep, costs, spent=0.0) -> float:
    extra = sum(len(keep[d.request_id]) - 1 for d in drafted)
    value = sum(min([d.values[k - 1] for k in _ancestry(d, node)]) for d in drafted for node in keep[d.request_id][1:])
    seconds = (
        costs.verify_seconds(
            VerifyShape(len(drafted) + extra, sum(d.context_len * len(keep[d.request_id]) for d in drafted))
        )
        + spent
        + costs.overhead
    )
    return (len(drafted) + value) / seconds


def _ancestry(d: DraftedNodes, node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(node)
        node = int(d.parents[node - 1])
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(scored_trees(), min_size=1, max_size=5), st.floats(0.0, 0.5), st.floats(0.0, 0.3), st.floats(0.0, 2.0))
def test_select_nodes_keeps_the_best_prefix_of_the_batch(trees, per_token, step_at_5, spent):
    """The kept nodes are closed under parents, every kept node is worth at least every dropped one,
    and no other cut of the best-first order has a higher expected rate."""
    costs = StepCosts(
        CostTable(
            {1: 1.0, 4: 1.0 + 3 * per_token, 6: 1.0 + 5 * per_token + step_at_5, 64: 2.0 + 63 * per_token + step_at_5}
        ),
        0.0,
        {},
        frozen=True,
    )
    drafted = [_drafted(f"r{i}", t.scores[1:], [p for p in t.tree.parents[1:]]) for i, t in enumerate(trees)]
    keep = select_nodes(drafted, costs, spent_seconds=spent)
    assert sorted(keep) == sorted(d.request_id for d in drafted)
    worth = {}
    for d in drafted:
        kept = keep[d.request_id]
        assert kept[0] == 0 and kept == sorted(set(kept))
        assert all(int(d.parents[k - 1]) in kept for k in kept[1:]), "closed under parents"
        for node in range(1, len(d.values) + 1):
            worth[(d.request_id, node)] = (min(d.values[k - 1] for k in _ancestry(d, node)), node in kept)
    kept_values = [v for v, k in worth.values() if k]
    dropped_values = [v for v, k in worth.values() if not k]
    if kept_values and dropped_values:
        assert min(kept_values) >= max(dropped_values) - 1e-12
    best = _rate(drafted, keep, costs, spent)
    order = sorted(worth, key=lambda key: (-worth[key][0], key[0], key[1]))
    for cut in range(len(order) + 1):
        other = {d.request_id: [0] for d in drafted}
        for rid, node in order[:cut]:
            other[rid].append(node)
        assert _rate(drafted, {r: sorted(v) for r, v in other.items()}, costs, spent) <= best + 1e-9


def test_select_nodes_on_a_cpu_shaped_cost_curve():
    """4 rows cost little more than 1, 6 cost much more: a batch of 4 verifies its roots alone
    unless its nodes are near-certain, while 1 request keeps its likely nodes."""
    costs = StepCosts(CostTable({1: 0.25, 4: 0.27, 6: 0.40, 8: 0.53, 16: 1.0}), 0.0, {}, frozen=True)
    unsure = [_drafted(f"r{i}", [0.7, 0.5], [0, 1]) for i in range(4)]
    assert all(k == [0] for k in select_nodes(unsure, costs).values())
    single = select_nodes([_drafted("a", [0.7, 0.5, 0.2], [0, 1, 2])], costs)
    assert single["a"] == [0, 1, 2, 3]  # 4 tokens cost 0.27 s: even the 0.2 node pays
    sure = [_drafted(f"r{i}", [0.99, 0.98, 0.97, 0.96], [0, 1, 2, 3]) for i in range(4)]
    assert all(len(k) == 5 for k in select_nodes(sure, costs).values()), "near-certain chains pay even past the step"
    assert select_nodes([_drafted("a", [], [])], costs) == {"a": [0]}


def test_select_drafts_cuts_only_adaptive_greedy_trees():
    from specinfer.core import ExpansionConfig, SamplingParams
    from specinfer.core.iteration import Running, select_drafts
    from specinfer.core.requests import GenerationRequest, SpeculationConfig

    tree = DraftTree(
        TokenTree((5, 7, 8, 9), (-1, 0, 0, 1)),
        (DraftGroup(0, (1, 2), None), DraftGroup(1, (3,), None)),
        (1.0, 0.3, 0.05, 0.2),
    )
    static = DraftTree(TokenTree((5, 7), (-1, 0)), (DraftGroup(0, (1,), None),))

    def running(rid, sampling, spec):
        return Running(GenerationRequest(rid, (1, 2, 3, 5), 16, sampling, spec), 0)

    batch = [
        running("greedy", SamplingParams(), SpeculationConfig(None)),
        running("sampled", SamplingParams(temperature=1.0), SpeculationConfig(None)),
        running("static", SamplingParams(), SpeculationConfig(ExpansionConfig((1,)))),
    ]
    drafted = {"greedy": [(0, tree)], "sampled": [(0, tree)], "static": [(0, static)]}
    # tokens cost a whole step (the batch, 7 tokens committing 3, does 0.43 tokens per token: nodes
    # worth 0.3 do not pay) / almost nothing (every node pays)
    for per_token, expect in ((1.0, 1), (1e-4, 4)):
        adaptive = AdaptiveSpeculation(
            _costs(per_token), PlannerConfig(), {0: (0.8, 0.1)}
        )  # edge prior: acceptance = slot probability, values = scores
        out = select_drafts(batch, drafted, adaptive, 0.0)
        assert len(out["greedy"][0][1].tree) == expect
        assert out["sampled"] == drafted["sampled"] and out["static"] == drafted["static"]


def test_a_subnormal_path_score_counts_as_zero():
    """A slot whose path score is subnormal is never chosen (hypothesis found one whose child's slot
    probability could not be recovered from the scores: 5e-324 * 0.75 rounds back to 5e-324)."""
    budget = TreeBudget(5, 2, 4, 0.0, (0.05,) * (len(EDGE_KNOTS) - 1) + (0.1,))
    builder = BestFirstTreeBuilder(0, budget)
    builder.expand([Proposal((0, 1, 2, 3), None, (0.0, 0.0, 0.0, 5e-324))])
    assert builder.done and len(builder.build().tree) == 1


def test_the_head_outdrafts_the_ssms_only_once_both_are_measured_and_it_is_ahead():
    """The draft head replaces SSM drafts only when its trees had at least as many tokens accepted per step
    as every SSM's, each over enough steps (an SSM not measured yet keeps drafting); its budget never drafts
    past what the request may still commit."""
    adaptive = AdaptiveSpeculation(
        _costs(per_token=1e-4, draft=1e-4), PlannerConfig(max_nodes=16, max_depth=6), {0: (0.5,)}
    )
    t = adaptive.totals
    assert not adaptive.outdrafts_ssms("head")
    t.drafter_steps["head"], t.drafter_accepted["head"] = 10, 30
    assert not adaptive.outdrafts_ssms("head"), "the SSM is not measured yet"
    t.drafter_steps[0], t.drafter_accepted[0] = 10, 35
    assert not adaptive.outdrafts_ssms("head"), "the SSM is ahead"
    t.drafter_accepted[0] = 30
    assert adaptive.outdrafts_ssms("head")

    def budget_of(remaining: int, kept: tuple[int, int] | None = None) -> TreeBudget | None:
        return head_budget(adaptive.config, adaptive.edge("head").knot_values(), remaining, kept)

    assert budget_of(2) is None
    budget = budget_of(5)
    assert budget.depth == 3 and budget.nodes == 16 and budget.max_width <= MAX_SLOTS
    # sized by what the last cut kept: twice its nodes, two depths more, within the limits; a head cut to its
    # root still drafts a small tree (it may earn more again)
    assert (budget_of(50, (5, 2)).nodes, budget_of(50, (5, 2)).depth) == (12, 4)
    assert (budget_of(50, (1, 0)).nodes, budget_of(50, (1, 0)).depth) == (4, 2)
    assert (budget_of(50, (16, 6)).nodes, budget_of(50, (16, 6)).depth) == (16, 6)
