"""The Gemma family: Gemma 2 and 3 (text; ``gemma3`` nests it under text_config, beside a vision
tower we do not run). Embeddings scaled by sqrt(hidden), Gemma RMSNorms (fp32, ``1 + weight``,
folded into the weights at load) before and after both sublayers, GeGLU MLP, per-layer sliding
windows; Gemma 2 soft-caps attention scores and logits, Gemma 3 norms each query and key head and
gives its sliding-window (*local*) layers a RoPE base of their own. Weight names: Llama's
(:mod:`.llama`), plus the norms on the sublayers' outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from specinfer.models.native.families.base import Blocks
from specinfer.models.native.families.llama import layer_weights, model_weights
from specinfer.models.native.spec import ModelSpec, UnsupportedModel, runnable_rope_type
from specinfer.models.native.weights import LayerWeights, ModelWeights, Placement, strip

if TYPE_CHECKING:
    from specinfer.models.native.model import NativeModel

ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with tanh-approximated GELU, what every Gemma 2 / 3 uses
# What transformers 5's Gemma2Config / Gemma3TextConfig assume for a field a config.json leaves out
# (the hub's Gemma 3 4B-27B configs give their text_config a few fields only)
_SHARED_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
_GEMMA2_DEFAULTS = MappingProxyType(
    dict(
        _SHARED_DEFAULTS,
        vocab_size=256_000,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
)
_GEMMA3_DEFAULTS = MappingProxyType(
    dict(_SHARED_DEFAULTS, vocab_size=262_208, max_position_embeddings=131_072, final_logit_softcapping=None)
)


@dataclass(frozen=True)
class GemmaFamily:
    """One model_type of the Gemma family; its fields say how it differs from the others."""

    model_type: str
    # transformers' value of each field a config may leave out (not compared: a mapping has no hash)
    defaults: Mapping[str, object] = field(compare=False)
    window_pattern: int  # every n-th layer is global when a config lists no layer_types
    gemma3: bool  # Gemma 3: query/key norms, a RoPE base of the local layers' own, no attention soft-cap
    text_config: bool = False  # the text model's config is the config's text_config (the multimodal gemma3)
    # applies final_logit_softcapping: transformers' multimodal Gemma3ForConditionalGeneration caps no logits
    final_softcap: bool = True
    rope: ClassVar[bool] = True
    gated_mlp: ClassVar[bool] = True

    def spec(self, cfg: dict) -> ModelSpec:
        """Read as transformers 5 reads it, older layouts included (``rope_local_base_freq``,
        ``rope_scaling``, ``sliding_window_pattern`` at the top) and fields left to transformers' defaults."""
        cfg = {**self.defaults, **((cfg.get("text_config") or {}) if self.text_config else cfg)}
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or ACTIVATION
        if activation != ACTIVATION:
            raise UnsupportedModel(f"hidden_activation {activation!r} (native Gemma blocks use {ACTIVATION})")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModel("use_bidirectional_attention (an embedding model, not a causal LM)")
        layers = int(cfg["num_hidden_layers"])
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or self.window_pattern)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        sliding = cfg.get("sliding_window")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope, local_theta = self._rope(cfg)
        return ModelSpec(
            arch=self.model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            max_positions=int(cfg["max_position_embeddings"]),
            norm_eps=float(cfg["rms_norm_eps"]),
            tie_embeddings=bool(cfg["tie_word_embeddings"]),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            layer_windows=tuple(int(sliding) if t == "sliding_attention" and sliding else None for t in layer_types),
            rope_type=runnable_rope_type(rope.get("rope_type") or rope.get("type")),
            qk_norm=self.gemma3,
            activation=ACTIVATION,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            # Gemma 3's attention passes no soft-cap to the attention function whatever the config says
            attn_softcap=None if self.gemma3 else _positive(cfg.get("attn_logit_softcapping")),
            final_softcap=_positive(cfg.get("final_logit_softcapping")) if self.final_softcap else None,
            local_rope_theta=local_theta,
        )

    def _rope(self, cfg: dict) -> tuple[dict, float | None]:
        """RoPE parameters of the global layers, and the local layers' base (Gemma 3; None for Gemma 2,
        whose layers share one RoPE). transformers 5 keeps Gemma 3's per layer type in
        ``rope_parameters``; older configs have ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
        params = cfg.get("rope_parameters") or {}
        if not self.gemma3:
            return {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {}), **params}, None
        if "full_attention" in params:
            full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        else:
            full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if (local.get("rope_type") or "default") != "default":
            raise UnsupportedModel(f"scaled RoPE {local.get('rope_type')!r} on the sliding-window layers")
        return full, float(local.get("rope_theta", 10000.0))

    def weights(self, spec: ModelSpec, state: dict[str, torch.Tensor], place: Placement) -> ModelWeights:
        # Gemma norms multiply by 1 + w, in fp32 (transformers: ``norm(x.float()) * (1.0 + w.float())``)
        def norm(x: torch.Tensor) -> torch.Tensor:
            return (1.0 + x.float()).to(place.device).contiguous()

        # gemma3 (multimodal) nests the text model: language_model.model.* on the hub, model.language_model.* in
        # transformers 5
        s = strip(state, ("language_model.model.", "model.language_model.", "model."))
        layers = [
            dataclasses.replace(
                layer_weights(s, i, spec, place, norm, "pre_feedforward_layernorm"),
                post_attn_norm_w=norm(s[f"layers.{i}.post_attention_layernorm.weight"]),
                post_mlp_norm_w=norm(s[f"layers.{i}.post_feedforward_layernorm.weight"]),
            )
            for i in range(spec.layers)
        ]
        head = state.get("lm_head.weight", state.get("language_model.lm_head.weight"))
        return model_weights(s, head, spec, place, norm, layers)

    def blocks(self, spec: ModelSpec, dtype: torch.dtype) -> Blocks:
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (55.4256 -> 55.5 in bf16 for 3072)
        scale = float(torch.tensor(spec.hidden_size**0.5, dtype=dtype))

        def embed(m: NativeModel, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return h * scale

        return Blocks(embed=embed, layer=_layer, final=_final, qk_norm=_qk_norm if spec.qk_norm else None)


GEMMA2 = GemmaFamily("gemma2", _GEMMA2_DEFAULTS, window_pattern=2, gemma3=False)
GEMMA3_TEXT = GemmaFamily("gemma3_text", _GEMMA3_DEFAULTS, window_pattern=6, gemma3=True)
GEMMA3 = GemmaFamily("gemma3", _GEMMA3_DEFAULTS, window_pattern=6, gemma3=True, text_config=True, final_softcap=False)


def _positive(value: float | None) -> float | None:
    """A soft-cap setting: None or 0 mean none."""
    return float(value) if value else None


def _norm(m: NativeModel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension in fp32, times ``weight`` (the fp32 ``1 + w``), back in x's dtype."""
    return F.rms_norm(x.float(), weight.shape, weight, m.spec.norm_eps).to(x.dtype)


def _qk_norm(
    m: NativeModel, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(m, q, layer.q_norm_w), _norm(m, k, layer.k_norm_w)


def _layer(m: NativeModel, i, layer, h, rope, cache_rows, meta, pool) -> torch.Tensor:
    attn = m.attention(i, layer, _norm(m, h, layer.norm1_w), rope, cache_rows, meta, pool)  # [T, hidden], reduced
    h = h + _norm(m, attn, layer.post_attn_norm_w)
    gate_up = m.linear(_norm(m, h, layer.norm2_w), layer.up_w)  # [T, 2 * intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    mlp = m.reduce(m.linear(F.gelu(gate, approximate="tanh") * up, layer.down_w))  # [T, hidden]
    return h + _norm(m, mlp, layer.post_mlp_norm_w)


def _final(m: NativeModel, h: torch.Tensor) -> torch.Tensor:
    return _norm(m, h, m.w.final_norm_w)
