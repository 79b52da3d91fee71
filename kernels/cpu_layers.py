"""Every decoder layer of a Llama-family model in one C call per step on an x86-64 CPU (``cpu_layers.c``, built with
:mod:`.cpu_qgemm`'s library): the ctypes mirror of its structures, the weights it reads, and the step's attention
segments (from which the C code builds each row's visible keys).

A *layer record* (:class:`Layer`) holds the addresses of one layer's weights, norms and KV caches; the model builds
the records once (:mod:`specinfer.models.native.fused`) and each step passes them with the step's rows. What the C
code computes is what the model's PyTorch layer computes (tests/kernels/test_cpu_layers.py holds it to that), with
every row computed alone, so a verified tree equals one-token steps bit for bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

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


def weight_kind(w: object) -> int | None:
    """The C kind of a projection's weight, or None where the C layers cannot read it: our int4/int8 block layouts,
    and contiguous fp32 or bf16 tensors whose inputs are whole 8s."""
    from specinfer.models.native.quant import QuantizedWeight  # the kernels package stays free of the runtime

    if type(w) is QuantizedWeight:
        if w.blocks_dtype is None:
            return None
        return INT4 if w.scheme == "int4" else INT8
    if not isinstance(w, torch.Tensor) or w.is_mkldnn or w.device.type != "cpu":
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


@dataclass(frozen=True)
class Segments:
    """A step's attention segments as the C layers read them (``cpu_layers.c``, at its top): one int32 array of a
    header of records ``(n, prefix, queries, parents_at, table_at, kv_start)``, then the parent arrays and block tables
    they point at; ``block_size``: the paged pool's (0: contiguous, rows from ``kv_start``); ``rows``: the query rows
    (the last ``queries`` nodes of each segment, segment after segment)."""

    data: torch.Tensor  # [6 * count + parents + tables] int32
    count: int
    block_size: int
    rows: int

    @staticmethod
    def of(
        parents: Sequence[Sequence[int]],
        prefix: Sequence[int],
        queries: Sequence[int],
        block_size: int,
        tables: Sequence[Sequence[int]] = (),
        kv_starts: Sequence[int] = (),
    ) -> Segments:
        """The segments of per-segment parent arrays, cached prefixes, query rows and either block tables (paged) or
        pool starts (contiguous); segments without queries are left out."""
        keep = [i for i, q in enumerate(queries) if q]
        header: list[int] = []
        body: list[int] = []
        at = 6 * len(keep)
        for i in keep:
            table = tables[i] if block_size else ()
            header += (
                len(parents[i]),
                prefix[i],
                queries[i],
                at,
                at + len(parents[i]),
                0 if block_size else kv_starts[i],
            )
            body += parents[i]
            body += table
            at += len(parents[i]) + len(table)
        data = torch.tensor(header + body, dtype=torch.int32)
        return Segments(data, len(keep), block_size, sum(queries[i] for i in keep))

    @staticmethod
    def of_metadata(meta: TreeAttentionMetadata) -> Segments:
        """The segments of a step's attention metadata."""
        tables = meta.block_tables if meta.paged else ()
        return Segments.of(
            meta.parents, meta.prefix_lens, meta.num_queries, meta.block_size if meta.paged else 0, tables,
            meta.kv_starts,
        )  # fmt: skip


def run(
    shape: Shape,
    layers: ctypes.Array,
    h: torch.Tensor,  # [T, hidden] fp32 or bf16, updated in place
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    rope_scale: float,
    cache_rows: torch.Tensor,  # [T] int64
    segments: Segments,
    windows: torch.Tensor,  # [W] int32: each visible-key list's window (0: none), as layers index them
) -> torch.Tensor:
    """Every layer of ``layers`` over ``h``, in place; returns ``h``."""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.run without its library (check cpu_qgemm.library() first)"
    if segments.rows != h.shape[0]:
        raise ValueError("cpu_layers.run: every row of h must be a segment's query row")
    failed = lib.decoder_layers(
        ctypes.addressof(shape), ctypes.addressof(layers), len(layers), h.shape[0], h.data_ptr(), positions.data_ptr(),
        inv_freq.data_ptr(), rope_scale, cache_rows.data_ptr(), segments.data.data_ptr(), segments.count,
        segments.block_size, windows.data_ptr(), windows.numel(), torch.get_num_threads(),
    )  # fmt: skip
    if failed == -2:
        raise ValueError("cpu_layers.run: the segments' query rows are not h's rows")
    if failed:
        raise MemoryError("cpu_layers: no memory for a step's buffers")
    return h


