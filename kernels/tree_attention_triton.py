"""Fused tree attention in Triton: flash-attention style online softmax over prefix + tree keys.

Imported lazily by :func:`specinfer.kernels.tree_attention` because ``@triton.jit`` reads ``TRITON_INTERPRET`` when
the decorators run: on a machine without a GPU set ``TRITON_INTERPRET=1`` before the first Triton call.

One program computes a tile of ``BLOCK_M`` *rows* of one request and one KV head. GQA packing: a row is a
(query, query head of the group) pair, ``row = query * GROUP + head_in_group``, so the ``GROUP`` query heads that
share a KV head read each K/V tile once (a 1-node decode step fills ``GROUP`` rows of the tile, not one).
A request's rows never share a tile with another request's. Query r of a request with n nodes and nq queries is
tree node ``n - nq + r`` (``nq == n`` unless the metadata was built with ``num_queries``).

Keys of the tile are visited in up to three phases, each on ``BLOCK_N``-key blocks:

1. *dense*: positions every row of the tile sees: the whole prefix, plus, for a chain, the tree nodes
   ``0 .. node_min`` (``node_min`` = smallest node of the tile; in a chain every row sees them). Full blocks load
   and compute without any mask.
2. *dense tail*: the last partial block of phase 1, masked only by its bound.
3. *tree*: the remaining tree nodes ``.. node_max`` (nodes after ``node_max`` are never ancestors of the tile's
   nodes because ``parents[i] < i``), masked by the ancestor bits or, for a chain, by ``j <= i``.

Split-KV (flash-decoding): when (tiles x KV heads) would leave most SMs idle, e.g. one request with a long prefix,
phase 1 is cut into ``NUM_SPLITS`` chunks computed by separate programs; the last chunk also runs phases 2-3.
Each writes a normalised partial output and its log-sum-exp, and :func:`_combine_kernel` merges them.

Soft-capping and sliding windows (``SOFTCAP``, ``WINDOW``; compile-time switches, so a call with neither runs the
kernel without them): a capped score is ``cap * tanh(score / cap)`` before the mask; a window masks, in every phase,
the keys whose token position is ``<= t - window`` for a row at token position t (chains: the logical position; tree
nodes: ``prefix + node_depth``), and phase 1 starts at the first ``BLOCK_N`` block any row of the tile can see.

Paged KV (``PAGED``, see :mod:`specinfer.kernels.metadata` for the layout): the same kernel, phases and masks; only the
address of a key's K/V row changes. Each key row of a tile looks its KV block up in the request's block-table row
(``block_table[b, pos // KV_BLOCK_SIZE]``, slot ``pos % KV_BLOCK_SIZE``), see :func:`_kv_offsets`. Per row rather
than per tile, so ``KV_BLOCK_SIZE`` and ``BLOCK_N`` are independent (either may divide the other, or neither) and
phase 3's unaligned tiles need no special case; a tile's few distinct table entries come from L1, and the loads
along ``head_dim`` stay as contiguous as in the contiguous layout, whose rows are a runtime stride apart too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import Forced, choose_config
from .metadata import TreeAttentionMetadata
from .tree_attention_ref import _check_shapes, check_score_options


def _check_interpreter_import_order() -> None:
    """Fail clearly when TRITON_INTERPRET=1 came after ``import triton``.

    Triton decides at import time whether its own ``@jit`` helpers (``tl.zeros``, ``tl.sum``, ...) are interpreted,
    so the kernel would otherwise die with "Cannot call @triton.jit'd outside of the scope of a kernel".
    """
    from triton.runtime.jit import JITFunction

    if triton.knobs.runtime.interpret and isinstance(tl.zeros, JITFunction):
        raise ImportError(
            "TRITON_INTERPRET=1 was set after triton had been imported (e.g. by transformers); set it before anything "
            "imports triton (tests/kernels/conftest.py shows how to re-import triton in interpreter mode)"
        )


_check_interpreter_import_order()

LOG2E = 1.4426950408889634  # log2(e): the kernel works in base 2 (exp2 is the native instruction)


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``[rows, BLOCK_D]`` tile; masks only what can be out of bounds (rows of a partial block, padded
    head_dim)."""
    if MASK_ROWS:
        if EVEN_D:
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & d_ok[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _kv_offsets(
    pos,
    pos_ok,
    table_row,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    MASK_ROWS: tl.constexpr,
    PAGED: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
    """Offsets of the K and V rows of logical positions ``pos`` (``[BLOCK_N]``) from the request's K/V base pointers.

    Contiguous: ``pos`` rows after the request's first row. Paged: block ``table_row[pos // KV_BLOCK_SIZE]``, slot
    ``pos % KV_BLOCK_SIZE``, in int64 (a pool of many blocks passes 2^31 elements). Positions past the request
    (``~pos_ok`` with ``MASK_ROWS``) would index past its table row, so their lookup is masked (block 0; the K/V
    loads are masked too).
    """
    if PAGED:
        if MASK_ROWS:
            blk = tl.load(table_row + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)  # [BLOCK_N]
        else:
            blk = tl.load(table_row + pos // KV_BLOCK_SIZE).to(tl.int64)
        slot = pos % KV_BLOCK_SIZE
        k_off = blk * stride_kb + slot * stride_kt
        v_off = blk * stride_vb + slot * stride_vt
    else:
        k_off = pos * stride_kt
        v_off = pos * stride_vt
    return k_off, v_off


@triton.jit
def _tanh(x):
    """fp32 tanh from exp2 (libdevice's tanh has no interpreter implementation): ``(1 - e^-2|x|) / (1 + e^-2|x|)``,
    and below |x| = 1/4, where ``1 - e^-2|x|`` would cancel, its Taylor series to x^9 (relative error < 1e-8)."""
    a = tl.abs(x)
    t = tl.math.exp2(-2.8853900817779268 * a)  # e^-2|x| = 2^(-2 log2(e) |x|) in (0, 1]: no overflow for any x
    x2 = x * x
    series = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    y = tl.where(a < 0.25, series, (1.0 - t) / (1.0 + t))
    return tl.where(x < 0, -y, y)


@triton.jit
def _in_window(qpos, kpos, window):
    """``[BLOCK_M, BLOCK_N]``: key token positions ``kpos`` inside the sliding window of row token positions
    ``qpos``."""
    return kpos[None, :] > (qpos - window)[:, None]


@triton.jit
def _softmax_step(
    acc,
    l_i,
    m_i,
    q,
    k,
    v,
    allowed,
    qk_scale,
    cap_log2e,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update with a ``[BLOCK_N, BLOCK_D]`` K/V block; returns the new (acc, l_i, m_i).

    ``m_i`` is the running row max of the base-2 logits, ``l_i`` the running sum of ``exp2(logit - m_i)``, ``acc`` the
    running un-normalised output (all fp32). Rows with no allowed key so far keep ``m_i = -inf``; ``m_safe`` avoids
    ``-inf - -inf = nan`` for them (such rows only occur as padding, in an empty split or before a window).
    ``SOFTCAP``: ``qk_scale`` is ``sm_scale / cap`` and the base-2 logit ``tanh(q k^T * qk_scale) * cap_log2e``.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
    if SOFTCAP:
        qk = _tanh(qk) * cap_log2e
    if MASKED:
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tree_attn_fwd_kernel(
    Q,  # [total_queries, num_heads, head_dim]
    K,  # [capacity, num_kv_heads, head_dim], or PAGED [num_blocks, KV_BLOCK_SIZE, num_kv_heads, head_dim]
    V,  # same shape as K
    Out,  # [total_queries, num_heads, head_dim] (NUM_SPLITS == 1)
    PartO,  # [NUM_SPLITS, total_queries, num_heads, head_dim] fp32 (NUM_SPLITS > 1)
    PartLse,  # [NUM_SPLITS, total_queries, num_heads] fp32, base-2 log-sum-exp (NUM_SPLITS > 1)
    q_start_ptr,  # [B + 1] int32
    kv_start_ptr,  # [B] int32
    prefix_len_ptr,  # [B] int32
    tree_len_ptr,  # [B] int32
    anc_row_ptr,  # [B] int32, -1 = chain
    anc_bits_ptr,  # [num_bit_rows, num_words] int32
    depth_ptr,  # [num_bit_rows] int32, node depths of the non-chain trees (read only with WINDOW)
    block_table_ptr,  # PAGED: [B, max_blocks_per_request] int32; else unused
    qk_scale,  # sm_scale * log2(e); SOFTCAP: sm_scale / cap
    cap_log2e,  # SOFTCAP: cap * log2(e); else unused
    window,  # WINDOW: keys at token positions > t - window are seen from token position t; else unused
    stride_qt,
    stride_qh,
    stride_kb,  # PAGED: between KV blocks; else unused
    stride_kt,  # between token rows (slots of a block when PAGED)
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_anc,  # int32 words per anc_bits row
    stride_bt,  # PAGED: entries per block_table row
    total_queries,
    num_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,  # PAGED: token slots per KV block; else 1
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    tl.static_assert(BLOCK_N <= 64, "phase 3 reads at most two bitmask words per block")
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kvh = tl.program_id(2)

    q0 = tl.load(q_start_ptr + b)
    n_q = tl.load(q_start_ptr + b + 1) - q0  # queries of this request
    start_m = pid_m * BLOCK_M
    if start_m >= n_q * GROUP:
        return  # the grid is sized for the request with most queries; others have fewer tiles
    n_tree = tl.load(tree_len_ptr + b)
    first = n_tree - n_q  # tree node of query 0
    table_row = block_table_ptr + b.to(tl.int64) * stride_bt  # request b's block-table row (read only when PAGED)
    prefix = tl.load(prefix_len_ptr + b)
    anc_row = tl.load(anc_row_ptr + b)
    is_tree = anc_row >= 0

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed rows
    qrow = q0 + offs_m // GROUP  # [BLOCK_M] row of q / out
    node = first + offs_m // GROUP  # [BLOCK_M] tree node of each row
    head = kvh * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_ok = offs_m < n_q * GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + qrow.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = _load_tile(q_ptrs, row_ok, d_ok, True, EVEN_D)  # [BLOCK_M, BLOCK_D]
    if PAGED:
        k_req = K + kvh * stride_kh  # rows are addressed from the pool's base, through the block table
        v_req = V + kvh * stride_vh
    else:
        # Scalar 64-bit base of the request's region; offsets inside it stay int32 (cheaper in the loops), which
        # limits one request to 2^31 / stride_kt cache rows (2M tokens at 8 KV heads x 128).
        kv0 = tl.load(kv_start_ptr + b).to(tl.int64)
        k_req = K + kv0 * stride_kt + kvh * stride_kh
        v_req = V + kv0 * stride_vt + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    node_min = first + start_m // GROUP
    node_max = tl.minimum(first + (start_m + BLOCK_M - 1) // GROUP, n_tree - 1)
    # is_tree as a block, not a scalar: the Triton interpreter turns `scalar_bool & block_bool` into int32.
    tree_row = row_ok & ((anc_row + tl.zeros_like(node)) >= 0)  # [BLOCK_M]
    # Phase 1 range [dense_lo, dense_end): positions every row of the tile attends to (but for a window's cut).
    dense_end = prefix + tl.where(is_tree, 0, node_min + 1)
    if WINDOW:
        qpos = prefix + tl.where(
            tree_row, tl.load(depth_ptr + anc_row + node, mask=tree_row, other=0), node
        )  # [BLOCK_M] token positions
        first_seen = (
            tl.min(tl.where(row_ok, qpos, prefix + n_tree), 0) - window + 1
        )  # lowest key position a row of the tile sees
        dense_lo = tl.minimum(
            tl.maximum(first_seen, 0) // BLOCK_N * BLOCK_N, dense_end
        )  # a tree row of window 1 sees no prefix
    else:
        qpos = node  # unused
        dense_lo = 0
    chunk = tl.cdiv(tl.cdiv(dense_end - dense_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N  # split chunks start block-aligned
    lo = dense_lo + split * chunk
    hi = tl.minimum(lo + chunk, dense_end)
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    for start_n in range(lo, full_end, BLOCK_N):
        pos = start_n + offs_n  # [BLOCK_N] logical positions (= token positions: prefix keys, chain nodes)
        k_off, v_off = _kv_offsets(
            pos, pos, table_row, stride_kb, stride_kt, stride_vb, stride_vt, False, PAGED, KV_BLOCK_SIZE
        )
        k = _load_tile(k_req + k_off[:, None] + offs_d[None, :], pos, d_ok, False, EVEN_D)
        v = _load_tile(v_req + v_off[:, None] + offs_d[None, :], pos, d_ok, False, EVEN_D)
        if WINDOW:
            acc, l_i, m_i = _softmax_step(
                acc, l_i, m_i, q, k, v, _in_window(qpos, pos, window), qk_scale, cap_log2e, True, SOFTCAP, DOT_PRECISION
            )
        else:
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, 0, qk_scale, cap_log2e, False, SOFTCAP, DOT_PRECISION)

    if full_end < hi:  # phase 2: partial block at the end of this split's dense chunk
        pos = full_end + offs_n
        in_bounds = pos < hi
        k_off, v_off = _kv_offsets(
            pos, in_bounds, table_row, stride_kb, stride_kt, stride_vb, stride_vt, True, PAGED, KV_BLOCK_SIZE
        )
        k = _load_tile(k_req + k_off[:, None] + offs_d[None, :], in_bounds, d_ok, True, EVEN_D)
        v = _load_tile(v_req + v_off[:, None] + offs_d[None, :], in_bounds, d_ok, True, EVEN_D)
        allowed = in_bounds[None, :]
        if WINDOW:
            allowed = allowed & _in_window(qpos, pos, window)
        acc, l_i, m_i = _softmax_step(
            acc, l_i, m_i, q, k, v, allowed, qk_scale, cap_log2e, True, SOFTCAP, DOT_PRECISION
        )

    # Phase 3 (last split only): tree nodes the tile does not uniformly see.
    tree_lo = dense_end
    tree_hi = tl.where(split == NUM_SPLITS - 1, prefix + node_max + 1, tree_lo)
    bits_row = anc_bits_ptr + (anc_row + node).to(tl.int64) * stride_anc  # [BLOCK_M] pointers (unused for chains)
    for start_n in range(tree_lo, tree_hi, BLOCK_N):
        pos = start_n + offs_n
        in_bounds = pos < tree_hi
        j = pos - prefix  # [BLOCK_N] tree node of each key
        k_off, v_off = _kv_offsets(
            pos, in_bounds, table_row, stride_kb, stride_kt, stride_vb, stride_vt, True, PAGED, KV_BLOCK_SIZE
        )
        k = _load_tile(k_req + k_off[:, None] + offs_d[None, :], in_bounds, d_ok, True, EVEN_D)
        v = _load_tile(v_req + v_off[:, None] + offs_d[None, :], in_bounds, d_ok, True, EVEN_D)
        # For a non-chain tree the blocks start at node j0 = a multiple of BLOCK_N (tree_lo == prefix), so with
        # BLOCK_N <= 64 a block's bits are word j0 // 32 of each row, plus the next word when BLOCK_N == 64:
        # two [BLOCK_M] loads instead of a [BLOCK_M, BLOCK_N] gather. Chains load nothing (tree_row is False).
        j0 = start_n - prefix
        word = tl.load(bits_row + j0 // 32, mask=tree_row, other=0)[:, None]  # [BLOCK_M, 1] int32
        if BLOCK_N > 32:
            hi_ok = tree_row & ((j0 + 32 + tl.zeros_like(node)) < n_tree)  # the second word exists
            word_hi = tl.load(bits_row + j0 // 32 + 1, mask=hi_ok, other=0)
            word = tl.where(offs_n[None, :] < 32, word, word_hi[:, None])  # [BLOCK_M, BLOCK_N]
        is_ancestor = ((word >> (j % 32)[None, :]) & 1) != 0
        allowed = tl.where(tree_row[:, None], is_ancestor, j[None, :] <= node[:, None]) & in_bounds[None, :]
        if WINDOW:
            tree_key = in_bounds & ((anc_row + tl.zeros_like(j)) >= 0)  # [BLOCK_N]
            kpos = prefix + tl.where(
                tree_key, tl.load(depth_ptr + anc_row + j, mask=tree_key, other=0), j
            )  # [BLOCK_N] token positions
            allowed = allowed & _in_window(qpos, kpos, window)
        acc, l_i, m_i = _softmax_step(
            acc, l_i, m_i, q, k, v, allowed, qk_scale, cap_log2e, True, SOFTCAP, DOT_PRECISION
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty split or padding row: output 0, lse -inf
    out = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = Out + qrow.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        part_row = (split * total_queries + qrow).to(tl.int64) * num_heads + head  # [BLOCK_M]
        tl.store(PartO + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(PartLse + part_row, m_i + tl.math.log2(l_safe), mask=row_ok)  # -inf when empty


@triton.jit
def _combine_kernel(
    PartO,  # [NUM_SPLITS, total_queries, num_heads, head_dim] fp32
    PartLse,  # [NUM_SPLITS, total_queries, num_heads] fp32
    Out,  # [total_queries, num_heads, head_dim]
    stride_ot,
    stride_oh,
    num_rows,  # total_queries * num_heads
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the split partials of one (node, head) row: ``o = sum_s 2^(lse_s - lse) o_s`` with
    ``lse = log2 sum 2^lse_s``."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(PartLse + offs_s * num_rows + row, mask=s_ok, other=float("-inf"))  # [SPLITS_P2]
    lse_max = tl.max(lse, 0)  # finite: some split holds the row's own key
    w = tl.math.exp2(lse - lse_max)  # [SPLITS_P2], 0 for empty splits
    o = tl.load(
        PartO + (offs_s[:, None] * num_rows + row) * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)  # [BLOCK_D]
    o_ptrs = Out + (row // num_heads) * stride_ot + (row % num_heads) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    sm_scale: float | None = None,
    forced: Forced | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Run the fused tree-attention kernel (see the module docstring); arguments and result as
    :func:`specinfer.kernels.tree_attention`, contiguous or paged caches alike.

    ``forced`` overrides :func:`choose_config`. q, k_cache and v_cache must share one dtype (fp16/bf16/fp32; fp32/fp16
    under the interpreter) and be contiguous in head_dim; any other strides work (e.g. q as a view of a fused qkv
    output).
    """
    group = _check_shapes(q, k_cache, v_cache, meta)
    check_score_options(softcap, window)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
        if t.device != meta.device:
            raise ValueError(f"{name} is on {t.device} but the metadata is on {meta.device}")
    head_dim = q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    cfg = choose_config(q, k_cache, meta, forced, window)
    block_d = max(16, triton.next_power_of_2(head_dim))
    total, num_heads, num_kv_heads = q.shape[0], q.shape[1], k_cache.shape[-2]
    paged = meta.paged
    # Contiguous: the block-table pointer is any valid int32 tensor (never read) and the block strides are 0.
    block_table = meta.block_table if meta.block_table is not None else meta.kv_start
    out = torch.empty_like(q)
    if cfg.num_splits > 1:
        part_o = torch.empty(cfg.num_splits, total, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(cfg.num_splits, total, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    grid = (triton.cdiv(meta.max_queries * group, cfg.block_m), meta.batch_size * cfg.num_splits, num_kv_heads)
    _tree_attn_fwd_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse,
        meta.q_start, meta.kv_start, meta.prefix_len, meta.tree_len, meta.anc_row_start, meta.anc_bits, meta.node_depth,
        block_table,
        scale * LOG2E if softcap is None else scale / softcap, 0.0 if softcap is None else softcap * LOG2E, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0) if paged else 0, k_cache.stride(-3), k_cache.stride(-2),
        v_cache.stride(0) if paged else 0, v_cache.stride(-3), v_cache.stride(-2),
        out.stride(0), out.stride(1), meta.anc_bits.stride(0), block_table.stride(0) if paged else 0,
        total, num_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits, EVEN_D=head_dim == block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGED=paged, KV_BLOCK_SIZE=meta.block_size if paged else 1,
        SOFTCAP=softcap is not None, WINDOW=window is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.num_splits > 1:
        _combine_kernel[(total * num_heads,)](
            part_o, part_lse, out, out.stride(0), out.stride(1), total * num_heads, num_heads,
            NUM_SPLITS=cfg.num_splits, SPLITS_P2=max(2, triton.next_power_of_2(cfg.num_splits)),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )  # fmt: skip
    return out
