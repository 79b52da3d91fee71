"""Draft trees: a token tree plus how each node's children were drafted.

Under sampling, verification must know the distribution every child was drawn from. A
*draft group* records one SSM's proposal at one node: the children in the order they were
drawn (without replacement) and the sparse distribution ``q`` they were drawn from. When
trees of several SSMs are merged, a node keeps one group per SSM, so a token proposed by two
SSMs is one tree node that appears in two groups: it is tried once per group, each time with
its own ``q`` (independent drafts), which keeps multi-step speculative sampling exact.
Under greedy decoding the groups carry ``q = None`` and only the tree matters.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.errors import InvalidArgument
from specinfer.core.sampling import SparseDist
from specinfer.core.tree import TokenTree

PAPER_EXPANSION = (
    "1,1,3,1,1,1,1,1"  # the paper's static tree (21 nodes): the default expansion where no tuning is installed
)
# A path score below the smallest normal float counts as 0 (the slot is never chosen): in the
# subnormal range a score has too few significant bits for tree_values to recover a child's slot
# probability from it (score / parent score), and such a path is never worth a verify row anyway.
MIN_SCORE = sys.float_info.min
DEFAULT_DRAFT_SUPPORT = 32  # most tokens of a sparse draft distribution q, unless a request or a flag says otherwise


@dataclass(frozen=True)
class DraftGroup:
    """Children of ``parent`` drafted together by one SSM, in draw order."""

    parent: int
    children: tuple[int, ...]
    q: SparseDist | None


@dataclass(frozen=True)
class DraftTree:
    """A token tree, its draft groups, and (dynamic trees only) each node's *score*: the
    product of the slot probabilities along its path (see :class:`BestFirstTreeBuilder`),
    1.0 at the root; empty for static trees."""

    tree: TokenTree
    groups: tuple[DraftGroup, ...] = ()
    scores: tuple[float, ...] = ()

    def groups_at(self, node: int) -> list[DraftGroup]:
        return [g for g in self.groups if g.parent == node]

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree of the nodes ``keep`` (the root and every kept node's parent must be kept), renumbered
        in their present order; each group keeps its kept children, and groups left without any are dropped.

        Only for greedy and coupled verification, where any subtree is verified exactly: under MSS a group
        must keep a prefix of its draws chosen without looking at them (see :class:`BestFirstTreeBuilder`)."""
        kept = sorted(set(int(k) for k in keep))
        if not kept or kept[0] != 0:
            raise ValueError("a subtree keeps the root")
        index = {old: new for new, old in enumerate(kept)}
        parents = []
        for old in kept:
            parent = self.tree.parents[old]
            if parent >= 0 and parent not in index:
                raise ValueError(f"node {old} is kept without its parent {parent}")
            parents.append(-1 if parent < 0 else index[parent])
        groups = []
        for g in self.groups:
            children = tuple(index[c] for c in g.children if c in index)
            if g.parent in index and children:
                groups.append(DraftGroup(index[g.parent], children, g.q))
        scores = tuple(self.scores[k] for k in kept) if self.scores else ()
        return DraftTree(TokenTree(tuple(self.tree.tokens[k] for k in kept), tuple(parents)), tuple(groups), scores)


@dataclass(frozen=True)
class ExpansionConfig:
    """Static expansion config ``<k1, ..., km>``: each node at depth d-1 gets ``k_d`` children."""

    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.widths) == 0:
            raise InvalidArgument("expansion", "needs at least one depth")
        for d, k in enumerate(self.widths):
            if not isinstance(k, int) or k <= 0:
                raise InvalidArgument("expansion", f"width at depth {d + 1} must be a positive integer, got {k}")

    @staticmethod
    def parse(text: str) -> ExpansionConfig:
        """Parse ``"1,1,3,1"`` (also accepts ``<1,1,3,1>`` and spaces)."""
        body = text.strip().strip("<>").strip()
        if not body:
            raise InvalidArgument("expansion", "needs at least one depth")
        try:
            widths = tuple(int(part) for part in body.split(","))
        except ValueError as exc:
            raise InvalidArgument("expansion", f"expected comma-separated integers, got {text!r}") from exc
        return ExpansionConfig(widths)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def max_nodes(self) -> int:
        """Node count of a full tree, the root included."""
        total, level = 1, 1
        for k in self.widths:
            level *= k
            total += level
        return total


