"""Paged KV cache: the pool is cut into *KV blocks* of ``block_size`` token rows (the term of
:mod:`specinfer.kernels.metadata`), handed out to requests as their context and tree grow.

A request's *block table* lists its physical KV blocks in logical order; its logical position p
(the context, then the pending tree nodes right behind it, as in the contiguous layout) lives in
physical row ``block_table[p // block_size] * block_size + p % block_size`` of the pool flattened
to ``[layers, num_blocks * block_size, kv_heads, head_dim]``. Unlike a contiguous slot, a request
holds only the blocks its context and pending nodes fill, so the budget is shared by tokens, not
reserved per request for the longest sequence.

*Prefix caching* (:class:`PagedKVPool` with ``prefix_caching`` storages): a KV block whose rows all
hold committed context, never tree nodes, is *full*; its keys and values depend only on the tokens
up to its end. Such a block gets a *block key*, :func:`block_key` of the key of the block before it
and its own ``block_size`` token IDs (a chain hash, as in vLLM), and the pool maps keys to blocks.
A request whose context starts with the tokens of cached blocks takes those blocks into its block
table instead of computing them (:meth:`BlockStorage.reuse_cached`). Blocks are reference-counted:
every block is exactly one of

- *free*: no key, no request holds it;
- *idle*: cached (it has a key) and no request holds it; kept, least recently released first, and
  evicted (its key dropped) only when an allocation finds no free block;
- *held*: in the block table of ``refs[b]`` requests (more than one only for a cached block).

Sharing never changes what a request reads: a request writes only positions at or past its
context length (its chain, its tree nodes, adopted paths), and a shared block is full of context
below it. A request whose context is cut inside a cached block drops that block from its table
(the others keep it) and computes those positions again, instead of overwriting it
(:meth:`BlockStorage.truncate_context`). Keys are registered once a block is full of context and
its rows are written: after the step that computed it, or once an accepted path moved into it.
Blocks of requests prefilled in the same step are not shared with each other (the rows are not
written until the step runs); a later request, or a request resumed after preemption, reuses them.

Admission (:mod:`specinfer.core.kv_budget`) counts every block a request's table lists, shared or
not, and idle blocks count as free (:attr:`PagedKVPool.free_blocks`): so the requests a schedule
admits always find their blocks, sharing only leaves more of them idle.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from specinfer.core.kv_budget import blocks_for
from specinfer.models.native.kv_pool import KVCacheFull, KVPool, PoolTensors
from specinfer.models.native.spec import ModelSpec


def physical_rows(block_table: Sequence[int], block_size: int, positions: Iterable[int]) -> list[int]:
    """Rows of the flattened pool holding the logical ``positions`` of a request with ``block_table``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full KV block holding ``tokens`` behind the block whose key is ``parent`` (``b""``
    for the first block): SHA-256 over both, so equal keys mean equal token prefixes."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


class PagedKVPool(PoolTensors):
    """``num_blocks`` KV blocks of ``block_size`` rows: free, idle (cached) or held (module docstring)."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int, num_blocks: int
    ) -> None:
        if block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1 for a paged pool, got {block_size}")
        if num_blocks <= 0:
            raise ValueError(f"the KV budget does not hold a single KV block of {block_size} tokens; raise the budget")
        # k, v: [layers, num_blocks + 1, block_size, kv_heads, head_dim]: the blocks, then one never handed out, whose
        # first row is the scratch row
        super().__init__(spec, dtype, device, (num_blocks + 1, block_size))
        self.scratch_row = num_blocks * block_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self._refs = [0] * num_blocks  # block tables listing each block
        self._key_of: dict[int, bytes] = {}  # cached blocks (held or idle) -> their key
        self._block_of: dict[bytes, int] = {}  # the inverse
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recently released first

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and idle cached ones (evicted when needed)."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks with a key, held or idle."""
        return len(self._key_of)

    def refs(self, block: int) -> int:
        """How many block tables list ``block``."""
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one request, free ones first, then the least recently used idle ones
        (their keys dropped); none at all (:class:`KVCacheFull`) when fewer are free or idle."""
        if n > self.free_blocks:
            raise KVCacheFull(
                f"{n} KV blocks ({self.block_size} tokens each) wanted, {self.free_blocks} of {self.num_blocks} free"
            )
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k :][::-1]
        del self._free[len(self._free) - k :]
        for _ in range(n - k):
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        """One block table less lists ``blocks``. Blocks nobody holds any more turn free (the next
        allocate hands them out in the same order) or, when cached, idle; the last of a table turn
        idle first, so they are evicted first (a block is of no use once the one before it is gone)."""
        for block in reversed(list(blocks)):
            if self._refs[block] <= 0:
                raise ValueError(f"KV block {block} released but not held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def share(self, key: bytes) -> int | None:
        """The cached block with ``key``, now held once more (None: no block has that key)."""
        block = self._block_of.get(key)
        if block is not None:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
        return block

    def register(self, block: int, key: bytes) -> None:
        """Cache held ``block`` under ``key`` (its rows hold the tokens ``key`` stands for). Nothing
        happens when the block has a key already, or another block has this one (two requests
        computed the same tokens): the first stays the cached copy, the other one stays private."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} registered but not held")
        if block not in self._key_of and key not in self._block_of:
            self._key_of[block] = key
            self._block_of[key] = block

    def check(self) -> None:
        """Raise AssertionError unless every block is exactly one of free, idle and held, the idle
        ones are cached, and keys and blocks map one to one (for tests)."""
        free, idle = set(self._free), set(self._idle)
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert len(free) == len(self._free) and not free & idle and not free & held and not idle & held
        assert free | idle | held == set(range(self.num_blocks)), "a KV block is lost"
        assert idle <= set(self._key_of) and not free & set(self._key_of)
        assert {b: k for k, b in self._block_of.items()} == self._key_of
        assert all(r >= 0 for r in self._refs)