def amx() -> bool:
    """Whether the library's dense bf16 products run on AMX tiles in this process (``kernels/cpu_amx.c``)."""
    lib = cpu_qgemm.library()
    return lib is not None and bool(lib.amx_on())


def dense_linear(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``x``  # [M, K] times a dense fp32 or bf16 ``w``  # [N, K] (K a multiple of 8) transposed, by the layers' own
    products (each output one reduction in a fixed order, whatever M), on ``threads`` threads of the kernels' team
    (None: PyTorch's thread count).  # [M, N] float32"""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.dense_linear without its library"
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    bf16 = int(w.dtype == torch.bfloat16)
    lib.dense_gemm(
        x.shape[0],
        w.shape[0],
        w.shape[1],
        x.data_ptr(),
        w.data_ptr(),
        bf16,
        y.data_ptr(),
        threads or torch.get_num_threads(),
    )
    return y


def rms_norm_rows(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of ``h``  # [M, N] fp32 or bf16 RMS-normed with ``w``  # [N] fp32, in h's dtype, by the layers' own
    norm (``cpu_layers.c``).  # [M, N]"""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.rms_norm_rows without its library"
    x = h.float().contiguous()
    y = torch.empty_like(x)
    lib.rms_norm_rows(
        x.shape[0], x.shape[1], x.data_ptr(), w.data_ptr(), eps, int(h.dtype == torch.bfloat16), y.data_ptr()
    )
    return y.to(h.dtype)


def weight_linear(x: torch.Tensor, w: Weight, threads: int | None = None) -> torch.Tensor:
    """``x``  # [M, K_x] times the weight of record ``w`` (:func:`weight`; any kind: a dense weight's K_x is its k, a
    block layout's at most its padded k) transposed, by the layers' own products on ``threads`` threads of the
    kernels' team (None: PyTorch's thread count); block layouts quantize x's rows as the layers do.  # [M, n] float32"""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.weight_linear without its library"
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    failed = lib.weight_gemm(
        x.shape[0], x.shape[1], x.data_ptr(), ctypes.addressof(w), y.data_ptr(), threads or torch.get_num_threads()
    )
    _raise_for(failed, "weight_linear", x.shape[1], w)
    return y


def _raise_for(failed: int, name: str, width: int, w: Weight) -> None:
    """The error of ``weight_gemm``'s status ``failed`` (0: none) for ``width`` inputs a row against ``w``."""
    if failed == -3:
        raise ValueError(f"cpu_layers.{name}: rows of {width} inputs against a weight of {w.k} (kind {w.kind})")
    if failed:
        raise MemoryError(f"cpu_layers.{name}: no memory for the rows")


def final_logits(
    h: torch.Tensor,  # [T, hidden] fp32 or bf16, contiguous
    rows: torch.Tensor,  # [N] int64
    norm: torch.Tensor,  # [hidden] fp32
    eps: float,
    head: Weight,  # the LM head's record (:func:`weight`): [vocab, hidden], any kind
) -> torch.Tensor:  # [N, vocab] float32
    """The logits of ``h``'s rows ``rows``: :func:`rms_norm_rows` with ``norm`` then :func:`weight_linear` with
    ``head``, bit for bit, in one call (a step's final norm and LM head)."""
    lib = cpu_qgemm.library()
    assert lib is not None, "cpu_layers.final_logits without its library"
    y = torch.empty(rows.shape[0], head.n, dtype=torch.float32)
    failed = lib.final_logits(
        h.shape[0], h.shape[1], h.data_ptr(), int(h.dtype == torch.bfloat16), rows.data_ptr(), rows.shape[0],
        norm.data_ptr(), eps, ctypes.addressof(head), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed == -2:
        raise IndexError("cpu_layers.final_logits: a logit row outside h")
    _raise_for(failed, "final_logits", h.shape[1], head)
    return y


def serves_rows(meta: TreeAttentionMetadata) -> bool:
    """Whether every request of the step is a decode or verify step the row-by-row attention serves."""
    return all(not meta.num_queries[b] or cpu_attention.row_by_row(meta, b) for b in range(meta.batch_size)) and any(
        meta.num_queries
    )
