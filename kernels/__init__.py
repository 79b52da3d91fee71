"""Attention kernels of specinfer: fused tree attention for the verify step and its PyTorch references.

The Triton kernel lives in :mod:`specinfer.kernels.tree_attention_triton`, imported on first use so that importing
this package never needs Triton (and so ``TRITON_INTERPRET`` can still be set before it is imported).
"""

from .metadata import (
    TreeAttentionMetadata,
    build_paged_tree_metadata,
    build_tree_metadata,
    is_chain,
    pack_bits,
    token_positions,
)
from .tree_attention import HAS_TRITON, tree_attention
from .tree_attention_ref import dense_tree_mask, soft_cap, tree_attention_ref, tree_attention_sdpa

__all__ = [
    "HAS_TRITON",
    "TreeAttentionMetadata",
    "build_paged_tree_metadata",
    "build_tree_metadata",
    "dense_tree_mask",
    "is_chain",
    "pack_bits",
    "soft_cap",
    "token_positions",
    "tree_attention",
    "tree_attention_ref",
    "tree_attention_sdpa",
]
