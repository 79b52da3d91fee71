"""Model-free suffix drafting (specinfer.core.suffix): the tree's invariants, known histories, greedy and
sampled exactness on synthetic models (no torch), and the work per draft.

The statistical test runs a small generation loop whose "LLM" is the fixed random function of
tests/test_verify.py, so the exact distribution of the first tokens is known; two wrongly drafted
distributions ``q`` (the candidates unchanged) must fail the same test.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from functools import cache, partial
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stats import chi_square_pvalue
from test_verify import VOCAB, synthetic_logits  # tests/test_verify.py

from specinfer.core import (
    DraftGroup,
    DraftTree,
    SamplingParams,
    SparseDist,
    TokenTree,
    combine_drafts,
    process_logits,
    verify_greedy,
    verify_stochastic,
)
from specinfer.core import suffix as suffix_module
from specinfer.core.coupled import position_noise, verify_coupled
from specinfer.core.dynamic_trees import MIN_SCORE
from specinfer.core.suffix import SuffixConfig, TokenHistory, point_mass, suffix_tree
from specinfer.core.verify import mss_tries

PARAMS = SamplingParams(temperature=1.0)


def _paths(draft: DraftTree) -> list[tuple[int, ...]]:
    """Each node's path tokens, the root's excluded (the root's path is empty)."""
    tree = draft.tree
    return [tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in range(len(tree))]


def _reference_occurrences(tokens: list[int], config: SuffixConfig) -> list[tuple[int, int]]:
    """(end, match length) of the occurrences, by the definition: every earlier position, ranked."""
    n, found = len(tokens), []
    for e in range(n - 1):
        m = 0
        while m < config.max_match and m <= e and tokens[e - m] == tokens[n - 1 - m]:
            m += 1
        if m >= config.min_match:
            found.append((e, m))
    found.sort(key=lambda em: (-em[1], -em[0]))
    return found[: config.max_occurrences]


def _reference_scores(tokens: list[int], config: SuffixConfig) -> dict[tuple[int, ...], float]:
    """Every path's score in the whole trie of the used continuations (each node's children cut to the
    best ``max_width``), by the module docstring's definitions."""
    support: dict[tuple[int, ...], float] = defaultdict(float)
    onward: dict[tuple[int, ...], float] = defaultdict(float)
    recent: dict[tuple[int, ...], int] = defaultdict(lambda: -1)
    for e, m in _reference_occurrences(tokens, config):
        continuation = tuple(tokens[e + 1 : e + 1 + config.max_depth])
        for d in range(len(continuation)):
            onward[continuation[:d]] += config.length_weight ** (m - 1)
            support[continuation[: d + 1]] += config.length_weight ** (m - 1)
            recent[continuation[: d + 1]] = max(recent[continuation[: d + 1]], e)
    scores, frontier = {(): 1.0}, [()]
    for path in frontier:
        kids = [p for p in support if p[:-1] == path and len(p) == len(path) + 1]
        kids.sort(key=lambda p: (-support[p], -recent[p]))
        for kid in kids[: config.max_width]:
            scores[kid] = scores[path] * support[kid] / (onward[path] + config.unseen_weight)
            frontier.append(kid)
    return scores


@st.composite
def configs(draw) -> tuple[SuffixConfig, bool]:
    """A small config, and whether the draft is for a sampled request (``with_q``)."""
    min_match = draw(st.integers(1, 3))
    config = SuffixConfig(
        max_nodes=draw(st.integers(0, 20)),
        max_depth=draw(st.integers(1, 6)),
        max_width=draw(st.integers(1, 4)),
        min_match=min_match,
        max_match=min_match + draw(st.integers(0, 3)),
        max_occurrences=draw(st.integers(1, 8)),
        length_weight=draw(st.sampled_from([1.0, 2.0, 4.0])),
    )
    return config, draw(st.booleans())


histories = st.lists(st.integers(0, 3), min_size=1, max_size=80)  # a small vocabulary: repeats happen


@settings(max_examples=300, deadline=None)
@given(tokens=histories, config_q=configs(), other=st.lists(st.integers(0, 3), max_size=3))
def test_a_suffix_tree_is_a_valid_draft_of_what_followed_the_suffix(tokens, config_q, other):
    config, with_q = config_q
    draft = suffix_tree(tokens, config, with_q=with_q)
    tree = draft.tree
    assert tree.tokens[0] == tokens[-1] and tree.parents[0] == -1  # TokenTree checked the rest of the shape
    assert len(tree) <= config.max_nodes + 1 and int(tree.depths.max()) <= config.max_depth
    assert all(len(kids) <= config.max_width for kids in tree.children)
    used = [e for e, _ in _reference_occurrences(tokens, config)]
    for path in _paths(draft)[1:]:  # each path follows a used occurrence of the (at least min_match) suffix
        assert any(tuple(tokens[e + 1 : e + 1 + len(path)]) == path for e in used), path
    if used and config.max_nodes:
        assert len(tree) >= 2
    # scores: the root 1.0, each in (MIN_SCORE, 1], never above the parent's
    assert len(draft.scores) == len(tree) and draft.scores[0] == 1.0
    assert all(MIN_SCORE < s <= 1.0 for s in draft.scores)
    assert all(draft.scores[i] <= draft.scores[tree.parents[i]] for i in range(1, len(tree)))
    # groups: every non-root node in exactly one, under its parent; point masses under sampling
    grouped = [c for g in draft.groups for c in g.children]
    assert sorted(grouped) == list(range(1, len(tree)))
    assert all(tree.parents[c] == g.parent for g in draft.groups for c in g.children)
    if with_q:
        assert all(len(g.children) == 1 and g.q.tokens.tolist() == [tree.tokens[g.children[0]]] for g in draft.groups)
        assert sum(len(t) for t in mss_tries(draft)) == len(tree) - 1
    else:
        assert all(g.q is None for g in draft.groups) and len({g.parent for g in draft.groups}) == len(draft.groups)
    # merges with another drafter's tree (same root), keeping every sequence of both
    chain = TokenTree.chain([tokens[-1], *other])
    q = point_mass if with_q else lambda _: None
    chain_draft = DraftTree(chain, tuple(DraftGroup(i - 1, (i,), q(chain.tokens[i])) for i in range(1, len(chain))))
    merged = combine_drafts(tokens[-1], [draft, chain_draft])
    assert merged.tree.sequences() == tree.sequences() | chain.sequences()
    assert len(merged.groups) == len(draft.groups) + len(chain_draft.groups)


@settings(max_examples=300, deadline=None)
@given(tokens=histories, config_q=configs())
def test_the_tree_keeps_the_best_nodes_of_the_trie(tokens, config_q):
    config, with_q = config_q
    draft = suffix_tree(tokens, config, with_q=with_q)
    reference = _reference_scores(tokens, config)
    assert draft.scores == pytest.approx([reference[path] for path in _paths(draft)], rel=1e-12)
    best = sorted(reference.values(), reverse=True)[: config.max_nodes + 1]  # the root's 1.0 first
    assert sorted(draft.scores, reverse=True) == pytest.approx(best, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=300), config_q=configs())
