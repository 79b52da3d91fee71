"""Token trees as flat arrays.

Terms used throughout the project:

- *committed prefix*: the tokens of a request that are final (prompt + accepted output).
- *tree node*: one speculated token. Node 0, the *root*, is the last committed token; every
  other node is a guess that continues the sequence of its ancestors.
- *accepted token*: a non-root node whose token the LLM agrees with (greedy) or accepts by
  speculative sampling; accepted nodes form a root-to-node path.
- *bonus token*: the token the LLM itself produces after the last accepted node, so every
  verify step commits at least one token.

A ``TokenTree`` stores only ``tokens[n]`` and ``parents[n]`` with ``parents[0] == -1`` and
``parents[i] < i``. Because parents precede children, every derived quantity (depth,
positions, ancestor mask, paths) is computed in one forward pass. A tree is a *trie*: no two
children of one node carry the same token, so a token sequence names at most one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def validate_parents(parents: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``parents`` is a tree: non-empty, ``parents[0] == -1`` and
    ``0 <= parents[i] < i``."""
    if len(parents) == 0:
        raise ValueError("a token tree needs at least the root node")
    if int(parents[0]) != -1:
        raise ValueError("parents[0] must be -1 (node 0 is the root)")
    for i in range(1, len(parents)):
        if not 0 <= int(parents[i]) < i:
            raise ValueError(f"parents[{i}] = {parents[i]} must be in [0, {i})")


def path_below_root(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """The tokens of ``node``'s path below the root (the node whose parent is -1), ``node``'s own last; the
    root's: none. What a node's row continues beyond the committed tokens."""
    path = []
    while parents[node] >= 0:
        path.append(int(tokens[node]))
        node = parents[node]
    return path[::-1]


def node_depths(parents: Sequence[int]) -> np.ndarray:
    """``depths[i]``: edges from node i up to a node whose parent is -1 (a root).  # [n] int64

    One forward pass (``parents[i] < i``); a parent array with several roots (a forest) is fine.
    """
    depths = [0] * len(parents)  # a list: element access is several times cheaper than on an array
    for i, p in enumerate(parents):
        if p >= 0:
            depths[i] = depths[p] + 1
    return np.array(depths, dtype=np.int64)


def binary_tree_parents(n: int) -> tuple[int, ...]:
    """The parents of a complete binary tree of ``n`` nodes (node i's parent is (i - 1) // 2): every
    depth has siblings and the depth grows as log2(n), like the wide trees speculation verifies;
    what benchmarks and cost calibration time."""
    return (-1, *((i - 1) // 2 for i in range(1, n)))


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """``anc[i, j]`` is True iff node j is node i or an ancestor of i.  # [n, n] bool

    The topology-aware mask of tree attention, the one home of its formula: the kernel metadata bit-packs it,
    the backends turn it into tensors. One forward pass (``parents[i] < i``): a node's row is its parent's row
    plus itself. A parent array with several roots (a forest) is fine.
    """
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A speculated token tree; see the module docstring for the invariants."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError("tokens and parents differ in length")
        validate_parents(self.parents)
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(self)):
            key = (self.parents[i], self.tokens[i])
            if key in seen:
                raise ValueError(f"node {self.parents[i]} has two children with token {self.tokens[i]}")
            seen.add(key)

    @staticmethod
    def root_only(token: int) -> TokenTree:
        return TokenTree((int(token),), (-1,))

    @staticmethod
    def chain(tokens: Sequence[int]) -> TokenTree:
        """A sequence (one child per node)."""
        return TokenTree(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenTree):
            return NotImplemented
        return self.tokens == other.tokens and self.parents == other.parents

    def __hash__(self) -> int:
        return hash((self.tokens, self.parents))

    @cached_property
    def depths(self) -> np.ndarray:
        """``depths[i]``: edges from the root to node i.  # [n] int64"""
        return node_depths(self.parents)

    def positions(self, root_position: int) -> np.ndarray:
        """Sequence positions of the nodes when the root sits at ``root_position``.  # [n]"""
        return self.depths + root_position

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[i]``: node indices of i's children, in index order."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i in range(1, len(self)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """``mask[i, j]`` is True iff node j is node i or an ancestor of it.  # [n, n] bool

        This is the topology-aware causal mask of tree attention: a node attends to the
        committed prefix, its ancestors and itself.
        """
        return ancestor_matrix(self.parents)

    @cached_property
    def dfs_order(self) -> tuple[int, ...]:
        """Pre-order depth-first traversal from the root, children in index order."""
        order: list[int] = []
        stack = [0]
        while stack:
            u = stack.pop()
            order.append(u)
            stack.extend(reversed(self.children[u]))
        return tuple(order)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self)) if not self.children[i])

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node indices from the root to ``node``, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    def paths(self) -> list[tuple[int, ...]]:
        """Token sequences of every root-to-leaf path (the root token included)."""
        return [tuple(self.tokens[j] for j in self.path_to(leaf)) for leaf in self.leaves]

    def sequences(self) -> frozenset[tuple[int, ...]]:
        """Every root-to-node token sequence: the set a tree stands for."""
        return frozenset(tuple(self.tokens[j] for j in self.path_to(i)) for i in range(len(self)))

    def child_with_token(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

    def reorder(self, order: Sequence[int]) -> tuple[TokenTree, np.ndarray]:
        """The same tree with nodes renumbered so that ``order`` lists the old indices.

        ``order`` must put parents before children (e.g. ``dfs_order``). Returns the new tree and
        ``new_index[old] -> new``.
        """
        new_index = np.full(len(self), -1, dtype=np.int64)
        for new, old in enumerate(order):
            new_index[old] = new
        if sorted(order) != list(range(len(self))) or order[0] != 0:
            raise ValueError("order must be a permutation of the nodes starting at the root")
        tokens = tuple(self.tokens[o] for o in order)
        parents = tuple(-1 if o == 0 else int(new_index[self.parents[o]]) for o in order)
        return TokenTree(tokens, parents), new_index
