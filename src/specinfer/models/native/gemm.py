"""The native runtime's matrix products ``x @ w.T``, each in whichever of its equal forms measures faster.

A verify step multiplies a few rows (the tree's nodes, 1-64) by every weight matrix. On a CPU, ATen's
``linear`` (one "NT" GEMM) takes a slow path for a few rows: on a 2-core AVX2 machine in fp32, 4 rows through
a [16384, 2048] weight cost 47 ms while the same product computed as ``(w @ x.T).T`` cost 11 ms; one row
costs about the same either way, and with many rows ``linear`` wins again. Which form is faster depends on
the BLAS, the CPU, the dtype and the shape, so the choice is measured once when the model loads
(:func:`calibrate`) and kept in a :class:`GemmPlan` per (weight shape, row bucket). Both forms compute the
same sums; only their rounding order can differ, as between two BLAS kernels.

One row (an incremental step, or the root of a batch of one) has a third form, ``torch.mv(w, x[0])``: a
matrix-vector kernel, which in bf16 on a CPU streams the weights faster than either GEMM (measured on a
2-core Xeon with AMX, [2048, 8192]: 36 GB/s against 22-24; the whole 1B model's products 85 ms against 111,
BENCHMARKS.md "Incremental step").

A weight kept quantized (:class:`specinfer.models.native.quant.QuantizedWeight`) has one form, its kernel: a plan
passes its products through.

A fourth form keeps the weight *packed*: oneDNN's blocked layout for its inner-product kernel, made once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what PyTorch's inductor packs CPU linear weights with), multiplied by
``torch.ops.mkldnn._linear_pointwise``. For a few rows it is the fastest form on the AVX2 EPYC in fp32 (a [16384,
2048] weight: 9.0 ms for 8 rows against 15.5 transposed and 64 linear; 20 against 29 for 32 rows; BENCHMARKS.md).
A packed weight has one layout, so the choice is per weight shape, not per row bucket: a shape is packed where its
packed times summed over the buckets take at most :data:`MARGIN` of the best other forms' sum (:func:`choose`).
``auto`` tries it on weights of :data:`PACK_MIN_BYTES` or more only.
Only the decoder layers' projections are packed (:meth:`GemmPlan.pack`): the LM head is also read as a plain
matrix (draft heads fold it, draft vocabularies take its rows). :meth:`GemmPlan.linear` dispatches on the tensor
(a packed one is an ``is_mkldnn`` tensor of the weight's shape), so a plan and its weights cannot disagree.

Terms: a *row bucket* is the smallest of :data:`ROW_BUCKETS` at least the number of rows; products with
more rows than the largest bucket (prefill) always use ``linear`` (or the packed kernel, for a packed weight).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specinfer.models.native.quant import QuantizedWeight

if TYPE_CHECKING:
    from specinfer.models.native.weights import ModelWeights

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MARGIN = 0.9  # the transposed form must take at most this fraction of linear's time: noise must not flip choices

Shape = tuple[int, int]  # (out_features, in_features) of a weight
GEMM_CHOICES = ("auto", "plain", "linear", "transposed", "packed")
PROJECTIONS = ("qkv_w", "o_w", "up_w", "down_w")  # a decoder layer's matrices (LayerWeights fields)
# ``auto`` measures the packed form for weights of at least this size only: smaller products are dispatch-bound, and
# oneDNN's state costs a process ~30-130 MB of memory (the demo's SSM worker: 0.30 -> 0.43 GB) for nothing there
PACK_MIN_BYTES = 1 << 22


def row_bucket(rows: int) -> int | None:
    """The smallest row bucket holding ``rows``; None past the largest."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return None