AnyKVPool = KVPool | PagedKVPool  # the native backend's pool in either layout


class BlockStorage:
    """:class:`specinfer.models.kv_store.KVStorage` on KV blocks of a :class:`PagedKVPool`.

    The block table grows on demand (:meth:`reserve`, before each forward) and shrinks back to the
    blocks the context fills whenever the pending nodes go (adopted, cleared, or the context cut),
    so between steps a request holds ``ceil(context_len / block_size)`` blocks. ``prefix_caching``:
    its full context blocks are cached, and its context may start with cached blocks (module docstring).
    """

    start = 0  # no contiguous start: the paged metadata's kv_start is 0, rows come from the block table

    def __init__(self, pool: PagedKVPool, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.block_table: list[int] = []
        # Context positions whose rows must be kept. The backend announces the context a step
        # computes (reserve), RequestCache's sync announces what it keeps (truncate, adopt).
        self.context_len = 0
        self.keys: list[bytes] = []  # block keys of the leading full context blocks (prefix caching)

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
        self.keys = []

    def truncate_context(self, length: int) -> int:
        """Keep the first ``length`` context positions, fewer when the cut falls inside a cached
        block: that block leaves the table (whoever else holds it keeps it) and its first positions
        are computed again, since writing past the cut would change a cached block. Returns the
        positions kept."""
        block_size = self.pool.block_size
        inside = length // block_size
        if length % block_size and inside < len(self.block_table) and self.pool.is_cached(self.block_table[inside]):
            length = inside * block_size
        self.context_len = min(self.context_len, length)
        del self.keys[self.context_len // block_size :]
        self._trim()
        return self.context_len

    def adopt_pending(self, context_len: int, path: list[int]) -> None:
        src = self.rows(context_len + j for j in path)
        dst = self.rows(range(context_len, context_len + len(path)))
        if src != dst:
            device = self.pool.k.device
            self.pool.move(
                torch.tensor(src, dtype=torch.long, device=device), torch.tensor(dst, dtype=torch.long, device=device)
            )
        self.context_len = context_len + len(path)
        self._trim()

    def clear_pending(self) -> None:
        self._trim()

    def cache_context(self, context: Sequence[int]) -> None:
        """Cache the full blocks of ``context``, the tokens whose rows the storage now holds."""
        if not self.prefix_caching:
            return
        block_size = self.pool.block_size
        for i in range(len(self.keys), min(len(context), self.context_len) // block_size):
            self.keys.append(block_key(self.keys[-1] if i else b"", context[i * block_size : (i + 1) * block_size]))
            self.pool.register(self.block_table[i], self.keys[i])

    def reuse_cached(self, context: Sequence[int], held: int) -> int:
        """Take cached blocks for the tokens of ``context`` past the ``held`` ones the storage holds:
        the longest run of whole blocks whose keys the pool has. Returns how many tokens they hold
        (0 without prefix caching, or when ``held`` ends inside a block: the next block is the
        request's own)."""
        block_size = self.pool.block_size
        if not self.prefix_caching or held % block_size or len(self.block_table) != held // block_size:
            return 0
        self.cache_context(context[:held])  # keys of the blocks before, e.g. a path adopted just now
        i = held // block_size
        while (i + 1) * block_size <= len(context):
            key = block_key(self.keys[-1] if i else b"", context[i * block_size : (i + 1) * block_size])
            block = self.pool.share(key)
            if block is None:
                break
            self.block_table.append(block)
            self.keys.append(key)
            i += 1
        self.context_len = i * block_size
        return self.context_len - held

    def _trim(self) -> None:
        """Free the blocks past the context (they held pending nodes only)."""
        keep = blocks_for(self.context_len, self.pool.block_size)
        if len(self.block_table) > keep:
            self.pool.release(self.block_table[keep:])
            del self.block_table[keep:]
