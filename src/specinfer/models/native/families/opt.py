"""The OPT family: learned positions (no RoPE), LayerNorm with biases before (most sizes) or after
(opt-350m) each sublayer, an fc1/activation/fc2 MLP (ReLU), biases on every projection, and
``project_in`` / ``project_out`` where the word embeddings are narrower than the hidden states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from specinfer.models.native.families.base import Blocks
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import LayerWeights, ModelWeights, Placement, strip

if TYPE_CHECKING:
    from specinfer.models.native.model import NativeModel

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2
Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class OptFamily:
    """OPT (model_type ``opt``)."""

    model_type: str = "opt"
    rope: ClassVar[bool] = False
    gated_mlp: ClassVar[bool] = False

    def spec(self, cfg: dict) -> ModelSpec:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        before = bool(cfg.get("do_layer_norm_before", True))
        return ModelSpec(
            arch=self.model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            layers=layers,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(cfg["ffn_dim"]),
            max_positions=int(cfg["max_position_embeddings"]),
            norm_eps=1e-5,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),  # OPT ties by default, Llama does not
            qkv_bias=bool(cfg.get("enable_bias", True)),
            rope_theta=0.0,
            layer_windows=(None,) * layers,
            layer_norm_before=before,
            final_layer_norm=before and not cfg.get("_remove_final_layer_norm", False),
            activation=str(cfg.get("activation_function", "relu")),
        )

    def weights(self, spec: ModelSpec, state: dict[str, torch.Tensor], place: Placement) -> ModelWeights:
        s = strip(state, ("model.decoder.", "decoder."))
        embed = place(s["embed_tokens.weight"])
        head = s.get("lm_head.weight")
        return ModelWeights(
            embed=embed,
            layers=[_layer_weights(s, f"layers.{i}.", place) for i in range(spec.layers)],
            final_norm_w=place(s.get("final_layer_norm.weight")) if spec.final_layer_norm else None,
            final_norm_b=place(s.get("final_layer_norm.bias")) if spec.final_layer_norm else None,
            lm_head=embed if head is None or spec.tie_embeddings else place(head),
            positions=place(s["embed_positions.weight"]),
            project_in=place(s.get("project_in.weight")),
            project_out=place(s.get("project_out.weight")),
        )

    def blocks(self, spec: ModelSpec, dtype: torch.dtype) -> Blocks:
        # transformers, which knows every activation name, takes seconds to import: only for an unusual one
        if spec.activation == "relu":
            act = F.relu
        else:
            from transformers.activations import ACT2FN

            act = ACT2FN[spec.activation]
        layer = _pre_norm_layer if spec.layer_norm_before else _post_norm_layer
        return Blocks(embed=_embed, layer=partial(layer, act), final=_final, qk_norm=None)


OPT = OptFamily()


def _layer_weights(s: dict[str, torch.Tensor], p: str, place: Placement) -> LayerWeights:
    """The decoder layer whose names start with ``p``; norms carry LayerNorm weight and bias, ``up`` is fc1."""
    a = p + "self_attn."
    has_bias = a + "q_proj.bias" in s
    return LayerWeights(
        qkv_w=place(torch.cat([s[a + "q_proj.weight"], s[a + "k_proj.weight"], s[a + "v_proj.weight"]])),
        qkv_b=place(torch.cat([s[a + "q_proj.bias"], s[a + "k_proj.bias"], s[a + "v_proj.bias"]]))
        if has_bias
        else None,
        o_w=place(s[a + "out_proj.weight"]),
        o_b=place(s.get(a + "out_proj.bias")),
        norm1_w=place(s.get(p + "self_attn_layer_norm.weight")),
        norm1_b=place(s.get(p + "self_attn_layer_norm.bias")),
        norm2_w=place(s.get(p + "final_layer_norm.weight")),
        norm2_b=place(s.get(p + "final_layer_norm.bias")),
        up_w=place(s[p + "fc1.weight"]),
        up_b=place(s.get(p + "fc1.bias")),
        down_w=place(s[p + "fc2.weight"]),
        down_b=place(s.get(p + "fc2.bias")),
    )


def _embed(m: NativeModel, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, hidden]
    if m.w.project_in is not None:
        h = m.linear(h, m.w.project_in)
    return h + F.embedding(positions + POSITION_OFFSET, m.w.positions)


def _layer_norm(
    m: NativeModel, h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return F.layer_norm(h, m.hidden_shape, weight, bias, m.spec.norm_eps)


def _mlp(m: NativeModel, act: Activation, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    return m.reduce(m.linear(act(m.linear(x, layer.up_w, layer.up_b)), layer.down_w, layer.down_b))


def _pre_norm_layer(act: Activation, m: NativeModel, i, layer, h, rope, cache_rows, meta, pool) -> torch.Tensor:
    h = h + m.attention(i, layer, _layer_norm(m, h, layer.norm1_w, layer.norm1_b), rope, cache_rows, meta, pool)
    return h + _mlp(m, act, layer, _layer_norm(m, h, layer.norm2_w, layer.norm2_b))


def _post_norm_layer(act: Activation, m: NativeModel, i, layer, h, rope, cache_rows, meta, pool) -> torch.Tensor:
    h = _layer_norm(m, h + m.attention(i, layer, h, rope, cache_rows, meta, pool), layer.norm1_w, layer.norm1_b)
    return _layer_norm(m, h + _mlp(m, act, layer, h), layer.norm2_w, layer.norm2_b)


def _final(m: NativeModel, h: torch.Tensor) -> torch.Tensor:
    if m.w.final_norm_w is not None or m.w.final_norm_b is not None:
        h = _layer_norm(m, h, m.w.final_norm_w, m.w.final_norm_b)
    return h if m.w.project_out is None else m.linear(h, m.w.project_out)