def gemv_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for one row ``x``  # [1, in] as a matrix-vector product; returns  # [1, out]."""
    out = torch.mv(w, x[0]).unsqueeze(0)  # [1, out]
    return out if b is None else out + b


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of ``dtype`` (bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        pack_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w``  # [out, in] (CPU) in oneDNN's blocked layout for :func:`packed_linear`: an opaque ``is_mkldnn`` tensor of
    the same shape."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for ``x``  # [M, in] and a packed ``w`` (:func:`pack_weight`); returns  # [M, out]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def transposed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` computed as ``(w @ x.T).T`` for ``x``  # [M, in] and ``w``  # [out, in];
    returns  # [M, out], contiguous."""
    out = torch.mm(w, x.t()).t()  # [M, out], a view of the [out, M] product
    out = out if x.shape[0] == 1 else out.contiguous()
    return out if b is None else out + b


@dataclass(frozen=True)
class GemmPlan:
    """Which products use the transposed form: ``(out_features, in_features, row bucket)`` triples; which
    weight shapes ``(out_features, in_features)`` use the matrix-vector form for one row; which weight shapes are
    kept packed (:meth:`pack`)."""

    transposed: frozenset[tuple[int, int, int]] = frozenset()
    gemv: frozenset[Shape] = frozenset()
    packed: frozenset[Shape] = frozenset()

    def pack(self, weights: ModelWeights) -> None:
        """Replace, layer by layer, the decoder layers' projections of a ``packed`` shape with their packed form (the
        plain ones are freed as each layer is replaced, so memory peaks one layer above the model's)."""
        if not self.packed:
            return
        for i, layer in enumerate(weights.layers):
            fields = {
                name: pack_weight(w)
                for name in PROJECTIONS
                if type(w := getattr(layer, name)) is torch.Tensor and (w.shape[0], w.shape[1]) in self.packed
            }
            weights.layers[i] = dataclasses.replace(layer, **fields)

    def linear(self, x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, w, b)`` for ``x``  # [M, in] and ``w``  # [out, in], in the planned form (a quantized ``w``:
        its kernel; a packed one: oneDNN's, :func:`packed_linear`)  # [M, out], contiguous."""
        if type(w) is QuantizedWeight:
            return w.linear(x, b)
        if w.is_mkldnn:
            return packed_linear(x, w, b)
        if self.gemv and x.shape[0] == 1 and (w.shape[0], w.shape[1]) in self.gemv:
            return gemv_linear(x, w, b)
        if self.transposed and (w.shape[0], w.shape[1], row_bucket(x.shape[0])) in self.transposed:
            return transposed_linear(x, w, b)
        return F.linear(x, w, b)


def all_transposed(weights: Iterable[torch.Tensor], buckets: tuple[int, ...] = ROW_BUCKETS) -> GemmPlan:
    """The transposed form for every weight shape and row bucket (tests, and forcing it)."""
    return GemmPlan(frozenset((w.shape[0], w.shape[1], b) for w in weights for b in buckets))


def choose(
    timings: Mapping[tuple[int, int, int], tuple[float, ...]],
    margin: float = MARGIN,
    packed: Mapping[tuple[int, int, int], float] | None = None,
) -> GemmPlan:
    """The plan from measured ``(linear, transposed[, gemv])`` seconds per ``(out, in, row bucket)`` (gemv:
    bucket 1 only): the fastest other form where it takes at most ``margin`` of linear's time. ``packed``: the
    packed form's seconds per ``(out, in, row bucket)``; a shape is packed where they sum to at most ``margin`` of
    the other forms' best times summed over the same buckets."""
    transposed, gemv = set(), set()
    best: dict[Shape, float] = {}
    for key, (lin, *others) in timings.items():
        best[key[:2]] = best.get(key[:2], 0.0) + min(lin, *others)
        form = min(range(len(others)), key=lambda i: others[i])
        if others[form] > margin * lin:
            continue
        if form == 0:
            transposed.add(key)
        else:
            gemv.add(key[:2])
    packed_sums: dict[Shape, float] = {}
    for key, seconds in (packed or {}).items():
        packed_sums[key[:2]] = packed_sums.get(key[:2], 0.0) + seconds
    # plain weights of a packed shape (an LM head shaped like a projection) keep their forms
    chosen = frozenset(shape for shape, total in packed_sums.items() if total <= margin * best.get(shape, 0.0))
    return GemmPlan(frozenset(transposed), frozenset(gemv), chosen)


MIN_TIMING_SECONDS = 1e-3  # one timing lasts at least this: small products are timed over several calls


def _calls_per_timing(fns) -> int:
    """Calls per timing such that the fastest of ``fns`` takes about :data:`MIN_TIMING_SECONDS` (at most 256).

    A product on a small model's weights takes ~10 us: timed one call at a time, the best of a few calls was
    a fluke as often as not, and the plan flipped from load to load (three loads of a 256-wide fp32 model
    chose three different plans, each with a form ~15 % slower than ``linear`` in steady state)."""
    fastest = float("inf")
    for fn in fns:
        start = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - start)
    return max(1, min(256, int(MIN_TIMING_SECONDS / max(fastest, 1e-7))))


def _best_seconds(fns, repeats: int) -> list[float]:
    """Best-of-``repeats`` time per call of each of ``fns``, each timing over enough calls to last about
    :data:`MIN_TIMING_SECONDS`, timings interleaved so a slow spell of the machine (another process, a
    page-cache flush) slows every form alike instead of one."""
    for fn in fns:
        fn()  # warm-up: first-call allocations and BLAS set-up
    calls = _calls_per_timing(fns)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best


