"""Fused CPU decoder layers: a Llama-family model's every layer in one C call per decode or verify step
(:mod:`specinfer.kernels.cpu_layers`), where the per-operation path costs about 60 dispatched PyTorch operations a
layer (BENCHMARKS.md, "Fused CPU decoder layers").

:func:`build` decides once per model whether the C layers can run it, and :class:`FusedLayers` runs the steps they
serve: every request's rows of the step at most 64, decode, verify and prompts alike (the row-by-row attention's;
longer prompts and chunks run per operation, :func:`specinfer.kernels.cpu_attention.row_by_row`). A mixed step is
split by the runner (:func:`specinfer.models.native.step.split_for_fused`), so that a row takes the same path
whatever else is in its batch: its result, bit for bit, depends on the row alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specinfer.kernels import TreeAttentionMetadata, cpu_attention, cpu_layers, cpu_qgemm
from specinfer.models.native.families import llama
from specinfer.models.native.kv_pool import PoolTensors
from specinfer.models.native.offload import ResidentLayers
from specinfer.models.native.spec import ModelSpec

if TYPE_CHECKING:
    from specinfer.models.native.backend import NativeOptions
    from specinfer.models.native.model import NativeModel

log = logging.getLogger(__name__)


# fp32 weights (or bf16 without AMX) on an AVX-512 CPU: the most a step's rows may cost in the C products beyond one
# row's, in multiply-adds a layer, before PyTorch's operations take the step. Their GEMMs (MKL, oneDNN) multiply many
# rows faster than the C tiles, which compute every row (about 30 GMAC/s a core in fp32; BENCHMARKS.md, "The fused
# layers on AVX-512 and AMX"), and their layer costs about 0.3 ms of dispatch more (60 operations): 0.3 ms at ~50
# GMAC/s (two cores) is 15 M.
EXTRA_ROW_MACS = 15_000_000


def row_cap(spec: ModelSpec, kind: int, capability: str, amx: bool) -> int | None:
    """The most rows of a step the C layers take (a larger step runs per operation, all of its rows, the LM head's
    too), or None for no cap: on AVX2 CPUs (the C tiles are the fastest products there), for our int4/int8 layouts
    (PyTorch has no kernel of its own for them) and for bf16 weights on AMX (``amx``: the C library's tiles serve,
    :mod:`specinfer.kernels.cpu_qgemm`; a 16-row product costs about a one-row one there). At least 1 (a decode step)
    and at most :data:`~specinfer.kernels.cpu_attention.MAX_ROWS`. ``kind``: the layers' weight kind
    (:func:`~specinfer.kernels.cpu_layers.weight_kind`); ``capability``: PyTorch's CPU capability (``AVX2``,
    ``AVX512``)."""
    if kind in (cpu_layers.INT4, cpu_layers.INT8) or capability == "AVX2" or (kind == cpu_layers.DENSE_BF16 and amx):
        return None
    return max(1, min(cpu_attention.MAX_ROWS, 1 + EXTRA_ROW_MACS // layer_macs(spec)))


def layer_macs(spec: ModelSpec) -> int:
    """A decoder layer's multiply-adds a row in its products: q/k/v, o, gate and up, down."""
    d, hidden = spec.head_dim, spec.hidden_size
    return hidden * (spec.heads + 2 * spec.kv_heads) * d + spec.heads * d * hidden + 3 * hidden * spec.intermediate_size


def dense_candidate(spec: ModelSpec, device: torch.device, options: NativeOptions) -> bool:
    """Whether the C layers may read ``spec``'s plain weights on ``device`` under ``options`` (decided before the
    weights are planned: the backend then keeps them out of oneDNN's packed layout, which the C layers cannot read)."""
    if device.type != "cpu" or options.attention == "triton" or options.gemm == "packed":  # packed: asked for
        return False
    if not isinstance(spec.family, llama.LlamaFamily):
        return False
    return cpu_qgemm.library() is not None  # built only on x86-64 CPUs with AVX2 or AVX-512 (cpu_qgemm._gate)


