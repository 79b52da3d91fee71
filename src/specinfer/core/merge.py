"""Merge-based tree construction: the trie union of several token trees.

The merged tree holds every token sequence of every input tree and nothing else; merging is
associative, commutative and idempotent on that set of sequences (node numbering follows the
input order, the set does not).
"""

from __future__ import annotations

from collections.abc import Sequence

from specinfer.core.drafts import DraftGroup, DraftTree
from specinfer.core.tree import TokenTree


def merge_with_maps(trees: Sequence[TokenTree]) -> tuple[TokenTree, list[list[int]]]:
    """Trie union of ``trees`` (all rooted at the same token) and, per input tree, the merged node of each of its
    nodes."""
    if not trees:
        raise ValueError("merge needs at least one tree")
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError("trees to merge must share the root token (the last committed token)")
    tokens, parents = [root], [-1]
    index: dict[tuple[int, int], int] = {}
    maps: list[list[int]] = []
    for tree in trees:
        m = [0] * len(tree)
        for i in range(1, len(tree)):
            key = (m[tree.parents[i]], tree.tokens[i])
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tree.tokens[i])
                parents.append(key[0])
            m[i] = index[key]
        maps.append(m)
    return TokenTree(tuple(tokens), tuple(parents)), maps


def merge_trees(trees: Sequence[TokenTree]) -> TokenTree:
    """Trie union of ``trees`` (all rooted at the same token)."""
    return merge_with_maps(trees)[0]


def merge_drafts(drafts: Sequence[DraftTree]) -> DraftTree:
    """Merge draft trees; every input group survives, re-indexed, in input order."""
    tree, maps = merge_with_maps([d.tree for d in drafts])
    groups = [
        DraftGroup(m[g.parent], tuple(m[c] for c in g.children), g.q)
        for d, m in zip(drafts, maps, strict=True)
        for g in d.groups
    ]
    return DraftTree(tree, tuple(groups))


def combine_drafts(root_token: int, drafts: Sequence[DraftTree]) -> DraftTree:
    """One request's tree for verification: its SSMs' drafts merged, or just the root when no
    SSM drafted (incremental decoding)."""
    if not drafts:
        return DraftTree(TokenTree.root_only(root_token))
    return drafts[0] if len(drafts) == 1 else merge_drafts(drafts)
