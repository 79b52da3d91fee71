"""Preallocated KV cache: one contiguous slot of ``slot_len`` token rows per request.

(:mod:`specinfer.models.native.paged_pool` is the paged alternative: KV blocks handed out on demand.)

The pool is allocated once from a memory budget; a request holds a slot from its first
forward until it is released. Inside a slot, rows ``[0, context_len)`` hold the committed
context and the pending tree nodes follow, which is the layout the tree-attention kernel reads
(:mod:`specinfer.kernels.metadata`). Adopting the accepted path compacts it in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specinfer.core.errors import ResourceExhausted
from specinfer.kernels import cpu_pool
from specinfer.models.native.spec import ModelSpec


class KVCacheFull(ResourceExhausted, RuntimeError):
    """No free slot (or KV block, paged layout): more concurrent requests or tokens than the KV budget holds."""


class PoolTensors:
    """The K and V tensors of a KV pool (``[layers, *row_shape, kv_heads, head_dim]``, where
    ``row_shape`` addresses one token row) and what every layout does with them alike.

    ``scratch_row``: a row of the pool flattened to ``[rows, kv_heads, head_dim]`` that no request owns (the layouts
    allocate one beyond their requests' rows), where a padded step (:mod:`.graphs`) writes the K/V of its padding
    tokens: they would otherwise overwrite a request's."""

    scratch_row: int

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, row_shape: tuple[int, ...]) -> None:
        shape = (spec.layers, *row_shape, spec.kv_heads, spec.head_dim)
        # empty, not zeros: rows are always written before they are read (attention masks every
        # row past a request's valid range), and untouched pages cost no host memory
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
        return 2 * spec.layers * spec.kv_heads * spec.head_dim * torch.tensor([], dtype=dtype).element_size()

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows ``src`` to rows ``dst`` in every layer (gathered first, so overlap is safe).
        Rows index the pool flattened to ``[layers, rows, kv_heads, head_dim]``."""
        k, v = self.k.flatten(1, -3), self.v.flatten(1, -3)  # views: [layers, rows, kv_heads, head_dim]
        cpu_pool.move(k, v, src, dst)


class KVPool(PoolTensors):
    """Contiguous layout: slot s owns rows ``[s * slot_len, (s + 1) * slot_len)``."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, slot_len: int, num_slots: int
    ) -> None:
        if num_slots <= 0:
            raise ValueError("the KV budget does not hold a single slot; raise the budget or lower max_seq_len")
        # k, v: [layers, capacity + 1, kv_heads, head_dim]: the slots' rows, then the scratch row
        super().__init__(spec, dtype, device, (num_slots * slot_len + 1,))
        self.scratch_row = num_slots * slot_len
        self.slot_len = slot_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise KVCacheFull(f"all {self.num_slots} KV slots ({self.slot_len} tokens each) are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class SlotStorage:
    """:class:`specinfer.models.kv_store.KVStorage` on one slot of a :class:`KVPool`."""

    block_table: tuple[int, ...] = ()  # the contiguous layout has none (see BlockStorage)

    def __init__(self, pool: KVPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.start = slot * pool.slot_len

    def reserve(self, context_len: int, rows: int) -> None:
        """Nothing to allocate: the slot holds every row a request may use (the backend checks the bound)."""

    def release(self) -> None:
        self.pool.release(self.slot)

    def truncate_context(self, length: int) -> int:
        """Nothing to free: rows past the context are overwritten by the next forward."""
        return length

    def adopt_pending(self, context_len: int, path: list[int]) -> None:
        if path == list(range(len(path))):  # the accepted nodes lie where the context goes on (a chain, a first child)
            return
        src = torch.tensor(path, dtype=torch.long) + self.start + context_len
        dst = torch.arange(len(path), dtype=torch.long) + self.start + context_len
        self.pool.move(src.to(self.pool.k.device), dst.to(self.pool.k.device))

    def clear_pending(self) -> None:
        """Pending rows are simply overwritten later."""

    def reuse_cached(self, context: Sequence[int], held: int) -> int:
        return 0  # a slot is one request's alone: no prefix cache

    def cache_context(self, context: Sequence[int]) -> None:
        """No prefix cache."""
