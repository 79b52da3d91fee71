"""Per-verify-step metadata of tree attention: where each request's queries and keys live, and its mask.

Terms (see also :mod:`specinfer.core.tree`):

- *request b*: one sequence of the batch. Its *committed prefix* (``prefix_len[b]`` tokens) already has its
  keys/values in the KV cache; its *token tree* has ``tree_len[b]`` nodes whose keys/values were written
  right behind the prefix before attention runs.
- *tree node j*: node 0 is the root, ``parents[0] == -1`` and ``parents[j] < j``. Node i attends to every
  prefix position, to its ancestors and to itself (the topology-aware causal mask).
- *chain*: a tree with ``parents == [-1, 0, 1, ..., n-2]``. Its mask is plain causal attention (``j <= i``),
  which is how prefill and single-token decode use the same kernel. Chains need no stored mask at all.

KV layout (token-major pools shared by all requests, ``[capacity, num_kv_heads, head_dim]``): request b owns the
contiguous rows ``kv_start[b] .. kv_start[b] + prefix_len[b] + tree_len[b] - 1``; row ``kv_start[b] + p`` holds
prefix position ``p`` for ``p < prefix_len[b]`` and tree node ``p - prefix_len[b]`` after that.

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
gets a valid pointer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specinfer.core.tree import ancestor_matrix, validate_parents

BITS_PER_WORD = 32


@dataclass(frozen=True, eq=False)
class TreeAttentionMetadata:
    """Everything tree attention needs besides q/k/v; built once per verify step and reused by every layer.

    Device tensors (int32, on ``device``) are read by the Triton kernel; the host tuples mirror them so the
    PyTorch paths and launch configuration never synchronise with the device.
    """

    q_start: torch.Tensor  # [B + 1] int32, cu_seqlens of the packed queries (request b has q_start[b+1]-q_start[b] queries)
    kv_start: torch.Tensor  # [B] int32, first KV-cache row of each request
    prefix_len: torch.Tensor  # [B] int32, committed tokens already in the cache
    tree_len: torch.Tensor  # [B] int32, tree nodes (>= 1) written right behind the prefix
    anc_row_start: torch.Tensor  # [B] int32, anc_bits row of node 0, -1 for chains
    anc_bits: torch.Tensor  # [num_bit_rows, num_words] int32, packed ancestor relation of non-chain trees
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
    _dense_masks: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.q_start.device


def is_chain(parents: Sequence[int]) -> bool:
    """True iff ``parents == [-1, 0, 1, ..., n-2]`` (every node's parent is the node before it)."""
    return all(int(p) == i - 1 for i, p in enumerate(parents))


def pack_bits(mask: np.ndarray, num_words: int) -> np.ndarray:
    """Pack a ``[n, m]`` bool matrix (m <= 32 * num_words) into ``[n, num_words]`` int32, bit j%32 of word j//32."""
    n, m = mask.shape
    padded = np.zeros((n, num_words * BITS_PER_WORD), dtype=np.uint64)
    padded[:, :m] = mask
    weights = np.left_shift(np.uint64(1), np.arange(BITS_PER_WORD, dtype=np.uint64))  # [32]
    words = (padded.reshape(n, num_words, BITS_PER_WORD) * weights).sum(axis=-1, dtype=np.uint64)  # [n, num_words]
    # Reinterpret the low 32 bits as two's complement int32 (bit 31 becomes the sign bit).
    return words.astype(np.uint32).view(np.int32)


def _to_device(arrays: Sequence[Sequence[int] | np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """int32 copies of ``arrays`` on ``device`` with one host-to-device transfer (views into one buffer).

    Each array starts on a 16-byte boundary so the kernel's pointer arguments keep Triton's divisibility-16
    specialisation (an unaligned view would trigger another compilation of the kernel).
    """
    parts = [np.asarray(a, dtype=np.int32) for a in arrays]
    sizes = [p.size for p in parts]
    offsets = np.concatenate([[0], np.cumsum([-(-n // 4) * 4 for n in sizes])])
    buf = np.zeros(int(offsets[-1]), dtype=np.int32)
    for p, off in zip(parts, offsets, strict=False):
        buf[off : off + p.size] = p.ravel()
    dev = torch.from_numpy(buf).to(device)
    return [dev[off : off + p.size].view(p.shape) for p, off in zip(parts, offsets, strict=False)]


def build_tree_metadata(
    parents_list: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    kv_starts: Sequence[int],
    device: torch.device | str,
    num_queries: Sequence[int] | None = None,
) -> TreeAttentionMetadata:
    """Build the metadata of one verify step (see the module docstring for every layout).

    Args:
        parents_list: per request, the parent array of its token tree (``parents[0] == -1``, ``parents[i] < i``).
        prefix_lens: per request, committed tokens already in the KV cache (may be 0).
        kv_starts: per request, the KV-cache row of its prefix position 0.
        device: where the device tensors go.
        num_queries: per request, how many of its tree nodes, counted from the last, have queries (1..tree_len);
            default: all of them.

    Chains are detected automatically and get no bit rows.
    """
    batch = len(parents_list)
    if batch == 0:
        raise ValueError("empty batch")
    if len(prefix_lens) != batch or len(kv_starts) != batch:
        raise ValueError(f"got {batch} trees, {len(prefix_lens)} prefix lengths and {len(kv_starts)} kv starts")
    parents = tuple(tuple(int(p) for p in ps) for ps in parents_list)
    for ps in parents:
        validate_parents(ps)
    prefix = tuple(int(p) for p in prefix_lens)
    starts = tuple(int(s) for s in kv_starts)
    if min(prefix) < 0 or min(starts) < 0:
        raise ValueError("prefix lengths and kv starts must be non-negative")

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
    rows = 0
    for ps, c in zip(parents, chain, strict=True):
        if c:
            row_start.append(-1)
            continue
        row_start.append(rows)
        blocks.append(pack_bits(ancestor_matrix(ps), num_words))
        rows += len(ps)
    bits = np.concatenate(blocks) if blocks else np.zeros((1, 1), dtype=np.int32)  # [num_bit_rows, num_words]

    q_starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(queries)]))
    q_start, kv_start, prefix_len, tree_len, anc_row_start, anc_bits = _to_device([q_starts, starts, prefix, tree_lens, row_start, bits], device)
    return TreeAttentionMetadata(
        q_start=q_start,
        kv_start=kv_start,
        prefix_len=prefix_len,
        tree_len=tree_len,
        anc_row_start=anc_row_start,
        anc_bits=anc_bits,
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
    )
