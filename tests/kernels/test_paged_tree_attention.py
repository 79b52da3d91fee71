"""Tree attention over the paged KV layout: block-table metadata, the PyTorch paths and the Triton kernel.

Same conventions as test_tree_attention.py (whose tree generators and batch builder this file reuses): fresh random
inputs from the ``seed`` fixture, named in failure messages; replay with ``SPECINFER_TEST_SEED=<seed>``. Every paged
batch comes with the contiguous batch holding the same logical keys/values, so a paged result can be checked both
against the fp32 reference (itself gathering position by position through the host block table) and against the
contiguous layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_tree_attention import (
    BF16_TOL,
    FP16_TOL,
    FP32_TOL,
    SCORE_IDS,
    SCORE_OPTIONS,
    TREE_KINDS,
    Batch,
    branches,
    chain,
    check_against_ref,
    make_batch,
    mixed_tree,
    needs_triton,
    random_tree,
    rel_err,
    run_triton,
    star,
)

from specinfer.kernels import build_paged_tree_metadata, build_tree_metadata, tree_attention, tree_attention_ref
from specinfer.kernels.launch import Forced

# -------------------------------------------------------------------------------- batch builder


@dataclass
class PagedBatch:
    paged: Batch  # k/v caches [num_blocks, block_size, num_kv_heads, head_dim], paged metadata
    contiguous: Batch  # the same q and the same logical keys/values in the contiguous layout


def make_paged_batch(
    rng: np.random.Generator,
    trees: list[list[int]],
    prefix_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_queries: list[int] | None = None,
) -> PagedBatch:
    """A random ragged batch in both layouts (see :func:`make_batch`).

    Physical blocks are a random permutation of the pool and no two requests share one. Everything a request must
    not read is NaN: the unused slots of its last block, 1-3 spare blocks no table names, and 0-2 blocks some tables
    list past their needed ones (reserved for later tokens); other tables end where needed and get -1 padding.
    """
    contiguous = make_batch(rng, trees, prefix_lens, num_kv_heads, group, head_dim, dtype, device, num_queries)
    lengths = [p + len(t) for p, t in zip(prefix_lens, trees, strict=True)]
    need = [-(-n // block_size) for n in lengths]
    reserved = [int(rng.integers(0, 3)) for _ in trees]
    num_blocks = sum(need) + sum(reserved) + int(rng.integers(1, 4))
    free = rng.permutation(num_blocks).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    tables: list[list[int]] = []
    for b, n in enumerate(lengths):
        table = [free.pop() for _ in range(need[b] + reserved[b])]
        tables.append(table)
        kv0 = contiguous.meta.kv_starts[b]
        ids = torch.tensor(table[: need[b]], device=device)
        for src, dst in ((contiguous.k_cache, k_cache), (contiguous.v_cache, v_cache)):
            rows = torch.full((need[b] * block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
            rows[:n] = src[kv0 : kv0 + n]
            dst[ids] = rows.view(need[b], block_size, num_kv_heads, head_dim)
    meta = build_paged_tree_metadata(trees, prefix_lens, tables, block_size, device, num_queries=num_queries)
    return PagedBatch(Batch(contiguous.q, k_cache, v_cache, meta), contiguous)


def describe(pb: PagedBatch) -> str:
    m = pb.paged.meta
    return (
        f"block_size={m.block_size} parents={m.parents} prefix={m.prefix_lens} num_queries={m.num_queries} "
        f"tables={m.block_tables}"
    )


# -------------------------------------------------------------------------------- metadata


def test_paged_metadata_layout_and_host_fields() -> None:
    trees = [[-1, 0, 1], [-1, 0, 0, 1], [-1]]
    tables = [[7, 2], [0, 5, 3], [4]]  # request 1 needs 1 block (4 positions) and lists two reserved ones
    meta = build_paged_tree_metadata(trees, [5, 0, 2], tables, 4, "cpu", num_queries=[3, 2, 1])
    assert meta.paged and meta.block_size == 4 and meta.block_tables == ((7, 2), (0, 5, 3), (4,))
    assert meta.block_table is not None and meta.block_table.dtype == torch.int32 and meta.block_table.is_contiguous()
    assert meta.block_table.tolist() == [[7, 2, -1], [0, 5, 3], [4, -1, -1]]
    assert meta.block_table.data_ptr() % 16 == 0, "views into the shared buffer must stay 16-byte aligned"
    assert meta.kv_start.tolist() == [0, 0, 0] and meta.kv_starts == (0, 0, 0)
    assert meta.cache_len == 8  # block 7 is the largest id read (blocks 5 and 3 of request 1 are only reserved)
    assert (meta.q_starts, meta.prefix_lens, meta.tree_lens, meta.is_chain) == (
        (0, 3, 5, 6),
        (5, 0, 2),
        (3, 4, 1),
        (True, False, True),
    )
    assert [meta.kv_len(b) for b in range(3)] == [8, 4, 3]
    contiguous = build_tree_metadata(trees, [5, 0, 2], [10, 0, 30], "cpu")
    assert (
        not contiguous.paged
        and contiguous.block_table is None
        and contiguous.block_size == 0
        and contiguous.cache_len == 33
    )


def test_paged_metadata_accepts_padded_array_rows() -> None:
    """Rows of a -1 padded 2-D table work as well as lists; -1 past the needed entries is padding."""
    table = np.array([[3, 1, -1, -1], [0, 2, 4, -1]], dtype=np.int64)
    meta = build_paged_tree_metadata([chain(2), [-1, 0, 0]], [4, 6], table, 3, "cpu")
    assert meta.block_table is not None and meta.block_table.tolist() == table.tolist() and meta.cache_len == 5


@pytest.mark.parametrize(
    ("tables", "block_size", "match"),
    [
        ([[0, 1], [2]], 4, "block table has 1 blocks"),  # request 1: 3 + 2 = 5 positions need 2 blocks of 4
        ([[0, 1], [2, -1]], 4, "negative block id"),  # padding where a block is needed
        ([[0, -2], [2, 3]], 8, "below -1"),  # request 0 needs one block of 8; -2 is no padding either
        ([[0, 1]], 4, "block tables"),  # one table for two trees
        ([[0, 1], [2, 3]], 0, "block_size"),
    ],
    ids=["too-short", "negative-needed", "bad-padding", "count", "block-size"],
)
def test_paged_metadata_rejects_bad_tables(tables: list[list[int]], block_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_paged_tree_metadata([chain(3), [-1, 0]], [2, 3], tables, block_size, "cpu")


def test_paged_metadata_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="prefix lengths"):
        build_paged_tree_metadata([[-1], [-1]], [0], [[0], [1]], 4, "cpu")
    with pytest.raises(ValueError, match="empty batch"):
        build_paged_tree_metadata([], [], [], 4, "cpu")


def test_paged_dispatcher_rejects_mismatched_layouts() -> None:
    paged = build_paged_tree_metadata([[-1, 0]], [3], [[2, 0]], 4, "cpu")  # 5 positions in blocks 2, 0
    contiguous = build_tree_metadata([[-1, 0]], [3], [0], "cpu")
    q = torch.zeros(2, 2, 64)
    pool = torch.zeros(3, 4, 1, 64)  # [num_blocks, block_size, H_kv, D]
    for impl in ("ref", "torch"):
        with pytest.raises(ValueError, match="paged"):
            tree_attention(q, torch.zeros(5, 1, 64), torch.zeros(5, 1, 64), paged, impl=impl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="contiguous"):
            tree_attention(q, pool, pool, contiguous, impl=impl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="block_size"):
            tree_attention(q, pool[:, :2], pool[:, :2], paged, impl=impl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cache holds 2 blocks"):
            tree_attention(q, pool[:2], pool[:2], paged, impl=impl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="multiple"):
            tree_attention(torch.zeros(2, 3, 64), torch.zeros(3, 4, 2, 64), torch.zeros(3, 4, 2, 64), paged, impl=impl)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- PyTorch paths


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_reference_equals_contiguous_reference(seed: int, block_size: int) -> None:
    """The oracle reads the same logical keys/values from both layouts, so it gives bit-identical outputs."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(5)]
    prefix = [0] + [int(rng.integers(0, 120)) for _ in trees[1:]]
    pb = make_paged_batch(rng, trees, prefix, 2, 2, 32, torch.float32, torch.device("cpu"), block_size)
    p, c = pb.paged, pb.contiguous
    assert torch.equal(
        tree_attention_ref(p.q, p.k_cache, p.v_cache, p.meta), tree_attention_ref(c.q, c.k_cache, c.v_cache, c.meta)
    ), f"seed={seed}"


