"""One packed forward step of the native backend, as plain data, and the runner that executes it.

A *packed step* is everything a forward pass needs besides the weights and the KV pool: the
tokens of every request of the batch as one packed row list, their positions and KV-pool rows,
the tree-attention segments (:func:`specinfer.kernels.build_tree_metadata`'s inputs, or
:func:`specinfer.kernels.build_paged_tree_metadata`'s for a paged pool) and the rows whose logits
are wanted. It holds Python ints only, so a distributed driver can ship it to
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
from specinfer.kernels import TreeAttentionMetadata, build_paged_tree_metadata, build_tree_metadata
from specinfer.kernels.cpu_attention import segment_row_by_row
from specinfer.kernels.cpu_layers import Segments
from specinfer.kernels.metadata import is_chain
from specinfer.models.native.model import NativeModel
from specinfer.models.native.paged_pool import AnyKVPool, physical_rows


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a packed step. Its logical KV positions hold ``cached`` context
    tokens already there, then ``chain`` (context tokens computed now), then its pending tree nodes
    (cached earlier), then the new ``tokens``. Logical position p is pool row ``kv_start + p``
    (contiguous pool) or row ``p % block_size`` of KV block ``block_table[p // block_size]``
    (paged pool; ``kv_start`` is then 0)."""

    kv_start: int  # pool row of the request's position 0 (contiguous layout)
    cached: int  # context tokens whose K/V the pool already holds
    chain: Sequence[int]  # context tokens to compute, right after the cached ones
    tokens: Sequence[int]  # new tree nodes (their logits are wanted)
    parents: Sequence[int]  # parent array of the pending nodes then the new ones; -1 attaches to the context
    block_table: Sequence[int] = ()  # paged layout: the request's KV blocks, covering every position above

    def rows(self, block_size: int, start: int, stop: int) -> list[int]:
        """Pool rows of logical positions ``[start, stop)``; paged (``block_size > 0``): rows of the
        pool flattened to ``[num_blocks * block_size]``."""
        if block_size:
            return physical_rows(self.block_table, block_size, range(start, stop))
        return list(range(self.kv_start + start, self.kv_start + stop))


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
    # Paged layout only (defaults: contiguous): then cache_rows are rows of the pool flattened to
    # [num_blocks * block_size] and seg_starts are all 0.
    block_size: int = 0  # token rows per KV block; 0: contiguous layout
    seg_tables: tuple[tuple[int, ...], ...] = ()  # per segment, its request's block table

    @staticmethod
    def from_trees(requests: Sequence[StepRequest], block_size: int = 0) -> PackedStep:
        """Pack ``requests`` in order: per request its chain (a causal segment behind the cached
        context), then its new nodes (a tree segment of pending + new nodes behind the whole
        context, where only the new nodes have queries). Logit rows are the new nodes', in order.
        ``block_size``: 0 for a contiguous pool, else the paged pool's (requests carry block tables)."""
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        # (parents, prefix, kv start, queries, block table)
        segments: list[tuple[tuple[int, ...], int, int, int, tuple[int, ...]]] = []
        logit_rows: list[int] = []
        for r in requests:
            m, n = len(r.chain), len(r.tokens)
            context = r.cached + m
            table = tuple(int(b) for b in r.block_table)
            if m:
                segments.append((tuple(range(-1, m - 1)), r.cached, r.kv_start, m, table))
                tokens.extend(int(t) for t in r.chain)
                positions.extend(range(r.cached, context))
                rows.extend(r.rows(block_size, r.cached, context))
            if n:
                if any(p < 0 for p in r.parents[1:]):
                    raise ValueError("only the first pending node may attach to the context (parent -1)")
                first = context + len(r.parents) - n  # logical position of the first new node
                segments.append((tuple(int(p) for p in r.parents), context, r.kv_start, n, table))
                logit_rows.extend(range(len(tokens), len(tokens) + n))
                tokens.extend(int(t) for t in r.tokens)
                positions.extend((node_depths(r.parents)[-n:] + context).tolist())
                rows.extend(r.rows(block_size, first, first + n))
        seg_parents, seg_prefix, seg_starts, seg_queries, seg_tables = (
            (tuple(column) for column in zip(*segments, strict=True)) if segments else ((),) * 5
        )
        return PackedStep(
            tuple(tokens),
            tuple(positions),
            tuple(rows),
            seg_parents,
            seg_prefix,
            seg_starts,
            seg_queries,
            tuple(logit_rows),
            block_size,
            seg_tables if block_size else (),
        )

    def subset(self, keep: Sequence[bool]) -> tuple[PackedStep, list[int], list[int]]:
        """The step of the segments ``keep`` marks, with the rows it keeps and the positions of its logit rows among
        this step's: ``(step, rows, logit positions)``."""
        rows: list[int] = []
        start = 0
        for queries, kept in zip(self.seg_queries, keep, strict=True):
            if kept:
                rows.extend(range(start, start + queries))
            start += queries
        index = {r: j for j, r in enumerate(rows)}
        positions = [i for i, r in enumerate(self.logit_rows) if r in index]
        segments = [i for i, kept in enumerate(keep) if kept]
        pick = lambda column: tuple(column[i] for i in segments)  # noqa: E731
        step = PackedStep(
            tuple(self.tokens[r] for r in rows),
            tuple(self.positions[r] for r in rows),
            tuple(self.cache_rows[r] for r in rows),
            pick(self.seg_parents),
            pick(self.seg_prefix),
            pick(self.seg_starts),
            pick(self.seg_queries),
            tuple(index[self.logit_rows[i]] for i in positions),
            self.block_size,
            pick(self.seg_tables) if self.block_size else (),
        )
        return step, rows, positions

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tokens, positions, cache_rows, logit_rows`` as int64 tensors on ``device`` (views of one copy)."""
        t = len(self.tokens)
        packed = torch.tensor(self.tokens + self.positions + self.cache_rows + self.logit_rows, dtype=torch.long)
        if device.type != "cpu":
            packed = packed.to(device)
        return packed[:t], packed[t : 2 * t], packed[2 * t : 3 * t], packed[3 * t :]  # slices: cheaper than split

    def segments(self) -> Segments:
        """The step's attention segments as the fused CPU layers read them (no attention metadata built)."""
        return Segments.of(
            self.seg_parents, self.seg_prefix, self.seg_queries, self.block_size, self.seg_tables, self.seg_starts
        )

    def metadata(self, device: torch.device) -> TreeAttentionMetadata:
        if self.block_size:
            return build_paged_tree_metadata(
                self.seg_parents,
                self.seg_prefix,
                self.seg_tables,
                self.block_size,
                device,
                num_queries=self.seg_queries,
            )
        return build_tree_metadata(
            self.seg_parents, self.seg_prefix, self.seg_starts, device, num_queries=self.seg_queries
        )


