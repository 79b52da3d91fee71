"""Property tests of the pure token-tree algorithms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core import (
    ExpansionConfig,
    TokenTree,
    TreeBuilder,
    ancestor_matrix,
    merge_drafts,
    merge_trees,
    node_depths,
    validate_parents,
)


@st.composite
def trees(draw, root: int = 0, max_nodes: int = 30, vocab: int = 6) -> TokenTree:
    """Random tries: each new node picks an existing parent and a token unused among its siblings."""
    n = draw(st.integers(1, max_nodes))
    tokens, parents = [root], [-1]
    used: dict[int, set[int]] = {0: set()}
    for _ in range(n - 1):
        parent = draw(st.integers(0, len(tokens) - 1))
        free = [t for t in range(vocab) if t not in used[parent]]
        if not free:
            continue
        tok = draw(st.sampled_from(free))
        used[parent].add(tok)
        used[len(tokens)] = set()
        tokens.append(tok)
        parents.append(parent)
    return TokenTree(tuple(tokens), tuple(parents))


def _is_ancestor(tree: TokenTree, a: int, i: int) -> bool:
    while i >= 0:
        if i == a:
            return True
        i = tree.parents[i]
    return False


@given(trees())
def test_ancestor_mask_is_the_ancestor_relation(tree):
    mask = tree.ancestor_mask
    for i in range(len(tree)):
        for j in range(len(tree)):
            assert mask[i, j] == _is_ancestor(tree, j, i)


def test_parent_array_functions_take_forests():
    """A forest (several -1 parents: pending nodes plus new ones of a backend's cache) has depths and an ancestor
    relation per tree; only ``validate_parents`` insists on a single root."""
    parents = [-1, 0, -1, 2, 1]
    assert node_depths(parents).tolist() == [0, 1, 0, 1, 2]
    assert ancestor_matrix(parents).astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    with pytest.raises(ValueError, match="parents\\[2\\]"):
        validate_parents(parents)
    validate_parents([-1, 0, 0, 2])


@given(trees())
def test_dfs_order_visits_parents_first_and_every_node_once(tree):
    order = tree.dfs_order
    assert sorted(order) == list(range(len(tree)))
    seen = set()
    for u in order:
        assert u == 0 or tree.parents[u] in seen
        seen.add(u)
    # pre-order: each subtree is a contiguous run
    pos = {u: k for k, u in enumerate(order)}
    for u in range(len(tree)):
        sub = [v for v in range(len(tree)) if _is_ancestor(tree, u, v)]
        assert sorted(pos[v] for v in sub) == list(range(pos[u], pos[u] + len(sub)))


@given(trees())
def test_depths_paths_and_reorder(tree):
    for i in range(len(tree)):
        assert tree.depths[i] == len(tree.path_to(i)) - 1
    assert np.array_equal(tree.positions(10), tree.depths + 10)
    assert {p for p in tree.paths()} <= tree.sequences()
    assert len(tree.paths()) == len(tree.leaves)
    re, new_index = tree.reorder(tree.dfs_order)
    assert re.sequences() == tree.sequences()
    assert all(re.tokens[new_index[i]] == tree.tokens[i] for i in range(len(tree)))


@given(st.lists(trees(), min_size=1, max_size=4))
def test_merge_holds_exactly_the_union(ts):
    merged = merge_trees(ts)
    assert merged.sequences() == frozenset().union(*(t.sequences() for t in ts))


@settings(max_examples=60)
@given(trees(), trees(), trees())
def test_merge_is_associative_commutative_idempotent(a, b, c):
    seqs = lambda t: t.sequences()  # noqa: E731
    assert seqs(merge_trees([merge_trees([a, b]), c])) == seqs(merge_trees([a, merge_trees([b, c])]))
    assert seqs(merge_trees([a, b])) == seqs(merge_trees([b, a]))
    assert merge_trees([a, a]) == merge_trees([a])
    assert merge_trees([a]).sequences() == a.sequences()


def test_merge_rejects_different_roots():
    with pytest.raises(ValueError, match="root"):
        merge_trees([TokenTree.root_only(1), TokenTree.root_only(2)])


def test_tree_rejects_bad_parents_and_duplicate_children():
    with pytest.raises(ValueError):
        TokenTree((1, 2), (-1, 1))
    with pytest.raises(ValueError):
        TokenTree((1, 2, 2), (-1, 0, 0))
    with pytest.raises(ValueError):
        TokenTree((1,), (0,))


def test_builder_follows_the_expansion_config():
    cfg = ExpansionConfig.parse("<1,1,3,1>")
    b = TreeBuilder(5, cfg)
    depth = 0
    while not b.done:
        frontier = b.frontier()
        b.expand([([10 * depth + k for k in range(b.width())], None) for _ in frontier])
        depth += 1
    draft = b.build()
    assert len(draft.tree) == cfg.max_nodes == 1 + 1 + 1 + 3 + 3
    assert draft.tree.depths.max() == 4
    assert [len(draft.tree.children[i]) for i in range(3)] == [1, 1, 3]


def test_merge_drafts_keeps_every_group():
    a = TreeBuilder(0, ExpansionConfig((2,)))
    a.expand([([1, 2], None)])
    b = TreeBuilder(0, ExpansionConfig((2,)))
    b.expand([([2, 3], None)])
    merged = merge_drafts([a.build(), b.build()])
    assert merged.tree.tokens == (0, 1, 2, 3)
    assert [g.children for g in merged.groups] == [(1, 2), (2, 3)]