@pytest.mark.parametrize(("block_size", "group"), [(1, 1), (4, 4), (16, 2), (5, 1)])
def test_paged_sdpa_path_matches_reference(seed: int, block_size: int, group: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(5)] + [chain(7)]
    prefix = [int(rng.integers(0, 200)) for _ in trees[:-1]] + [0]  # the last one takes the is_causal branch
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees[:-1]] + [7]
    pb = make_paged_batch(
        rng, trees, prefix, 2, group, 64, torch.float32, torch.device("cpu"), block_size, num_queries=nq
    )
    out = tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta, impl="torch")
    check_against_ref(pb.paged, out, FP32_TOL, f"seed={seed} sdpa paged {describe(pb)}")
    contiguous = tree_attention(
        pb.contiguous.q, pb.contiguous.k_cache, pb.contiguous.v_cache, pb.contiguous.meta, impl="torch"
    )
    assert rel_err(out, contiguous) < FP32_TOL, f"seed={seed} paged vs contiguous"


@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
def test_paged_sdpa_path_options_match_reference(seed: int, softcap: float | None, window: int | None) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(4)] + [chain(7)]
    prefix = [int(rng.integers(0, 100)) for _ in trees[:-1]] + [0]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    pb = make_paged_batch(rng, trees, prefix, 2, 2, 32, torch.float32, torch.device("cpu"), 5, num_queries=nq)
    out = tree_attention(
        pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta, impl="torch", softcap=softcap, window=window
    )
    check_against_ref(pb.paged, out, FP32_TOL, f"seed={seed} sdpa paged {describe(pb)}", softcap, window)
    c = pb.contiguous
    assert (
        rel_err(out, tree_attention(c.q, c.k_cache, c.v_cache, c.meta, impl="torch", softcap=softcap, window=window))
        < FP32_TOL
    )


