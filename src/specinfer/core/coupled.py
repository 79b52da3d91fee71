"""Coupled verification: seeded sampling whose draw does not depend on speculation.

Terms. A request's *sequence* is its prompt followed by its output; the token at sequence index
``t`` is drawn from the LLM's processed distribution ``p_t`` (:func:`~specinfer.core.sampling.process_logits`
after the tokens before it). *Position noise* ``g_t`` is one standard Gumbel variable per vocabulary
entry, drawn from a generator keyed by the request's seed and ``t`` alone (:func:`position_noise`).

The Gumbel-max draw. The LLM's token at index ``t`` is ``argmax_x(log p_t(x) + g_t(x))``
(:func:`coupled_token`). For Gumbel noise this argmax is distributed exactly as ``p_t`` (the
Gumbel-max trick), and ``g_t`` is independent of the noise of every other index, so a sequence
drawn token by token this way is distributed as sampling from the LLM alone. The draw at ``t``
depends only on (seed, ``t``, ``p_t``): plain decoding (``--no-speculation``) draws with the same
rule, so for a given seed it produces the same tokens.

Speculation only guesses that token. :func:`verify_coupled` walks the tree from the root like
greedy verification, with the Gumbel-max token in place of the argmax: at a node of depth ``d``
(sequence index ``t = root_index + d`` for its children) the LLM's token is computed from the node's
``p`` and ``g_t``; the child carrying it is accepted, else that token is the bonus token. The
committed tokens are therefore exactly the tokens plain decoding draws, whatever the tree, its shape,
the drafter, the batch or the timing; which draft tokens are proposed changes only how many of
them are accepted per step. As for greedy verification, any subtree of a draft verifies exactly, so
adaptive trees may be cut to the nodes worth verifying.

Drafting with the same noise. A drafter proposes the top-k tokens of ``log q(x) + g_t(x)`` over its
draft distribution ``q`` (:func:`coupled_children`): the Gumbel-top-k trick, which is sampling k
tokens without replacement from ``q``. When ``q`` is close to ``p`` the drafter's first choice is the
LLM's token most of the time. Nothing of the draft enters the output, so no draft can bias it.

Compared with multi-step speculative sampling (:func:`~specinfer.core.verify.verify_stochastic`),
which accepts a draw of ``q`` with probability ``min(1, p/q)`` and so matches p and q maximally
(``sum_x min(p(x), q(x))`` for one child), the Gumbel coupling matches somewhat less often: that is
the price of a draw fixed by the seed (measured in BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specinfer.core.sampling import SparseDist
from specinfer.core.tree import TokenTree
from specinfer.core.verify import VerifyResult

# Mixed into every key, so that position noise is unrelated to the per-step generators of
# :func:`specinfer.core.iteration.step_rng` whatever the seed.
_NOISE_DOMAIN = 0x5EEDC0DE
_M32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """``h * c mod 2**32`` for 32-bit values ``h`` held in int64 (NumPy arrays or torch tensors) and a
    32-bit constant ``c``, without ever leaving int64's range (torch gives no wrap-around guarantee)."""
    lo, hi = h & 0xFFFF, h >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: a bijection of 32-bit values whose every output bit depends
    on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def noise_bits(seed, index, tokens):
    """32 random bits per token for (seed, sequence index): a counter-based hash, so any token's bits
    are computed alone, on any device, in any order, with the same result. Operators only: ``seed``
    and ``index`` are ints or int64 arrays/tensors that broadcast against ``tokens`` (e.g. ``[R, 1]``
    against ``[R, V]`` or ``[V]``); a seed is any 64-bit value, an int in [0, 2**64) or its int64 form
    (:func:`int64_seed`): only its two 32-bit halves enter the hash."""
    key = _fmix32(_fmix32(_fmix32((seed & _M32) ^ _NOISE_DOMAIN) ^ ((seed >> 32) & _M32)) ^ (index & _M32))
    return _fmix32(_fmix32(_mul32(tokens & _M32, 0x9E3779B1) ^ key) ^ _mul32(key, 0x27D4EB2F))


def int64_seed(seed: int) -> int:
    """A request's seed in [0, 2**64) as the int64 with the same 64 bits (two's complement), the form an int64 tensor
    holds: :func:`noise_bits` gives both forms the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def gumbel_of_bits(bits):
    """Standard Gumbel variables from 32 random bits each, via the uniform ``(bits + 0.5) / 2**32``
    (never 0 or 1); float64 NumPy in, float64 NumPy out (the torch twin is in the engine)."""
    u = (np.asarray(bits, dtype=np.float64) + 0.5) / 2.0**32
    return -np.log(-np.log(u))


def position_noise(seed: int, index: int, vocab_size: int) -> np.ndarray:
    """The Gumbel noise ``g_t`` of sequence index ``index`` for a request seeded ``seed``.  # [V] float64

    A pure function of its arguments: every process that drafts or verifies the request's token at
    ``index`` (or draws it without speculation) computes the same noise."""
    return noise_at(seed, index, np.arange(vocab_size, dtype=np.int64))


def noise_at(seed: int, index: int, tokens: np.ndarray) -> np.ndarray:
    """:func:`position_noise` at the given tokens only.  # [k] float64"""
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got {seed}, {index}")
    return gumbel_of_bits(noise_bits(int(seed), int(index), np.asarray(tokens, dtype=np.int64)))


def coupled_token(probs: np.ndarray, noise: np.ndarray) -> int:
    """The Gumbel-max draw ``argmax_x(log probs(x) + noise(x))`` over tokens with ``probs > 0``.  # [V], [V]"""
    p = np.asarray(probs, dtype=np.float64)
    with np.errstate(divide="ignore"):
        scores = np.log(p) + noise  # log 0 = -inf: a token the processing removed is never drawn
    return int(np.argmax(scores))


def coupled_children(q: SparseDist, seed: int, index: int, k: int) -> list[int]:
    """Up to ``k`` distinct tokens of ``q``'s support, best first by ``log q(x) + g(x)`` with the
    position noise ``g`` of sequence ``index``: a draw of k tokens without replacement from ``q``
    (Gumbel-top-k), made with the noise the LLM's token at this index is drawn with, so that the
    first is the LLM's token whenever ``q`` and ``p`` agree."""
    keep = q.probs > 0
    tokens, probs = q.tokens[keep], q.probs[keep]
    scores = np.log(probs) + noise_at(seed, index, tokens)
    order = np.lexsort((tokens, -scores))[:k]  # ties (measure zero): the lower token first
    return [int(t) for t in tokens[order]]


def verify_coupled(
    tree: TokenTree, target_probs: Callable[[int], np.ndarray], noise: Callable[[int], np.ndarray], root_index: int
) -> VerifyResult:
    """Coupled verification of ``tree``, whose root is the last committed token, at sequence index
    ``root_index``. ``target_probs(i)``: the LLM's processed distribution after node i;  # [V]
    ``noise(t)``: the position noise of sequence index t (:func:`position_noise`).  # [V]"""
    u, depth, path = 0, 0, []
    while True:
        token = coupled_token(target_probs(u), noise(root_index + depth + 1))
        child = tree.child_with_token(u, token)
        if child is None:
            return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path), token)
        path.append(child)
        u, depth = child, depth + 1
