"""Dynamic draft trees (adaptive speculation): a request's tree grown best-first within the
:class:`TreeBudget` the planner gives it (:class:`BestFirstTreeBuilder`, from each expanded node's
:class:`Proposal`), and the *values* that rank its nodes: the chance each is accepted, from the
slot probabilities through an edge acceptance curve (:func:`edge_values`, :func:`tree_values`).
Static trees (``ExpansionConfig``) and the tree types are :mod:`specinfer.core.drafts`.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.drafts import DraftGroup, DraftTree
from specinfer.core.sampling import SparseDist
from specinfer.core.tree import TokenTree, path_below_root

# A path score below the smallest normal float counts as 0 (the slot is never chosen): in the
# subnormal range a score has too few significant bits for tree_values to recover a child's slot
# probability from it (score / parent score), and such a path is never worth a verify row anyway.
MIN_SCORE = sys.float_info.min
MAX_DRAFT_WIDTH = 4  # most children one node of a dynamic tree gets (slots drafted per expanded node)
# Slot probabilities at which an *edge curve* (see TreeBudget) gives the acceptance, between them
# interpolated: finer where SSMs put most of their slots.
EDGE_KNOTS = (0.0, 0.01, 0.035, 0.075, 0.125, 0.175, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.925, 0.975, 1.0)


def edge_values(slot_probs: Sequence[float], curve: Sequence[float]) -> list[float]:
    """The acceptance ``curve`` (one value per :data:`EDGE_KNOTS`; empty: the identity) at ``slot_probs``."""
    if not curve:
        return [min(1.0, max(0.0, float(p))) for p in slot_probs]
    return [float(v) for v in np.interp(np.clip(np.asarray(slot_probs, dtype=np.float64), 0.0, 1.0), EDGE_KNOTS, curve)]


def slot_probabilities(parents: Sequence[int], scores: Sequence[float]) -> list[float]:
    """Each node's slot probability, recovered from the path *scores* of a dynamic tree (a node's
    score over its parent's; 1.0 at the root, 0.0 under a parent that scored 0)."""
    return [
        1.0 if parent < 0 else (scores[i] / scores[parent] if scores[parent] > 0.0 else 0.0)
        for i, parent in enumerate(parents)
    ]


def tree_values(parents: Sequence[int], scores: Sequence[float], curve: Sequence[float]) -> list[float]:
    """Each node's *value* (see :class:`BestFirstTreeBuilder`) under the edge ``curve``, from the
    tree's ``parents`` (parents first) and path ``scores``; 1.0 at the root."""
    edges = edge_values(slot_probabilities(parents, scores), curve)
    values = [1.0] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0:
            values[i] = values[parent] * edges[i]
    return values


@dataclass(frozen=True)
class TreeBudget:
    """What the planner lets one dynamic draft tree grow to.

    ``nodes``: most tree nodes, the root included (>= 2); ``depth``: most depths, which is also
    the most SSM passes; ``max_width``: most children per node; ``edge_curve``: the SSM's *edge
    acceptance* by slot probability, one non-decreasing value in [0, 1] per :data:`EDGE_KNOTS`:
    the chance that a child drafted with slot probability p is accepted once its parent is (see
    :class:`~specinfer.core.acceptance.EdgeCalibration`; empty: the slot probability itself);
    ``min_score``: a node whose *value* (see :class:`BestFirstTreeBuilder`) is below this is not
    worth its verify cost (0: no floor).
    """

    nodes: int
    depth: int
    max_width: int = MAX_DRAFT_WIDTH
    min_score: float = 0.0
    edge_curve: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.depth < 1 or self.max_width < 1:
            raise ValueError(f"a tree budget needs nodes >= 2, depth >= 1 and max_width >= 1, got {self}")
        if not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {self.min_score}")
        curve = self.edge_curve
        if curve and (
            len(curve) != len(EDGE_KNOTS)
            or any(not 0.0 <= v <= 1.0 for v in curve)
            or any(b < a for a, b in itertools.pairwise(curve))
        ):
            raise ValueError(
                f"edge_curve must be {len(EDGE_KNOTS)} non-decreasing values in [0, 1] (or none), got {curve}"
            )

    @property
    def width(self) -> int:
        """Slots drafted per expanded node: no node can have more children than the budget holds."""
        return min(self.max_width, self.nodes - 1)


