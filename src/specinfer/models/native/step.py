"""One packed forward step of the native backend, as plain data, and the runner that executes it.

A *packed step* is everything a forward pass needs besides the weights and the KV pool: the
tokens of every request of the batch as one packed row list, their positions and KV-pool rows,
the tree-attention segments (:func:`specinfer.kernels.build_tree_metadata`'s inputs) and the
rows whose logits are wanted. It holds Python ints only, so a distributed driver can ship it to
the other ranks (:mod:`specinfer.models.native.parallel`) and each rebuilds the same tensors.
:meth:`PackedStep.from_trees` packs one from a :class:`StepRequest` per request; it is pure, so
tests build steps without a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specinfer.core.tree import node_depths
from specinfer.kernels import TreeAttentionMetadata, build_tree_metadata
from specinfer.models.native.kv_pool import KVPool
from specinfer.models.native.model import NativeModel


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a packed step. Its KV rows start at ``kv_start``: ``cached`` context
    tokens already there, then ``chain`` (context tokens computed now), then its pending tree nodes
    (cached earlier), then the new ``tokens``."""

    kv_start: int  # pool row of the request's position 0
    cached: int  # context tokens whose K/V the pool already holds
    chain: Sequence[int]  # context tokens to compute, right after the cached ones
    tokens: Sequence[int]  # new tree nodes (their logits are wanted)
    parents: Sequence[int]  # parent array of the pending nodes then the new ones; -1 attaches to the context


@dataclass(frozen=True)
class PackedStep:
    """Inputs of one forward pass over packed tokens (``T`` rows, ``N`` logit rows)."""

    tokens: tuple[int, ...]  # [T]
    positions: tuple[int, ...]  # [T]
    cache_rows: tuple[int, ...]  # [T] pool row where each token's K/V go
    seg_parents: tuple[tuple[int, ...], ...]  # per attention segment, its parent array
    seg_prefix: tuple[int, ...]  # per segment, cached tokens it attends to
    seg_starts: tuple[int, ...]  # per segment, pool row of its prefix position 0
    seg_queries: tuple[int, ...]  # per segment, rows with queries (its last nodes)
    logit_rows: tuple[int, ...]  # [N] rows whose logits are wanted

    @staticmethod
    def from_trees(requests: Sequence[StepRequest]) -> PackedStep:
        """Pack ``requests`` in order: per request its chain (a causal segment behind the cached
        context), then its new nodes (a tree segment of pending + new nodes behind the whole
        context, where only the new nodes have queries). Logit rows are the new nodes', in order."""
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        segments: list[tuple[tuple[int, ...], int, int, int]] = []  # (parents, prefix, kv start, queries)
        logit_rows: list[int] = []
        for r in requests:
            m, n = len(r.chain), len(r.tokens)
            context = r.cached + m
            if m:
                segments.append((tuple(range(-1, m - 1)), r.cached, r.kv_start, m))
                tokens.extend(int(t) for t in r.chain)
                positions.extend(range(r.cached, context))
                rows.extend(range(r.kv_start + r.cached, r.kv_start + context))
            if n:
                if any(p < 0 for p in r.parents[1:]):
                    raise ValueError("only the first pending node may attach to the context (parent -1)")
                first = r.kv_start + context + len(r.parents) - n  # KV row of the first new node
                segments.append((tuple(int(p) for p in r.parents), context, r.kv_start, n))
                logit_rows.extend(range(len(tokens), len(tokens) + n))
                tokens.extend(int(t) for t in r.tokens)
                positions.extend((node_depths(r.parents)[-n:] + context).tolist())
                rows.extend(range(first, first + n))
        seg_parents, seg_prefix, seg_starts, seg_queries = (tuple(column) for column in zip(*segments, strict=True)) if segments else ((),) * 4
        return PackedStep(tuple(tokens), tuple(positions), tuple(rows), seg_parents, seg_prefix, seg_starts, seg_queries, tuple(logit_rows))

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tokens, positions, cache_rows, logit_rows`` as int64 tensors on ``device``."""
        return tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (self.tokens, self.positions, self.cache_rows, self.logit_rows))

    def metadata(self, device: torch.device) -> TreeAttentionMetadata:
        return build_tree_metadata(self.seg_parents, self.seg_prefix, self.seg_starts, device, num_queries=self.seg_queries)


class StepRunner(Protocol):
    """Executes packed steps on the KV pool it owns (one process, or a group of ranks)."""

    @property
    def pool(self) -> KVPool: ...

    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits of ``step.logit_rows``.  # [N, vocab] float32"""
        ...


class LocalRunner:
    """The whole model in this process."""

    def __init__(self, model: NativeModel, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self._pool = pool
        self.device = device

    @property
    def pool(self) -> KVPool:
        return self._pool

    def run(self, step: PackedStep) -> torch.Tensor:
        tokens, positions, rows, logit_rows = step.tensors(self.device)
        return self.model.forward(tokens, positions, rows, step.metadata(self.device), self._pool, logit_rows)  # [N, vocab]