def merged_tree_nodes(expansion: ExpansionConfig, num_ssms: int) -> int:
    """Most nodes of the tree merged from ``num_ssms`` SSMs' drafts of ``expansion``: the drafts share at least the
    root."""
    return 1 + num_ssms * (expansion.max_nodes - 1)


class TreeBuilder:
    """Grows one request's draft tree depth by depth from proposals made by a model.

    The caller asks for ``frontier()`` (nodes whose children are wanted next), runs the SSM on
    them (batched across requests), and hands back one proposal per frontier node. Nodes are
    numbered breadth-first, so parents precede children.
    """

    def __init__(self, root_token: int, config: ExpansionConfig) -> None:
        self._widths = config.widths
        self._tokens = [int(root_token)]
        self._parents = [-1]
        self._groups: list[DraftGroup] = []
        self._frontier = [0]
        self._depth = 0

    @property
    def done(self) -> bool:
        return self._depth >= len(self._widths) or not self._frontier

    def frontier(self) -> list[int]:
        return list(self._frontier)

    def width(self) -> int:
        """Children wanted per frontier node at the next depth."""
        return self._widths[self._depth]

    def tokens_of(self, nodes: Sequence[int]) -> list[int]:
        return [self._tokens[i] for i in nodes]

    def parents_of(self, nodes: Sequence[int]) -> list[int]:
        return [self._parents[i] for i in nodes]

    def expand(self, proposals: Sequence[tuple[Sequence[int], SparseDist | None]]) -> list[int]:
        """Add children: ``proposals[j]`` = (tokens in draw order, their q) for frontier node j."""
        if self.done:
            raise RuntimeError("tree is complete")
        if len(proposals) != len(self._frontier):
            raise ValueError("one proposal per frontier node")
        new: list[int] = []
        for parent, (tokens, q) in zip(self._frontier, proposals, strict=True):
            if len(set(tokens)) != len(tokens):
                raise ValueError("children of one node must carry distinct tokens")
            kids = []
            for t in list(tokens)[: self.width()]:
                kids.append(len(self._tokens))
                self._tokens.append(int(t))
                self._parents.append(parent)
            if kids:
                self._groups.append(DraftGroup(parent, tuple(kids), q))
            new.extend(kids)
        self._frontier = new
        self._depth += 1
        return new

    def build(self) -> DraftTree:
        return DraftTree(TokenTree(tuple(self._tokens), tuple(self._parents)), tuple(self._groups))


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
        return self.budget.width

    def tokens_of(self, slots: Sequence[int]) -> list[int]:
        return [self._tokens[i] for i in slots]

    def parents_of(self, slots: Sequence[int]) -> list[int]:
        """Parents of ``slots`` as the SSM's cache numbers them: by the order nodes were sent to it
        (only expanded slots are sent, so slot numbers differ)."""
        return [-1 if self._parents[i] < 0 else self._sent[self._parents[i]] for i in slots]

    def expand(self, proposals: Sequence[Proposal]) -> None:
        """Add each frontier slot's proposal (one per frontier slot, in order), then re-select."""
        if self.done:
            raise RuntimeError("tree is complete")
        if len(proposals) != len(self._frontier):
            raise ValueError("one proposal per frontier node")
        for parent in self._frontier:
            self._sent[parent] = len(self._sent)
        for parent, prop in zip(self._frontier, proposals, strict=True):
            if len(set(prop.tokens)) != len(prop.tokens):
                raise ValueError("children of one node must carry distinct tokens")
            if len(prop.slot_probs) < len(prop.tokens):
                raise ValueError("one slot probability per proposed token")
            self._q[parent] = prop.q
            tokens = prop.tokens[: self.width()]
            probs = [min(1.0, max(0.0, float(p))) for p in prop.slot_probs[: len(tokens)]]
            for token, p, edge in zip(tokens, probs, edge_values(probs, self.budget.edge_curve), strict=True):
                self._tokens.append(int(token))
                self._parents.append(parent)
                self._scores.append(self._scores[parent] * p)
                self._values.append(self._values[parent] * edge)
                self._depths.append(self._depths[parent] + 1)
        self._passes += 1
        self._select()

    def _select(self) -> None:
        budget = self.budget
        values = self._values
        eligible = (
            i
            for i in range(1, len(self._tokens))
            if values[i] >= budget.min_score and values[i] > 0.0 and self._scores[i] >= MIN_SCORE
        )
        best = heapq.nsmallest(budget.nodes - 1, eligible, key=lambda i: (-values[i], i))
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
