"""Tree attention: metadata, the PyTorch paths, and the Triton kernel against the fp32 reference.

Every test draws fresh random inputs from the ``seed`` fixture and names the seed in its failure message; replay
with ``SPECINFER_TEST_SEED=<seed>``. Relative error is ``max|out - ref| / max|ref|`` over the whole output.
Without a GPU the kernel runs under the Triton interpreter (see conftest.py), so shapes stay small.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specinfer.kernels import (
    TreeAttentionMetadata,
    build_tree_metadata,
    dense_tree_mask,
    is_chain,
    token_positions,
    tree_attention,
    tree_attention_ref,
    tree_attention_sdpa,
)
from specinfer.kernels.launch import Forced, choose_config

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

FP32_TOL = 1e-5
FP16_TOL = 5e-3
BF16_TOL = 3e-2


# -------------------------------------------------------------------------------- tree generators


def random_tree(rng: np.random.Generator, n: int) -> list[int]:
    """Each node's parent uniform among the earlier nodes."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    """Root plus n-1 children of the root (a depth-1 tree)."""
    return [-1] + [0] * (n - 1)


def branches(rng: np.random.Generator, n: int) -> list[int]:
    """A few chains hanging off the root, interleaved in index order (like merged SSM drafts)."""
    k = int(rng.integers(2, 5))
    tails = [0] * k
    parents = [-1]
    for i in range(1, n):
        b = int(rng.integers(0, k))
        parents.append(tails[b])
        tails[b] = i
    return parents


TREE_KINDS: dict[str, Callable[[np.random.Generator], list[int]]] = {
    "random": lambda rng: random_tree(rng, int(rng.integers(2, 48))),
    "chain": lambda rng: chain(int(rng.integers(1, 40))),
    "star": lambda rng: star(int(rng.integers(2, 40))),
    "depth1": lambda rng: star(int(rng.integers(2, 5))),
    "single": lambda rng: [-1],
    "branches": lambda rng: branches(rng, int(rng.integers(3, 40))),
}


def mixed_tree(rng: np.random.Generator) -> list[int]:
    kind = list(TREE_KINDS)[int(rng.integers(0, len(TREE_KINDS)))]
    return TREE_KINDS[kind](rng)


# -------------------------------------------------------------------------------- batch builder


@dataclass
class Batch:
    q: torch.Tensor  # [total_nodes, num_heads, head_dim]
    k_cache: torch.Tensor  # [capacity, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [capacity, num_kv_heads, head_dim]
    meta: TreeAttentionMetadata


