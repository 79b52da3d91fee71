"""Acceptance models: how many drafted tokens the LLM will accept, learned from verification.

Terms.
- A drafted node is *accepted* when it lies on the accepted path of its verify step.
- *Slot acceptance* ``c[k]``: the probability that the k-th child (in draw order) of a node the
  verification reached is the one accepted (the earlier children rejected). Under greedy decoding ``c[0]`` is the
  SSM's top-1 agreement with the LLM, ``c[1]`` the chance the LLM's token is the SSM's second, and so on:
  exactly the ``top_k_agreement`` differences a ``specinfer tune`` run measures, which is
  therefore the prior. The tree of ``n`` nodes with the most expected accepted tokens under this
  model is the best-first tree of path products (Sequoia's positional acceptance model), and
  :func:`node_values` lists its nodes.
- *Edge acceptance*: the probability that a drafted child is accepted once its parent is,
  given the slot probability the SSM drafted it with (:class:`EdgeCalibration`), forced
  monotone. A dynamic tree's node is worth the product of its edges' acceptances along its path
  (its *value*, see :class:`~specinfer.core.dynamic_trees.BestFirstTreeBuilder`). Calibrating edges,
  not whole paths by their score, lets one curve serve every depth: it is learned at every
  reached node, shallow ones included, and the product carries it to nodes never drafted yet.
- *Per-position acceptance*: accepted tokens by depth, the counters vLLM exports.

Everything here is arithmetic on counts: no I/O, no torch. Counts decay geometrically so the
models follow a request, or a workload, that changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.drafts import DraftTree
from specinfer.core.dynamic_trees import EDGE_KNOTS, slot_probabilities

MAX_SLOTS = 4  # slot acceptance is tracked for the first children of a node
MAX_POSITIONS = 16  # per-position acceptance counters (depths 1..16)
DEFAULT_SLOT_PRIOR = (0.5, 0.1, 0.04, 0.02)  # c[k] before any tuning or verification says otherwise


def nondecreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> np.ndarray:
    """The closest non-decreasing sequence in weighted least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for i, v in enumerate(values):
        w = 1.0 if weights is None else max(float(weights[i]), 1e-12)
        blocks.append([float(v) * w, w, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return np.array([b[0] / b[1] for b in blocks for _ in range(int(b[2]))])


def slot_prior_from_agreement(top_k_agreement: Mapping[int, float]) -> tuple[float, ...]:
    """``c[k] = P(rank == k)`` from a tuning run's ``P(rank < k)`` (k = 1, 2, ...)."""
    prev, out = 0.0, []
    for k in sorted(top_k_agreement)[:MAX_SLOTS]:
        cur = float(top_k_agreement[k])
        out.append(max(0.0, cur - prev))
        prev = cur
    return tuple(out) if out else DEFAULT_SLOT_PRIOR


@dataclass(frozen=True)
class StepOutcomes:
    """What one verify step says about one SSM's draft tree.

    ``slot_tries[k]`` / ``slot_hits[k]``: reached nodes with a k-th child / whose k-th child was
    accepted; ``edge_probs`` / ``edge_hits``: the slot probability of every child of a reached
    node and whether it was accepted (empty for static trees, which carry no scores);
    ``depth_hits[d]``: accepted tokens at depth d + 1. A node is *reached* when it is the root or
    on the accepted path: verification then looked at its children.
    """

    slot_tries: np.ndarray  # [MAX_SLOTS]
    slot_hits: np.ndarray  # [MAX_SLOTS]
    edge_probs: np.ndarray  # [children of reached nodes] float64
    edge_hits: np.ndarray  # [children of reached nodes] bool
    depth_hits: np.ndarray  # [MAX_POSITIONS]


def step_outcomes(draft: DraftTree, accepted_tokens: Sequence[int]) -> StepOutcomes:
    """Score one SSM's tree against the step's accepted tokens (those of the merged tree it was part of)."""
    tree = draft.tree
    on_path = [0]  # nodes of this tree on the accepted path, root first
    for token in accepted_tokens:
        child = tree.child_with_token(on_path[-1], token)
        if child is None:
            break
        on_path.append(child)
    path = set(on_path)
    tries = np.zeros(MAX_SLOTS)
    hits = np.zeros(MAX_SLOTS)
    for group in draft.groups:
        if group.parent in path:
            for k, child in enumerate(group.children[:MAX_SLOTS]):
                tries[k] += 1
                if child in path:
                    hits[k] += 1
                    break  # later slots were never tried
    depth_hits = np.zeros(MAX_POSITIONS)
    depth_hits[: min(MAX_POSITIONS, len(on_path) - 1)] = 1
    if draft.scores:
        probs = slot_probabilities(tree.parents, draft.scores)
        children = [i for i in range(1, len(tree)) if tree.parents[i] in path]
        edge_probs = np.array([probs[i] for i in children], dtype=np.float64)
        edge_hits = np.array([i in path for i in children], dtype=bool)
    else:
        edge_probs, edge_hits = np.zeros(0), np.zeros(0, dtype=bool)
    return StepOutcomes(tries, hits, edge_probs, edge_hits, depth_hits)


class SlotAcceptance:
    """Decaying estimate of the slot acceptance ``c[k]`` (see the module docstring).

    Counted as *hit rates*: ``h[k]`` = P(the k-th child is accepted | it was tried, i.e. its
    parent was reached and the earlier children were rejected), so ``c[k] = h[k] * prod(1 - h[j], j < k)``.
    ``prior`` (``c``, e.g. from :func:`slot_prior_from_agreement`) is worth ``prior_weight`` tries per
    slot; each update first multiplies the counts by ``decay``, so old steps fade.
    """

    def __init__(self, prior: Sequence[float], prior_weight: float = 8.0, decay: float = 0.95) -> None:
        c = np.zeros(MAX_SLOTS)
        c[: len(prior)] = np.clip(np.asarray(prior, dtype=np.float64)[:MAX_SLOTS], 0.0, 1.0)
        left = np.maximum(1e-9, 1.0 - np.concatenate(([0.0], np.cumsum(c)[:-1])))
        self.prior_hit_rates = np.clip(c / left, 0.0, 1.0)  # [MAX_SLOTS]
        self.prior_weight = prior_weight
        self.decay = decay
        self.tries = np.zeros(MAX_SLOTS)
        self.hits = np.zeros(MAX_SLOTS)

    def observe(self, outcome: StepOutcomes) -> None:
        self.tries = self.tries * self.decay + outcome.slot_tries
        self.hits = self.hits * self.decay + outcome.slot_hits

    def hit_rates(self) -> np.ndarray:
        """``h[k]``.  # [MAX_SLOTS]"""
        return (self.hits + self.prior_weight * self.prior_hit_rates) / (self.tries + self.prior_weight)

    def rates(self) -> np.ndarray:
        """``c[k]``.  # [MAX_SLOTS]"""
        h = self.hit_rates()
        return h * np.concatenate(([1.0], np.cumprod(1.0 - h)[:-1]))


class EdgeCalibration:
    """Decaying counts, by slot probability, of the drafted children of reached nodes (see
    :class:`StepOutcomes`) and of those accepted: the edge acceptance curve at
    :data:`~specinfer.core.dynamic_trees.EDGE_KNOTS`.

    A child of slot probability p counts toward the two knots around p, in proportion to how near
    it is (the curve is read by linear interpolation between knots, so it is learned the same
    way). The prior is the identity (a calibrated SSM: a child of slot probability p is accepted
    with probability p), worth ``prior_weight`` children per knot. Each observed step first
    multiplies the counts by ``decay``.
    """

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999) -> None:
        self.knots = np.array(EDGE_KNOTS)
        self.prior = self.knots.copy()
        self.prior_weight = prior_weight
        self.decay = decay
        self.drafted = np.zeros(len(self.knots))
        self.accepted = np.zeros(len(self.knots))
        self._knot_values: tuple[float, ...] | None = None  # the curve as of the last observation

    def observe(self, outcome: StepOutcomes) -> None:
        if outcome.edge_probs.size == 0:
            return
        self._knot_values = None
        p = np.clip(outcome.edge_probs, 0.0, 1.0)
        upper = np.clip(np.searchsorted(self.knots, p, side="right"), 1, len(self.knots) - 1)  # knot at or above p
        lower = upper - 1
        t = (p - self.knots[lower]) / (self.knots[upper] - self.knots[lower])  # 0 at the lower knot, 1 at the upper
        hits = outcome.edge_hits.astype(np.float64)
        self.drafted *= self.decay
        self.accepted *= self.decay
        np.add.at(self.drafted, lower, 1.0 - t)
        np.add.at(self.drafted, upper, t)
        np.add.at(self.accepted, lower, (1.0 - t) * hits)
        np.add.at(self.accepted, upper, t * hits)

    def curve(self) -> np.ndarray:
        """Edge acceptance per knot, non-decreasing in the slot probability.  # [knots]"""
        weight = self.drafted + self.prior_weight
        return np.clip(nondecreasing((self.accepted + self.prior_weight * self.prior) / weight, weight), 0.0, 1.0)

    def knot_values(self) -> tuple[float, ...]:
        """:meth:`curve` as a :class:`~specinfer.core.dynamic_trees.TreeBudget`'s ``edge_curve`` (fitted once per
        observation: the planner and the draft selection of each step read it, and most steps observe once)."""
        if self._knot_values is None:
            self._knot_values = tuple(float(v) for v in self.curve())
        return self._knot_values


@dataclass(frozen=True)
class NodeValues:
    """The best-first tree of a slot-acceptance vector: node i (0: the first non-root node) has
    expected acceptance ``values[i]`` (non-increasing), ``depths[i]`` and parent ``parents[i]``
    (-1: the root; else an earlier index)."""

    values: np.ndarray  # [n] float64
    depths: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64


def node_values(rates: Sequence[float], max_nodes: int, max_depth: int) -> NodeValues:
    """The ``max_nodes`` best non-root nodes of the product tree of ``rates`` (``c[k]``), best first:
    the child in slot k of a node of value v has value v * c[k]."""
    rates = [float(r) for r in rates if r > 0.0]
    values, depths, parents = [], [], []
    heap: list[tuple[float, int, int, int, int]] = []  # (-value, order, parent, slot, depth)
    order = 0
    if rates and max_depth >= 1:
        heapq.heappush(heap, (-rates[0], order, -1, 0, 1))
    while heap and len(values) < max_nodes:
        neg, _, parent, slot, depth = heapq.heappop(heap)
        me = len(values)
        values.append(-neg)
        depths.append(depth)
        parents.append(parent)
        parent_value = 1.0 if parent < 0 else values[parent]
        if slot + 1 < len(rates):  # the next sibling
            order += 1
            heapq.heappush(heap, (-parent_value * rates[slot + 1], order, parent, slot + 1, depth))
        if depth < max_depth:  # the first child
            order += 1
            heapq.heappush(heap, (neg * rates[0], order, me, 0, depth + 1))
    return NodeValues(
        np.array(values, dtype=np.float64), np.array(depths, dtype=np.int64), np.array(parents, dtype=np.int64)
    )
