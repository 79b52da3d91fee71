"""Row-invariant tree attention on an x86-64 CPU (``cpu_attention.c``, built with :mod:`.cpu_qgemm`'s library).

Each query row reads exactly its *visible keys* (its request's prefix, then its tree ancestors and itself, within a
sliding window if any) in logical order, and reduces them in a fixed order, so a row's output depends on its query
and keys alone: the rows of a verify step get, bit for bit, what one-query incremental steps give the same tokens.
SDPA does not: a one-query step (no mask) and a tree step (a mask over every key of the tree) round differently,
and on quantized weights, whose activations are rounded to int8, greedy speculation then left incremental
decoding's tokens (BENCHMARKS.md, "Our own int4 and int8 CPU kernels"). :func:`row_keys` lists the cache rows per
query row once per step (cached on the metadata) for every layer.
"""

from __future__ import annotations

import numpy as np
import torch

from specinfer.core.tree import ancestor_matrix

from . import cpu_qgemm
from .metadata import TreeAttentionMetadata, token_positions

MAX_ROWS = 64  # query rows of a request above which SDPA serves (a longer prompt or chunk: the same in every mode)


def serves(q: torch.Tensor, k_cache: torch.Tensor, meta: TreeAttentionMetadata, b: int) -> bool:
    """Whether request b's rows go through this kernel: a CPU where the library runs, float32 or bfloat16, a head
    size of whole 8s (at most 512), and a decode or verify step (:func:`row_by_row`)."""
    if q.device.type != "cpu" or q.shape[-1] % 8 or q.shape[-1] > 512 or not row_by_row(meta, b):
        return False
    kinds = (torch.float32, torch.bfloat16)
    if q.dtype not in kinds or k_cache.dtype not in kinds or not k_cache.is_contiguous():
        return False
    return cpu_qgemm.library() is not None


def row_by_row(meta: TreeAttentionMetadata, b: int) -> bool:
    """Whether request b's rows go row by row: at most :data:`MAX_ROWS` of them (a decode or verify step, or a prompt,
    or a chunk of one, of that many tokens; a prompt is a chain, which is a tree)."""
    return segment_row_by_row(meta.num_queries[b])


def segment_row_by_row(queries: int) -> bool:
    """:func:`row_by_row` of one attention segment of ``queries`` query rows.

    A prompt of at most :data:`MAX_ROWS` tokens goes row by row as well: then the fused CPU layers
    (:mod:`.cpu_layers`) take it in the same pass as the step's decode and verify rows, where as PyTorch operations it
    was a pass of its own (every weight read again, by GEMMs that repack them per call): on the 2-core AMX Xeon with a
    1B-shaped LLM in bf16, a 63-token prompt cost 267-378 ms per operation and 146-160 ms in the C layers, and beside
    32 decoding requests 464-489 ms against their 142-175 ms alone. Its attention is short (each token reads the
    tokens before it), so reading row by row costs little of that."""
    return queries <= MAX_ROWS


def row_keys(meta: TreeAttentionMetadata, b: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Request b's visible keys per query row, as rows of the flattened cache: ``(offsets, keys, longest)``
    # [nq + 1] int64, [sum of lengths] int32; cached on ``meta`` per (request, window)."""
    cached = meta._row_keys.get((b, window))
    if cached is not None:
        return cached
    parents, prefix, nq = meta.parents[b], meta.prefix_lens[b], meta.num_queries[b]
    n = len(parents)
    positions = np.arange(prefix + n)  # logical positions of the request's keys
    if meta.paged:
        table = np.asarray(meta.block_tables[b], dtype=np.int64)
        rows = table[positions // meta.block_size] * meta.block_size + positions % meta.block_size
    else:
        rows = meta.kv_starts[b] + positions
    if meta.is_chain[b] and window is None:  # row i sees every position up to its own (a decode step: all of them)
        lists = [rows[: prefix + i + 1] for i in range(n - nq, n)]
    else:
        lists = _tree_lists(parents, prefix, nq, rows, window)
    offsets = np.zeros(nq + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in lists])
    keys = np.concatenate(lists).astype(np.int32)
    cached = (torch.from_numpy(offsets), torch.from_numpy(keys), int(max(len(x) for x in lists)))
    meta._row_keys[(b, window)] = cached
    return cached


def _tree_lists(
    parents: tuple[int, ...], prefix: int, nq: int, rows: np.ndarray, window: int | None
) -> list[np.ndarray]:
    """Each query row's visible cache rows (of ``rows``, the request's logical positions'): the prefix, then the row's
    ancestors and itself, within ``window`` of its position."""
    n = len(parents)
    token_pos = token_positions(parents, prefix)  # [prefix + n] RoPE positions (a node: prefix + depth)
    ancestors = ancestor_matrix(parents)  # [n, n]: row i's ancestors and itself (parents precede children: root first)
    lists = []
    for i in range(n - nq, n):
        visible = np.concatenate([np.arange(prefix), prefix + np.flatnonzero(ancestors[i])])
        if window is not None:
            visible = visible[token_pos[visible] > token_pos[prefix + i] - window]
        lists.append(rows[visible])
    return lists


def attend(
    q: torch.Tensor,  # [nq, heads, head_dim] request b's queries
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    b: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:  # [nq, heads, head_dim] in q's dtype
    """Request b's attention, row by row over :func:`row_keys` (see the module)."""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_attention.attend without its library (check serves() first)"
    offsets, keys, longest = row_keys(meta, b, window)
    q = q.contiguous()
    out = torch.empty_like(q)
    nq, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    bf16_q, bf16_kv = int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16)
    v_cache = v_cache.contiguous()  # a view of the pool in every layout here (a no-op)
    failed = lib.tree_attend(
        nq, heads, kv_heads, dim, q.data_ptr(), bf16_q, k_cache.data_ptr(), v_cache.data_ptr(), bf16_kv,
        offsets.data_ptr(), keys.data_ptr(), longest, scale, softcap or 0.0, out.data_ptr(), bf16_q,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu_attention: no memory for the scores of a row")
    return out
