"""Greedy verification and multi-step speculative sampling on synthetic models (no torch).

The stochastic tests run a small generation loop whose "LLM" and "SSMs" are fixed random
functions from a token sequence to logits, so the exact distribution of the first tokens is
known and the empirical one can be tested against it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from functools import cache
from itertools import product

import numpy as np
import pytest
from stats import chi_square_pvalue

from specinfer.core import (
    DraftTree,
    ExpansionConfig,
    SamplingParams,
    SparseDist,
    TokenTree,
    TreeBuilder,
    VerifyResult,
    draw_without_replacement,
    merge_drafts,
    process_logits,
    sparsify,
    verify_greedy,
    verify_stochastic,
)

VOCAB = 6


@cache
def synthetic_logits(seq: tuple[int, ...], salt: str) -> np.ndarray:
    digest = hashlib.sha256(f"{salt}:{seq}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).normal(0, 1.5, VOCAB)


def test_greedy_walks_the_matching_branch():
    tree = TokenTree((7, 1, 2, 3, 4), (-1, 0, 0, 2, 2))
    argmax = np.array([2, 9, 9, 9, 5])  # LLM: after 7 -> 2, after 7,2 -> 4, after 7,2,4 -> 5
    argmax[2] = 4
    res = verify_greedy(tree, argmax)
    assert res.accepted_nodes == (2, 4) and res.accepted_tokens == (2, 4) and res.bonus_token == 5
    assert verify_greedy(TokenTree.root_only(7), np.array([3])).new_tokens == (3,)


@cache
def synthetic_probs(seq: tuple[int, ...], salt: str, params: SamplingParams) -> np.ndarray:
    """``process_logits`` of :func:`synthetic_logits`, cached as they are: the loops below ask for the same few
    hundred sequences ~100k times a test. Read-only, so that no caller can change what the next one gets."""
    probs = process_logits(synthetic_logits(seq, salt), params)
    probs.flags.writeable = False
    return probs


@cache
def synthetic_draft_dist(seq: tuple[int, ...], salt: str, params: SamplingParams, support: int) -> SparseDist:
    """An SSM's draft distribution after ``seq``: :func:`synthetic_probs` cut to its ``support`` likeliest tokens."""
    q = sparsify(synthetic_probs(seq, salt, params), support)
    q.tokens.flags.writeable = q.probs.flags.writeable = False
    return q


def _draft(
    context: tuple[int, ...], widths: tuple[int, ...], salt: str, params: SamplingParams, rng, support: int
) -> DraftTree:
    builder = TreeBuilder(context[-1], ExpansionConfig(widths))
    seqs = {0: context}
    while not builder.done:
        proposals = []
        for node in builder.frontier():
            q = synthetic_draft_dist(seqs[node], salt, params, support)
            proposals.append((draw_without_replacement(q, builder.width(), rng), q))
        new = builder.expand(proposals)
        for n, parent, token in zip(new, builder.parents_of(new), builder.tokens_of(new), strict=True):
            seqs[n] = seqs[parent] + (token,)
    return builder.build()


def _generate(verify, params, n_tokens, n_samples, salts, widths, seed, support=VOCAB) -> Counter:
    rng = np.random.default_rng(seed)
    counts: Counter = Counter()
    for _ in range(n_samples):
        context: tuple[int, ...] = (0,)
        while len(context) - 1 < n_tokens:
            draft = merge_drafts([_draft(context, widths, s, params, rng, support) for s in salts])
            seqs = {0: context}
            for i in range(1, len(draft.tree)):
                seqs[i] = seqs[draft.tree.parents[i]] + (draft.tree.tokens[i],)
            res = verify(draft, lambda node, seqs=seqs: synthetic_probs(seqs[node], "llm", params), rng)
            context = context + res.new_tokens
        counts[context[1 : n_tokens + 1]] += 1
    return counts


def _exact(params, n_tokens) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in product(range(VOCAB), repeat=n_tokens):
        prob, ctx = 1.0, (0,)
        for t in seq:
            prob *= process_logits(synthetic_logits(ctx, "llm"), params)[t]
            ctx = ctx + (t,)
        out[seq] = prob
    return out


def always_accept(draft: DraftTree, target_probs, rng) -> VerifyResult:
    """A wrong verifier: takes the first child at every node, then samples the bonus from p."""
    tree, u, path = draft.tree, 0, []
    while tree.children[u]:
        u = tree.children[u][0]
        path.append(u)
    p = target_probs(u)
    return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path), int(rng.choice(p.size, p=p)))


def forget_residual(draft: DraftTree, target_probs, rng) -> VerifyResult:
    """A wrong verifier: after rejecting every child, samples from p instead of the residual."""
    res = verify_stochastic(draft, target_probs, rng)
    # re-sample the bonus from the untouched target distribution at the last accepted node
    last = res.accepted_nodes[-1] if res.accepted_nodes else 0
    p = target_probs(last)
    return VerifyResult(res.accepted_nodes, res.accepted_tokens, int(rng.choice(p.size, p=p)))


CASES = {
    "width3": (SamplingParams(temperature=1.0), ("ssm-a",), (3, 2)),
    "merged-two-ssms": (SamplingParams(temperature=1.0), ("ssm-a", "ssm-b"), (2, 2)),
    "merged-same-ssm-twice": (SamplingParams(temperature=1.0), ("ssm-a", "ssm-a"), (2, 1)),
    "top-k-top-p": (SamplingParams(temperature=0.7, top_k=4, top_p=0.9), ("ssm-a", "ssm-b"), (2, 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mss_matches_llm_sampling(case):
    params, salts, widths = CASES[case]
    counts = _generate(verify_stochastic, params, n_tokens=2, n_samples=20000, salts=salts, widths=widths, seed=1234)
    assert chi_square_pvalue(counts, _exact(params, 2)) > 0.001


@pytest.mark.slow
def test_mss_with_truncated_drafts_is_still_exact():
    params, salts, widths = SamplingParams(temperature=1.0), ("ssm-a",), (2, 2)
    counts = _generate(verify_stochastic, params, 2, 20000, salts, widths, seed=99, support=3)
    assert chi_square_pvalue(counts, _exact(params, 2)) > 0.001


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [always_accept, forget_residual])
def test_a_wrong_verifier_fails_the_same_test(wrong):
    params, salts, widths = CASES["width3"]
    counts = _generate(wrong, params, n_tokens=2, n_samples=20000, salts=salts, widths=widths, seed=1234)
    assert chi_square_pvalue(counts, _exact(params, 2)) < 1e-6
