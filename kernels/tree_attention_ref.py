"""PyTorch tree attention: the fp32 reference (test oracle) and the SDPA-with-explicit-mask path.

Both take and return what :func:`specinfer.kernels.tree_attention` does (shapes there). Both loop over requests and
materialise each request's dense ``[num_queries, prefix_len + tree_len]`` mask from its *parent array* (not from the
packed ``anc_bits`` and ``node_depth`` the kernel reads), so they check the packing too.
See :mod:`specinfer.kernels.metadata` for the terms and layouts (token positions, sliding windows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specinfer.core.kv_budget import blocks_for
from specinfer.core.tree import ancestor_matrix

from . import cpu_attention
from .metadata import TreeAttentionMetadata, is_chain, token_positions


def dense_tree_mask(
    parents: Sequence[int], prefix_len: int, device: torch.device | str = "cpu", window: int | None = None
) -> torch.Tensor:
    """Boolean mask of one request: ``mask[i, k]`` is True iff tree node i may attend to key k.  # [n, prefix_len + n]

    Keys ``0 .. prefix_len-1`` are the prefix (visible unless ``window`` excludes them); key ``prefix_len + j`` is
    tree node j, visible iff j is i or an ancestor of i (and within ``window``). ``window``: a sliding window over
    token positions (:mod:`specinfer.kernels.metadata`), None for none. ``True`` means "attend", as
    ``scaled_dot_product_attention`` expects.
    """
    n = len(parents)
    mask = torch.ones(n, prefix_len + n, dtype=torch.bool)
    # A chain's ancestor relation is j <= i; tril avoids the O(n) Python loop for long prefill chains.
    mask[:, prefix_len:] = (
        torch.ones(n, n, dtype=torch.bool).tril() if is_chain(parents) else torch.from_numpy(ancestor_matrix(parents))
    )
    if window is not None:
        pos = torch.from_numpy(token_positions(parents, prefix_len))  # [prefix_len + n]
        mask &= pos[None, :] > pos[prefix_len:, None] - window
    return mask.to(device)


def _request_views(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TreeAttentionMetadata, b: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request b's queries ``[nq, H, D]`` and keys/values ``[prefix_len + n, H_kv, D]`` in logical order.

    Contiguous layout: views, no copies. Paged layout: copies gathered through the device block table (whole KV
    blocks, then the unused slots of the last one cut off), so the math after this is the same for both layouts.
    """
    q0, q1 = meta.q_starts[b], meta.q_starts[b + 1]
    length = meta.kv_len(b)
    if meta.paged:
        assert meta.block_table is not None
        key = (b, str(k_cache.device))
        blocks = meta._request_blocks.get(key)  # [num_request_blocks] int32, cut once per step (not per layer)
        if blocks is None:
            blocks = meta.block_table[b, : blocks_for(length, meta.block_size)].to(k_cache.device)
            meta._request_blocks[key] = blocks
        return (
            q[q0:q1],
            k_cache.index_select(0, blocks).flatten(0, 1)[:length],
            v_cache.index_select(0, blocks).flatten(0, 1)[:length],
        )
    kv0 = meta.kv_starts[b]
    return q[q0:q1], k_cache[kv0 : kv0 + length], v_cache[kv0 : kv0 + length]


