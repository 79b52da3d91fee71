"""Weight-only quantization of the native runtime: the decoder layers' linear projections kept as 8- or 4-bit
integers in memory and multiplied by PyTorch's packed weight-only kernels (as gpt-fast does), activations in the
run's dtype.

Terms, used here and in docs/quantization.md:

- *scheme*: ``int8`` (one scale per output row, symmetric: ``w ~ q * scale`` with ``q`` in [-127, 127]; in our CPU
  kernels' layout one per block of 32 inputs, llama.cpp's Q8_0) or
  ``int4`` (per *group* of ``group_size`` consecutive inputs of a row, a scale and a zero: ``w ~ (q - 8) * scale
  + zero`` with ``q`` in [0, 15], the layout of PyTorch's int4 kernels; a GGUF file's Q4_0 and Q4_1 blocks are
  groups of 32 of this form, kept as they are: :func:`quantize_int4`). ``none``: plain weights.
- *quantized layers*: every decoder layer's q/k/v, o, gate/up and down projections (:data:`LAYER_MATRICES`). The
  token embeddings and the LM head stay in the run's dtype: the embeddings are a table lookup, and the LM head is
  read by draft heads and folded with their projections (:meth:`NativeModel.logits_after`), which want it plain.
- *padding*: the int4 kernels want whole groups of inputs and output rows in multiples of 16, so a weight whose
  shape is not is padded with zero rows and columns when it is quantized; a product pads its input with zero
  columns and drops the padded outputs (the demo LLM's down projection has 688 inputs, SmolLM2's q/k/v 576).

Scales (and int4 zeros) are stored in the run's dtype, which the kernels require of them, and every integer is
rounded against the stored scale, so that :func:`dequantize_int8` / :func:`dequantize_int4` give exactly the
weights the kernels multiply by: each product's reference is ``F.linear`` on them (the tests compare the two).

Devices (checked by :func:`check_quantize` before a model loads): on a CPU both schemes in float32, float16 and
bfloat16; on CUDA int8 in all three, int4 in bfloat16 only (PyTorch's CUDA int4 kernel takes bf16 activations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specinfer.core.errors import InvalidArgument
from specinfer.kernels import cpu_qgemm

if TYPE_CHECKING:
    from specinfer.models.native.weights import ModelWeights

QUANTIZE_CHOICES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's int4 kernels accept
# inputs per int4 scale and zero, llama.cpp's Q4_0 / Q4_1 group, chosen by perplexity (bench/quantized.py,
# docs/quantization.md): SmolLM2-135M-Instruct (from its Q4_1 GGUF, bf16) lost nothing at 32, 42 % at 64 and 69 % at
# 128; the demo LLM, too small to tell, 0.6 %, 0.2 % and 0.2 %. 32 costs 0.125 bytes per weight of scale and zero
DEFAULT_GROUP_SIZE = 32
LAYER_MATRICES = ("qkv_w", "o_w", "up_w", "down_w")  # the fields of LayerWeights that are quantized
INT4_ROWS = 16  # output rows of an int4 weight come in multiples of this (the CPU kernel's, a multiple of CUDA's 8)
FIELD = "quantize"  # the flag every refusal names


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight ``[out_features, in_features]`` kept quantized, packed for its device's kernel.

    ``packed``: int8: the ``[out, in]`` int8 values; int4: the kernel's packed layout of the padded
    ``[out_padded, in_padded]`` 4-bit values (CPU and CUDA layouts differ: ``cuda`` says which). ``scales``: int8:
    ``[out]``; int4: ``[in_padded / group_size, out_padded, 2]``, each group's scale and zero. ``group_size``: 0 for
    int8. In our CPU kernels' layouts (``blocks_dtype`` set) the two are theirs instead
    (:mod:`specinfer.kernels.cpu_qgemm`: int8 with a float16 scale per block of 32 inputs)."""

    scheme: str
    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group_size: int = 0
    pad_in: int = 0  # zero input columns the product appends (int4)
    pad_out: int = 0  # padded output rows the product drops (int4)
    cuda: bool = False  # packed for CUDA's int4 kernel (int8's layout is the same on both)
    # packed in the block layouts of our CPU kernels (specinfer.kernels.cpu_qgemm), whose activations and outputs
    # are in this dtype (their scales are not); None: PyTorch's kernels, in the scales' dtype
    blocks_dtype: torch.dtype | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, as a plain weight's ``shape``."""
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype the kernels take (that of the scales, for PyTorch's kernels)."""
        return self.blocks_dtype or self.scales.dtype

    @property
    def device(self) -> torch.device:
        """Where its tensors are, as a plain weight's ``device``."""
        return self.packed.device

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, w, b)`` for ``x``  # [M, in] with ``w`` the dequantized weight; returns  # [M, out].
        (Our CPU kernels quantize ``x`` per block of 32 first: :mod:`specinfer.kernels.cpu_qgemm`.)"""
        if self.blocks_dtype is not None:  # pads the inputs itself, no padded outputs
            out = cpu_qgemm.linear(x, self.scheme, self.packed, self.scales, self.blocks_dtype)  # [M, out]
            return out if b is None else out + b
        if self.pad_in:
            x = F.pad(x, (0, self.pad_in))  # [M, in_padded]
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)  # [M, out]
        elif self.cuda:
            out = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales)  # [M, out_padded]
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales)
        if self.pad_out:
            out = out[:, : self.out_features].contiguous()  # [M, out]
        return out if b is None else out + b

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with ``fn`` applied to its tensors (a copy to another device, pinned memory, ...)."""
        return dataclasses.replace(self, packed=fn(self.packed), scales=fn(self.scales))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by name (the bytes it holds, what offloading stages)."""
        return {"packed": self.packed, "scales": self.scales}


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 of ``w``  # [out, in]: ``(q, scales)``  # [out, in] int8, [out] in w's dtype,
    ``q`` rounded against the stored scale."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(w.dtype)  # [out]
    q = (wf / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # [out, in] in scales' dtype
    """The weights :func:`quantize_int8`'s ``(q, scales)`` stand for."""
    return (q.float() * scales.float()[:, None]).to(scales.dtype)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 of ``w``  # [out, in], ``in`` a multiple of ``group_size``: ``(q, scales,
    zeros)``  # [out, in] int32 in [0, 15], [out, in / group_size] each in w's dtype, such that
    ``w ~ (q - 8) * scale + zero`` per group: the min-max range of the group in 15 steps, or, where that does not
    hold the group exactly and llama.cpp's Q4_0 block does, the Q4_0 block (``zero = 0``, the group's largest
    magnitude at ``q = 0``, ``scale = -that / 8``). So a Q4_1 block (``q * d + m``, its min at 0 and max at 15) and a
    Q4_0 block come back as the file holds them (tests/test_quant.py, tests/test_gguf.py), and other weights are
    fitted by the min-max range as before."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"{in_f} inputs are not whole groups of {group_size} (pad the weight first)")
    groups = w.float().reshape(out_f, in_f // group_size, group_size)  # [out, groups, group_size]
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # [out, groups]
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(w.dtype)
    zeros = (lo + scales.float() * 8).to(w.dtype)  # the value q = 8 stands for
    q, exact = _int4_fit(groups, scales, zeros)
    peak = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # [out, groups] signed
    q0_scales = torch.where(peak == 0, 1e-6, -peak / 8).to(w.dtype)
    q0_zeros = torch.zeros_like(zeros)
    q0, q0_exact = _int4_fit(groups, q0_scales, q0_zeros)
    use_q0 = q0_exact & ~exact  # [out, groups]
    q = torch.where(use_q0[..., None], q0, q)
    scales, zeros = torch.where(use_q0, q0_scales, scales), torch.where(use_q0, q0_zeros, zeros)
    return q.to(torch.int32).reshape(out_f, in_f), scales, zeros


def _int4_fit(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit values of ``groups``  # [out, groups, size] rounded against the stored ``scales`` and ``zeros``
    # [out, groups], and whether each group comes back exactly.  # ([out, groups, size] float, [out, groups] bool)"""
    s, z = scales.float()[..., None], zeros.float()[..., None]
    q = ((groups - z) / s + 8).round().clamp(0, 15)
    return q, ((q - 8) * s + z == groups).all(dim=2)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weights :func:`quantize_int4`'s ``(q, scales, zeros)`` stand for.  # [out, in] in scales' dtype"""
    out_f, in_f = q.shape
    groups = q.float().reshape(out_f, in_f // group_size, group_size) - 8  # [out, groups, group_size]
    w = groups * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(out_f, in_f).to(scales.dtype)


def pad_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w``  # [out, in] with zero rows and columns appended up to a multiple of :data:`INT4_ROWS` rows and of
    ``group_size`` columns.  # [out_padded, in_padded]"""
    out_f, in_f = w.shape
    return F.pad(w, (0, -in_f % group_size, 0, -out_f % INT4_ROWS))


def pack_int8(q: torch.Tensor, scales: torch.Tensor, device: torch.device) -> QuantizedWeight:
    """:func:`quantize_int8`'s output as the int8 kernel's weight on ``device``."""
    return QuantizedWeight("int8", q.to(device).contiguous(), scales.to(device), q.shape[0], q.shape[1])


def pack_int4(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    shape: tuple[int, int],
    device: torch.device,
) -> QuantizedWeight:
    """:func:`quantize_int4`'s output for a weight of ``shape`` (padded by :func:`pad_int4` to ``q``'s shape) as the
    int4 kernel's weight, packed on ``device`` in its layout."""
    q = q.to(device)
    out_p, in_p = q.shape
    if device.type == "cuda":
        inner_k_tiles = next(t for t in (8, 4, 2) if in_p % (t * 16) == 0)  # as many as the inputs allow
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [out_p, in_p / 2], two values a byte
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scales_zeros = torch.stack([scales.to(device), zeros.to(device)], dim=-1)  # [out_p, groups, 2]
    return QuantizedWeight(
        "int4",
        packed,
        scales_zeros.transpose(0, 1).contiguous(),  # [groups, out_p, 2]
        shape[0],
        shape[1],
        group_size,
        pad_in=in_p - shape[1],
        pad_out=out_p - shape[0],
        cuda=device.type == "cuda",
    )


def blocks_serve(scheme: str, group_size: int, device: torch.device) -> bool:
    """Whether our CPU kernels (:mod:`specinfer.kernels.cpu_qgemm`) multiply ``scheme`` on ``device``: a CPU they
    run on, int8, or int4 in groups of 32 (their block)."""
    if device.type != "cpu" or scheme not in ("int8", "int4") or (scheme == "int4" and group_size != cpu_qgemm.BLOCK):
        return False
    return cpu_qgemm.library() is not None


def pack_blocks(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    """``w``  # [out, in] on the CPU quantized by ``scheme`` in our CPU kernels' layout, its inputs padded with zero
    weights to whole blocks of 32: int4 in groups of 32 rounded as PyTorch's layout is, int8 with a scale per block
    of 32 (llama.cpp's Q8_0; PyTorch's int8 has one per row)."""
    out_f, in_f = w.shape
    padded = F.pad(w, (0, -in_f % cpu_qgemm.BLOCK))  # [out, in_padded]
    if scheme == "int8":
        packed, block_scales = cpu_qgemm.quantize_int8(padded)
    else:
        packed, block_scales = cpu_qgemm.pack_int4(*quantize_int4(padded, cpu_qgemm.BLOCK))
    group = cpu_qgemm.BLOCK if scheme == "int4" else 0
    return QuantizedWeight(scheme, packed, block_scales, out_f, in_f, group, blocks_dtype=w.dtype)


def quantize(
    w: torch.Tensor, scheme: str, group_size: int, device: torch.device, blocks: bool | None = None
) -> QuantizedWeight:
    """``w``  # [out, in] quantized by ``scheme`` (``int8`` or ``int4`` with ``group_size``), packed for ``device``'s
    kernels and kept where ``w`` is (offloading quantizes for the GPU in host memory). ``blocks``: our CPU kernels'
    layout (True), PyTorch's (False), or ours where they serve (None: :func:`blocks_serve`)."""
    keep = w.device
    if blocks if blocks is not None else blocks_serve(scheme, group_size, device):
        return pack_blocks(w.cpu(), scheme).map(lambda t: t.to(keep))
    w = w.to(device)
    if scheme == "int8":
        return pack_int8(*quantize_int8(w), device).map(lambda t: t.to(keep))
    q, scales, zeros = quantize_int4(pad_int4(w, group_size), group_size)
    return pack_int4(q, scales, zeros, group_size, (w.shape[0], w.shape[1]), device).map(lambda t: t.to(keep))


def quantize_weights(weights: ModelWeights, scheme: str, group_size: int, device: torch.device) -> ModelWeights:
    """``weights`` with every decoder layer's :data:`LAYER_MATRICES` quantized (:func:`quantize`), layer by layer
    (each plain matrix is dropped as its layer is done); the rest unchanged. ``none``: ``weights`` itself."""
    if scheme == "none":
        return weights
    layers = [
        dataclasses.replace(
            layer, **{name: quantize(getattr(layer, name), scheme, group_size, device) for name in LAYER_MATRICES}
        )
        for layer in weights.layers
    ]
    return dataclasses.replace(weights, layers=layers)


def quantize_head(weights: ModelWeights, scheme: str, device: torch.device) -> ModelWeights:
    """``weights`` with, where the layers are quantized (``scheme`` not ``none``) and our CPU kernels serve int8 on
    ``device``, the LM head also kept int8 for the model's own logits beside its plain copy (``logits_head``; as
    llama.cpp's files keep it in Q8_0: on SmolLM2-135M the bf16 head took 3.3 ms of a 23 ms token). Draft heads keep
    folding the plain one. Else ``weights`` itself."""
    if scheme == "none" or not blocks_serve("int8", 0, device):
        return weights
    return dataclasses.replace(weights, logits_head=quantize(weights.lm_head, "int8", 0, device))


def slow_on_cpu(scheme: str, group_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``scheme``'s kernels take PyTorch's slow path: on a CPU our kernels do not serve
    (:func:`blocks_serve`), activations other than bfloat16 (measured on an AVX2 EPYC, torch 2.13: a [2048, 2048]
    int8 product of one row took 3.1 ms in fp32 and 0.24 ms in bf16, the plain fp32 product 0.7 ms)."""
    if scheme == "none" or device.type != "cpu" or blocks_serve(scheme, group_size, device):
        return False
    return dtype != torch.bfloat16


def check_quantize(scheme: str, group_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """:class:`InvalidArgument` naming ``quantize`` unless ``scheme`` runs on ``device`` with activations in
    ``dtype``: a known refusal (int4 on CUDA outside bfloat16), else one small product on the device compared with
    its reference, so that a kernel this PyTorch lacks there is refused before the model loads."""
    if scheme not in QUANTIZE_CHOICES:
        raise InvalidArgument(FIELD, f"must be one of {', '.join(QUANTIZE_CHOICES)}, got {scheme!r}")
    if scheme == "none":
        return
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidArgument(FIELD, f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgument(FIELD, f"quantized products run on cpu and cuda devices, not {device}")
    if scheme == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise InvalidArgument(FIELD, "int4 on CUDA needs --dtype bfloat16 (PyTorch's CUDA int4 kernel takes bf16)")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 2 * group_size + 8, generator=gen).to(dtype)  # padded both ways under int4
    x = torch.randn(3, w.shape[1], generator=gen).to(dtype)
    try:
        got = quantize(w, scheme, group_size, device).linear(x.to(device)).float().cpu()  # [3, 48]
    except (RuntimeError, NotImplementedError) as exc:
        raise InvalidArgument(
            FIELD, f"{scheme} products do not run on {device} in {dtype} with torch {torch.__version__}: {exc}"
        ) from None
    want = F.linear(x.float(), reference_weight(w, scheme, group_size).float())
    if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
        raise InvalidArgument(FIELD, f"{scheme} products on {device} in {dtype} disagree with their reference")


def reference_weight(w: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    """The plain weight ``[out, in]`` that ``scheme`` quantizes ``w``  # [out, in] to: what its kernel multiplies by
    (the reference of every quantized product)."""
    if scheme == "int8":
        return dequantize_int8(*quantize_int8(w))
    q, scales, zeros = quantize_int4(pad_int4(w, group_size), group_size)
    return dequantize_int4(q, scales, zeros, group_size)[: w.shape[0], : w.shape[1]]