# -------------------------------------------------------------------------------- Triton kernel


@needs_triton
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 32)])
def test_triton_paged_fp32_matches_reference(
    seed: int, device: torch.device, block_size: int, group: int, head_dim: int
) -> None:
    """Ragged batch: random trees, a chain, a single node; prefixes 0, not multiples of the block size, and random."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(2, 40))), chain(int(rng.integers(1, 30))), [-1], branches(rng, 12)]
    prefix = [0, block_size * 3 + 1, int(rng.integers(0, 150)), int(rng.integers(0, 150))]
    pb = make_paged_batch(rng, trees, prefix, 2, group, head_dim, torch.float32, device, block_size)
    out = run_triton(pb.paged)
    check_against_ref(pb.paged, out, FP32_TOL, f"seed={seed} group={group} {describe(pb)}")
    assert rel_err(out, run_triton(pb.contiguous)) < FP32_TOL, f"seed={seed} paged vs contiguous kernel {describe(pb)}"


@needs_triton
@pytest.mark.parametrize(
    ("block_size", "block_n", "num_splits"),
    [(16, 64, 1), (64, 16, 1), (32, 32, 3), (5, 16, 2), (24, 64, 1), (128, 32, 1)],
    ids=["kv-block-divides-tile", "tile-divides-kv-block", "equal-split", "odd-block-split", "neither", "one-block"],
)
def test_triton_paged_tile_vs_block_sizes(
    seed: int, device: torch.device, block_size: int, block_n: int, num_splits: int
) -> None:
    """KV blocks smaller, larger, equal and incommensurate to the key tile; split-KV chunks crossing KV blocks."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(33, 70))), chain(20), star(9), [-1]]
    prefix = [int(rng.integers(0, 200)), 0, int(rng.integers(0, 200)), 130]
    pb = make_paged_batch(rng, trees, prefix, 1, 2, 32, torch.float32, device, block_size)
    out = run_triton(pb.paged, Forced(block_m=16, block_n=block_n, num_splits=num_splits))
    check_against_ref(pb.paged, out, FP32_TOL, f"seed={seed} block_n={block_n} num_splits={num_splits} {describe(pb)}")


@needs_triton
@pytest.mark.parametrize("kind", ["random", "chain", "star", "branches"])
def test_triton_paged_partial_queries(seed: int, device: torch.device, kind: str) -> None:
    """Pending nodes (cached, attended to, no query) then the querying ones, in KV blocks of 8."""
    rng = np.random.default_rng(seed)
    trees = [TREE_KINDS[kind](rng) for _ in range(3)]
    prefix = [int(rng.integers(0, 100)) for _ in trees]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    pb = make_paged_batch(rng, trees, prefix, 2, 2, 32, torch.float32, device, 8, num_queries=nq)
    check_against_ref(pb.paged, run_triton(pb.paged), FP32_TOL, f"seed={seed} kind={kind} {describe(pb)}")


@needs_triton
@pytest.mark.parametrize("group", [1, 4])
def test_triton_paged_fp16_matches_reference(seed: int, device: torch.device, group: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(4)]
    prefix = [int(rng.integers(0, 150)) for _ in trees]
    pb = make_paged_batch(rng, trees, prefix, 2, group, 64, torch.float16, device, 16)
    check_against_ref(pb.paged, run_triton(pb.paged), FP16_TOL, f"seed={seed} fp16 group={group} {describe(pb)}")