def why_not(model: NativeModel) -> str | None:
    """Why the C layers cannot run ``model``, or None where they can."""
    from specinfer.models.native.model import NativeModel

    spec, w = model.spec, model.w
    if cpu_qgemm.library() is None:
        return "no C kernels here"
    if model.attention_impl == "triton":
        return "the Triton attention asked for"
    if type(model) is not NativeModel or not isinstance(model.layers, ResidentLayers):
        return "a tensor-parallel shard or offloaded layers"
    if model.blocks.layer is not llama._layer or model.rope is None or model.rope.local_inv_freq is not None:
        return f"{spec.arch} layers (the C layers are the Llama family's)"
    if w.embed.device.type != "cpu" or w.embed.dtype not in (torch.float32, torch.bfloat16):
        return f"{w.embed.device.type} {w.embed.dtype}"
    if len(set(spec.layer_windows)) > 8:
        return "more than 8 distinct sliding windows"
    if spec.head_dim % 8 or spec.head_dim > 512 or spec.heads % spec.kv_heads:
        return f"head_dim {spec.head_dim}"
    for layer in w.layers:
        if layer.up_b is not None or layer.down_b is not None:
            return "MLP biases"
        for m in (layer.qkv_w, layer.o_w, layer.up_w, layer.down_w):
            if isinstance(m, torch.Tensor) and m.is_mkldnn:
                return "weights in oneDNN's packed layout (--gemm plain keeps them plain)"
            if cpu_layers.weight_kind(m) is None:
                return f"a {type(m).__name__} weight the C layers do not read (dense ones: on AVX2 or AVX-512 CPUs)"
    return None


def build(model: NativeModel) -> FusedLayers | None:
    """The C layers of ``model``, or None where they cannot run it (the reason logged)."""
    reason = why_not(model)
    if reason is not None:
        log.info("fused CPU decoder layers off for this model: %s", reason)
        return None
    return FusedLayers(model)