def _request_kv_by_position(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TreeAttentionMetadata, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys/values ``[prefix_len + n, H_kv, D]``, each logical position looked up on its own from the
    *host* block table: the reference's deliberately naive gather, so it also checks the device table the faster
    paths read. Contiguous layout: the same views as :func:`_request_views`."""
    length = meta.kv_len(b)
    if not meta.paged:
        kv0 = meta.kv_starts[b]
        return k_cache[kv0 : kv0 + length], v_cache[kv0 : kv0 + length]
    table = meta.block_tables[b]
    block = torch.tensor([table[p // meta.block_size] for p in range(length)], device=k_cache.device)  # [L]
    slot = torch.tensor([p % meta.block_size for p in range(length)], device=k_cache.device)  # [L]
    return k_cache[block, slot], v_cache[block, slot]


def _query_mask(meta: TreeAttentionMetadata, b: int, device: torch.device, window: int | None) -> torch.Tensor:
    """Rows of request b's dense mask that have queries (its last num_queries nodes).  # [nq, prefix_len + n]"""
    n, nq = len(meta.parents[b]), meta.num_queries[b]
    return dense_tree_mask(meta.parents[b], meta.prefix_lens[b], device, window)[n - nq :]


def check_score_options(softcap: float | None, window: int | None) -> None:
    """``softcap`` must be positive and ``window`` at least 1 (a query always sees its own key), or None."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention-logit soft-capping: ``softcap * tanh(scores / softcap)`` (Gemma 2), or ``scores`` unchanged for
    None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TreeAttentionMetadata) -> int:
    """Validate shapes, and that the caches' layout (3-D contiguous, 4-D paged) is the metadata's; returns the GQA
    group size ``num_heads // num_kv_heads``."""
    if q.dim() != 3 or k_cache.dim() not in (3, 4) or v_cache.shape != k_cache.shape:
        raise ValueError(
            "expected q [T, H, D] and k/v caches [capacity, H_kv, D] or paged [num_blocks, block_size, H_kv, D]; "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if (k_cache.dim() == 4) != meta.paged:
        layout = f"paged (block_size {meta.block_size})" if meta.paged else "contiguous"
        raise ValueError(f"{k_cache.dim()}-D k/v caches but the metadata describes the {layout} KV layout")
    if meta.paged and k_cache.shape[1] != meta.block_size:
        raise ValueError(
            f"the paged caches hold KV blocks of {k_cache.shape[1]} slots but the metadata's block_size is "
            f"{meta.block_size}"
        )
    if q.shape[0] != meta.total_queries:
        raise ValueError(f"q has {q.shape[0]} rows but the metadata describes {meta.total_queries} queries")
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    if q.shape[2] != head_dim:
        raise ValueError(f"head_dim differs: q {q.shape[2]} vs cache {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if meta.cache_len > k_cache.shape[0]:
        if meta.paged:
            raise ValueError(
                f"the block tables name KV block {meta.cache_len - 1} but the cache holds {k_cache.shape[0]} blocks"
            )
        raise ValueError(f"requests reach KV row {meta.cache_len} but the cache holds {k_cache.shape[0]} rows")
    return q.shape[1] // num_kv_heads


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference tree attention: per request, dense fp32 ``softmax(cap(q k^T * scale) + mask) v``. Slow and obvious.

    Paged caches are first gathered position by position into the contiguous ``[prefix_len + n, H_kv, D]`` view."""
    group = _check_shapes(q, k_cache, v_cache, meta)
    check_score_options(softcap, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for b in range(meta.batch_size):
        if not meta.num_queries[b]:
            continue  # a padding segment (metadata.pad_metadata)
        qb = q[meta.q_starts[b] : meta.q_starts[b + 1]]  # [nq, H, D]
        kb, vb = _request_kv_by_position(k_cache, v_cache, meta, b)  # [L, H_kv, D] each
        kb = kb.float().repeat_interleave(group, dim=1)  # [L, H, D]; query head h reads kv head h // group
        vb = vb.float().repeat_interleave(group, dim=1)  # [L, H, D]
        scores = soft_cap(torch.einsum("qhd,khd->hqk", qb.float(), kb) * scale, softcap)  # [H, nq, L]
        scores = scores.masked_fill(~_query_mask(meta, b, q.device, window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, nq, L]
        out[meta.q_starts[b] : meta.q_starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype)
    return out


def _cached_additive_mask(
    meta: TreeAttentionMetadata, b: int, device: torch.device, dtype: torch.dtype, window: int | None, repeat: int = 1
) -> torch.Tensor:
    """Request b's query mask as an additive float mask (0 = attend, -inf = not), built once per metadata (i.e.
    per verify step), window and ``repeat``, and reused by every layer. Float, not bool: CPU SDPA is several times
    slower with bool masks. ``repeat``: the mask stacked that many times over its rows (the query rows of a GQA
    group folded into one head, :func:`tree_attention_sdpa`).  # [repeat * nq, prefix_len + n]"""
    key = (b, f"{device}/{dtype}/{window}/{repeat}")
    mask = meta._dense_masks.get(key)
    if mask is None:
        allowed = _query_mask(meta, b, device, window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        mask = mask if repeat == 1 else mask.repeat(repeat, 1)
        meta._dense_masks[key] = mask
    return mask


def tree_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Tree attention through ``F.scaled_dot_product_attention`` with an explicit mask per request.

    The "SDPA with explicit mask" baseline and the CPU path of :func:`tree_attention`. A chain without prefix
    (all of whose nodes have queries), without window or soft-capping, uses ``is_causal=True`` instead (same result,
    lets SDPA pick its flash backend). SDPA has no soft-capping, so with ``softcap`` the same masked attention is
    written out (scores in q's dtype, softmax in fp32, as ``transformers``' eager attention does).
    Paged caches are gathered block-wise through the block table first (:func:`_request_views`).
    """
    group = _check_shapes(q, k_cache, v_cache, meta)
    check_score_options(softcap, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    # one request with every row: its output is the output (no copy into a new one)
    out = None if meta.batch_size == 1 and meta.num_queries[0] == q.shape[0] else torch.empty_like(q)
    for b in range(meta.batch_size):
        if not meta.num_queries[b]:
            continue  # a padding segment (metadata.pad_metadata)
        if cpu_attention.serves(q, k_cache, meta, b):  # decode and verify rows on a CPU: row by row, row-invariant
            qb = q[meta.q_starts[b] : meta.q_starts[b + 1]]  # [nq, H, D]
            ob = cpu_attention.attend(qb, k_cache, v_cache, meta, b, scale, softcap, window)
            if out is None:
                return ob
            out[meta.q_starts[b] : meta.q_starts[b + 1]] = ob
            continue
        qb, kb, vb = _request_views(q, k_cache, v_cache, meta, b)  # [nq, H, D], [L, H_kv, D] x 2
        plain = softcap is None and window is None
        causal = plain and meta.is_chain[b] and meta.prefix_lens[b] == 0 and meta.num_queries[b] == len(meta.parents[b])
        if softcap is None and not (causal and group > 1):
            ob = _grouped_sdpa(meta, b, qb, kb, vb, scale, causal, window, group)  # [nq, H, D]
            if out is None:
                return ob
            out[meta.q_starts[b] : meta.q_starts[b + 1]] = ob
            continue
        # head-major copies: soft-capped attention, and a GQA model's causal chain (a prompt's prefill)
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (qb, kb, vb))  # [1, heads, len, D]
        if softcap is None:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _cached_additive_mask(meta, b, q.device, q.dtype, window)  # [nq, L]
            ob = _softcapped_attention(qb, kb, vb, mask, scale, softcap, group)
        if out is None:
            return ob[0].transpose(0, 1)
        out[meta.q_starts[b] : meta.q_starts[b + 1]] = ob[0].transpose(0, 1)
    return out


def _grouped_sdpa(
    meta: TreeAttentionMetadata,
    b: int,
    q: torch.Tensor,  # [nq, heads, D]
    k: torch.Tensor,  # [L, kv_heads, D]
    v: torch.Tensor,  # [L, kv_heads, D]
    scale: float,
    causal: bool,
    window: int | None,
    group: int,
) -> torch.Tensor:  # [nq, heads, D]
    """Request b's attention without soft cap through SDPA, each GQA group's queries folded into the rows of one
    head: ``[1, kv_heads, group * nq, D]`` against that head's keys, read in place (strided views of the
    token-major cache, no head-major copies). Query head h reads KV head ``h // group``, so the fold is a view of
    the queries; CPU SDPA's ``enable_gqa`` instead repeats every key and value ``group`` times, which made a
    one-query step of a GQA model 1.3-3x slower in bf16 (BENCHMARKS.md, "Attention on a CPU without copies").
    ``causal`` only with ``group`` 1: folded rows are not in token order."""
    nq, heads, dim = q.shape
    kv_heads = heads // group
    if nq == 1:  # [1, H, D] is already [1, kv_heads, group, D] in memory: views, no permutes
        qh = q.view(1, kv_heads, group, dim)
    else:
        qh = q.view(nq, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * nq, dim)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, D], strided views
    # one query at the end of a chain (an incremental step) sees every key: no mask to build or add
    sees_all = causal or (window is None and meta.is_chain[b] and meta.num_queries[b] == 1)
    mask = None if sees_all else _cached_additive_mask(meta, b, q.device, q.dtype, window, group)  # [group * nq, L]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale)
    if nq == 1:
        return o.reshape(1, heads, dim)  # a view where SDPA's output is head-major
    return o.view(kv_heads, group, nq, dim).permute(2, 0, 1, 3).reshape(nq, heads, dim)


def _softcapped_attention(
    q: torch.Tensor,  # [1, heads, nq, D]
    k: torch.Tensor,  # [1, kv_heads, L, D]
    v: torch.Tensor,  # [1, kv_heads, L, D]
    mask: torch.Tensor,  # [nq, L] additive
    scale: float,
    softcap: float,
    group: int,
) -> torch.Tensor:  # [1, heads, nq, D]
    """``softmax(cap(q k^T * scale) + mask) v``, what SDPA would compute if it soft-capped."""
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, heads, L, D]
    scores = soft_cap(q @ k.transpose(-1, -2) * scale, softcap) + mask  # [1, heads, nq, L]
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