def test_occurrences_are_the_longest_matches_most_recent_first(tokens, config_q):
    """The vectorised search (recent candidates first, stopping early) agrees with the definition."""
    config = config_q[0]
    ends, lengths = TokenHistory(tokens).occurrences(config)
    assert list(zip(ends.tolist(), lengths.tolist(), strict=True)) == _reference_occurrences(tokens, config)


@settings(max_examples=100, deadline=None)
@given(tokens=histories, cuts=st.lists(st.integers(0, 80), max_size=6), config_q=configs())
def test_an_extended_history_drafts_what_the_whole_history_does(tokens, cuts, config_q):
    config, with_q = config_q
    history = TokenHistory()
    at = 0
    for cut in sorted(cuts) + [len(tokens)]:
        history.extend(tokens[at:cut])
        at = max(at, cut)
    assert history.tokens.tolist() == tokens
    a, b = history.suffix_tree(config, with_q=with_q), suffix_tree(tokens, config, with_q=with_q)
    assert a.tree == b.tree and a.scores == b.scores
    assert [(g.parent, g.children) for g in a.groups] == [(g.parent, g.children) for g in b.groups]


def _children_tokens(draft: DraftTree, node: int = 0) -> tuple[int, ...]:
    return tuple(draft.tree.tokens[c] for c in draft.tree.children[node])