class FusedLayers:
    """A model's layer records (weights' and norms' addresses, built once; the KV pool's bound at the first step on
    a pool) and the step's call."""

    def __init__(self, model: NativeModel) -> None:
        spec = model.spec
        self.dtype = model.w.embed.dtype
        self.inv_freq = model.rope.inv_freq.float().contiguous()  # [rotary_dim / 2]
        self.rope_scale = model.rope.scale
        self._keep: list[torch.Tensor] = []  # what the records point at
        windows = tuple(sorted(set(spec.layer_windows), key=lambda x: -1 if x is None else x))
        # the step's visible-key lists, one per distinct window (0: none), which the C code builds from its segments
        self.windows = torch.tensor([w or 0 for w in windows], dtype=torch.int32)
        self.records = (cpu_layers.Layer * spec.layers)()
        for i, layer in enumerate(model.w.layers):
            r = self.records[i]
            for name, m, b in (("qkv", layer.qkv_w, layer.qkv_b), ("o", layer.o_w, layer.o_b)):
                setattr(r, name, cpu_layers.weight(m, cpu_layers.weight_kind(m), b, self._keep))
            for name, m in (("up", layer.up_w), ("down", layer.down_w)):
                setattr(r, name, cpu_layers.weight(m, cpu_layers.weight_kind(m), None, self._keep))
            for name, norm in (("norm1", layer.norm1_w), ("norm2", layer.norm2_w)):
                setattr(r, name, self._address(norm))
            r.q_norm, r.k_norm = self._address(layer.q_norm_w), self._address(layer.k_norm_w)
            r.keys = windows.index(spec.layer_windows[i])
        scale = model._sm_scale if model._sm_scale is not None else spec.head_dim**-0.5
        self.shape = cpu_layers.Shape(
            spec.hidden_size, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate_size, spec.rotary_dim,
            int(self.dtype == torch.bfloat16), 0, spec.norm_eps, scale, spec.attn_softcap or 0.0,
        )  # fmt: skip
        self._pool: tuple[int, int] | None = None  # the bound pool's K and V addresses
        head = model.w.lm_head if model.w.logits_head is None else model.w.logits_head
        # the LM head (dense, or int8 kept for the logits) through the C products too, so that logits are row-invariant
        # as the layers are, and on the kernels' team: on OpenMP's, its worker spun into the next step beside the team
        head_kind = cpu_layers.weight_kind(head)
        self.head_weight = None if head_kind is None else cpu_layers.weight(head, head_kind, None, self._keep)
        # the final norm in C too (microseconds a step less than a dispatched operation), for every path of the model
        final = model.w.final_norm_w
        self.final_norm = final.detach().float().contiguous() if model.blocks.final is llama._final else None
        self.eps = spec.norm_eps
        # None: every step the C layers can serve (a test may lower it)
        kind = cpu_layers.weight_kind(model.w.layers[0].up_w)
        self.max_rows = row_cap(spec, kind, torch.backends.cpu.get_cpu_capability(), cpu_layers.amx())

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows (or an LM head call of that many) is within :attr:`max_rows`."""
        return self.max_rows is None or rows <= self.max_rows

    def norm(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """The model's final norm of ``h``  # [T, hidden] (:attr:`final_norm` set)."""
        return cpu_layers.rms_norm_rows(h, self.final_norm, self.eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        """The LM head on final-normed ``h``  # [N, hidden] (:attr:`head_weight` set)."""
        return cpu_layers.weight_linear(h, self.head_weight)

    def serves_head(self, h: torch.Tensor, logit_rows: torch.Tensor) -> bool:
        """Whether :meth:`head` computes the logits of ``h``  # [T, hidden] at ``logit_rows``  # [N] int64."""
        cpu = h.device.type == "cpu" and logit_rows.device.type == "cpu" and logit_rows.dtype == torch.int64
        ours = self.final_norm is not None and self.head_weight is not None and self.takes(logit_rows.shape[0])
        return cpu and ours and h.dtype in (torch.float32, torch.bfloat16) and h.is_contiguous()

    def head(self, h: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        """:meth:`norm` then :meth:`logits` of ``h``'s rows ``logit_rows`` in one C call (:meth:`serves_head`)."""
        return cpu_layers.final_logits(h, logit_rows.contiguous(), self.final_norm, self.eps, self.head_weight)

    def _address(self, x: torch.Tensor | None) -> int:
        if x is None:
            return 0
        x = x.detach().float().contiguous()
        self._keep.append(x)
        return x.data_ptr()

    def serves(self, h: torch.Tensor, meta: TreeAttentionMetadata | cpu_layers.Segments) -> bool:
        """Whether this step runs here (see the module); ``meta`` of :class:`~cpu_layers.Segments` come only for steps
        the runner found served (:func:`specinfer.models.native.step.fused_segments`)."""
        if isinstance(meta, cpu_layers.Segments):
            return True
        # every row a query row (a padded step's padding tokens are not: its runner pads for CUDA graphs)
        rows = h.shape[0] == sum(meta.num_queries) and self.takes(h.shape[0])
        return h.device.type == "cpu" and h.dtype == self.dtype and rows and cpu_layers.serves_rows(meta)

    def run(
        self,
        h: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        cache_rows: torch.Tensor,  # [T] int64
        meta: TreeAttentionMetadata | cpu_layers.Segments,
        pool: PoolTensors,
    ) -> torch.Tensor:  # [T, hidden]
        """Every layer over ``h`` (a new tensor: the embedding's), K/V into ``pool``."""
        if self._pool != (pool.k.data_ptr(), pool.v.data_ptr()):
            self._bind(pool)
        segments = meta if isinstance(meta, cpu_layers.Segments) else cpu_layers.Segments.of_metadata(meta)
        return cpu_layers.run(
            self.shape, self.records, h.contiguous(), positions, self.inv_freq, self.rope_scale, cache_rows, segments,
            self.windows,
        )  # fmt: skip

    def _bind(self, pool: PoolTensors) -> None:
        contiguous = pool.k.is_contiguous() and pool.v.is_contiguous()
        if not contiguous or pool.k.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("the fused CPU layers need contiguous fp32 or bf16 KV pools")
        for i in range(len(self.records)):
            self.records[i].k_cache = pool.k[i].data_ptr()
            self.records[i].v_cache = pool.v[i].data_ptr()
        self.shape.kv_bf16 = int(pool.k.dtype == torch.bfloat16)
        self._pool = (pool.k.data_ptr(), pool.v.data_ptr())
