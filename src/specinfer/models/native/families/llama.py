"""The Llama family: Llama 1/2/3, Mistral, Qwen2, Qwen3 and Phi-3. RMSNorm before each sublayer,
RoPE, SwiGLU MLP; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm on each query and key head, and Phi-3
ships q/k/v and gate/up fused in its checkpoint (the layout our weights use anyway, read by name:
:func:`fused_projection`). Gemma (:mod:`.gemma`) reads its weights with this module's names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from specinfer.models.native.families.base import Blocks
from specinfer.models.native.spec import ModelSpec, UnsupportedModel, runnable_rope_type
from specinfer.models.native.weights import LayerWeights, ModelWeights, Placement, fused_projection, strip

if TYPE_CHECKING:
    from specinfer.models.native.model import NativeModel

Norm = Callable[[torch.Tensor], torch.Tensor]  # how a norm weight is placed (Gemma: as the fp32 1 + weight)


@dataclass(frozen=True)
class LlamaFamily:
    """One model_type of the Llama family; its fields say how it differs from Llama."""

    model_type: str
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # an RMSNorm over head_dim on every query and key head, before RoPE (Qwen3)
    # without layer_types, a sliding window on the layers from max_window_layers on (Qwen2/3); else on all
    windows_from_max_window_layers: bool = False
    rope: ClassVar[bool] = True
    gated_mlp: ClassVar[bool] = True

    def spec(self, cfg: dict) -> ModelSpec:
        rope_type = _rope_type(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelSpec(
            arch=self.model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias or bool(cfg.get("attention_bias", False)),
            rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
            layer_windows=self._layer_windows(cfg),
            rope_type=rope_type,
            qk_norm=self.qk_norm,
            partial_rotary_factor=_partial_rotary_factor(cfg),
            rope_switch=_rope_switch(cfg) if rope_type == "longrope" else None,
        )

    def _layer_windows(self, cfg: dict) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention), as transformers sets it:
        ``sliding_window`` for the layers ``layer_types`` marks ``sliding_attention``; without
        ``layer_types``, the layers from ``max_window_layers`` on (Qwen2/Qwen3) or all (the others)."""
        layers = int(cfg["num_hidden_layers"])
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if not sliding:
            return (None,) * layers
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            first = int(cfg.get("max_window_layers") or 0) if self.windows_from_max_window_layers else 0
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return tuple(int(sliding) if t == "sliding_attention" else None for t in layer_types)

    def weights(self, spec: ModelSpec, state: dict[str, torch.Tensor], place: Placement) -> ModelWeights:
        s = strip(state, ("model.",))
        layers = [layer_weights(s, i, spec, place, place, "post_attention_layernorm") for i in range(spec.layers)]
        return model_weights(s, state.get("lm_head.weight"), spec, place, place, layers)

    def blocks(self, spec: ModelSpec, dtype: torch.dtype) -> Blocks:
        return Blocks(embed=_embed, layer=_layer, final=_final, qk_norm=_qk_norm if spec.qk_norm else None)


LLAMA = LlamaFamily("llama")
MISTRAL = LlamaFamily("mistral")
QWEN2 = LlamaFamily("qwen2", qkv_bias=True, windows_from_max_window_layers=True)
QWEN3 = LlamaFamily("qwen3", qk_norm=True, windows_from_max_window_layers=True)
PHI3 = LlamaFamily("phi3")


def _rope_type(cfg: dict) -> str:
    """The RoPE variant of a Llama-family config; raises :class:`UnsupportedModel` for what the native blocks cannot
    run."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg.get('hidden_act')!r} (native Llama blocks use SwiGLU)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias (native Llama blocks have no MLP biases; the reference backend runs it)")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    return runnable_rope_type(rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type"))


def _partial_rotary_factor(cfg: dict) -> float:
    """Fraction of head_dim that RoPE rotates (transformers 5 keeps it in rope_parameters, older configs at the top)."""
    return float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def _rope_switch(cfg: dict) -> int:
    """The sequence length past which a LongRoPE config's long factors apply."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    switch = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not switch:
        raise UnsupportedModel("LongRoPE config without original_max_position_embeddings")
    return int(switch)


def layer_weights(
    s: dict[str, torch.Tensor], i: int, spec: ModelSpec, place: Placement, norm: Norm, mlp_norm: str
) -> LayerWeights:
    """Decoder layer ``i`` named as Llama's (``s``: the state dict without the model's prefix); ``norm``
    places the norm weights, ``mlp_norm`` names the norm before the MLP (Llama's post_attention_layernorm;
    Gemma's of that name is on the attention's output)."""
    p = f"layers.{i}."
    a = p + "self_attn."
    qkv_w, qkv_b = fused_projection(s, a, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    up_w, _ = fused_projection(s, p + "mlp.", "gate_up_proj", ("gate_proj", "up_proj"))
    return LayerWeights(
        qkv_w=place(qkv_w),
        qkv_b=place(qkv_b),
        o_w=place(s[a + "o_proj.weight"]),
        o_b=place(s.get(a + "o_proj.bias")),
        norm1_w=norm(s[p + "input_layernorm.weight"]),
        norm1_b=None,
        norm2_w=norm(s[p + mlp_norm + ".weight"]),
        norm2_b=None,
        up_w=place(up_w),
        up_b=None,
        down_w=place(s[p + "mlp.down_proj.weight"]),
        down_b=None,
        q_norm_w=norm(s[a + "q_norm.weight"]) if spec.qk_norm else None,
        k_norm_w=norm(s[a + "k_norm.weight"]) if spec.qk_norm else None,
    )


def model_weights(
    s: dict[str, torch.Tensor],
    head: torch.Tensor | None,
    spec: ModelSpec,
    place: Placement,
    norm: Norm,
    layers: list[LayerWeights],
) -> ModelWeights:
    """The weights of ``layers`` with the embedding and final norm named as Llama's, and the LM head
    ``head`` (None, or tied embeddings: the embedding table)."""
    embed = place(s["embed_tokens.weight"])
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm_w=norm(s["norm.weight"]),
        final_norm_b=None,
        lm_head=embed if head is None or spec.tie_embeddings else place(head),
    )


def _embed(m: NativeModel, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return h


def _layer(m: NativeModel, i, layer, h, rope, cache_rows, meta, pool) -> torch.Tensor:
    eps = m.spec.norm_eps
    h = h + m.attention(i, layer, F.rms_norm(h, m.hidden_shape, layer.norm1_w, eps), rope, cache_rows, meta, pool)
    gate_up = m.linear(F.rms_norm(h, m.hidden_shape, layer.norm2_w, eps), layer.up_w)  # [T, 2 * intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return h + m.reduce(m.linear(F.silu(gate) * up, layer.down_w))


def _final(m: NativeModel, h: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(h, m.hidden_shape, m.w.final_norm_w, m.spec.norm_eps)


def _qk_norm(
    m: NativeModel, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: each query and key head RMS-normalized over head_dim, one weight for all heads."""
    eps, dims = m.spec.norm_eps, m.head_shape
    return F.rms_norm(q, dims, layer.q_norm_w, eps), F.rms_norm(k, dims, layer.k_norm_w, eps)
