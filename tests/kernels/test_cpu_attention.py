"""The row-by-row CPU tree attention (specinfer.kernels.cpu_attention): equal to the fp32 reference, and each tree
row equal bit for bit to a one-query step over the same keys (the property greedy speculation's exactness on
quantized weights rests on), in the contiguous and the paged layout, with GQA, a window and a soft cap."""

from __future__ import annotations

import pytest
import torch

from specinfer.kernels import build_paged_tree_metadata, build_tree_metadata, cpu_attention, cpu_qgemm
from specinfer.kernels.tree_attention_ref import tree_attention_ref, tree_attention_sdpa

pytestmark = pytest.mark.skipif(
    cpu_qgemm.unavailable_reason() is not None, reason=f"our CPU kernels: {cpu_qgemm.unavailable_reason()}"
)
PARENTS = [-1, 0, 0, 1, 1, 2, 4]  # a branching tree of 7 nodes
HEADS, KV_HEADS, DIM, PREFIX = 6, 2, 64, 37


def _step(dtype: torch.dtype, paged: bool):
    """Caches of 64 rows, the tree's queries and its metadata (after a prefix of 37), contiguous or paged."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(64, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))  # [64, kv_heads, dim]
    q = torch.randn(len(PARENTS), HEADS, DIM, generator=gen).to(dtype)
    if paged:  # blocks of 8 slots in a scrambled order
        meta = build_paged_tree_metadata([PARENTS], [PREFIX], [[5, 2, 7, 0, 6, 1]], 8, "cpu")
        return q, k.view(8, 8, KV_HEADS, DIM), v.view(8, 8, KV_HEADS, DIM), meta
    return q, k, v, build_tree_metadata([PARENTS], [PREFIX], [3], "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 20.0)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_tree_rows_equal_the_reference_and_one_query_steps(dtype, window, softcap, paged):
    q, k, v, meta = _step(dtype, paged)
    assert cpu_attention.serves(q, k, meta, 0)
    got = tree_attention_sdpa(q, k, v, meta, softcap=softcap, window=window)  # [n, heads, dim]
    want = tree_attention_ref(q, k, v, meta, softcap=softcap, window=window)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    # node i as the one query of a chain over its prefix and its path (root first), an incremental step: the same
    # cache rows reached through a paged table of one slot per block
    flat_k, flat_v = k.reshape(-1, 1, KV_HEADS, DIM), v.reshape(-1, 1, KV_HEADS, DIM)
    for i in range(len(PARENTS)):
        path = [i]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        positions = [*range(PREFIX), *(PREFIX + j for j in reversed(path))]
        rows = [_cache_row(meta, p) for p in positions]
        chain = list(range(-1, len(path) - 1))
        one = build_paged_tree_metadata([chain], [PREFIX], [rows], 1, "cpu", num_queries=[1])
        alone = tree_attention_sdpa(q[i : i + 1], flat_k, flat_v, one, softcap=softcap, window=window)
        assert torch.equal(alone[0], got[i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_prompts_go_row_by_row_and_equal_the_reference(dtype):
    """A whole causal chain from position 0 (a prompt) of at most MAX_ROWS tokens is a tree like any other: each token
    reads the tokens before it, as SDPA's causal attention has it."""
    q, k, v, _ = _step(dtype, False)
    prompt = build_tree_metadata([list(range(-1, 6))], [0], [0], "cpu")
    assert cpu_attention.serves(q[:7], k, prompt, 0)
    got = tree_attention_sdpa(q[:7], k, v, prompt)
    want = tree_attention_ref(q[:7], k, v, prompt)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_long_prompts_and_long_chunks_stay_on_sdpa():
    gen = torch.Generator().manual_seed(3)
    n = cpu_attention.MAX_ROWS + 1
    q, k = torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n + 3, KV_HEADS, DIM, generator=gen)
    prompt = build_tree_metadata([list(range(-1, n - 1))], [0], [0], "cpu")  # a causal chain of MAX_ROWS + 1 tokens
    assert not cpu_attention.serves(q, k, prompt, 0)
    chunk = [list(range(-1, n - 1))]  # MAX_ROWS + 1 rows after a prefix
    assert not cpu_attention.serves(q, k, build_tree_metadata(chunk, [3], [0], "cpu"), 0)


def _cache_row(meta, position: int) -> int:
    """The flattened cache row of request 0's logical position ``position``."""
    if meta.paged:
        return meta.block_tables[0][position // meta.block_size] * meta.block_size + position % meta.block_size
    return meta.kv_starts[0] + position