def test_known_histories():
    config = SuffixConfig(max_nodes=8, max_depth=4)
    a, b, c, d = 1, 2, 3, 4
    chain = suffix_tree([a, b, c, d, a, b], config)
    assert _paths(chain)[1:] == [(c,), (c, d), (c, d, a), (c, d, a, b)]
    assert chain.scores == pytest.approx([1.0, 0.8, 0.64, 0.512, 0.4096])  # one match of 2: weight 4, 4/(4+1) per edge
    assert suffix_tree([a, b, c, d], config) == DraftTree(TokenTree.root_only(d), (), (1.0,))
    assert suffix_tree([a], config).tree == TokenTree.root_only(a)
    with pytest.raises(ValueError, match="at least one committed token"):
        suffix_tree([], config)
    # children by support; equal support: the most recent occurrence first
    assert _children_tokens(suffix_tree([a, b, c, a, b, c, a, b, d, a, b], config)) == (c, d)
    assert _children_tokens(suffix_tree([a, b, c, a, b, d, a, b], config)) == (d, c)
    # a longer match outweighs more numerous shorter ones (9 1 2 -> 3 once; 1 2 -> 4 twice), unless weighed alike
    history = [9, 1, 2, 3, 0, 1, 2, 4, 5, 1, 2, 4, 9, 1, 2]
    assert _children_tokens(suffix_tree(history, config)) == (3, 4)
    assert _children_tokens(suffix_tree(history, SuffixConfig(max_nodes=8, max_depth=4, length_weight=1.0))) == (4, 3)
    assert _children_tokens(suffix_tree(history, SuffixConfig(max_nodes=8, max_depth=4, max_occurrences=1))) == (3,)
    # min_match: "4 2" never occurred before, "2" did
    assert len(suffix_tree([1, 2, 3, 4, 2], SuffixConfig(min_match=2)).tree) == 1
    assert _children_tokens(suffix_tree([1, 2, 3, 4, 2], SuffixConfig(min_match=1))) == (3,)
    # max_width and max_nodes: the best children, the best nodes
    wide = [5, 0, 5, 1, 5, 2, 5, 3, 5, 0, 5]
    assert _children_tokens(suffix_tree(wide, SuffixConfig(max_width=2, max_depth=1))) == (1, 0)  # "0 5" -> 1
    assert _children_tokens(suffix_tree(wide, SuffixConfig(max_width=2, max_depth=1, length_weight=1.0))) == (0, 3)
    assert len(suffix_tree(wide, SuffixConfig(max_nodes=3, max_depth=3)).tree) == 4


def test_config_checks_and_budget():
    assert SuffixConfig(min_match=2).within(8, 3) == SuffixConfig(max_nodes=8, max_depth=3, min_match=2)
    assert SuffixConfig(max_nodes=4).within(8, 30) == SuffixConfig(max_nodes=4)  # never grown past the config
    bad_configs = ({"max_depth": 0}, {"max_nodes": -1}, {"min_match": 0}, {"min_match": 3, "max_match": 2})
    for bad in (*bad_configs, {"unseen_weight": 0.0}, {"length_weight": 0.5}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)


def _copying_llm(seq: tuple[int, ...]) -> int:
    """A greedy "LLM" that copies: the token after the latest earlier occurrence of the last two tokens,
    else a hash of the sequence."""
    for e in range(len(seq) - 2, 0, -1):
        if seq[e - 1 : e + 1] == seq[-2:]:
            return seq[e + 1]
    return hash(seq) % 5


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), config_q=configs())
def test_greedy_verification_accepts_the_longest_path_the_llm_agrees_with(tokens, config_q):
    config, with_q = config_q
    draft = suffix_tree(tokens, config, with_q=with_q)
    context = tuple(tokens)
    res = verify_greedy(draft.tree, np.array([_copying_llm(context + path) for path in _paths(draft)]))
    rollout: tuple[int, ...] = ()  # the LLM's own tokens, while the tree holds them
    while (tokens[-1], *rollout) in draft.tree.sequences():
        rollout += (_copying_llm(context + rollout),)
    assert res.new_tokens == rollout


def test_greedy_on_a_known_continuation():
    draft = suffix_tree([1, 2, 3, 4, 5, 1, 2], SuffixConfig(max_depth=4))
    llm = {(): 3, (3,): 4, (3, 4): 9}  # the LLM follows the earlier text for two tokens, then departs
    res = verify_greedy(draft.tree, np.array([llm.get(path, 0) for path in _paths(draft)]))
    assert res.accepted_tokens == (3, 4) and res.bonus_token == 9


