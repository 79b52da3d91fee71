"""The KV pool's row moves by our C code (kernels/cpu_pool.c) against PyTorch's indexing (cpu_pool.reference_move):
the same pool afterwards for either layout's shapes, dtypes and overlapping moves; bad rows refused."""

from __future__ import annotations

import pytest
import torch

from specinfer.kernels import cpu_pool, cpu_qgemm

pytestmark = pytest.mark.skipif(cpu_qgemm.library() is None, reason="the C kernels do not run here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "src, dst",
    [
        ([5, 9, 2], [3, 4, 5]),  # overlapping: row 5 is read before it is written
        ([7, 6, 5, 4], [4, 5, 6, 7]),  # reversed onto itself
        ([], []),
        ([0], [39]),
    ],
)
def test_the_c_move_equals_pytorchs_indexing(dtype, src, dst):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 40, 2, 16, generator=g).to(dtype)  # [layers, rows, kv_heads, head_dim]
    v = torch.randn(3, 40, 2, 16, generator=g).to(dtype)
    ref_k, ref_v = k.clone(), v.clone()
    s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
    cpu_pool.reference_move(ref_k, ref_v, s, d)
    cpu_pool.move(k, v, s, d)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_rows_outside_the_pool_are_refused_and_nothing_moves():
    k, v = torch.randn(2, 8, 1, 8), torch.randn(2, 8, 1, 8)
    before = k.clone()
    with pytest.raises(IndexError, match="8 rows"):
        cpu_pool.move(k, v, torch.tensor([1, 8]), torch.tensor([0, 1]))
    with pytest.raises(IndexError):
        cpu_pool.move(k, v, torch.tensor([1]), torch.tensor([-1]))
    assert torch.equal(k, before)
