"""Per-verify-step metadata of tree attention: where each request's queries and keys live, and its mask.

Terms (see also :mod:`specinfer.core.tree`):

- *request b*: one sequence of the batch. Its *committed prefix* (``prefix_len[b]`` tokens) already has its
  keys/values in the KV cache; its *token tree* has ``tree_len[b]`` nodes whose keys/values were written
  right behind the prefix before attention runs.
- *tree node j*: node 0 is the root, ``parents[0] == -1`` and ``parents[j] < j``. Node i attends to every
  prefix position, to its ancestors and to itself (the topology-aware causal mask).
- *chain*: a tree with ``parents == [-1, 0, 1, ..., n-2]``. Its mask is plain causal attention (``j <= i``),
  which is how prefill and single-token decode use the same kernel. Chains need no stored mask at all.

*Logical position* p of request b: prefix position ``p`` for ``p < prefix_len[b]``, tree node ``p - prefix_len[b]``
after that (``0 <= p < prefix_len[b] + tree_len[b]``). Both KV layouts below store exactly these positions.

*Token position* of a key or query: where its token sits in the sequence it belongs to (its RoPE position):
``p`` for prefix position p, ``prefix_len[b] + depth(j)`` for tree node j (the root has depth 0), so siblings share
one. For a chain it equals the logical position. A *sliding window* of w (an argument of each attention call) lets a
query at token position t attend only keys at token positions ``> t - w``: its own and the ``w - 1`` before it, the
rule of ``transformers``' sliding-window masks. Keys outside the window stay in the cache; they are only masked.

Contiguous KV layout (token-major pools shared by all requests, ``[capacity, num_kv_heads, head_dim]``, built by
:func:`build_tree_metadata`): request b owns the contiguous rows ``kv_start[b] .. kv_start[b] + prefix_len[b] +
tree_len[b] - 1``; row ``kv_start[b] + p`` holds logical position ``p``.

Paged KV layout (vLLM style, built by :func:`build_paged_tree_metadata`): the pools are ``[num_blocks, block_size,
num_kv_heads, head_dim]``, cut into *KV blocks* of ``block_size`` token slots (a KV block is the unit the cache
manager hands out; not to be confused with the kernel's ``BLOCK_N``-key tiles). Request b's *block table* row lists
its physical KV blocks in logical order: logical position ``p`` lives in block ``block_table[b, p // block_size]``,
slot ``p % block_size``. Only the first ``ceil((prefix_len[b] + tree_len[b]) / block_size)`` entries of a row are
read; a row may hold more (blocks reserved for later tokens) and is padded with -1 to the widest row. Blocks may be
shared between requests (prefix caching); nothing here assumes they are not. ``kv_start`` is all zero.

Query layout (cu_seqlens style): request b's queries are rows ``q_start[b] .. q_start[b + 1] - 1`` of the packed
``[total_queries, num_heads, head_dim]`` query tensor. By default every tree node has a query (``total_queries ==
total_nodes``, node j at row ``q_start[b] + j``). With ``num_queries[b] = nq < tree_len[b] = n`` only the *last* nq
nodes have queries (node ``n - nq + r`` at row ``q_start[b] + r``): the first nodes are pending nodes of an earlier
step whose keys/values are already cached and which are only attended to, never recomputed.

Ancestor bitmask layout (the choice documented here): ``anc_bits`` holds rows only for requests that are *not*
chains, so a 2k-token prefill costs nothing while a 64-node tree costs 64 rows of ``num_words`` int32 words.
``anc_row_start[b]`` is the ``anc_bits`` row of request b's node 0, or -1 for a chain (then the kernel uses the
arithmetic rule ``j <= i``). Bit ``j % 32`` of word ``j // 32`` of node i's row (bit 0 = least significant,
two's complement int32) is set iff node j is i or an ancestor of i. ``num_words = ceil(max non-chain tree_len
/ 32)``; when every request is a chain, ``anc_bits`` is a single all-zero ``[1, 1]`` row so the kernel always
gets a valid pointer. ``node_depth`` has the same rows: ``node_depth[anc_row_start[b] + j]`` is the depth of node j of
non-chain request b (a chain's node j has depth j, stored nowhere), read by the kernel only under a sliding window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specinfer.core.kv_budget import blocks_for
from specinfer.core.tree import ancestor_matrix, node_depths, validate_parents

BITS_PER_WORD = 32


@dataclass(frozen=True, eq=False)
class TreeAttentionMetadata:
    """Everything tree attention needs besides q/k/v; built once per verify step and reused by every layer.

    Device tensors (int32, on ``device``) are read by the Triton kernel; the host tuples mirror them so the
    PyTorch paths and launch configuration never synchronise with the device.

    One class for both KV layouts (``paged``: ``block_size > 0``) rather than a sibling class: the queries, trees and
    masks, which are most of it, do not depend on the layout, and every consumer (kernel, PyTorch paths, launch
    heuristics, the native runtime's signatures) then takes one type; only where a logical position's K/V row lives
    differs, and the caches' rank must match (3-D: contiguous, 4-D: paged; checked at every call).
    """

    q_start: (
        torch.Tensor
    )  # [B + 1] int32, cu_seqlens of the packed queries (request b has q_start[b+1]-q_start[b] queries)
    kv_start: torch.Tensor  # [B] int32, first KV-cache row of each request (all zero when paged)
    prefix_len: torch.Tensor  # [B] int32, committed tokens already in the cache
    tree_len: torch.Tensor  # [B] int32, tree nodes (>= 1) written right behind the prefix
    anc_row_start: torch.Tensor  # [B] int32, anc_bits row of node 0, -1 for chains
    anc_bits: torch.Tensor  # [num_bit_rows, num_words] int32, packed ancestor relation of non-chain trees
    node_depth: torch.Tensor  # [num_bit_rows] int32, depth of each node of the non-chain trees (rows as anc_bits)
    parents: tuple[tuple[int, ...], ...]  # host copy of each request's parent array
    q_starts: tuple[int, ...]  # host copy of q_start
    tree_lens: tuple[int, ...]  # host copy of tree_len
    prefix_lens: tuple[int, ...]  # host copy of prefix_len
    kv_starts: tuple[int, ...]  # host copy of kv_start
    is_chain: tuple[bool, ...]  # request b's tree is a chain (plain causal mask, no bit rows)
    num_queries: tuple[int, ...]  # queries of request b: its last num_queries[b] tree nodes
    batch_size: int  # B, requests
    total_nodes: int  # tree nodes of all requests (keys/values in the cache)
    total_queries: int  # rows of q and of the output (== total_nodes unless num_queries was given)
    max_tree_len: int  # max over requests of tree_len
    max_queries: int  # max over requests of num_queries (launch grid)
    max_prefix_len: int  # max over requests of prefix_len (split heuristic)
    num_words: int  # int32 words per anc_bits row
    cache_len: int  # least first dimension of the KV caches: rows (contiguous) or blocks (paged: max block id read + 1)
    _dense_masks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # per (request, device): its KV blocks in logical order, cut from block_table once per step, read by every layer
    _request_blocks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # per (request, window): each query row's visible cache rows (kernels/cpu_attention.py), built once per step
    _row_keys: dict[tuple[int, int | None], tuple] = field(default_factory=dict, init=False, repr=False)
    # Paged layout only (defaults: contiguous).
    block_size: int = 0  # token slots per KV block; 0: contiguous layout
    # [B, max_blocks_per_request] int32, physical KV block of each logical block, -1 padded
    block_table: torch.Tensor | None = None
    block_tables: tuple[tuple[int, ...], ...] = ()  # host copy of each request's block-table row, unpadded

    @property
    def device(self) -> torch.device:
        return self.q_start.device

    @property
    def paged(self) -> bool:
        """K/V are read through block tables from ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches."""
        return self.block_size > 0

    def kv_len(self, b: int) -> int:
        """Logical positions of request b (prefix + tree nodes), i.e. keys each of its queries may see."""
        return self.prefix_lens[b] + self.tree_lens[b]


def is_chain(parents: Sequence[int]) -> bool:
    """True iff ``parents == [-1, 0, 1, ..., n-2]`` (every node's parent is the node before it)."""
    return all(int(p) == i - 1 for i, p in enumerate(parents))


def token_positions(parents: Sequence[int], prefix_len: int) -> np.ndarray:
    """Token position of each logical position of a request (see the module docstring).  # [prefix_len + n] int64"""
    return np.concatenate([np.arange(prefix_len, dtype=np.int64), prefix_len + node_depths(parents)])


def pack_bits(mask: np.ndarray, num_words: int) -> np.ndarray:
    """Pack a ``[n, m]`` bool matrix (m <= 32 * num_words) into ``[n, num_words]`` int32, bit j%32 of word j//32."""
    n, m = mask.shape
    padded = np.zeros((n, num_words * BITS_PER_WORD), dtype=np.uint64)
    padded[:, :m] = mask
    weights = np.left_shift(np.uint64(1), np.arange(BITS_PER_WORD, dtype=np.uint64))  # [32]
    words = (padded.reshape(n, num_words, BITS_PER_WORD) * weights).sum(axis=-1, dtype=np.uint64)  # [n, num_words]
    # Reinterpret the low 32 bits as two's complement int32 (bit 31 becomes the sign bit).
    return words.astype(np.uint32).view(np.int32)


def _aligned_offsets(sizes: Sequence[int]) -> np.ndarray:
    """Where arrays of ``sizes`` int32 words start in :func:`_to_device`'s buffer, each on a 16-byte boundary, and
    (last) the buffer's length.  # [len(sizes) + 1]"""
    return np.concatenate([[0], np.cumsum([-(-n // 4) * 4 for n in sizes])])


def _to_device(
    arrays: Sequence[Sequence[int] | np.ndarray], device: torch.device | str, into: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """int32 copies of ``arrays`` on ``device`` with one host-to-device transfer (views into one buffer); ``into``:
    that buffer, already on the device (a CUDA graph's static input), overwritten instead of a new one.

    Each array starts on a 16-byte boundary so the kernel's pointer arguments keep Triton's divisibility-16
    specialisation (an unaligned view would trigger another compilation of the kernel).
    """
    parts = [np.asarray(a, dtype=np.int32) for a in arrays]
    offsets = _aligned_offsets([p.size for p in parts])
    buf = np.zeros(int(offsets[-1]), dtype=np.int32)
    for p, off in zip(parts, offsets, strict=False):
        buf[off : off + p.size] = p.ravel()
    if into is None:
        dev = torch.from_numpy(buf).to(device)
    else:
        if into.shape != buf.shape:
            raise ValueError(f"the static metadata buffer holds {into.numel()} words, this step's needs {buf.size}")
        dev = into
        dev.copy_(torch.from_numpy(buf))
    return [dev[off : off + p.size].view(p.shape) for p, off in zip(parts, offsets, strict=False)]


def next_power_of_two(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class MetadataShape:
    """The sizes a step's metadata is padded to (:func:`pad_metadata`), so that steps of one shape share every tensor
    shape, stride and launch parameter: what a CUDA graph captures once and replays (``models.native.graphs``).

    ``batch``: segments (requests); ``queries``: rows of q; ``max_queries``: the launch grid's rows per segment;
    ``words`` and ``bit_rows``: the ancestor bitmask's; ``table_width``: block-table entries per segment (paged; 0:
    contiguous); ``max_prefix_len``: the prefix the split-KV heuristic plans for."""

    batch: int
    queries: int
    max_queries: int
    words: int
    bit_rows: int
    table_width: int
    max_prefix_len: int

    @staticmethod
    def covering(meta: TreeAttentionMetadata, queries: int, min_prefix: int = 256) -> MetadataShape:
        """The shape of ``meta`` with each size rounded up to a power of two (``queries``: q's rows, at least
        ``meta.total_queries``; the prefix to at least ``min_prefix``), so few shapes cover many steps."""
        if queries < meta.total_queries:
            raise ValueError(f"{queries} query rows cannot hold the step's {meta.total_queries}")
        return MetadataShape(
            batch=next_power_of_two(meta.batch_size),
            queries=queries,
            max_queries=next_power_of_two(meta.max_queries),
            words=next_power_of_two(meta.num_words),
            bit_rows=next_power_of_two(meta.anc_bits.shape[0]),
            table_width=next_power_of_two(meta.block_table.shape[1]) if meta.block_table is not None else 0,
            max_prefix_len=next_power_of_two(max(meta.max_prefix_len, min_prefix)),
        )

    def holds(self, meta: TreeAttentionMetadata) -> bool:
        """Whether ``meta`` fits this shape (:func:`pad_metadata` accepts it)."""
        return (
            meta.batch_size <= self.batch
            and meta.total_queries <= self.queries
            and meta.max_queries <= self.max_queries
            and meta.num_words <= self.words
            and meta.anc_bits.shape[0] <= self.bit_rows
            and (meta.block_table is None) == (self.table_width == 0)
            and (meta.block_table is None or meta.block_table.shape[1] <= self.table_width)
        )


def pad_metadata(
    meta: TreeAttentionMetadata,
    shape: MetadataShape,
    cache_len: int,
    device: torch.device | str,
    into: torch.Tensor | None = None,
) -> TreeAttentionMetadata:
    """``meta`` (any device; its tensors are read back on the host) padded to ``shape``: the same attention for its
    segments, whose queries stay rows ``[0, meta.total_queries)`` of q, and nothing for the rest.

    Padding adds segments without queries (``q_start`` repeats the last row, so every program of theirs exits at
    once; each stands for a one-node chain without prefix), zero ancestor words and rows, -1 block-table entries,
    and query rows ``[meta.total_queries, shape.queries)`` that belong to no segment: their output rows are left
    unwritten (whatever the buffer held), which is harmless where every later operation works row by row and only
    the real rows are read. ``cache_len``: the caches' first dimension (what the launch may address).
    ``max_prefix_len`` is the shape's, so the split-KV count (:func:`specinfer.kernels.launch.choose_config`) is a
    function of the shape alone. ``into``: the device buffer to overwrite (:func:`_to_device`)."""
    if not shape.holds(meta):
        raise ValueError(f"{shape} does not hold a step of {meta.batch_size} segments and {meta.total_queries} queries")
    batch, pad = meta.batch_size, shape.batch - meta.batch_size
    q_start = np.full(shape.batch + 1, meta.q_starts[-1], dtype=np.int32)
    q_start[: batch + 1] = meta.q_starts
    rows, words = meta.anc_bits.shape
    anc_bits = np.zeros((shape.bit_rows, shape.words), dtype=np.int32)
    anc_bits[:rows, :words] = meta.anc_bits.cpu().numpy()  # higher words of a row are zero: bits j // 32 stay put
    node_depth = np.zeros(shape.bit_rows, dtype=np.int32)
    node_depth[:rows] = meta.node_depth.cpu().numpy()
    extra: list[np.ndarray] = []
    if meta.block_table is not None:
        table = np.full((shape.batch, shape.table_width), -1, dtype=np.int32)
        table[:batch, : meta.block_table.shape[1]] = meta.block_table.cpu().numpy()
        extra = [table]
    arrays = [
        q_start,
        (*meta.kv_starts, *(0,) * pad),
        (*meta.prefix_lens, *(0,) * pad),
        (*meta.tree_lens, *(1,) * pad),
        np.concatenate([meta.anc_row_start.cpu().numpy(), np.full(pad, -1, dtype=np.int32)]),
        anc_bits,
        node_depth,
        *extra,
    ]
    q_start_t, kv_start, prefix_len, tree_len, anc_row_start, anc_bits_t, node_depth_t, *paged = _to_device(
        arrays, device, into
    )
    return TreeAttentionMetadata(
        q_start=q_start_t,
        kv_start=kv_start,
        prefix_len=prefix_len,
        tree_len=tree_len,
        anc_row_start=anc_row_start,
        anc_bits=anc_bits_t,
        node_depth=node_depth_t,
        parents=(*meta.parents, *((-1,),) * pad),
        q_starts=tuple(int(x) for x in q_start),
        tree_lens=(*meta.tree_lens, *(1,) * pad),
        prefix_lens=(*meta.prefix_lens, *(0,) * pad),
        kv_starts=(*meta.kv_starts, *(0,) * pad),
        is_chain=(*meta.is_chain, *(True,) * pad),
        num_queries=(*meta.num_queries, *(0,) * pad),
        batch_size=shape.batch,
        total_nodes=meta.total_nodes + pad,
        total_queries=shape.queries,
        max_tree_len=meta.max_tree_len,
        max_queries=shape.max_queries,
        max_prefix_len=shape.max_prefix_len,
        num_words=shape.words,
        cache_len=cache_len,
        block_size=meta.block_size,
        block_table=paged[0] if paged else None,
        block_tables=(*meta.block_tables, *((),) * pad) if meta.block_table is not None else (),
    )


def padded_buffer_words(shape: MetadataShape) -> int:
    """int32 words of the device buffer holding a step of ``shape``'s padded metadata (:func:`pad_metadata`)."""
    sizes = [shape.batch + 1, *(shape.batch,) * 4, shape.bit_rows * shape.words, shape.bit_rows]
    if shape.table_width:
        sizes.append(shape.batch * shape.table_width)
    return int(_aligned_offsets(sizes)[-1])


def build_tree_metadata(
    parents_list: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    kv_starts: Sequence[int],
    device: torch.device | str,
    num_queries: Sequence[int] | None = None,
) -> TreeAttentionMetadata:
    """Build the metadata of one verify step over the contiguous KV layout (see the module docstring for every layout).

    Args:
        parents_list: per request, the parent array of its token tree (``parents[0] == -1``, ``parents[i] < i``).
        prefix_lens: per request, committed tokens already in the KV cache (may be 0).
        kv_starts: per request, the KV-cache row of its prefix position 0.
        device: where the device tensors go.
        num_queries: per request, how many of its tree nodes, counted from the last, have queries (1..tree_len);
            default: all of them.

    Chains are detected automatically and get no bit rows.
    """
    if len(prefix_lens) != len(parents_list) or len(kv_starts) != len(parents_list):
        raise ValueError(
            f"got {len(parents_list)} trees, {len(prefix_lens)} prefix lengths and {len(kv_starts)} kv starts"
        )
    starts = tuple(int(s) for s in kv_starts)
    if starts and min(starts) < 0:
        raise ValueError("kv starts must be non-negative")
    return _build(parents_list, prefix_lens, starts, device, num_queries, block_tables=None, block_size=0)


def build_paged_tree_metadata(
    parents_list: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    num_queries: Sequence[int] | None = None,
) -> TreeAttentionMetadata:
    """Build the metadata of one verify step over the paged KV layout (module docstring); as :func:`build_tree_metadata`
    but with block tables instead of ``kv_starts``.

    Args:
        block_tables: per request, its physical KV blocks in logical order (a list, or a row of a -1 padded 2-D
            array). The first ``ceil((prefix_len + tree_len) / block_size)`` entries must be block ids (>= 0); later
            ones are not read and may be -1. Whether ids are below the caches' ``num_blocks`` is checked per call.
        block_size: token slots per KV block (>= 1; any value, powers of two are cheapest in the kernel).

    Raises ValueError when a block table is too short for its request's prefix + tree, or holds a negative id
    where a block is needed.
    """
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(prefix_lens) != len(parents_list) or len(block_tables) != len(parents_list):
        raise ValueError(
            f"got {len(parents_list)} trees, {len(prefix_lens)} prefix lengths and {len(block_tables)} block tables"
        )
    tables = tuple(tuple(int(x) for x in t) for t in block_tables)
    return _build(
        parents_list,
        prefix_lens,
        (0,) * len(tables),
        device,
        num_queries,
        block_tables=tables,
        block_size=int(block_size),
    )


def _build(
    parents_list: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    starts: tuple[int, ...],
    device: torch.device | str,
    num_queries: Sequence[int] | None,
    block_tables: tuple[tuple[int, ...], ...] | None,
    block_size: int,
) -> TreeAttentionMetadata:
    """The two public builders' common part; ``block_tables is None`` for the contiguous layout."""
    batch = len(parents_list)
    if batch == 0:
        raise ValueError("empty batch")
    parents = tuple(tuple(int(p) for p in ps) for ps in parents_list)
    for ps in parents:
        validate_parents(ps)
    prefix = tuple(int(p) for p in prefix_lens)
    if min(prefix) < 0:
        raise ValueError("prefix lengths must be non-negative")

    tree_lens = tuple(len(ps) for ps in parents)
    queries = tuple(tree_lens) if num_queries is None else tuple(int(x) for x in num_queries)
    if len(queries) != batch:
        raise ValueError(f"got {batch} trees and {len(queries)} query counts")
    for b, (nq, n) in enumerate(zip(queries, tree_lens, strict=True)):
        if not 1 <= nq <= n:
            raise ValueError(f"request {b}: num_queries {nq} must be in [1, {n}]")
    chain = tuple(is_chain(ps) for ps in parents)
    num_words = max([-(-n // BITS_PER_WORD) for n, c in zip(tree_lens, chain, strict=True) if not c], default=1)

    row_start: list[int] = []
    blocks: list[np.ndarray] = []
    depths: list[np.ndarray] = []
    rows = 0
    for ps, c in zip(parents, chain, strict=True):
        if c:
            row_start.append(-1)
            continue
        row_start.append(rows)
        blocks.append(pack_bits(ancestor_matrix(ps), num_words))
        depths.append(node_depths(ps))
        rows += len(ps)
    bits = np.concatenate(blocks) if blocks else np.zeros((1, 1), dtype=np.int32)  # [num_bit_rows, num_words]
    depth = np.concatenate(depths) if depths else np.zeros(1, dtype=np.int64)  # [num_bit_rows]

    if block_tables is None:
        cache_len = max(s + p + n for s, p, n in zip(starts, prefix, tree_lens, strict=True))
        extra: list[np.ndarray] = []
    else:
        cache_len = _check_block_tables(block_tables, block_size, prefix, tree_lens)
        width = max(len(t) for t in block_tables)
        table = np.full((batch, width), -1, dtype=np.int32)  # [B, max_blocks_per_request]
        for b, t in enumerate(block_tables):
            table[b, : len(t)] = t
        extra = [table]

    q_starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(queries)]))
    arrays = [q_starts, starts, prefix, tree_lens, row_start, bits, depth, *extra]
    q_start, kv_start, prefix_len, tree_len, anc_row_start, anc_bits, node_depth, *paged = _to_device(
        arrays, device
    )  # one transfer
    return TreeAttentionMetadata(
        q_start=q_start,
        kv_start=kv_start,
        prefix_len=prefix_len,
        tree_len=tree_len,
        anc_row_start=anc_row_start,
        anc_bits=anc_bits,
        node_depth=node_depth,
        parents=parents,
        q_starts=q_starts,
        tree_lens=tree_lens,
        prefix_lens=prefix,
        kv_starts=starts,
        is_chain=chain,
        num_queries=queries,
        batch_size=batch,
        total_nodes=sum(tree_lens),
        total_queries=sum(queries),
        max_tree_len=max(tree_lens),
        max_queries=max(queries),
        max_prefix_len=max(prefix),
        num_words=num_words,
        cache_len=cache_len,
        block_size=block_size,
        block_table=paged[0] if paged else None,
        block_tables=block_tables or (),
    )


def _check_block_tables(
    tables: tuple[tuple[int, ...], ...], block_size: int, prefix: tuple[int, ...], tree_lens: tuple[int, ...]
) -> int:
    """Validate each request's block table against its length; returns the number of blocks the caches need."""
    max_id = -1
    for b, (t, p, n) in enumerate(zip(tables, prefix, tree_lens, strict=True)):
        need = blocks_for(p + n, block_size)
        if len(t) < need:
            raise ValueError(
                f"request {b}: block table has {len(t)} blocks but prefix_len {p} + tree_len {n} = {p + n} positions "
                f"need {need} blocks of {block_size}"
            )
        if min(t[:need]) < 0 or (len(t) > need and min(t[need:]) < -1):
            raise ValueError(
                f"request {b}: block table {list(t)} has a negative block id among its first {need} entries, "
                "or one below -1 (padding)"
            )
        max_id = max(max_id, *t[:need])
    return max_id + 1