# --- sampling -------------------------------------------------------------------------------------------

HISTORY = (1, 2, 3, 4, 1, 2, 5, 0, 1, 2)  # "1 2" was followed by "3 4" and by "5 0"
SAMPLED = SuffixConfig(max_nodes=6, max_depth=2)


@cache
def _llm(seq: tuple[int, ...]) -> np.ndarray:
    """The "LLM": half the fixed random distribution of tests/test_verify.py, half :func:`_copying_llm`'s
    token, so that suffix drafts are often accepted, to their full depth."""
    p = 0.5 * process_logits(synthetic_logits(seq, "llm"), PARAMS)
    p[_copying_llm(seq) % VOCAB] += 0.5
    return p


def _exact(n_tokens: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in product(range(VOCAB), repeat=n_tokens):
        prob, ctx = 1.0, HISTORY
        for t in seq:
            prob *= _llm(ctx)[t]
            ctx = ctx + (t,)
        out[seq] = prob
    return out


def _uniform_q(draft: DraftTree) -> DraftTree:
    """Wrong: each candidate claims to be drawn from the uniform distribution."""
    uniform = SparseDist(np.arange(VOCAB), np.full(VOCAB, 1.0 / VOCAB))
    return DraftTree(draft.tree, tuple(DraftGroup(g.parent, g.children, uniform) for g in draft.groups), draft.scores)


def _one_group(draft: DraftTree) -> DraftTree:
    """Wrong: siblings claim to be drawn together, without replacement, from the uniform over them."""
    groups = []
    for node, kids in enumerate(draft.tree.children):
        if kids:
            tokens = np.array([draft.tree.tokens[c] for c in kids])
            groups.append(DraftGroup(node, kids, SparseDist(tokens, np.full(len(kids), 1.0 / len(kids)))))
    return DraftTree(draft.tree, tuple(groups), draft.scores)


def _generate(draft_of: Callable[[tuple[int, ...]], DraftTree], n_samples: int, seed: int) -> tuple[Counter, Counter]:
    """The first two tokens after HISTORY, ``n_samples`` times, one MSS step after another; and how many
    draft tokens each step accepted."""
    rng = np.random.default_rng(seed)
    drafts: dict[tuple[int, ...], tuple[DraftTree, list[tuple[int, ...]]]] = {}
    counts, accepted = Counter(), Counter()
    for _ in range(n_samples):
        context = HISTORY
        while len(context) - len(HISTORY) < 2:
            if context not in drafts:
                draft = draft_of(context)
                drafts[context] = draft, [context + path for path in _paths(draft)]
            draft, seqs = drafts[context]
            res = verify_stochastic(draft, lambda node, seqs=seqs: _llm(seqs[node]), rng)
            accepted[res.num_accepted] += 1
            context = context + res.new_tokens
        counts[context[len(HISTORY) : len(HISTORY) + 2]] += 1
    return counts, accepted


def _first(counts: Counter) -> Counter:
    out: Counter = Counter()
    for seq, k in counts.items():
        out[seq[:1]] += k
    return out


def _without_best_child(draft: DraftTree) -> DraftTree:
    """A cut chosen without looking at any random draw: the root's first child and its subtree dropped."""
    tree = draft.tree
    if not tree.children[0]:
        return draft
    dropped = tree.children[0][0]
    return draft.subtree([i for i in range(len(tree)) if dropped not in tree.path_to(i)])


@pytest.mark.parametrize(("cut", "min_accepted"), [(None, (2000, 2000)), (_without_best_child, (500, 50))])
def test_mss_over_suffix_drafts_samples_the_llm(cut, min_accepted):
    """Exact whole, and exact cut to a subtree (the candidates are fixed before any draw)."""
    draft = suffix_tree(HISTORY, SAMPLED, with_q=True)
    assert _children_tokens(draft) == (5, 3) and _paths(draft)[1:] == [(5,), (3,), (5, 0), (3, 4)]
    draft_of = partial(suffix_tree, config=SAMPLED, with_q=True)
    counts, accepted = _generate(draft_of if cut is None else lambda ctx: cut(draft_of(ctx)), 20000, seed=7)
    assert accepted[1] > min_accepted[0] and accepted[2] > min_accepted[1]  # the tree is used, to its full depth
    assert chi_square_pvalue(_first(counts), _exact(1)) > 0.001
    assert chi_square_pvalue(counts, _exact(2)) > 0.001


@pytest.mark.parametrize("wrong", [_uniform_q, _one_group])
def test_a_wrong_draft_distribution_fails_the_same_test(wrong):
    counts, _ = _generate(lambda ctx: wrong(suffix_tree(ctx, SAMPLED, with_q=True)), 4000, seed=7)
    assert chi_square_pvalue(_first(counts), _exact(1)) < 1e-6
    assert chi_square_pvalue(counts, _exact(2)) < 1e-6


def test_coupled_verification_of_suffix_drafts_gives_plain_decodings_tokens():
    """Coupled verification uses only the tree: suffix drafts change how many tokens a step accepts, never which."""

    def generate(seed: int, draft_of) -> tuple[int, ...]:
        context = HISTORY
        while len(context) - len(HISTORY) < 6:
            tree = draft_of(context)
            seqs = [context + path for path in _paths(DraftTree(tree))]
            noise = partial(position_noise, seed, vocab_size=VOCAB)
            res = verify_coupled(tree, lambda node, seqs=seqs: _llm(seqs[node]), noise, len(context) - 1)
            context = context + res.new_tokens
        return context[len(HISTORY) : len(HISTORY) + 6]

    for seed in range(30):
        plain = generate(seed, lambda ctx: TokenTree.root_only(ctx[-1]))
        assert generate(seed, lambda ctx: suffix_tree(ctx, SuffixConfig(), with_q=True).tree) == plain


# --- cost -----------------------------------------------------------------------------------------------


def _histories(n: int, rng: np.random.Generator) -> dict[str, list[int]]:
    """Histories of ``n`` tokens: code-like copies of one text with edits, a small vocabulary (many short
    matches), one repeated token (every position a full-length match: the worst case of the scan)."""
    base = rng.integers(0, 32000, 300).tolist()
    copied: list[int] = []
    while len(copied) < n:
        start = int(rng.integers(0, 250))
        copied += base[start : start + int(rng.integers(10, 50))] + rng.integers(0, 32000, 3).tolist()
    return {"copies": copied[:n], "vocab 8": rng.integers(0, 8, n).tolist(), "constant": [7] * n}


def test_draft_work_is_bounded_whatever_the_history_length(monkeypatch):
    """The cost the module docstring promises, counted rather than timed (a loaded machine times nothing
    reliably): the growth partitions the occurrences of at most ``max_nodes + 1`` nodes, each among at most
    ``max_occurrences``, however long the history; and the scan of a long repetitive history compares only
    its most recent candidates (the first block), not all of them."""
    config = SuffixConfig(max_nodes=16, max_depth=8)
    partitions: list[int] = []  # per _push_children call: how many occurrences it partitions
    scanned: list[int] = []  # per _match_lengths call: how many candidates it compares
    push, lengths = suffix_module._push_children, suffix_module._match_lengths

    def counting_push(heap, occ, cfg, node, depth, score, members):
        partitions.append(len(members))
        return push(heap, occ, cfg, node, depth, score, members)

    def counting_lengths(tokens, n, ends, max_match):
        scanned.append(int(ends.size))
        return lengths(tokens, n, ends, max_match)

    monkeypatch.setattr(suffix_module, "_push_children", counting_push)
    monkeypatch.setattr(suffix_module, "_match_lengths", counting_lengths)
    rng = np.random.default_rng(0)
    constant_scans = []
    for n in (1024, 4096, 16384):
        for name, tokens in _histories(n, rng).items():
            history = TokenHistory(tokens)
            partitions.clear()
            scanned.clear()
            draft = history.suffix_tree(config)
            assert 0 < len(partitions) <= config.max_nodes + 1, (n, name, len(partitions))
            assert max(partitions) <= config.max_occurrences, (n, name)
            if name == "constant":
                constant_scans.append(sum(scanned))
            assert len(draft.tree) - 1 <= config.max_nodes
            assert len(history.occurrences(config)[0]) <= config.max_occurrences
            assert draft == suffix_tree(tokens, config), name  # a kept history drafts what the list does
    # every candidate of a constant history matches in full: the first block (4 x max_occurrences) settles it
    assert constant_scans == [4 * config.max_occurrences] * 3, constant_scans
