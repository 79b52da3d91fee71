"""Pure arithmetic of the tree-configuration tuner: acceptance from SSM ranks, step cost, search.

Terms. Along the LLM's greedy output, the *rank* of position t is the place of the LLM's token
among the SSM's predictions for that position (0: the SSM's top-1), with the SSM conditioned on
the exact committed prefix. Under greedy verification with a static expansion ``<k1..km>``
(children of one SSM are its top-k predictions), a step that starts at position t accepts the
longest chain d <= m with ``rank[t + j - 1] < k_j`` for every j <= d: the tree holds the LLM's
token at depth j exactly when every ancestor on the LLM's path was among its parent's top-k. The
step then commits d accepted tokens plus the bonus token and the next step starts at t + d + 1.
Walking a continuation this way gives exactly the tokens per step the engine achieves.

The *cost* of a step is the LLM verify pass over the tree's nodes plus one SSM pass per depth
over that depth's frontier, interpolated from measured times.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def walk(ranks: np.ndarray, widths: Sequence[int]) -> tuple[int, int]:
    """(tokens, steps) of greedy speculation with ``widths`` along one continuation.

    ``ranks``: [positions] int, the SSM rank of the LLM's token at each position.
    """
    n, t, steps = len(ranks), 0, 0
    while t < n:
        d = 0
        while d < len(widths) and t + d < n and ranks[t + d] < widths[d]:
            d += 1
        t += d + 1
        steps += 1
    return n, steps


def tokens_per_step(rank_lists: Sequence[np.ndarray], widths: Sequence[int]) -> float:
    """Tokens per LLM step over several continuations (walked exactly)."""
    tokens = steps = 0
    for ranks in rank_lists:
        a, b = walk(ranks, widths)
        tokens += a
        steps += b
    return tokens / max(1, steps)


def mean_tokens_per_step(hits: np.ndarray, widths: Sequence[int]) -> float:
    """Fast estimate of :func:`tokens_per_step`: 1 + the mean accepted length over every start
    position, not only those a walk visits. ``hits``: [max_width + 1, depth, positions] bool,
    ``hits[k, j, t]`` = rank[t + j] < k (False past the end)."""
    alive = np.ones(hits.shape[2], dtype=bool)
    accepted = np.zeros(hits.shape[2])
    for j, k in enumerate(widths):
        alive &= hits[k, j]
        accepted += alive
    return 1.0 + float(accepted.mean())


def hit_table(rank_lists: Sequence[np.ndarray], depth: int, max_width: int) -> np.ndarray:
    """The ``hits`` array of :func:`mean_tokens_per_step` for continuations laid end to end
    (a chain never crosses into the next continuation)."""
    tables = []
    for ranks in rank_lists:
        n = len(ranks)
        shifted = np.full((depth, n), np.iinfo(np.int64).max, dtype=np.int64)
        for j in range(depth):
            shifted[j, : max(0, n - j)] = ranks[j:]
        tables.append(shifted)
    shifted = np.concatenate(tables, axis=1)  # [depth, positions]
    return np.stack([shifted < k for k in range(max_width + 1)])  # [max_width + 1, depth, positions]


def frontier_sizes(widths: Sequence[int]) -> list[int]:
    """Nodes the SSM expands at each depth: 1 (the root), k1, k1*k2, ... (the last depth's
    nodes are leaves and need no pass)."""
    sizes, level = [1], 1
    for k in widths[:-1]:
        level *= k
        sizes.append(level)
    return sizes


def num_nodes(widths: Sequence[int]) -> int:
    total, level = 1, 1
    for k in widths:
        level *= k
        total += level
    return total


@dataclass(frozen=True)
class CostModel:
    """Seconds of an LLM verify pass by tree size and of an SSM pass by frontier size, at one
    batch size; linear interpolation between measured sizes, linear extrapolation beyond."""

    verify: Mapping[int, float]  # nodes per request -> seconds per batched verify call
    draft: Mapping[int, float]  # frontier nodes per request -> seconds per batched SSM pass
    overhead: float = 0.0  # seconds per step outside the models (scheduling, verification maths)

    @staticmethod
    def _interp(table: Mapping[int, float], x: int) -> float:
        xs = sorted(table)
        ys = [table[k] for k in xs]
        if x >= xs[-1] and len(xs) >= 2:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (x - xs[-1])
        return float(np.interp(x, xs, ys))

    def step_seconds(self, widths: Sequence[int]) -> float:
        if not widths:
            return self._interp(self.verify, 1) + self.overhead
        drafting = sum(self._interp(self.draft, n) for n in frontier_sizes(widths))
        return self._interp(self.verify, num_nodes(widths)) + drafting + self.overhead


@dataclass(frozen=True)
class Candidate:
    widths: tuple[int, ...]
    tokens_per_step: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def expansion(self) -> str:
        return ",".join(map(str, self.widths))

    def as_dict(self) -> dict:
        return {
            "expansion": self.expansion,
            "nodes": num_nodes(self.widths),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "step_seconds": round(self.step_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 4),
        }


def configs(max_depth: int, max_width: int, max_nodes: int) -> Iterator[tuple[int, ...]]:
    """Every expansion with 1..max_depth depths, widths 1..max_width, at most ``max_nodes`` nodes."""

    def grow(prefix: tuple[int, ...], nodes: int, level: int) -> Iterator[tuple[int, ...]]:
        if prefix:
            yield prefix
        if len(prefix) == max_depth:
            return
        for k in range(1, max_width + 1):
            if nodes + level * k <= max_nodes:
                yield from grow(prefix + (k,), nodes + level * k, level * k)

    yield from grow((), 1, 1)


def search(
    rank_lists: Sequence[np.ndarray], cost: CostModel, max_depth: int, max_width: int, max_nodes: int, refine: int = 40
) -> list[Candidate]:
    """Candidates best first by expected tokens/s: every config scored with the fast estimate,
    the best ``refine`` re-scored by walking the continuations exactly."""
    hits = hit_table(rank_lists, max_depth, max_width)
    scored = []
    for widths in configs(max_depth, max_width, max_nodes):
        tps = mean_tokens_per_step(hits, widths)
        scored.append(Candidate(widths, tps, cost.step_seconds(widths)))
    scored.sort(key=lambda c: -c.tokens_per_second)
    exact = [Candidate(c.widths, tokens_per_step(rank_lists, c.widths), c.step_seconds) for c in scored[:refine]]
    exact.sort(key=lambda c: -c.tokens_per_second)
    return exact


def evaluate(rank_lists: Sequence[np.ndarray], cost: CostModel, widths: Sequence[int]) -> Candidate:
    """One config, walked exactly (e.g. the paper's default, for comparison)."""
    return Candidate(tuple(widths), tokens_per_step(rank_lists, widths), cost.step_seconds(widths))