@dataclass(frozen=True)
class Proposal:
    """An SSM's proposal at one expanded node: ``tokens`` in draw order (the top-k under greedy
    decoding; drawn without replacement from ``q`` under sampling), and ``slot_probs``, the
    k largest probabilities of the distribution drafted from, best first.

    ``slot_probs[i]`` scores the node's i-th *slot* whatever token the i-th draw gave: under
    greedy decoding it is that token's own probability, under sampling it is not (see
    :class:`BestFirstTreeBuilder` for why that matters)."""

    tokens: tuple[int, ...]
    q: SparseDist | None
    slot_probs: tuple[float, ...]


class BestFirstTreeBuilder:
    """Grows one request's *dynamic* draft tree best-first by score, within a :class:`TreeBudget`.

    Terms. Expanding a node runs the SSM on it and drafts ``budget.width`` *slots*: the i-th slot
    holds the i-th token drawn (sampling) or the i-th best token (greedy). Its *score* is the
    parent's score times ``slot_probs[i]`` (what the SSM says), its *value* the parent's value
    times the budget's edge acceptance at ``slot_probs[i]`` (what verification has shown that
    probability to be worth, :data:`TreeBudget.edge_curve`: the predicted chance the slot is
    accepted); the root scores and is worth 1. The tree is always the ``budget.nodes - 1`` most
    valuable slots drafted so far (ties: the slot drafted first) whose value is at least
    ``budget.min_score``. A slot is never worth more than its parent and a later slot of a node
    never more than an earlier one (slot probabilities fall, the edge curve does not), so that set
    is a tree, and each node's children in it are a prefix of its slots in draw order. Each round
    expands the newest depth's tree nodes that could still add a child (all of them while the
    budget is not full, else those worth more than the weakest node): one batched SSM pass per
    depth, as for static trees, at most ``budget.depth`` of them.

    Why values and not scores: an SSM's probabilities are rarely calibrated, and a path product
    compounds the error with depth. The pycode-a SSM, for one, is underconfident at low
    probabilities (children of slot probability about 0.05 were accepted about 18% of the time),
    so ranked by score the fourth node of a confident chain loses to second-choice siblings that
    are accepted no more often, and the tree grows wide and shallow.

    Why this keeps multi-step speculative sampling exact. Verification at node u tries u's
    children in draw order, the i-th as a draw from q renormalised over the tokens not drawn
    before it; that is exact for any number of tries as long as whether the i-th draw is tried
    does not depend on the value it drew (then stopping before it leaves the target
    distribution unchanged, as every rejection step does). Here whether slot i of u stays in
    the tree depends on values: u's own (its ancestors' slots), slot i's (from u's distribution
    and the edge curve, fixed for the step, not from the token drawn into it), and other slots
    worth more, which are slots of other nodes or descendants of u's earlier draws, never of the
    i-th draw or its descendants (they are worth at most slot i's value and were drafted after
    it). Nothing decides on a drawn token's own probability. A builder that kept or dropped a drawn child by q(token)
    instead would bias the output, which is the negative control of the statistical test.
    """

    def __init__(self, root_token: int, budget: TreeBudget) -> None:
        self.budget = budget
        self._width = budget.width
        # every drafted slot; slot 0 is the root. Slots are numbered in draft order.
        self._tokens = [int(root_token)]
        self._parents = [-1]
        self._scores = [1.0]
        self._values = [1.0]
        self._depths = [0]
        self._q: dict[int, SparseDist | None] = {}  # expanded slot -> the distribution its children were drawn from
        self._sent: dict[int, int] = {}  # expanded slot -> its index among the nodes sent to the SSM
        self._chosen: set[int] = {0}
        self._frontier = [0]
        self._passes = 0

    @property
    def done(self) -> bool:
        return not self._frontier

    def frontier(self) -> list[int]:
        """Slots to expand in the next SSM pass (parents precede children)."""
        return list(self._frontier)

    def width(self) -> int:
        return self._width

    def tokens_of(self, slots: Sequence[int]) -> list[int]:
        return [self._tokens[i] for i in slots]

    def parents_of(self, slots: Sequence[int]) -> list[int]:
        """Parents of ``slots`` as the SSM's cache numbers them: by the order nodes were sent to it
        (only expanded slots are sent, so slot numbers differ)."""
        return [-1 if self._parents[i] < 0 else self._sent[self._parents[i]] for i in slots]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens of ``node``'s path below the root, its own last (the root's: none)."""
        return path_below_root(self._tokens, self._parents, node)

    def expand(self, proposals: Sequence[Proposal]) -> None:
        """Add each frontier slot's proposal (one per frontier slot, in order), then re-select."""
        if self.done:
            raise RuntimeError("tree is complete")
        if len(proposals) != len(self._frontier):
            raise ValueError("one proposal per frontier node")
        for parent in self._frontier:
            self._sent[parent] = len(self._sent)
        width = self._width
        kept: list[tuple[int, tuple[int, ...], list[float]]] = []  # (parent, tokens, clamped slot probabilities)
        for parent, prop in zip(self._frontier, proposals, strict=True):
            if len(set(prop.tokens)) != len(prop.tokens):
                raise ValueError("children of one node must carry distinct tokens")
            if len(prop.slot_probs) < len(prop.tokens):
                raise ValueError("one slot probability per proposed token")
            self._q[parent] = prop.q
            tokens = prop.tokens[:width]
            kept.append((parent, tokens, [min(1.0, max(0.0, float(p))) for p in prop.slot_probs[: len(tokens)]]))
        # one interpolation for the pass's slots (the curve is per slot: batching changes no value)
        edges = iter(edge_values([p for _, _, probs in kept for p in probs], self.budget.edge_curve))
        for parent, tokens, probs in kept:
            score, value, depth = self._scores[parent], self._values[parent], self._depths[parent] + 1
            for token, p in zip(tokens, probs, strict=True):
                self._tokens.append(int(token))
                self._parents.append(parent)
                self._scores.append(score * p)
                self._values.append(value * next(edges))
                self._depths.append(depth)
        self._passes += 1
        self._select()

    def _select(self) -> None:
        budget = self.budget
        values, scores = self._values, self._scores
        floor = budget.min_score
        eligible = [
            i for i in range(1, len(self._tokens)) if values[i] >= floor and values[i] > 0.0 and scores[i] >= MIN_SCORE
        ]
        # most valuable first, ties in draft order (the sort is stable, reversed too; eligible is in slot order)
        best = sorted(eligible, key=values.__getitem__, reverse=True)[: budget.nodes - 1]
        self._chosen = {0, *best}
        full = len(best) == budget.nodes - 1
        weakest = (values[best[-1]], best[-1]) if best else (1.0, 0)
        newest = self._passes
        self._frontier = []
        if newest >= budget.depth:
            return
        for i in sorted(best):
            # a child is worth at most its parent: a slot that is itself the weakest cannot add one
            if self._depths[i] == newest and (not full or (values[i], -i) > (weakest[0], -weakest[1])):
                self._frontier.append(i)

    def build(self) -> DraftTree:
        order = sorted(self._chosen, key=lambda i: (self._depths[i], i))  # breadth-first: parents first
        new_index = {slot: n for n, slot in enumerate(order)}
        tokens = tuple(self._tokens[i] for i in order)
        parents = tuple(-1 if i == 0 else new_index[self._parents[i]] for i in order)
        children: dict[int, list[int]] = {}
        for i in sorted(self._chosen):  # draw order within each parent
            if i:
                children.setdefault(self._parents[i], []).append(i)
        groups = tuple(
            DraftGroup(new_index[p], tuple(new_index[c] for c in kids), self._q[p])
            for p, kids in sorted(children.items(), key=lambda kv: new_index[kv[0]])
        )
        return DraftTree(TokenTree(tokens, parents), groups, tuple(self._scores[i] for i in order))
