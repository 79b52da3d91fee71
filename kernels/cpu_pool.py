"""A KV pool's row moves on the CPU by our C code (``cpu_pool.c``: why not PyTorch's indexing there), with PyTorch's
indexing as the reference and the path everywhere else (another device, no kernels here)."""

from __future__ import annotations

import torch

from . import cpu_qgemm


def reference_move(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rows ``src`` to rows ``dst`` of ``k`` and ``v``  # [layers, rows, kv_heads, head_dim] in every layer, all
    gathered before any is written."""
    k[:, dst] = k[:, src]
    v[:, dst] = v[:, src]


def move(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """:func:`reference_move`, by the C code where ``k`` and ``v`` are contiguous host tensors and the kernels run
    here."""
    lib = cpu_qgemm.library() if k.device.type == "cpu" else None
    if lib is None or not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape or k.dtype != v.dtype:
        reference_move(k, v, src, dst)
        return
    src = src.to(torch.int64).contiguous()
    dst = dst.to(torch.int64).contiguous()
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"a row move needs two 1-d indexes of one length: {tuple(src.shape)}, {tuple(dst.shape)}")
    rows, row_bytes = k.shape[1], k[0, 0].numel() * k.element_size()
    done = lib.pool_move(
        k.data_ptr(), v.data_ptr(), k.shape[0], rows, row_bytes, src.data_ptr(), dst.data_ptr(), src.numel()
    )
    if done == -2:
        raise IndexError(f"a row move outside the pool's {rows} rows")
    if done:
        raise MemoryError("the KV pool's row move could not allocate its buffer")