@needs_triton
@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
@pytest.mark.parametrize(
    ("block_size", "block_n", "num_splits"), [(4, 16, 1), (5, 16, 3)], ids=["kv-block4", "odd-block-split"]
)
def test_triton_paged_options_match_reference(
    seed: int,
    device: torch.device,
    softcap: float | None,
    window: int | None,
    block_size: int,
    block_n: int,
    num_splits: int,
) -> None:
    """Soft-capping and windows through block tables: windows starting mid KV block, trees, chains, partial queries."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(10, 30))), chain(int(rng.integers(10, 30))), branches(rng, 12), [-1]]
    prefix = [int(rng.integers(0, 100)), 0, int(rng.integers(0, 100)), 53]
    nq = [len(trees[0]), len(trees[1]), int(rng.integers(1, 13)), 1]
    pb = make_paged_batch(rng, trees, prefix, 2, 2, 32, torch.float32, device, block_size, num_queries=nq)
    forced = Forced(block_m=16, block_n=block_n, num_splits=num_splits)
    out = run_triton(pb.paged, forced, softcap=softcap, window=window)
    check_against_ref(
        pb.paged, out, FP32_TOL, f"seed={seed} softcap={softcap} window={window} {describe(pb)}", softcap, window
    )
    assert rel_err(out, run_triton(pb.contiguous, forced, softcap=softcap, window=window)) < FP32_TOL, (
        f"seed={seed} paged vs contiguous kernel"
    )


@needs_triton
def test_dispatcher_triton_impl_paged(seed: int, device: torch.device) -> None:
    rng = np.random.default_rng(seed)
    pb = make_paged_batch(rng, [random_tree(rng, 8)], [20], 1, 2, 64, torch.float32, device, 4)
    out = tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta, impl="triton")
    check_against_ref(pb.paged, out, FP32_TOL, f"seed={seed} impl=triton paged")
    with pytest.raises(ValueError, match="contiguous"):
        tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.contiguous.meta, impl="triton")


# -------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL), (torch.float32, FP32_TOL)]
)
@pytest.mark.parametrize(("block_size", "group", "head_dim"), [(16, 4, 128), (1, 1, 128), (32, 8, 64)])
def test_gpu_paged_large_batch(
    seed: int, dtype: torch.dtype, tol: float, block_size: int, group: int, head_dim: int
) -> None:
    """Verify-step sized batches with the automatic config (split-KV included) on a real GPU, paged vs reference and
    vs the contiguous layout."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(12)] + [random_tree(rng, 256), star(128), chain(200)]
    prefix = [int(rng.integers(0, 4096)) for _ in trees]
    pb = make_paged_batch(rng, trees, prefix, 8, group, head_dim, dtype, torch.device("cuda"), block_size)
    out = tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta)
    check_against_ref(pb.paged, out, tol, f"seed={seed} {dtype} block_size={block_size}")
    contiguous = tree_attention(pb.contiguous.q, pb.contiguous.k_cache, pb.contiguous.v_cache, pb.contiguous.meta)
    assert rel_err(out, contiguous) < tol, f"seed={seed} paged vs contiguous"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL), (torch.float32, FP32_TOL)]
)
@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
def test_gpu_paged_score_options(
    seed: int, dtype: torch.dtype, tol: float, softcap: float | None, window: int | None
) -> None:
    """Soft-capping and sliding windows through block tables on a real GPU in every dtype: KV blocks of 16, GQA 4,
    a ragged batch with partial queries, windows starting mid block; paged vs reference and vs contiguous."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(6)] + [chain(40), random_tree(rng, 128), [-1]]
    prefix = [int(rng.integers(0, 2048)) for _ in trees]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    pb = make_paged_batch(rng, trees, prefix, 8, 4, 128, dtype, torch.device("cuda"), 16, num_queries=nq)
    out = tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta, softcap=softcap, window=window)
    check_against_ref(pb.paged, out, tol, f"seed={seed} {dtype} softcap={softcap} window={window}", softcap, window)
    contiguous = tree_attention(
        pb.contiguous.q,
        pb.contiguous.k_cache,
        pb.contiguous.v_cache,
        pb.contiguous.meta,
        softcap=softcap,
        window=window,
    )
    assert rel_err(out, contiguous) < tol, f"seed={seed} paged vs contiguous"


@pytest.mark.gpu
@needs_triton
def test_gpu_paged_single_request_long_prefix_uses_splits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pb = make_paged_batch(rng, [random_tree(rng, 32)], [8000], 8, 4, 128, torch.bfloat16, torch.device("cuda"), 16)
    check_against_ref(
        pb.paged,
        tree_attention(pb.paged.q, pb.paged.k_cache, pb.paged.v_cache, pb.paged.meta),
        BF16_TOL,
        f"seed={seed}",
    )
