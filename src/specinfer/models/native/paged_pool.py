"""Paged KV cache: the pool is cut into *KV blocks* of ``block_size`` token rows (the term of
:mod:`specinfer.kernels.metadata`), handed out to requests as their context and tree grow.

A request's *block table* lists its physical KV blocks in logical order; its logical position p
(the context, then the pending tree nodes right behind it, as in the contiguous layout) lives in
physical row ``block_table[p // block_size] * block_size + p % block_size`` of the pool flattened
to ``[layers, num_blocks * block_size, kv_heads, head_dim]``. Unlike a contiguous slot, a request
holds only the blocks its context and pending nodes fill, so the budget is shared by tokens, not
reserved per request for the longest sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from specinfer.core.kv_budget import blocks_for
from specinfer.models.native.kv_pool import KVCacheFull, KVPool, PoolTensors
from specinfer.models.native.spec import ModelSpec


def physical_rows(block_table: Sequence[int], block_size: int, positions: Iterable[int]) -> list[int]:
    """Rows of the flattened pool holding the logical ``positions`` of a request with ``block_table``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class PagedKVPool(PoolTensors):
    """``num_blocks`` KV blocks of ``block_size`` rows and the free list of the unused ones."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int, num_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1 for a paged pool, got {block_size}")
        if num_blocks <= 0:
            raise ValueError(f"the KV budget does not hold a single KV block of {block_size} tokens; raise the budget")
        super().__init__(spec, dtype, device, (num_blocks, block_size))  # k, v: [layers, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free KV blocks, or none at all (:class:`KVCacheFull`) when fewer are free."""
        if n > len(self._free):
            raise KVCacheFull(f"{n} KV blocks ({self.block_size} tokens each) wanted, {len(self._free)} of {self.num_blocks} free")
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        self._free.extend(reversed(list(blocks)))  # the next allocate hands them out in the same order


AnyKVPool = KVPool | PagedKVPool  # the native backend's pool in either layout


class BlockStorage:
    """:class:`specinfer.models.kv_store.KVStorage` on KV blocks of a :class:`PagedKVPool`.

    The block table grows on demand (:meth:`reserve`, before each forward) and shrinks back to the
    blocks the context fills whenever the pending nodes go (adopted, cleared, or the context cut),
    so between steps a request holds ``ceil(context_len / block_size)`` blocks.
    """

    start = 0  # no contiguous start: the paged metadata's kv_start is 0, rows come from the block table

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.block_table: list[int] = []
        # Context positions whose rows must be kept. The backend announces the context a step
        # computes (reserve), RequestCache's sync announces what it keeps (truncate, adopt).
        self.context_len = 0

    def rows(self, positions: Iterable[int]) -> list[int]:
        return physical_rows(self.block_table, self.pool.block_size, positions)

    def reserve(self, context_len: int, rows: int) -> None:
        """Hold blocks for logical positions ``[0, rows)``, of which ``[0, context_len)`` are context
        once the coming step has run; raises :class:`KVCacheFull` (holding nothing more) when the
        pool lacks the blocks."""
        missing = blocks_for(rows, self.pool.block_size) - len(self.block_table)
        if missing > 0:
            self.block_table.extend(self.pool.allocate(missing))
        self.context_len = context_len

    def release(self) -> None:
        self.pool.release(self.block_table)
        self.block_table = []
        self.context_len = 0

    def truncate_context(self, length: int) -> None:
        self.context_len = min(self.context_len, length)
        self._trim()

    def adopt_pending(self, context_len: int, path: list[int]) -> None:
        src = self.rows(context_len + j for j in path)
        dst = self.rows(range(context_len, context_len + len(path)))
        if src != dst:
            device = self.pool.k.device
            self.pool.move(torch.tensor(src, dtype=torch.long, device=device), torch.tensor(dst, dtype=torch.long, device=device))
        self.context_len = context_len + len(path)
        self._trim()

    def clear_pending(self) -> None:
        self._trim()

    def _trim(self) -> None:
        """Free the blocks past the context (they held pending nodes only)."""
        keep = blocks_for(self.context_len, self.pool.block_size)
        if len(self.block_table) > keep:
            self.pool.release(self.block_table[keep:])
            del self.block_table[keep:]
