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
from specinfer.core.sampling import sample
from specinfer.core.tree import TokenTree


@dataclass(frozen=True)
class VerifyResult:
    """``accepted_nodes``: the accepted path without the root; ``bonus_token``: the LLM's own
    token after it. The tokens to commit are ``accepted_tokens + (bonus_token,)``."""

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int

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


def verify_stochastic(
    draft: DraftTree,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> VerifyResult:
    """MSS. ``target_probs(i)``: the LLM's processed distribution after node i.  # [V]"""
    tree = draft.tree
    u, path = 0, []
    while True:
        p = np.array(target_probs(u), dtype=np.float64)
        accepted = None
        groups = draft.groups_at(u)
        if tree.children[u] and not groups:
            raise ValueError(f"node {u} has children but no draft distribution to verify them with")
        for group in groups:
            if group.q is None:
                raise ValueError("stochastic verification needs draft distributions (q)")
            q_rest = group.q.dense(p.size)  # [V] q over the tokens this group has not tried yet
            for child in group.children:
                x = tree.tokens[child]
                q_i = q_rest / q_rest.sum()
                if q_i[x] <= 0:
                    raise ValueError(f"token {x} was drafted with probability 0")
                if rng.random() * q_i[x] < p[x]:
                    accepted = child
                    break
                residual = np.maximum(p - q_i, 0.0)
                total = residual.sum()
                # total == 0 means p == q_i, where rejection has probability 0; only rounding gets here
                if total > 1e-12:
                    p = residual / total
                q_rest[x] = 0.0
            if accepted is not None:
                break
        if accepted is None:
            bonus = sample(p, rng)
            return _result(tree, path, bonus)
        path.append(accepted)
        u = accepted
