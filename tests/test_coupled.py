"""Coupled verification (specinfer.core.coupled) on synthetic models (no torch).

The "LLM" and "SSMs" are the fixed random functions of tests/test_verify.py, so the exact
distribution of the first tokens is known. Two properties are tested: for every seed the tokens
equal plain decoding's with that seed (whatever the trees), and over many seeds they are
distributed as sampling from the LLM (chi-square, with a negative control that fails).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import gumbel_r, kstest
from stats import chi_square_pvalue
from test_verify import VOCAB, _exact, synthetic_draft_dist, synthetic_logits, synthetic_probs  # tests/test_verify.py

from specinfer.core import SamplingParams, TokenTree, process_logits, sparsify
from specinfer.core.coupled import (
    coupled_children,
    coupled_token,
    int64_seed,
    noise_at,
    noise_bits,
    position_noise,
    verify_coupled,
)

PARAMS = SamplingParams(temperature=1.0)


def _draft_tree(
    context: tuple[int, ...],
    widths: tuple[int, ...],
    salt: str,
    params: SamplingParams,
    seed: int,
    rng: np.random.Generator,
    keep: float,
) -> TokenTree:
    """A static tree drafted by Gumbel-top-k with the position noise, then a random subtree of it
    (each node kept with probability ``keep`` if its parent is): shape and tokens vary freely."""
    tokens, parents, seqs = [context[-1]], [-1], [context]
    frontier = [0]
    for depth, width in enumerate(widths, start=1):
        nxt = []
        for node in frontier:
            q = synthetic_draft_dist(seqs[node], salt, params, VOCAB)
            for token in coupled_children(q, seed, len(context) - 1 + depth, width):
                if rng.random() < keep:
                    tokens.append(token)
                    parents.append(node)
                    seqs.append(seqs[node] + (token,))
                    nxt.append(len(tokens) - 1)
        frontier = nxt
    return TokenTree(tuple(tokens), tuple(parents))


def _generate(
    seed: int, n_tokens: int, widths: tuple[int, ...], salt: str, params=PARAMS, keep: float = 1.0, noise_of=None
) -> tuple[int, ...]:
    """``n_tokens`` tokens after the context ``(0,)``, one coupled verify step after another."""
    noise = noise_of(seed) if noise_of else partial(position_noise, seed, vocab_size=VOCAB)
    rng = np.random.default_rng(seed + 10**6)  # the tree shapes: independent of the noise
    context: tuple[int, ...] = (0,)
    while len(context) - 1 < n_tokens:
        tree = _draft_tree(context, widths, salt, params, seed, rng, keep)
        seqs = {0: context}
        for i in range(1, len(tree)):
            seqs[i] = seqs[tree.parents[i]] + (tree.tokens[i],)
        res = verify_coupled(
            tree,
            lambda node, seqs=seqs: synthetic_probs(seqs[node], "llm", params),
            noise,
            len(context) - 1,
        )
        context = context + res.new_tokens
    return context[1 : n_tokens + 1]


def test_position_noise_is_a_pure_function_of_seed_and_index():
    a, b = position_noise(7, 12, 100), position_noise(7, 12, 100)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, position_noise(7, 13, 100)) and not np.array_equal(a, position_noise(8, 12, 100))


@pytest.mark.parametrize("seed", [0, 5, 2**32 + 7, 2**63 - 1, 2**63, 2**64 - 1])
def test_a_64_bit_seed_gives_the_same_bits_as_an_int_and_as_an_int64_tensor(seed):
    """The proto's seed is a uint64: the verifier's tensors hold it as the int64 of its bits (int64_seed), the host
    as an int; the noise must not differ (a seed of 2**63 or more once overflowed the verifier's int64 tensor)."""
    tokens = np.arange(64, dtype=np.int64)
    on_host = noise_bits(seed, 11, tokens)
    as_tensor = noise_bits(torch.tensor([[int64_seed(seed)]]), torch.tensor([[11]]), torch.from_numpy(tokens))
    assert np.array_equal(on_host, as_tensor[0].numpy())
    assert int64_seed(seed) == (seed if seed < 2**63 else seed - 2**64)


def test_position_noise_is_standard_gumbel_and_independent_across_tokens_indices_and_seeds():
    g = np.concatenate(
        [position_noise(seed, index, 1000) for seed in (0, 1, 2**40 + 3) for index in (0, 1, 7, 1000)]
    )  # 12000 draws
    assert kstest(g, gumbel_r.cdf).pvalue > 0.001
    a, b, c = position_noise(11, 5, 20000), position_noise(11, 6, 20000), position_noise(12, 5, 20000)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.03 and abs(np.corrcoef(a, c)[0, 1]) < 0.03
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.03  # neighbouring tokens
    assert np.array_equal(noise_at(11, 5, np.array([3, 19999, 0])), a[[3, 19999, 0]])


def test_coupled_token_never_draws_a_removed_token():
    p = np.array([0.0, 0.3, 0.0, 0.7])
    assert all(coupled_token(p, position_noise(s, 0, 4)) in (1, 3) for s in range(200))


def test_coupled_children_are_distinct_tokens_of_the_support_best_first():
    q = sparsify(np.array([0.1, 0.0, 0.5, 0.4]), 4)
    noise = position_noise(3, 5, 4)
    children = coupled_children(q, 3, 5, 5)
    assert sorted(children) == [0, 2, 3]
    scores = {t: np.log(q.prob_of(t)) + noise[t] for t in children}
    assert [scores[t] for t in children] == sorted(scores.values(), reverse=True)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**40),
    widths=st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple),
    salt=st.sampled_from(["ssm-a", "ssm-b", "llm"]),
    keep=st.sampled_from([1.0, 0.7, 0.4]),
    params=st.sampled_from([PARAMS, SamplingParams(temperature=0.7, top_k=4, top_p=0.9)]),
)
def test_every_tree_gives_plain_decodings_tokens(seed, widths, salt, keep, params):
    """Whatever the drafter (even the LLM itself), the tree's shape or a random cut of it, the output
    is what plain decoding (a root-only tree every step) draws with the same seed."""
    plain = _generate(seed, 6, (), salt, params)
    assert _generate(seed, 6, widths, salt, params, keep) == plain