class _Rotation:
    """Calls a product on a shape's weights in turn, as a forward pass does layer after layer: timing
    one weight again and again would read it from the CPU cache, which a real pass over a model
    larger than the cache never does."""

    def __init__(self, weights: list[torch.Tensor], x: torch.Tensor, product) -> None:
        self.weights, self.x, self.product, self.next = weights, x, product, 0

    def __call__(self) -> torch.Tensor:
        w = self.weights[self.next]
        self.next = (self.next + 1) % len(self.weights)
        return self.product(self.x, w)


@torch.inference_mode()
def measure(
    weights: Iterable[torch.Tensor],
    repeats: int = 5,
    buckets: tuple[int, ...] = ROW_BUCKETS,
    per_shape: int = 4,
    packed: dict[tuple[int, int, int], float] | None = None,
    packable: frozenset[Shape] = frozenset(),
) -> dict[tuple[int, int, int], tuple[float, ...]]:
    """Best-of-``repeats`` time of each form (linear, transposed, and gemv for one row) for every distinct
    weight shape and row bucket (on the weights' own device and dtype), each call on the next of up to
    ``per_shape`` weights of the shape. ``packed``: filled with the packed form's time per key too, for the shapes
    in ``packable`` (packed copies of those weights, freed after their shape)."""
    by_shape: dict[Shape, list[torch.Tensor]] = {}
    for w in weights:
        same = by_shape.setdefault((w.shape[0], w.shape[1]), [])
        if len(same) < per_shape:
            same.append(w)
    timings = {}
    for n, ((out_f, in_f), ws) in enumerate(by_shape.items(), 1):
        log.info("measuring matrix-product forms: weight %d/%d [%d, %d]", n, len(by_shape), out_f, in_f)
        packs = [pack_weight(w) for w in ws] if packed is not None and (out_f, in_f) in packable else []
        for b in buckets:
            x = torch.randn(b, in_f, dtype=ws[0].dtype, device=ws[0].device)  # [b, in]
            forms = [_Rotation(ws, x, f) for f in (F.linear, transposed_linear, *([gemv_linear] if b == 1 else []))]
            seconds = _best_seconds([*forms, *([_Rotation(packs, x, packed_linear)] if packs else [])], repeats)
            timings[(out_f, in_f, b)] = tuple(seconds[: len(forms)])
            if packs:
                packed[(out_f, in_f, b)] = seconds[-1]
    return timings


def plan_for(choice: str, weights: ModelWeights, device: torch.device, packing: bool = True) -> GemmPlan:
    """The plan ``choice`` (one of :data:`GEMM_CHOICES`) gives a model's ``weights``: ``auto`` measures
    (:func:`calibrate`), ``plain`` too but keeps every weight plain (the packed form not a candidate), ``packed``
    packs every layer projection's shape (a CPU whose oneDNN packs their dtype),
    ``transposed`` transposes every product of up to 128 rows, ``linear`` is ``F.linear`` throughout. ``packing``:
    False keeps every weight plain (offloaded layers, copied into plain staging buffers)."""
    matrices = weights.matrices()
    packable = frozenset(
        (w.shape[0], w.shape[1])
        for layer in weights.layers
        for name in PROJECTIONS
        if packing and type(w := getattr(layer, name)) is torch.Tensor
    )
    if choice in ("auto", "plain"):
        size = matrices[0].element_size() if matrices else 0
        large = frozenset(shape for shape in packable if shape[0] * shape[1] * size >= PACK_MIN_BYTES)
        return calibrate(matrices, device, large if choice == "auto" else frozenset())
    if choice == "packed":
        if device.type != "cpu" or not matrices or not packing_available(matrices[0].dtype):
            raise ValueError(f"gemm packed: oneDNN does not pack these weights on this {device.type}")
        return GemmPlan(packed=packable)
    return all_transposed(matrices) if choice == "transposed" else GemmPlan()


def calibrate(
    weights: Iterable[torch.Tensor], device: torch.device, packable: frozenset[Shape] = frozenset()
) -> GemmPlan:
    """The measured plan on a CPU; on a GPU every product uses ``linear`` (cuBLAS picks well for few rows).
    ``packable``: the weight shapes the packed form is a candidate for (where the CPU's oneDNN packs their dtype)."""
    if device.type != "cpu":
        return GemmPlan()
    weights = list(weights)
    start = time.perf_counter()
    can_pack = bool(packable) and bool(weights) and packing_available(weights[0].dtype)
    packed: dict[tuple[int, int, int], float] | None = {} if can_pack else None
    plan = choose(measure(weights, packed=packed, packable=packable), packed=packed)
    log.info(
        "matrix-product forms measured in %.1f s: %d of the (shape, rows) cases use w @ x.T, %d shapes mv for one row, "
        "%d shapes packed",
        time.perf_counter() - start,
        len(plan.transposed),
        len(plan.gemv),
        len(plan.packed),
    )
    return plan
