"""Draft trees: a token tree plus how each node's children were drafted.

Under sampling, verification must know the distribution every child was drawn from. A
*draft group* records one SSM's proposal at one node: the children in the order they were
drawn (without replacement) and the sparse distribution ``q`` they were drawn from. When
trees of several SSMs are merged, a node keeps one group per SSM, so a token proposed by two
SSMs is one tree node that appears in two groups: it is tried once per group, each time with
its own ``q`` (independent drafts), which keeps multi-step speculative sampling exact.
Under greedy decoding the groups carry ``q = None`` and only the tree matters.

Static trees (one ``ExpansionConfig`` of widths per depth) grow with :class:`TreeBuilder`; dynamic
trees (adaptive speculation) grow best-first in :mod:`specinfer.core.dynamic_trees`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.errors import InvalidArgument
from specinfer.core.sampling import SparseDist
from specinfer.core.tree import TokenTree, path_below_root

# the paper's static tree (21 nodes): the default expansion where no tuning is installed
PAPER_EXPANSION = "1,1,3,1,1,1,1,1"
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
    product of the slot probabilities along its path (see :class:`~specinfer.core.dynamic_trees.BestFirstTreeBuilder`),
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
        must keep a prefix of its draws chosen without looking at them
        (see :class:`~specinfer.core.dynamic_trees.BestFirstTreeBuilder`)."""
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

    def with_chains(self, chains: Mapping[int, Sequence[int]]) -> DraftTree:
        """This tree with each chain of ``chains`` (node -> tokens) appended below its node, in the chains' order,
        the new nodes numbered after the present ones. The chains' tokens are *certain* (a grammar allows each
        alone, :func:`~specinfer.core.constraints.certain_chains`): each is its own draft group with all of ``q``
        on it (MSS then accepts it with probability p(x)/q(x) = 1, as greedy and coupled walks do) and scores
        its parent's score. A chain's first token must not be a child of its node already."""
        tokens, parents = list(self.tree.tokens), list(self.tree.parents)
        groups = list(self.groups)
        scores = list(self.scores)
        for node, chain in chains.items():
            if chain and self.tree.child_with_token(node, chain[0]) is not None:
                raise ValueError(f"node {node} has a child with token {chain[0]} already")
            parent = node
            for t in chain:
                tokens.append(int(t))
                parents.append(parent)
                groups.append(DraftGroup(parent, (len(tokens) - 1,), certain(int(t))))
                if scores:
                    scores.append(scores[parent])
                parent = len(tokens) - 1
        return DraftTree(TokenTree(tuple(tokens), tuple(parents)), tuple(groups), tuple(scores))


def certain(token: int) -> SparseDist:
    """The draft distribution of a certain token: all its mass on ``token``."""
    return SparseDist(np.array([token], dtype=np.int64), np.array([1.0]))


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


DEFAULT_MAX_TREE_NODES = 64  # most nodes of a request's merged tree the request manager accepts, unless configured


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

    def path_tokens(self, node: int) -> list[int]:
        """The tokens of ``node``'s path below the root, its own last (the root's: none)."""
        return path_below_root(self._tokens, self._parents, node)

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