def fused_served(step: PackedStep, max_rows: int | None = None) -> list[bool]:
    """Per segment of ``step``, whether the fused CPU layers serve it (:mod:`.fused`: segments of at most 64 rows,
    decode, verify and prompts alike, :func:`~specinfer.kernels.cpu_attention.segment_row_by_row`). Where the layers
    have a row cap (``max_rows``, :attr:`.fused.FusedLayers.max_rows`: CPUs whose PyTorch GEMMs multiply many rows
    faster than the C tiles), a prompt's causal chain stays per operation, and none is served where the others hold
    more than ``max_rows`` rows."""
    served = [
        segment_row_by_row(q) and (max_rows is None or not (prefix == 0 and q == len(p) and is_chain(p)))
        for q, p, prefix in zip(step.seg_queries, step.seg_parents, step.seg_prefix, strict=True)
    ]
    if max_rows is not None and sum(q for q, s in zip(step.seg_queries, served, strict=True) if s) > max_rows:
        return [False] * len(served)
    return served


def split_for_fused(
    step: PackedStep, served: list[bool] | None = None
) -> list[tuple[PackedStep, list[int], list[int]]] | None:
    """A step whose segments the fused CPU layers serve only in part (``served``: :func:`fused_served`'s, computed if
    not given), as two steps (:meth:`PackedStep.subset`), the others first, so that each row takes its own path whatever
    else is in its batch; None where the step is not mixed, or where a request's served segment precedes one of its
    own that is not (its K/V must come first)."""
    served = fused_served(step) if served is None else served
    if all(served) or not any(served):
        return None
    for i in range(len(served) - 1):
        follows = step.seg_prefix[i + 1] == step.seg_prefix[i] + len(step.seg_parents[i])
        where = step.seg_tables if step.block_size else step.seg_starts
        if served[i] and not served[i + 1] and follows and where[i] == where[i + 1]:
            return None
    return [step.subset([not s for s in served]), step.subset(served)]


class StepRunner(Protocol):
    """Executes packed steps on the KV pool it owns (one process, or a group of ranks)."""

    @property
    def pool(self) -> AnyKVPool: ...

    def run(self, step: PackedStep) -> torch.Tensor:
        """Logits of ``step.logit_rows``.  # [N, vocab] float32"""
        ...


class LocalRunner:
    """The whole model in this process."""

    def __init__(self, model: NativeModel, pool: AnyKVPool, device: torch.device) -> None:
        self.model = model
        self._pool = pool
        self.device = device

    @property
    def pool(self) -> AnyKVPool:
        return self._pool

    def run(self, step: PackedStep) -> torch.Tensor:
        fused = self.model.fused
        served = fused_served(step, fused.max_rows) if fused is not None and step.tokens else None
        parts = split_for_fused(step, served) if served is not None else None
        if parts is None:
            tokens, positions, rows, logit_rows = step.tensors(self.device)
            # a step the fused layers serve whole reads its segments, without attention metadata (host work per step)
            meta = step.segments() if served is not None and all(served) else step.metadata(self.device)
            return self.model.forward(tokens, positions, rows, meta, self._pool, logit_rows)  # [N, vocab]
        return self._joined(step, parts)[0]

    def run_features(self, step: PackedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of ``step.logit_rows`` and the features of every row (:meth:`NativeModel.forward_features`).
        # [N, vocab] float32, [T, lm_head_dim]"""
        fused = self.model.fused
        parts = split_for_fused(step, fused_served(step, fused.max_rows)) if fused is not None else None
        if parts is None:
            tokens, positions, rows, logit_rows = step.tensors(self.device)
            return self.model.forward_features(
                tokens, positions, rows, step.metadata(self.device), self._pool, logit_rows
            )
        return self._joined(step, parts)

    def _joined(
        self, step: PackedStep, parts: list[tuple[PackedStep, list[int], list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and features of ``step`` run as ``parts`` (:func:`split_for_fused`), in order."""
        logits = features = None
        for part, rows, positions in parts:
            tokens, pos, cache_rows, logit_rows = part.tensors(self.device)
            out, feats = self.model.forward_features(
                tokens, pos, cache_rows, part.metadata(self.device), self._pool, logit_rows
            )  # [n, vocab], [t, dim]
            if logits is None:
                logits = out.new_empty(len(step.logit_rows), out.shape[1])
                features = feats.new_empty(len(step.tokens), feats.shape[1])
            logits[positions] = out
            features[rows] = feats
        return logits, features
