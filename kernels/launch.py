"""Launch configuration of the Triton tree-attention kernel: tile sizes, split-KV count, warps and stages.

Pure heuristics over the shapes and the per-step metadata (no Triton needed), kept apart from the kernel so the
choice can be inspected and forced in tests and tuning. See :mod:`specinfer.kernels.tree_attention_triton` for
what a tile (``BLOCK_M`` rows x ``BLOCK_N`` keys) and a split are.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from .metadata import TreeAttentionMetadata


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split count of one launch (chosen by :func:`choose_config` unless given)."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_tiles(meta: TreeAttentionMetadata, group: int, block_m: int) -> int:
    """Programs that do work for one KV head (early-exit programs of the padded grid not counted)."""
    return sum(-(-(n * group) // block_m) for n in meta.num_queries)


@dataclass(frozen=True)
class Forced:
    """Launch parameters forced instead of chosen by :func:`choose_config` (tests, tuning); None: chosen."""

    block_m: int | None = None  # 16, 32, 64 or 128
    block_n: int | None = None  # 16, 32 or 64
    num_splits: int | None = None  # >= 1

    def __post_init__(self) -> None:
        if (
            self.block_m not in (None, 16, 32, 64, 128)
            or self.block_n not in (None, 16, 32, 64)
            or (self.num_splits is not None and self.num_splits < 1)
        ):
            raise ValueError(f"unsupported launch override {self}")


def choose_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    forced: Forced | None = None,
    window: int | None = None,
) -> LaunchConfig:
    """Heuristic launch configuration; any of ``block_m``, ``block_n``, ``num_splits`` can be ``forced``; ``window``:
    the call's sliding window (a query reads at most that many prefix keys).

    ``block_m`` follows the packed rows (``max_queries * group``) of the largest request: 16/32 for small verify steps
    so little of a tile is padding, 64 for larger trees, 128 for prefill-sized chains. Warps and stages were picked
    so that the sm_90 build neither spills registers nor exceeds shared memory (checked with ptxas resource usage).
    fp32 (a correctness path: exact ``ieee`` dots on CUDA cores) uses small tiles to limit spilling.
    Splits are only used on a GPU, to give about one program per SM when tiles x KV heads are fewer, while keeping
    at least 4 key blocks per split.
    """
    forced = forced or Forced()
    block_m, block_n, num_splits = forced.block_m, forced.block_n, forced.num_splits
    group = q.shape[1] // k_cache.shape[-2]  # k_cache: [capacity, H_kv, D] or paged [num_blocks, block_size, H_kv, D]
    head_dim = q.shape[2]
    rows = meta.max_queries * group
    fp32 = q.dtype == torch.float32
    if block_m is None:
        block_m = 16 if fp32 or rows <= 16 else 32 if rows <= 32 else 64 if rows < 1024 else 128
    if block_n is None:
        block_n = 32 if fp32 or head_dim > 128 else 64
    if num_splits is None:
        num_splits = 1
        if q.is_cuda:
            programs = _num_tiles(meta, group, block_m) * k_cache.shape[-2]
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            if programs < sms:
                keys = meta.max_prefix_len if window is None else min(meta.max_prefix_len, window)
                num_splits = max(1, min(-(-sms // programs), keys // (4 * block_n), 32))
                num_splits = 1 << (
                    num_splits.bit_length() - 1
                )  # a power of two: NUM_SPLITS is constexpr, few variants to JIT
    num_warps = 8 if block_m >= 128 or (block_m == 64 and head_dim > 64) else 4
    num_stages = 2 if fp32 or head_dim > 128 or (block_m == 16 and head_dim > 64) else 3
    return LaunchConfig(block_m, block_n, num_splits, num_warps, num_stages)
