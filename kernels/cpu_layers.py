"""Every decoder layer of a Llama-family model in one C call per step on an x86-64 CPU (``cpu_layers.c``, built with
:mod:`.cpu_qgemm`'s library): the ctypes mirror of its structures, the weights it reads, and the step's visible keys.

A *layer record* (:class:`Layer`) holds the addresses of one layer's weights, norms and KV caches; the model builds
the records once (:mod:`specinfer.models.native.fused`) and each step passes them with the step's rows. What the C
code computes is what the model's PyTorch layer computes (tests/kernels/test_cpu_layers.py holds it to that), with
every row computed alone, so a verified tree equals one-token steps bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_attention, cpu_qgemm
from .metadata import TreeAttentionMetadata

DENSE_F32, DENSE_BF16, INT4, INT8 = 0, 1, 4, 8


class Weight(ctypes.Structure):
    """One product's weight: ``kind`` (the constants above), ``n`` outputs, ``k`` inputs (block layouts: padded to
    whole blocks), the values ``w``, the block scales ``s`` and an fp32 ``bias`` (0: none)."""

    _fields_ = [("kind", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int)] + [
        (name, ctypes.c_void_p) for name in ("w", "s", "bias")
    ]


class Layer(ctypes.Structure):
    _fields_ = [(name, Weight) for name in ("qkv", "o", "up", "down")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("norm1", "norm2", "q_norm", "k_norm", "k_cache", "v_cache")]
    _fields_ += [("keys", ctypes.c_int)]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "dim", "inter", "rotary_dim")]
    _fields_ += [("h_bf16", ctypes.c_int), ("kv_bf16", ctypes.c_int)]
    _fields_ += [(name, ctypes.c_float) for name in ("eps", "scale", "softcap")]


def weight_kind(w: object, dense: bool) -> int | None:
    """The C kind of a projection's weight, or None where the C layers cannot read it: our int4/int8 block layouts,
    and (``dense``) contiguous fp32 or bf16 tensors whose inputs are whole 8s."""
    from specinfer.models.native.quant import QuantizedWeight  # the kernels package stays free of the runtime

    if type(w) is QuantizedWeight:
        if w.blocks_dtype is None:
            return None
        return INT4 if w.scheme == "int4" else INT8
    if not dense or not isinstance(w, torch.Tensor) or w.is_mkldnn or w.device.type != "cpu":
        return None
    if not w.is_contiguous() or w.shape[1] % 8:
        return None
    return {torch.float32: DENSE_F32, torch.bfloat16: DENSE_BF16}.get(w.dtype)


def weight(w: object, kind: int, bias: torch.Tensor | None, keep: list) -> Weight:
    """The record of ``w`` (of :func:`weight_kind` ``kind``), with ``bias`` as fp32; what it points at is appended to
    ``keep``, which must outlive the record."""
    b = None if bias is None else bias.detach().float().contiguous()
    if kind in (INT4, INT8):
        values, scales = w.packed, w.scales
        k = values.shape[1] * (2 if kind == INT4 else 1)
    else:
        values, scales, k = w, None, w.shape[1]
    keep.extend(x for x in (values, scales, b) if x is not None)
    address = lambda x: 0 if x is None else x.data_ptr()  # noqa: E731
    return Weight(kind, values.shape[0], k, values.data_ptr(), address(scales), address(b))


def step_keys(meta: TreeAttentionMetadata, window: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every query row's visible keys of the step, rows in packed order (:func:`cpu_attention.row_keys` of each request,
    concatenated): ``(offsets, keys, longest)``  # [T + 1] int64, [total] int32; cached on ``meta`` per window."""
    cached = meta._row_keys.get((-1, window))
    if cached is not None:
        return cached
    offsets, keys, longest, base = [torch.zeros(1, dtype=torch.int64)], [], 0, 0
    for b in range(meta.batch_size):
        if not meta.num_queries[b]:
            continue
        o, k, n = cpu_attention.row_keys(meta, b, window)
        offsets.append(o[1:] + base)
        keys.append(k)
        base += int(o[-1])
        longest = max(longest, n)
    cached = (torch.cat(offsets), torch.cat(keys), longest)
    meta._row_keys[(-1, window)] = cached
    return cached


def run(
    shape: Shape,
    layers: ctypes.Array,
    h: torch.Tensor,  # [T, hidden] fp32 or bf16, updated in place
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    rope_scale: float,
    cache_rows: torch.Tensor,  # [T] int64
    keys: list[tuple[torch.Tensor, torch.Tensor, int]],  # visible-key lists (:func:`step_keys`), as layers index them
) -> torch.Tensor:
    """Every layer of ``layers`` over ``h``, in place; returns ``h``."""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.run without its library (check cpu_qgemm.library() first)"
    if any(o.shape[0] != h.shape[0] + 1 for o, _, _ in keys):
        raise ValueError("cpu_layers.run: a visible-key list per row of h is needed (every row a query)")
    n = len(keys)
    offsets = (ctypes.c_void_p * n)(*(o.data_ptr() for o, _, _ in keys))
    lists = (ctypes.c_void_p * n)(*(k.data_ptr() for _, k, _ in keys))
    longest = max(m for _, _, m in keys)
    failed = lib.decoder_layers(
        ctypes.addressof(shape), ctypes.addressof(layers), len(layers), h.shape[0], h.data_ptr(), positions.data_ptr(),
        inv_freq.data_ptr(), rope_scale, cache_rows.data_ptr(), ctypes.addressof(offsets), ctypes.addressof(lists),
        longest, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu_layers: no memory for a step's buffers")
    return h


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x``  # [M, K] times a dense fp32 or bf16 ``w``  # [N, K] (K a multiple of 8) transposed, by the layers' own
    products (each output one reduction in a fixed order, whatever M).  # [M, N] float32"""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.dense_linear without its library"
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    bf16 = int(w.dtype == torch.bfloat16)
    lib.dense_gemm(
        x.shape[0], w.shape[0], w.shape[1], x.data_ptr(), w.data_ptr(), bf16, y.data_ptr(), torch.get_num_threads()
    )
    return y


def serves_rows(meta: TreeAttentionMetadata) -> bool:
    """Whether every request of the step is a decode or verify step the row-by-row attention serves."""
    return all(not meta.num_queries[b] or cpu_attention.row_by_row(meta, b) for b in range(meta.batch_size)) and any(
        meta.num_queries
    )
