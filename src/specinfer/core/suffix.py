"""Model-free suffix drafting (prompt lookup): propose what followed earlier occurrences of the text's ending.

Repetitive output (code edits, quoting the prompt, structured data, loops) often continues the way an
earlier stretch of the same request did. This drafter needs no model: it looks the request's ending up in
its own committed tokens and proposes, as a token tree, the tokens that followed.

Terms.

- *history*: a request's committed tokens (prompt and output so far); its last token is the root of the
  draft tree, as for every drafter (``iteration.draft_specs`` roots trees at ``context[-1]``).
- *match length* of an earlier position ``e`` (``e < len(history) - 1``): how many tokens ending at ``e``
  equal the history's last tokens, capped at ``max_match``. ``e`` is an *occurrence* when its match length
  is at least ``min_match``; its *continuation* is the up to ``max_depth`` tokens after it.
- *weight* of an occurrence of match length ``m``: ``length_weight ** (m - 1)``. Longer matches are
  stronger evidence that the history repeats, so one occurrence matching one more token counts as
  ``length_weight`` shorter ones.
- *support* of a tree node: the summed weight of the occurrences whose continuation passes through it.
- *score* of a node: an estimate of the probability that its whole path is accepted, the product along the
  path of its edges' *slot probabilities*; 1.0 at the root, as in
  :class:`~specinfer.core.dynamic_trees.BestFirstTreeBuilder`, so the adaptive planner ranks (and calibrates)
  these nodes like an SSM's. A child's slot probability is its support over its parent's *onward* support
  (the occurrences that go on past the parent; those cut off by the history's end say nothing) plus
  ``unseen_weight``: a pseudo-weight for "the LLM continues differently from every occurrence", which keeps
  every slot probability below 1 and makes a lone occurrence less certain than many agreeing ones.

Mixing match lengths (backoff). Occurrences are ranked longest match first, most recent first among equal
lengths, and the first ``max_occurrences`` are used: shorter matches only fill the places longer ones leave
free, and then count with their (smaller) weight. So a history that repeats a long stretch is drafted from
that stretch alone, and a history whose ending is rare falls back to what followed its last token or two.

The tree is the trie of the used continuations; a node's children are ordered by support (ties: the most
recent occurrence first), at most ``max_width`` of them. It keeps the ``max_nodes`` best nodes by score
(ties: the shallower, then the child of the node kept first, then sibling order): a child never scores
above its parent, so the kept nodes are a tree. Nodes are numbered depth by depth, best first within a
depth, so siblings appear in their order (which is the order verification tries them in).

Exactness. The proposal is a deterministic function of the history. Under multi-step speculative sampling
(:func:`~specinfer.core.verify.verify_stochastic`) every child is therefore its own draft group whose ``q``
is the point mass on it: the try accepts x with probability min(1, p(x) / 1) = p(x) and on rejection leaves
p with x removed, renormalised, which is exact for any fixed list of candidates (siblings are tried one
after the other). Putting siblings in one group with a ``q`` spread over them would claim they were drawn at
random, and bias the output (the negative control of tests/test_suffix.py). For the same reason any subtree
of a suffix tree, cut without looking at random draws, verifies exactly under every verification. Greedy
and coupled verification use only the tree; greedy drafts carry ``q = None``, one group per node with its
children in order, like an SSM's greedy draft.

Cost. :class:`TokenHistory` keeps a request's history in a growing array (8 bytes a token). A draft is a
vectorised scan for the positions holding the last token (O(history) numpy work, a few microseconds per
thousand tokens) and for their match lengths, most recent first and stopping once enough full-length
matches are found; then a best-first growth that builds only the kept nodes' children (at most
``max_nodes`` partitions of at most ``max_occurrences`` occurrences), independent of the history's length.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specinfer.core.drafts import DraftGroup, DraftTree
from specinfer.core.dynamic_trees import MAX_DRAFT_WIDTH, MIN_SCORE
from specinfer.core.sampling import SparseDist
from specinfer.core.tree import TokenTree


@dataclass(frozen=True)
class SuffixConfig:
    """How big a suffix draft grows and how occurrences are weighed (terms: see the module docstring).

    ``max_nodes``: most nodes besides the root; ``max_depth``: most tokens of a path (and of a
    continuation); ``max_width``: most children per node; ``min_match`` / ``max_match``: shortest match
    that counts as an occurrence, and the cap on match lengths; ``max_occurrences``: most occurrences used
    (the longest matches, most recent first); ``length_weight``: weight ratio of a match one token longer;
    ``unseen_weight``: pseudo-weight of a continuation no occurrence shows.
    """

    max_nodes: int = 16
    max_depth: int = 8
    max_width: int = MAX_DRAFT_WIDTH
    min_match: int = 1
    max_match: int = 8
    max_occurrences: int = 32
    length_weight: float = 4.0
    unseen_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or min(self.max_depth, self.max_width, self.max_occurrences) < 1:
            raise ValueError(f"needs max_nodes >= 0 and max_depth, max_width, max_occurrences >= 1: {self}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"needs 1 <= min_match <= max_match: {self}")
        if not (self.length_weight >= 1.0 and self.unseen_weight > 0.0):
            raise ValueError(f"needs length_weight >= 1 and unseen_weight > 0: {self}")

    def within(self, nodes: int, depth: int) -> SuffixConfig:
        """This config grown to at most ``nodes`` nodes besides the root and ``depth`` tokens deep."""
        return replace(self, max_nodes=min(self.max_nodes, nodes), max_depth=min(self.max_depth, depth))


class TokenHistory:
    """One request's history (committed tokens) for suffix drafting: appended as tokens commit, so a draft
    never converts the whole history again. Not thread-safe; one per request."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._buf = np.zeros(64, dtype=np.int64)  # [capacity] the history, then unused room
        self._len = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The history (a read-only view).  # [n] int64"""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens (amortised O(1) per token: the buffer doubles when full)."""
        new = np.fromiter(tokens, dtype=np.int64)
        end = self._len + new.size
        if end > self._buf.size:
            grown = np.zeros(max(end, 2 * self._buf.size), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : end] = new
        self._len = end

    def occurrences(self, config: SuffixConfig) -> tuple[np.ndarray, np.ndarray]:
        """The occurrences drafting uses: their end positions and match lengths, longest match first, most
        recent first among equal lengths, at most ``config.max_occurrences``.  # [k] int64, [k] int64"""
        tokens, n, limit = self._buf, self._len, config.max_occurrences
        candidates = np.flatnonzero(tokens[: max(0, n - 1)] == tokens[n - 1]) if n else np.zeros(0, np.int64)
        ends, lengths = [], []
        # Most recent candidates first, in blocks that grow 4x: once `limit` of them match the full
        # `max_match`, no older one can rank above them, so a long repetitive history (thousands of
        # candidates) costs only its last block.
        hi, block, full = candidates.size, 4 * limit, 0
        while hi > 0:
            lo = max(0, hi - block)
            chunk = candidates[lo:hi]
            chunk_lengths = _match_lengths(tokens, n, chunk, config.max_match)
            ends.append(chunk)
            lengths.append(chunk_lengths)
            full += int(np.count_nonzero(chunk_lengths == config.max_match))
            if full >= limit:
                break
            hi, block = lo, 4 * block
        if not ends:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ends_all, lengths_all = np.concatenate(ends), np.concatenate(lengths)
        keep = lengths_all >= config.min_match
        ends_all, lengths_all = ends_all[keep], lengths_all[keep]
        rank = lengths_all * n + ends_all  # longest first, then most recent: one distinct key per candidate
        if rank.size > limit:  # a partial sort: a common token has thousands of candidates
            top = np.argpartition(rank, rank.size - limit)[rank.size - limit :]
            ends_all, lengths_all, rank = ends_all[top], lengths_all[top], rank[top]
        order = np.argsort(-rank)
        return ends_all[order], lengths_all[order]

    def suffix_tree(self, config: SuffixConfig, *, with_q: bool = False) -> DraftTree:
        """The suffix draft of this history (see the module docstring), rooted at its last token.

        ``with_q``: True for a sampled request (multi-step speculative sampling verifies with it, and the
        services require a ``q`` under sampling): each child its own group with a point-mass ``q``; False
        for a greedy one: one group per node, ``q`` None."""
        if self._len == 0:
            raise ValueError("suffix drafting needs at least one committed token (the root)")
        n = self._len
        root = int(self._buf[n - 1])
        ends, lengths = self.occurrences(config)
        positions = ends[:, None] + np.arange(1, config.max_depth + 1)  # [k, max_depth] of the continuations
        spans = np.minimum(positions[:, -1], n - 1) - ends  # [k] continuation lengths (cut at the history's end)
        rows = self._buf[np.minimum(positions, n - 1)]  # [k, max_depth]; past a span: filler, never read
        weights = config.length_weight ** (lengths - 1).astype(np.float64)  # [k]
        grown = _grow(_Occurrences(rows.tolist(), spans.tolist(), weights.tolist(), ends.tolist()), config)
        return _build(root, grown, with_q)


