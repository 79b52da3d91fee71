"""What drafting needs of an SSM pass's logit rows, computed in place where the rows are host memory
(``cpu_rows.c``, built into :mod:`.cpu_qgemm`'s library), beside its plain PyTorch reference (:func:`reference`).

For each row: the ``k`` largest entries, best first, equal values in index order, and optionally the row's softmax
at them in double precision (a dynamic draft tree scores its slots by it). PyTorch spends 3-5 passes over the
vocabulary on this, each with its own dispatch (on the 2-core development CPU, 0.1-0.3 ms for 8 rows of 4096): on a
small SSM more than its forward; the C kernel reads each row once (twice where scored).
"""

from __future__ import annotations

import numpy as np
import torch

from . import cpu_qgemm

MAX_K = 256  # most entries a row's top takes (cpu_rows.c's MAX_K)


def serves(rows: torch.Tensor, k: int) -> bool:
    """Whether :func:`top_k` can take the top ``k`` of ``rows``  # [R, V]: fp32 in host memory, rows of unit stride,
    ``k`` at most :data:`MAX_K`, and the library built here."""
    return (
        k <= MAX_K
        and rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and rows.dim() == 2
        and rows.stride(-1) == 1
        and cpu_qgemm.library() is not None
    )


def top_k(x: np.ndarray, k: int, scored: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row's ``k`` largest entries' indices, best first (equal values in index order), and where ``scored`` the
    row's softmax at them (float64), of ``x``  # [R, V] float32, unit stride along V; 1 <= k <= min(V, MAX_K).
    # [R, k] int64, [R, k] float64 or None"""
    rows, vocab = x.shape
    if x.dtype != np.float32 or x.strides[1] != 4 or x.strides[0] % 4:
        raise ValueError("cpu_rows.top_k reads float32 rows of unit stride")
    if not 1 <= k <= min(vocab, MAX_K):
        raise ValueError(f"cpu_rows.top_k: k must be in [1, {min(vocab, MAX_K)}], got {k}")
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_rows.top_k without its library (check serves() first)"
    idx = np.empty((rows, k), dtype=np.int64)
    probs = np.empty((rows, k), dtype=np.float64) if scored else None
    if rows:
        lib.row_top_k(
            rows, vocab, x.ctypes.data, x.strides[0] // 4, k, int(scored), idx.ctypes.data,
            None if probs is None else probs.ctypes.data, torch.get_num_threads(),
        )  # fmt: skip
    return idx, probs


def reference(x: torch.Tensor, k: int, scored: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`top_k` in plain PyTorch: a stable descending sort (equal values keep index order) and a float64
    softmax.  # [R, k] int64, [R, k] float64 or None"""
    idx = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    if not scored:
        return idx, None
    return idx, torch.softmax(x.to(torch.float64), dim=-1).gather(-1, idx)