def test_a_good_drafter_is_accepted():
    """With the LLM as its own drafter every child the noise ranks first is the LLM's token."""
    noise = partial(position_noise, 5, vocab_size=VOCAB)
    context = (0,)
    tree = _draft_tree(context, (1, 1, 1, 1), "llm", PARAMS, 5, np.random.default_rng(0), 1.0)
    res = verify_coupled(
        tree,
        lambda node: process_logits(synthetic_logits(context + tree.tokens[1 : node + 1], "llm"), PARAMS),
        noise,
        0,
    )
    assert res.num_accepted == 4


def _counts(n_samples: int, widths, salt, noise_of=None, keep: float = 1.0) -> Counter:
    return Counter(_generate(seed, 2, widths, salt, keep=keep, noise_of=noise_of) for seed in range(n_samples))


@pytest.mark.slow
@pytest.mark.parametrize(("widths", "salt", "keep"), [((2, 2), "ssm-a", 1.0), ((3, 1), "ssm-b", 0.6)])
def test_coupled_sampling_matches_llm_sampling(widths, salt, keep):
    assert chi_square_pvalue(_counts(20000, widths, salt, keep=keep), _exact(PARAMS, 2)) > 0.001


class _ReusedNoise:
    """A wrong noise source: one Gumbel vector for every index of a request."""

    def __init__(self, seed: int) -> None:
        self.noise = position_noise(seed, 0, VOCAB)

    def __call__(self, index: int) -> np.ndarray:
        return self.noise


@pytest.mark.slow
def test_noise_reused_across_positions_fails_the_same_test():
    noise_of: Callable[[int], _ReusedNoise] = _ReusedNoise
    assert chi_square_pvalue(_counts(20000, (2, 2), "ssm-a", noise_of=noise_of), _exact(PARAMS, 2)) < 1e-6