def make_batch(
    rng: np.random.Generator,
    trees: list[list[int]],
    prefix_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_queries: list[int] | None = None,
) -> Batch:
    """Random q/k/v for a ragged batch (queries for the last ``num_queries[b]`` nodes of each tree, default all).

    Request regions sit in shuffled order with gaps, and every cache row outside the regions is NaN, so a kernel
    that reads (and uses) a row it does not own produces NaN."""
    order = rng.permutation(len(trees))
    kv_starts = [0] * len(trees)
    row = int(rng.integers(0, 5))
    for b in order:
        kv_starts[b] = row
        row += prefix_lens[b] + len(trees[b]) + int(rng.integers(0, 5))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    shape = (row, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for b, s in enumerate(kv_starts):
        n = prefix_lens[b] + len(trees[b])
        k_cache[s : s + n] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_cache[s : s + n] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    total = sum(num_queries) if num_queries is not None else sum(len(t) for t in trees)
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen)
    meta = build_tree_metadata(trees, prefix_lens, kv_starts, device, num_queries=num_queries)
    return Batch(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|``, in fp32 (NaN in ``out`` gives NaN, which fails every ``<`` check)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_triton(
    batch: Batch,
    forced: Forced | None = None,
    sm_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    from specinfer.kernels.tree_attention_triton import tree_attention_triton

    return tree_attention_triton(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, sm_scale, forced, softcap=softcap, window=window
    )


def check_against_ref(
    batch: Batch, out: torch.Tensor, tol: float, what: str, softcap: float | None = None, window: int | None = None
) -> None:
    ref = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, softcap=softcap, window=window)
    assert out.shape == ref.shape and out.dtype == batch.q.dtype
    err = rel_err(out, ref)
    assert err < tol, (
        f"{what}: relative error {err:.3g} >= {tol:g}; parents={batch.meta.parents} prefix={batch.meta.prefix_lens}"
    )


def causal_attention(q_full: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention of one sequence via SDPA ``is_causal``.  [L, H, D] x [L, H_kv, D] -> [L, H, D]"""
    group = q_full.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).float() for x in (q_full, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=group > 1)[0].transpose(0, 1)


# -------------------------------------------------------------------------------- metadata


def ancestors_by_walking(parents: list[int]) -> np.ndarray:
    """``anc[i, j]``: j is on the path from i up to the root (walks parent pointers; independent of the builder)."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


def unpack_row(words: np.ndarray, n: int) -> np.ndarray:
    """Bits 0..n-1 of one packed row (bit j%32 of word j//32)."""
    return np.array([(int(words[j // 32]) >> (j % 32)) & 1 for j in range(n)], dtype=bool)


def test_metadata_bits_match_ancestor_relation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(8)] + [star(70), random_tree(rng, 65)]  # > 64 nodes: 3 words, bit 31 set
    prefix = [int(rng.integers(0, 300)) for _ in trees]
    starts = [int(rng.integers(0, 1000)) for _ in trees]
    meta = build_tree_metadata(trees, prefix, starts, "cpu")
    bits = meta.anc_bits.numpy()
    assert meta.anc_bits.dtype == torch.int32 and bits.shape[1] == meta.num_words == 3
    for b, parents in enumerate(trees):
        n = len(parents)
        row0 = int(meta.anc_row_start[b])
        assert meta.is_chain[b] == (parents == chain(n)), f"seed={seed} b={b}"
        if meta.is_chain[b]:
            assert row0 == -1
            continue
        got = np.stack([unpack_row(bits[row0 + i], n) for i in range(n)])
        np.testing.assert_array_equal(
            got, ancestors_by_walking(parents), err_msg=f"seed={seed} b={b} parents={parents}"
        )
        # no stray bits beyond the tree
        for i in range(n):
            beyond = [(int(bits[row0 + i, j // 32]) >> (j % 32)) & 1 for j in range(n, 32 * meta.num_words)]
            assert not any(beyond), f"seed={seed} b={b} i={i}"


def test_metadata_layout_and_host_fields() -> None:
    trees = [[-1, 0, 1], [-1, 0, 0, 1], [-1], [-1, 0, 0]]
    meta = build_tree_metadata(trees, [5, 0, 7, 3], [100, 0, 50, 20], "cpu")
    assert meta.q_start.tolist() == [0, 3, 7, 8, 11] and list(meta.q_starts) == [0, 3, 7, 8, 11]
    assert meta.kv_start.tolist() == [100, 0, 50, 20] and meta.kv_starts == (100, 0, 50, 20)
    assert meta.prefix_len.tolist() == [5, 0, 7, 3] and meta.prefix_lens == (5, 0, 7, 3)
    assert meta.tree_len.tolist() == [3, 4, 1, 3] and meta.tree_lens == (3, 4, 1, 3)
    assert meta.is_chain == (True, False, True, False)
    assert meta.anc_row_start.tolist() == [-1, 0, -1, 4]  # bit rows only for the two non-chain trees
    assert tuple(meta.anc_bits.shape) == (7, 1)
    assert meta.anc_bits[:4, 0].tolist() == [0b1, 0b11, 0b101, 0b1011]
    assert (meta.max_tree_len, meta.max_prefix_len, meta.num_words, meta.total_nodes, meta.batch_size) == (
        4,
        7,
        1,
        11,
        4,
    )
    tensors = (meta.q_start, meta.kv_start, meta.prefix_len, meta.tree_len, meta.anc_row_start, meta.anc_bits)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors)
    assert all(t.data_ptr() % 16 == 0 for t in tensors), "views into the shared buffer must stay 16-byte aligned"


def test_metadata_num_queries() -> None:
    """Only the last num_queries nodes of a tree have queries; q_start counts queries, not nodes."""
    trees = [[-1, 0, 0, 1], chain(5), [-1]]
    meta = build_tree_metadata(trees, [3, 0, 2], [0, 10, 20], "cpu", num_queries=[2, 5, 1])
    assert meta.num_queries == (2, 5, 1) and meta.q_start.tolist() == [0, 2, 7, 8] and meta.q_starts == (0, 2, 7, 8)
    assert (meta.total_queries, meta.total_nodes, meta.max_queries, meta.max_tree_len) == (8, 10, 5, 5)
    assert meta.tree_len.tolist() == [4, 5, 1]
    full = build_tree_metadata(trees, [3, 0, 2], [0, 10, 20], "cpu")
    assert full.num_queries == (4, 5, 1) and full.total_queries == full.total_nodes == 10
    for bad in ([0, 5, 1], [2, 6, 1], [2, 5]):
        with pytest.raises(ValueError):
            build_tree_metadata(trees, [3, 0, 2], [0, 10, 20], "cpu", num_queries=bad)


def test_metadata_all_chains_has_dummy_row() -> None:
    meta = build_tree_metadata([chain(2000), [-1]], [0, 9], [0, 2000], "cpu")
    assert meta.is_chain == (True, True)
    assert tuple(meta.anc_bits.shape) == (1, 1) and meta.num_words == 1
    assert meta.anc_row_start.tolist() == [-1, -1]


@pytest.mark.parametrize(
    "parents",
    [[], [0], [-1, 1], [-1, 0, 2], [-1, -1]],
    ids=["empty", "root-not-minus-1", "self-parent", "forward-parent", "two-roots"],
)
def test_metadata_rejects_invalid_trees(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        build_tree_metadata([parents], [0], [0], "cpu")


def test_metadata_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError):
        build_tree_metadata([[-1], [-1]], [0], [0, 1], "cpu")
    with pytest.raises(ValueError):
        build_tree_metadata([[-1]], [-1], [0], "cpu")


def test_is_chain() -> None:
    assert is_chain([-1]) and is_chain([-1, 0]) and is_chain(chain(10))
    assert not is_chain([-1, 0, 0]) and not is_chain([-1, 0, 1, 1])


def test_dense_tree_mask() -> None:
    mask = dense_tree_mask([-1, 0, 0, 1], prefix_len=2)
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


# -------------------------------------------------------------------------------- PyTorch paths


def test_reference_chain_is_causal_attention(seed: int) -> None:
    """The oracle itself: a chain behind a prefix is the tail of causal attention over prefix + chain."""
    rng = np.random.default_rng(seed)
    prefix, n, group = int(rng.integers(0, 300)), int(rng.integers(1, 40)), 2
    gen = torch.Generator().manual_seed(seed)
    q_full = torch.randn(prefix + n, 4, 64, generator=gen)
    k = torch.randn(prefix + n, 4 // group, 64, generator=gen)
    v = torch.randn(prefix + n, 4 // group, 64, generator=gen)
    meta = build_tree_metadata([chain(n)], [prefix], [0], "cpu")
    out = tree_attention_ref(q_full[prefix:], k, v, meta)
    err = rel_err(out, causal_attention(q_full, k, v)[prefix:])
    assert err < FP32_TOL, f"seed={seed} prefix={prefix} n={n}: {err:.3g}"


@pytest.mark.parametrize("group", [1, 3, 4])
def test_sdpa_path_matches_reference(seed: int, group: int) -> None:
    """Trees, an incremental step (one node behind a prefix: no mask) and a causal chain; with GQA groups, whose
    queries the path folds into one head's rows (and a causal chain it runs unfolded)."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(5)] + [chain(1), chain(7)]
    prefix = [int(rng.integers(1, 300)) for _ in trees[:-1]] + [0]  # the last one takes the is_causal branch
    batch = make_batch(rng, trees, prefix, 2, group, 64, torch.float32, torch.device("cpu"))
    out = tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, impl="torch")
    check_against_ref(batch, out, FP32_TOL, f"seed={seed} sdpa path")
    again = tree_attention_sdpa(batch.q, batch.k_cache, batch.v_cache, batch.meta)  # cached masks
    assert torch.equal(out, again)


@pytest.mark.parametrize("impl", ["ref", "torch"])
def test_partial_queries_are_the_tail_of_full_queries(seed: int, impl: str) -> None:
    """With num_queries, request b's outputs are the last rows of attention with every node querying."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(5)] + [chain(9)]
    prefix = [int(rng.integers(0, 300)) for _ in trees[:-1]] + [0]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    full = make_batch(rng, trees, prefix, 2, 2, 64, torch.float32, torch.device("cpu"))
    meta = build_tree_metadata(trees, prefix, full.meta.kv_starts, "cpu", num_queries=nq)
    rows = [full.meta.q_starts[b + 1] - k for b in range(len(trees)) for k in range(nq[b], 0, -1)]
    out = tree_attention(full.q[rows], full.k_cache, full.v_cache, meta, impl=impl)  # type: ignore[arg-type]
    expected = tree_attention_ref(full.q, full.k_cache, full.v_cache, full.meta)[rows]
    err = rel_err(out, expected)
    assert err < FP32_TOL, f"seed={seed} impl={impl} num_queries={nq}: {err:.3g}"


def test_sm_scale_is_used(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [random_tree(rng, 9)], [11], 1, 2, 64, torch.float32, torch.device("cpu"))
    a = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, sm_scale=0.3)
    b = tree_attention_ref(batch.q * (0.3 * 8), batch.k_cache, batch.v_cache, batch.meta)  # default scale 1/8
    assert rel_err(a, b) < FP32_TOL, f"seed={seed}"
    c = tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, sm_scale=0.3, impl="torch")
    assert rel_err(c, a) < FP32_TOL, f"seed={seed}"


def test_dispatcher_rejects_bad_input() -> None:
    meta = build_tree_metadata([[-1, 0]], [3], [0], "cpu")
    k = torch.zeros(5, 1, 64)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(torch.zeros(2, 2, 64), k, k, meta, impl="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows"):
        tree_attention(torch.zeros(3, 2, 64), k, k, meta)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(torch.zeros(2, 3, 64), torch.zeros(5, 2, 64), torch.zeros(5, 2, 64), meta)
    with pytest.raises(ValueError, match="cache holds"):
        tree_attention(torch.zeros(2, 2, 64), k[:4], k[:4], meta)


# -------------------------------------------------------------------------------- soft-capping, sliding windows

# (softcap, window): a cap of 1.5 bends scores of about N(0, 1) hard; windows of 1 (only itself), 3 (cuts into trees and
# chains) and 40 (cuts into most prefixes); (None, None) is every other test of this file
SCORE_OPTIONS = [(1.5, None), (None, 1), (None, 3), (None, 40), (1.5, 3)]
SCORE_IDS = [f"softcap{c}-window{w}" for c, w in SCORE_OPTIONS]


def sequence_attention(batch: Batch, softcap: float | None, window: int | None, sm_scale: float) -> torch.Tensor:
    """Each query's attention over its own sequence (the prefix, then its root-to-node path), keeping only the last
    ``window`` tokens, with capped scores: the semantics the options mean, computed without masks, depths or token
    positions.  # [total_queries, H, D] fp32"""
    meta = batch.meta
    group = batch.q.shape[1] // batch.k_cache.shape[1]
    out = torch.empty(batch.q.shape)
    for b, parents in enumerate(meta.parents):
        n, nq, prefix, kv0 = len(parents), meta.num_queries[b], meta.prefix_lens[b], meta.kv_starts[b]
        for r in range(nq):
            path, j = [], n - nq + r
            while j >= 0:
                path.append(prefix + j)
                j = parents[j]
            rows = [kv0 + p for p in [*range(prefix), *path[::-1]]][-(window or len(path) + prefix) :]
            k = batch.k_cache[rows].float().repeat_interleave(group, dim=1)  # [L, H, D]
            v = batch.v_cache[rows].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", batch.q[meta.q_starts[b] + r].float(), k) * sm_scale  # [H, L]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[meta.q_starts[b] + r] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
def test_reference_options_are_sequence_attention(seed: int, softcap: float | None, window: int | None) -> None:
    """The oracle itself: with a window, tree node i sees the last ``window`` tokens of prefix + its path, whatever
    the other branches hold; partial queries too."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 12), chain(9), star(6), branches(rng, 10), [-1]]
    prefix = [55] + [int(rng.integers(0, 60)) for _ in trees[1:-1]] + [0]  # 55: every window cuts somewhere
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    batch = make_batch(rng, trees, prefix, 2, 2, 32, torch.float32, torch.device("cpu"), num_queries=nq)
    out = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, softcap=softcap, window=window)
    err = rel_err(out, sequence_attention(batch, softcap, window, 32**-0.5))
    assert err < FP32_TOL, f"seed={seed}: {err:.3g}"
    plain = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta)
    assert rel_err(out, plain) > 1e-3, "the options change nothing: the test would not see them ignored"


def test_dense_tree_mask_window() -> None:
    """Tree [-1, 0, 0, 1] (token positions 2, 3, 3, 4) behind 2 prefix tokens, window 2: each node sees itself and
    the one token before it on its path."""
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 0, 1, 0],
            [0, 0, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(dense_tree_mask([-1, 0, 0, 1], prefix_len=2, window=2), expected)
    assert torch.equal(
        dense_tree_mask([-1, 0, 0, 1], prefix_len=2, window=5), dense_tree_mask([-1, 0, 0, 1], prefix_len=2)
    )


@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
def test_sdpa_path_options_match_reference(seed: int, softcap: float | None, window: int | None) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(4)] + [chain(7)]
    prefix = [int(rng.integers(0, 100)) for _ in trees[:-1]] + [0]  # a chain without prefix: no is_causal shortcut
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees[:-1]] + [7]
    batch = make_batch(rng, trees, prefix, 2, 2, 64, torch.float32, torch.device("cpu"), num_queries=nq)
    out = tree_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, impl="torch", softcap=softcap, window=window
    )
    check_against_ref(batch, out, FP32_TOL, f"seed={seed} sdpa path", softcap, window)
    again = tree_attention_sdpa(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, softcap=softcap, window=window
    )  # cached masks
    assert torch.equal(out, again)


def test_options_are_validated() -> None:
    meta = build_tree_metadata([[-1, 0]], [3], [0], "cpu")
    k = torch.zeros(5, 1, 64)
    for impl in ("ref", "torch"):
        with pytest.raises(ValueError, match="window"):
            tree_attention(torch.zeros(2, 2, 64), k, k, meta, impl=impl, window=0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="softcap"):
            tree_attention(torch.zeros(2, 2, 64), k, k, meta, impl=impl, softcap=0.0)  # type: ignore[arg-type]


def test_metadata_node_depths() -> None:
    """Depths of the non-chain trees' nodes, in their anc_bits rows; chains store none."""
    meta = build_tree_metadata([[-1, 0, 0, 1], chain(3), [-1, 0, 1, 0]], [2, 0, 5], [0, 10, 20], "cpu")
    assert meta.anc_row_start.tolist() == [0, -1, 4]
    assert meta.node_depth.tolist() == [0, 1, 1, 2, 0, 1, 2, 1] and meta.node_depth.dtype == torch.int32
    assert token_positions([-1, 0, 0, 1], 2).tolist() == [0, 1, 2, 3, 3, 4]
    assert build_tree_metadata([chain(4)], [1], [0], "cpu").node_depth.tolist() == [0]


# -------------------------------------------------------------------------------- Triton kernel


@needs_triton
@pytest.mark.parametrize("kind", list(TREE_KINDS))
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 128), (4, 64)])
def test_triton_fp32_matches_reference(seed: int, device: torch.device, kind: str, group: int, head_dim: int) -> None:
    """Ragged batch of 4 requests of one tree kind, prefixes 0..300 (one forced to 0)."""
    rng = np.random.default_rng(seed)
    trees = [TREE_KINDS[kind](rng) for _ in range(4)]
    prefix = [0] + [int(rng.integers(0, 301)) for _ in range(3)]
    batch = make_batch(rng, trees, prefix, 1, group, head_dim, torch.float32, device)
    check_against_ref(batch, run_triton(batch), FP32_TOL, f"seed={seed} kind={kind} group={group} head_dim={head_dim}")


@needs_triton
@pytest.mark.parametrize("group", [1, 2, 4])
def test_triton_fp16_matches_reference(seed: int, device: torch.device, group: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(5)]
    prefix = [int(rng.integers(0, 301)) for _ in trees]
    batch = make_batch(rng, trees, prefix, 2, group, 64, torch.float16, device)
    check_against_ref(batch, run_triton(batch), FP16_TOL, f"seed={seed} fp16 group={group}")


@needs_triton
@pytest.mark.parametrize(
    ("block_m", "block_n", "num_splits"),
    [(16, 32, 1), (32, 64, 1), (64, 32, 1), (128, 64, 1), (16, 16, 1), (16, 64, 2), (32, 32, 5)],
)
def test_triton_tile_sizes_and_splits(
    seed: int, device: torch.device, block_m: int, block_n: int, num_splits: int
) -> None:
    """Forced configurations: tiles straddling nodes and heads, 3-4 bitmask words (one partly used), split-KV with
    empty splits (prefix 0 / short)."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(65, 110))), chain(45), star(33), [-1], branches(rng, 20)]
    prefix = [int(rng.integers(0, 301)), 0, int(rng.integers(0, 40)), int(rng.integers(0, 301)), 3]
    batch = make_batch(rng, trees, prefix, 2, 2, 64, torch.float32, device)
    out = run_triton(batch, Forced(block_m, block_n, num_splits))
    check_against_ref(batch, out, FP32_TOL, f"seed={seed} block_m={block_m} block_n={block_n} num_splits={num_splits}")


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_chain_is_causal_attention(seed: int, device: torch.device, num_splits: int) -> None:
    """Prefill/decode through the same kernel: a chain behind a prefix equals SDPA is_causal over prefix + chain."""
    rng = np.random.default_rng(seed)
    prefix, n, group = int(rng.integers(0, 301)), int(rng.integers(20, 80)), 2
    gen = torch.Generator().manual_seed(seed)
    q_full = torch.randn(prefix + n, 2 * group, 64, generator=gen)
    k = torch.randn(prefix + n, 2, 64, generator=gen)
    v = torch.randn(prefix + n, 2, 64, generator=gen)
    meta = build_tree_metadata([chain(n)], [prefix], [0], device)
    from specinfer.kernels.tree_attention_triton import tree_attention_triton

    out = tree_attention_triton(
        q_full[prefix:].to(device), k.to(device), v.to(device), meta, forced=Forced(num_splits=num_splits)
    )
    err = rel_err(out.cpu(), causal_attention(q_full, k, v)[prefix:])
    assert err < FP32_TOL, f"seed={seed} prefix={prefix} n={n} num_splits={num_splits}: {err:.3g}"


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_partial_queries(seed: int, device: torch.device, num_splits: int) -> None:
    """Pending nodes of an earlier step (cached, attended to, no query) followed by the nodes that query."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(40, 90))), chain(50), star(20), branches(rng, 30), [-1]]
    prefix = [int(rng.integers(0, 301)) for _ in trees]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    batch = make_batch(rng, trees, prefix, 2, 2, 64, torch.float32, device, num_queries=nq)
    out = run_triton(batch, Forced(num_splits=num_splits))
    check_against_ref(batch, out, FP32_TOL, f"seed={seed} num_queries={nq} num_splits={num_splits}")


@needs_triton
def test_triton_strided_q_and_custom_scale(seed: int, device: torch.device) -> None:
    """q as a view of a fused qkv projection output (row stride > heads * head_dim), a non-default sm_scale."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 12), chain(5), star(6), [-1]]
    prefix = [int(rng.integers(0, 200)) for _ in trees]
    batch = make_batch(rng, trees, prefix, 1, 4, 64, torch.float32, device)
    qkv = torch.randn(batch.q.shape[0], 6, 64, device=device)
    qkv[:, :4] = batch.q
    strided = Batch(qkv[:, :4], batch.k_cache, batch.v_cache, batch.meta)
    assert not strided.q.is_contiguous()
    out = run_triton(strided, sm_scale=0.07)
    ref = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, sm_scale=0.07)
    assert rel_err(out, ref) < FP32_TOL, f"seed={seed}"


@needs_triton
def test_triton_head_dim_not_power_of_two(seed: int, device: torch.device) -> None:
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 10), chain(3)]
    batch = make_batch(rng, trees, [17, 40], 1, 2, 80, torch.float32, device)
    check_against_ref(batch, run_triton(batch), FP32_TOL, f"seed={seed} head_dim=80")


@needs_triton
def test_dispatcher_triton_impl(seed: int, device: torch.device) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [random_tree(rng, 8)], [20], 1, 2, 64, torch.float32, device)
    out = tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, impl="triton")
    check_against_ref(batch, out, FP32_TOL, f"seed={seed} impl=triton")


@needs_triton
@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
@pytest.mark.parametrize("forced", [None, Forced(block_m=16, block_n=16, num_splits=3)], ids=["auto", "splits"])
def test_triton_options_match_reference(
    seed: int, device: torch.device, softcap: float | None, window: int | None, forced: Forced | None
) -> None:
    """Soft-capping and windows on trees (depths differ from node indices), chains, a single node and partial queries;
    with small tiles and split-KV, windows start inside a split, inside a block and past whole splits."""
    rng = np.random.default_rng(seed)
    trees = [
        random_tree(rng, int(rng.integers(20, 40))),
        chain(int(rng.integers(20, 40))),
        star(9),
        [-1],
        branches(rng, 15),
    ]
    prefix = [int(rng.integers(0, 120)), 0, int(rng.integers(0, 120)), 70, int(rng.integers(0, 120))]
    nq = [len(trees[0]), len(trees[1]), 9, 1, int(rng.integers(1, 16))]
    batch = make_batch(rng, trees, prefix, 2, 2, 32, torch.float32, device, num_queries=nq)
    out = run_triton(batch, forced, softcap=softcap, window=window)
    check_against_ref(
        batch, out, FP32_TOL, f"seed={seed} softcap={softcap} window={window} forced={forced}", softcap, window
    )


@needs_triton
def test_triton_options_fp16_and_custom_scale(seed: int, device: torch.device) -> None:
    """fp16 inputs with both options and a Gemma-like scale (query_pre_attn_scalar apart from head_dim)."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(4)]
    prefix = [int(rng.integers(0, 150)) for _ in trees]
    batch = make_batch(rng, trees, prefix, 2, 2, 64, torch.float16, device)
    out = run_triton(batch, sm_scale=0.2, softcap=2.0, window=17)
    ref = tree_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, sm_scale=0.2, softcap=2.0, window=17)
    assert rel_err(out, ref) < FP16_TOL, f"seed={seed}"


# -------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL), (torch.float32, FP32_TOL)]
)
@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (4, 128), (8, 64)])
def test_gpu_large_batch(seed: int, dtype: torch.dtype, tol: float, group: int, head_dim: int) -> None:
    """Verify-step sized batches with the automatic config (split-KV included) on a real GPU."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(12)] + [random_tree(rng, 256), star(128), chain(200)]
    prefix = [int(rng.integers(0, 4096)) for _ in trees]
    batch = make_batch(rng, trees, prefix, 8, group, head_dim, dtype, torch.device("cuda"))
    check_against_ref(
        batch, tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta), tol, f"seed={seed} {dtype}"
    )


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL), (torch.float32, FP32_TOL)]
)
@pytest.mark.parametrize(("softcap", "window"), SCORE_OPTIONS, ids=SCORE_IDS)
def test_gpu_score_options(
    seed: int, dtype: torch.dtype, tol: float, softcap: float | None, window: int | None
) -> None:
    """Soft-capping and sliding windows on a real GPU in every dtype: GQA 4, a ragged batch (trees, a chain, a
    lone root) with partial queries, prefixes up to 2k (split-KV where the automatic config picks it)."""
    rng = np.random.default_rng(seed)
    trees = [mixed_tree(rng) for _ in range(6)] + [chain(40), random_tree(rng, 128), [-1]]
    prefix = [int(rng.integers(0, 2048)) for _ in trees]
    nq = [int(rng.integers(1, len(t) + 1)) for t in trees]
    batch = make_batch(rng, trees, prefix, 8, 4, 128, dtype, torch.device("cuda"), num_queries=nq)
    out = tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, softcap=softcap, window=window)
    check_against_ref(batch, out, tol, f"seed={seed} {dtype} softcap={softcap} window={window}", softcap, window)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_single_request_long_prefix_uses_splits(seed: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, [random_tree(rng, 32)], [8000], 8, 4, 128, dtype, torch.device("cuda"))
    assert choose_config(batch.q, batch.k_cache, batch.meta).num_splits > 1
    tol = BF16_TOL if dtype == torch.bfloat16 else FP16_TOL
    check_against_ref(
        batch, tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta), tol, f"seed={seed} {dtype}"
    )


@pytest.mark.gpu
@needs_triton
def test_gpu_prefill_chain_2k(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = make_batch(
        rng,
        [chain(2048), chain(1), random_tree(rng, 64)],
        [0, 3000, 500],
        8,
        4,
        128,
        torch.bfloat16,
        torch.device("cuda"),
    )
    check_against_ref(
        batch, tree_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta), BF16_TOL, f"seed={seed} prefill"
    )


def test_relative_error_definition() -> None:
    assert math.isclose(rel_err(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])), 0.25)


# -------------------------------------------------------------------------------- GPU build without a GPU

_COMPILE_SCRIPT = """
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specinfer.kernels import build_tree_metadata
from specinfer.kernels import tree_attention_triton as m
from specinfer.kernels.launch import Forced, choose_config

kernel = m._tree_attn_fwd_kernel
assert not triton.knobs.runtime.interpret
# Mimic a real launch: pointers and multiple-of-16 strides get Triton's divisibility-16 specialisation.
# Arguments: 6 tensor pointers, 8 int32 pointers, qk_scale, cap_log2e, window, 14 ints (the first 10 of them \
q/k/v/out strides).
div16 = {(i,): [["tt.divisibility", 16]] for i in list(range(14)) + list(range(17, 27))}
SHAPES = ((1, 1), (8, 4), (64, 4), (2048, 1))  # (tree_len, group): block_m 16, 32 (+ splits), 64, 128
# (arch, dtype, name, head_dim, shape, KV block size of the paged layout or 0 for contiguous, soft-capping and window)
CASES = [(90, torch.bfloat16, "bf16", d, s, 0, False) for d in (64, 128) for s in SHAPES]
CASES += [(90, torch.float16, "fp16", 128, SHAPES[0], 0, False), (90, torch.float32, "fp32", 128, SHAPES[0], 0, False)]
CASES += [(90, torch.float32, "fp32", 64, SHAPES[2], 0, False)]
CASES += [(80, torch.bfloat16, "bf16", 128, s, 0, False) for s in SHAPES[1:3]]
CASES += [(90, torch.bfloat16, "bf16", 128, s, 16, False) for s in SHAPES[2:]]
CASES += [(90, torch.float32, "fp32", 64, SHAPES[2], 16, False), \
(80, torch.bfloat16, "bf16", 128, SHAPES[1], 16, False)]
# Gemma: head_dim 256 (Gemma 2 / 3 up to 12B) and 128 (Gemma 3 27B), capped and windowed
CASES += [(90, torch.bfloat16, "bf16", d, s, kv, True) for d in (128, 256) for s in SHAPES[1:3] for kv in (0, 16)]
CASES += [(80, torch.bfloat16, "bf16", 256, SHAPES[2], 16, True), (90, torch.float32, "fp32", 256, SHAPES[0], 0, True)]
for cap, dtype, tname, head_dim, (tree_len, group), kv_block, gemma in CASES:
    meta = build_tree_metadata([list(range(-1, tree_len - 1))], [4096], [0], "cpu")
    q = torch.empty(tree_len, 8 * group, head_dim, dtype=dtype)
    k = torch.empty(1, 8, head_dim, dtype=dtype)
    cfg = choose_config(q, k, meta, Forced(num_splits=1 + (tree_len == 8) * 3))
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      NUM_SPLITS=cfg.num_splits, EVEN_D=True, DOT_PRECISION="ieee" if tname == "fp32" else "tf32",
                      PAGED=kv_block > 0, KV_BLOCK_SIZE=max(kv_block, 1), SOFTCAP=gemma, WINDOW=gemma)
    sig = dict(zip(kernel.arg_names, [f"*{tname}"] * 4 + ["*fp32"] * 2 + ["*i32"] * 8 + ["fp32"] * 2 + ["i32"] * 15))
    src = ASTSource(kernel, sig, constexprs, div16)
    compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), \
options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    assert "cubin" in compiled.asm
    limit = 232448 if cap == 90 else 166912
    assert compiled.metadata.shared <= limit, (cap, tname, head_dim, cfg, kv_block, gemma, compiled.metadata.shared)
sig = dict(zip(m._combine_kernel.arg_names, ["*fp32", "*fp32", "*bf16", "i32", "i32", "i32", "i32"]))
src = ASTSource(m._combine_kernel, sig, dict(NUM_SPLITS=5, SPLITS_P2=8, HEAD_DIM=128, BLOCK_D=128))
triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2))
print("compiled")
"""


@needs_triton
@pytest.mark.slow
def test_kernel_builds_for_sm90_and_sm80() -> None:
    """Compile (Triton -> PTX -> cubin with the bundled ptxas) the configurations choose_config picks, for H100 and
    A100, contiguous and paged KV, Gemma's soft-capped and windowed variant (head_dim up to 256), without needing a
    GPU: catches what the interpreter cannot (types across control flow, dot shapes, shared-memory overflow). Runs
    in a subprocess because this process has Triton in interpreter mode."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr):
        pytest.skip("ptxas is not available")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
