"""Token tree verification: greedy and multi-step speculative sampling (MSS).

Both walk from the root and return the accepted path plus the bonus token. Greedy output is
token-for-token the LLM's greedy decoding; MSS output is distributed exactly as sampling from
the LLM's processed distribution ``p`` (see :mod:`specinfer.core.sampling`).

MSS at node u with target distribution p: for each draft group at u (one per SSM), try its
children in draw order; the i-th child x was drawn from q_i = q renormalised over the group's
tokens not drawn before it (drawing without replacement). Accept x with probability
min(1, p(x) / q_i(x)); on rejection set p <- normalize(max(0, p - q_i)) and go on. If every try
fails, the bonus token is sampled from the final p. This is recursive rejection sampling: each
try leaves the overall output distribution equal to the p it started from, whatever q_i is,
so the result is exact for any drafts, including groups that share a node (same token from two
SSMs: two independent tries with their own q).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specinfer.core.drafts import DraftTree
from specinfer.core.requests import TokenLogprob
from specinfer.core.sampling import SparseDist, sample
from specinfer.core.tree import TokenTree


@dataclass(frozen=True)
class VerifyResult:
    """``accepted_nodes``: the accepted path without the root; ``bonus_token``: the LLM's own
    token after it. The tokens to commit are ``accepted_tokens + (bonus_token,)``. ``next_tree``: the
    verifier's draft head's tree for the next step, rooted at the bonus token (None: none asked, or no head).
    ``logprobs``: each of ``new_tokens``' :class:`~specinfer.core.requests.TokenLogprob`, when the job asked."""

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int
    next_tree: DraftTree | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return self.accepted_tokens + (self.bonus_token,)


def _result(tree: TokenTree, path: list[int], bonus: int) -> VerifyResult:
    return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path), int(bonus))


def verify_greedy(tree: TokenTree, target_argmax: np.ndarray) -> VerifyResult:
    """``target_argmax[i]``: the LLM's argmax token after node i's sequence.  # [n] int"""
    u, path = 0, []
    while True:
        best = int(target_argmax[u])
        child = tree.child_with_token(u, best)
        if child is None:
            return _result(tree, path, best)
        path.append(child)
        u = child


@dataclass(frozen=True)
class MssTry:
    """One try of MSS at a node: ``child``, whose ``token`` was drawn from ``q``, its group's draft
    distribution renormalised over the group's tokens not tried before it."""

    child: int
    token: int
    q: SparseDist


def mss_tries(draft: DraftTree) -> list[list[MssTry]]:
    """Per node, its tries in the order MSS makes them: its draft groups in order, each group's
    children in draw order (a node in two groups is tried twice, each time with its group's q)."""
    tree = draft.tree
    tries: list[list[MssTry]] = [[] for _ in range(len(tree))]
    grouped = set()
    for group in draft.groups:
        if group.q is None:
            raise ValueError("stochastic verification needs draft distributions (q)")
        grouped.add(group.parent)
        rest = group.q.probs.copy()  # [support] q's mass on the group's tokens not tried yet
        for child in group.children:
            x = tree.tokens[child]
            hit = np.nonzero(group.q.tokens == x)[0]
            if not hit.size or rest[hit[0]] <= 0:
                raise ValueError(f"token {x} was drafted with probability 0")
            tries[group.parent].append(MssTry(child, x, SparseDist(group.q.tokens, rest / rest.sum())))
            rest[hit[0]] = 0.0
    for u in range(len(tree)):
        if tree.children[u] and u not in grouped:
            raise ValueError(f"node {u} has children but no draft distribution to verify them with")
    return tries


def mss_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The target after a rejected try: ``normalize(max(0, p - q))``.  # [V] float64

    A residual without mass means p == q, where rejection has probability 0: only rounding gets
    there, and p is kept."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return residual / total if total > 1e-12 else p


def bonus_draws(tries: list[list[MssTry]]) -> list[tuple[int, int]]:
    """Per node u, the range ``(lo, hi)`` of j such that a walk ending at u draws its bonus token
    with the j-th uniform of its stream (0-based): one uniform per try made before, on the way
    (up to the accepting try at each ancestor) and at u (all of them). A node tried in two groups
    of its parent can be reached after different numbers of tries, hence a range."""
    reach: list[tuple[int, int] | None] = [None] * len(tries)  # uniforms used before arriving at a node
    reach[0] = (0, 0)
    for u, node_tries in enumerate(tries):  # parents before children
        if reach[u] is None:
            continue  # never tried: no walk gets here
        lo, hi = reach[u]
        for k, t in enumerate(node_tries):
            seen = reach[t.child]
            reach[t.child] = (
                (lo + k + 1, hi + k + 1) if seen is None else (min(seen[0], lo + k + 1), max(seen[1], hi + k + 1))
            )
    return [(0, 0) if r is None else (r[0] + len(t), r[1] + len(t)) for r, t in zip(reach, tries, strict=True)]


def verify_stochastic(
    draft: DraftTree,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> VerifyResult:
    """MSS. ``target_probs(i)``: the LLM's processed distribution after node i.  # [V]

    Each try takes one uniform from ``rng``, and so does the bonus token when every try at the
    last node fails (:func:`~specinfer.core.sampling.sample`)."""
    tree = draft.tree
    tries = mss_tries(draft)
    u, path = 0, []
    while True:
        p = np.array(target_probs(u), dtype=np.float64)
        accepted = None
        for t in tries[u]:
            q_i = t.q.dense(p.size)  # [V]
            if rng.random() * q_i[t.token] < p[t.token]:
                accepted = t.child
                break
            p = mss_residual(p, q_i)
        if accepted is None:
            return _result(tree, path, sample(p, rng))
        path.append(accepted)
        u = accepted


def walk_stochastic(
    draft: DraftTree,
    tries: list[list[MssTry]],
    try_probs: Callable[[int, int], float],
    bonus: Callable[[int, int], int],
    uniforms: np.ndarray,
) -> VerifyResult:
    """:func:`verify_stochastic` from precomputed numbers (see
    :func:`specinfer.models.on_device.mss_tables`): ``try_probs(u, k)``: the target at node u after
    its first k tries were rejected, at the k-th try's token; ``bonus(u, j)``: the token drawn with
    ``uniforms[j]`` from u's target once all its tries are rejected; ``uniforms``: the stream's
    draws, in order (at least :func:`bonus_draws`' highest + 1). Given the same numbers, it accepts
    and draws what :func:`verify_stochastic` does with a generator that yields ``uniforms``."""
    u, path, j = 0, [], 0
    while True:
        accepted = None
        for k, t in enumerate(tries[u]):
            w = uniforms[j]
            j += 1
            if w * t.q.prob_of(t.token) < try_probs(u, k):
                accepted = t.child
                break
        if accepted is None:
            return _result(draft.tree, path, bonus(u, j))
        path.append(accepted)
        u = accepted
