"""Tree attention for the LLM verify step: one entry point choosing between the Triton kernel and PyTorch.

See :mod:`specinfer.kernels.metadata` for the terms (prefix, tree, chain) and the q / KV-cache / mask layouts.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from .metadata import TreeAttentionMetadata
from .tree_attention_ref import tree_attention_ref, tree_attention_sdpa

Impl = Literal["auto", "triton", "torch", "ref"]

HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_impl(impl: Impl, on_cuda: bool) -> Impl:
    """What ``impl`` runs for tensors on CUDA (``on_cuda``) or not: ``auto`` is the Triton kernel on CUDA where Triton
    is installed, the PyTorch path otherwise; any other choice is itself."""
    if impl != "auto":
        return impl
    return "triton" if on_cuda and HAS_TRITON else "torch"


def tree_attention(
    q: torch.Tensor,  # [total_queries, num_heads, head_dim] (total_nodes unless num_queries was given)
    k_cache: torch.Tensor,  # [capacity, num_kv_heads, head_dim], or paged
    #                         [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape as k_cache
    meta: TreeAttentionMetadata,
    sm_scale: float | None = None,
    impl: Impl = "auto",
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [total_queries, num_heads, head_dim], q.dtype
    """Attention of every tree node (that has a query) to its request's prefix, its ancestors and itself.

    Per call, because a model's layers differ (Gemma): ``softcap`` soft-caps the scaled scores, ``softcap *
    tanh(scores / softcap)``, before the mask; ``window`` restricts each query to the keys of a sliding window of
    token positions (:mod:`specinfer.kernels.metadata`; tree nodes sit at ``prefix_len + depth``). None: neither.

    ``impl``: ``"triton"`` forces the fused kernel (on CPU only under ``TRITON_INTERPRET=1``, set before the first
    call), ``"torch"`` the per-request SDPA-with-mask path, ``"ref"`` the slow fp32 reference, ``"auto"`` the kernel
    for CUDA tensors when Triton is installed and the SDPA path otherwise. ``sm_scale`` defaults to
    ``1 / sqrt(head_dim)``.

    The KV layout follows the caches' rank, which must match ``meta``: 3-D caches with metadata from
    :func:`~specinfer.kernels.metadata.build_tree_metadata` (contiguous rows per request), 4-D caches with metadata from
    :func:`~specinfer.kernels.metadata.build_paged_tree_metadata` (KV blocks through block tables); every ``impl``
    takes both, and a mismatch raises ValueError.
    """
    impl = resolve_impl(impl, q.is_cuda)
    if impl == "triton":
        # Imported here, not at module load: @triton.jit reads TRITON_INTERPRET when the kernel module is imported.
        from .tree_attention_triton import tree_attention_triton

        return tree_attention_triton(q, k_cache, v_cache, meta, sm_scale, softcap=softcap, window=window)
    if impl == "torch":
        return tree_attention_sdpa(q, k_cache, v_cache, meta, sm_scale, softcap, window)
    if impl == "ref":
        return tree_attention_ref(q, k_cache, v_cache, meta, sm_scale, softcap, window)
    raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'triton', 'torch' or 'ref'")