def suffix_tree(tokens: Sequence[int], config: SuffixConfig, *, with_q: bool = False) -> DraftTree:
    """The suffix draft of the history ``tokens`` (see :meth:`TokenHistory.suffix_tree`), without keeping a
    :class:`TokenHistory` (each call converts the whole history)."""
    return TokenHistory(tokens).suffix_tree(config, with_q=with_q)


def _match_lengths(tokens: np.ndarray, n: int, ends: np.ndarray, max_match: int) -> np.ndarray:
    """Match length of each candidate end (``tokens[e] == tokens[n - 1]``), capped at ``max_match``.  # [c]

    A handful of numpy calls whatever ``max_match`` (a loop over lengths would pay numpy's per-call
    overhead for each, which dominates with the few candidates of most drafts)."""
    lengths = np.ones(ends.size, dtype=np.int64)
    if max_match < 2 or ends.size == 0:
        return lengths
    # The token before first, alone: it rules out most candidates of a common last token, so that the
    # [rows, max_match] comparison of the rest stays small.
    alive = np.flatnonzero((ends >= 1) & (tokens[np.maximum(ends - 1, 0)] == tokens[n - 2]))
    back = np.arange(2, max_match)
    earlier = ends[alive, None] - back  # [a, max_match - 2] the tokens further back, position by position
    same = tokens[np.maximum(earlier, 0)] == tokens[n - 1 - back]  # [a, max_match - 2]
    same &= earlier >= 0  # a match cannot reach before the history's first token
    lengths[alive] = 2 + np.logical_and.accumulate(same, axis=1).sum(axis=1)
    return lengths


@dataclass(frozen=True)
class _Occurrences:
    """The used occurrences, ranked: ``rows[i][:spans[i]]`` is the continuation of the one ending at
    ``ends[i]``, which weighs ``weights[i]``."""

    rows: list[list[int]]
    spans: list[int]
    weights: list[float]
    ends: list[int]


@dataclass
class _Grown:
    """The kept nodes in the order they were kept (parents first): token, parent, depth and score."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


def _grow(occ: _Occurrences, config: SuffixConfig) -> _Grown:
    """The best ``config.max_nodes`` nodes of the trie of the continuations, found best first: a heap of the
    children of kept nodes, keyed (-score, depth, parent, sibling rank). A child never scores above its
    parent, so popping in key order keeps the best nodes and each one after its parent; only the kept
    nodes' children are ever built (about ``max_nodes`` partitions of at most ``max_occurrences`` items)."""
    grown = _Grown([0], [-1], [0], [1.0])  # the root's token is filled in by the caller
    heap: list[tuple[float, int, int, int, int, list[int]]] = []
    _push_children(heap, occ, config, 0, 0, 1.0, list(range(len(occ.ends))))
    while heap and len(grown.tokens) <= config.max_nodes:
        neg_score, depth, parent, _, token, members = heapq.heappop(heap)
        node = len(grown.tokens)
        grown.tokens.append(token)
        grown.parents.append(parent)
        grown.depths.append(depth)
        grown.scores.append(-neg_score)
        if depth < config.max_depth:
            _push_children(heap, occ, config, node, depth, -neg_score, members)
    return grown


def _push_children(heap: list, occ: _Occurrences, config: SuffixConfig, node: int, depth: int, score: float, members):
    """Push the children of kept ``node`` (at ``depth``, with ``score``, whose path the occurrences
    ``members`` continue): the up to ``max_width`` best next tokens by support, then recency."""
    if len(members) == 1:  # a lone occurrence (a long copy): no partition to make
        (i,) = members
        child_score = score * (occ.weights[i] / (occ.weights[i] + config.unseen_weight))
        if occ.spans[i] > depth and child_score > MIN_SCORE:
            heapq.heappush(heap, (-child_score, depth + 1, node, 0, occ.rows[i][depth], members))
        return
    by_token: dict[int, list] = {}  # next token -> [support, latest end, members]
    onward = 0.0  # the support going on past the node: occurrences cut off by the history's end say nothing
    spans, weights, rows, ends = occ.spans, occ.weights, occ.rows, occ.ends
    for i in members:
        if spans[i] > depth:
            w = weights[i]
            onward += w
            child = by_token.get(rows[i][depth])
            if child is None:
                by_token[rows[i][depth]] = [w, ends[i], [i]]
            else:
                child[0] += w
                child[1] = max(child[1], ends[i])
                child[2].append(i)
    children = sorted(by_token.items(), key=lambda c: (-c[1][0], -c[1][1]))
    denominator = onward + config.unseen_weight
    for rank, (token, (support, _, child_members)) in enumerate(children[: config.max_width]):
        child_score = score * (support / denominator)
        if child_score > MIN_SCORE:  # a child scores at most its parent: none of its subtree would pass either
            heapq.heappush(heap, (-child_score, depth + 1, node, rank, token, child_members))


def point_mass(token: int) -> SparseDist:
    """The draft distribution of a deterministic proposal: all its mass on ``token``."""
    return SparseDist(np.array([token], dtype=np.int64), np.ones(1))


def _build(root: int, grown: _Grown, with_q: bool) -> DraftTree:
    """The :class:`DraftTree` of the kept nodes, numbered depth by depth (best first within a depth), with
    their groups and scores."""
    order = sorted(range(len(grown.tokens)), key=grown.depths.__getitem__)  # stable: best first in a depth
    index = {old: new for new, old in enumerate(order)}
    parents = tuple(-1 if old == 0 else index[grown.parents[old]] for old in order)
    tokens = (root, *(grown.tokens[old] for old in order[1:]))
    if with_q:  # deterministic candidates: one try each, with a point mass (see the module docstring)
        groups = [DraftGroup(parents[i], (i,), point_mass(tokens[i])) for i in range(1, len(order))]
    else:
        children: dict[int, list[int]] = {}
        for i in range(1, len(order)):
            children.setdefault(parents[i], []).append(i)
        groups = [DraftGroup(p, tuple(kids), None) for p, kids in sorted(children.items())]
    return DraftTree(TokenTree(tokens, parents), tuple(groups), tuple(grown.scores[old] for old in order))
