"""Reading a checkpoint's safetensors into plain tensors, fused for fewer matmuls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specinfer.models.native.spec import ModelSpec


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards an index names."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        f = root / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (native backend reads safetensors only)")
        state.update(load_file(str(f)))
    return state


@dataclass
class LayerWeights:
    """One decoder layer. Llama family: norm1/norm2 are RMSNorm weights (before attention and
    before the MLP), ``up`` is the fused gate+up projection, Qwen3 adds the per-head query and key
    RMSNorm weights. Gemma: as Llama, plus the norms of the attention's and the MLP's outputs; every
    Gemma norm weight is stored as the fp32 ``1 + weight`` it multiplies by. OPT: norms carry
    LayerNorm weight and bias, ``up`` is fc1."""

    qkv_w: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [hidden, heads * head_dim]
    o_b: torch.Tensor | None
    norm1_w: torch.Tensor
    norm1_b: torch.Tensor | None
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor | None
    up_w: torch.Tensor  # Llama: [2 * intermediate, hidden] (gate rows first); OPT: fc1 [ffn, hidden]
    up_b: torch.Tensor | None
    down_w: torch.Tensor  # [hidden, intermediate]
    down_b: torch.Tensor | None
    q_norm_w: torch.Tensor | None = None  # Qwen3, Gemma 3 [head_dim], shared by every query head
    k_norm_w: torch.Tensor | None = None  # Qwen3, Gemma 3 [head_dim], shared by every key head
    post_attn_norm_w: torch.Tensor | None = None  # Gemma [hidden] fp32, on the attention's output
    post_mlp_norm_w: torch.Tensor | None = None  # Gemma [hidden] fp32, on the MLP's output


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, word_embed_dim]
    layers: list[LayerWeights]
    final_norm_w: torch.Tensor | None
    final_norm_b: torch.Tensor | None
    lm_head: torch.Tensor  # [vocab, word_embed_dim]
    positions: torch.Tensor | None = None  # OPT learned positions [max_positions + 2, hidden]
    project_in: torch.Tensor | None = None  # OPT [hidden, word_embed_dim]
    project_out: torch.Tensor | None = None  # OPT [word_embed_dim, hidden]

    def matrices(self) -> list[torch.Tensor]:
        """Every weight the forward pass multiplies activations by (``x @ w.T``)."""
        per_layer = [w for layer in self.layers for w in (layer.qkv_w, layer.o_w, layer.up_w, layer.down_w)]
        return [*per_layer, self.lm_head, *(w for w in (self.project_in, self.project_out) if w is not None)]


def _strip(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p) :]
                break
        out[k] = v
    return out


def build_weights(
    spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device=device, dtype=dtype).contiguous()

    if spec.arch == "opt":
        return _opt_weights(spec, _strip(state, ("model.decoder.", "decoder.")), t)
    if spec.gemma:
        # Gemma norms multiply by 1 + w, in fp32 (transformers: ``norm(x.float()) * (1.0 + w.float())``)
        def norm(x: torch.Tensor) -> torch.Tensor:
            return (1.0 + x.float()).to(device).contiguous()

        # gemma3 (multimodal) nests the text model: language_model.model.* on the hub, model.language_model.* in
        # transformers 5
        s = _strip(state, ("language_model.model.", "model.language_model.", "model."))
        head = state.get("lm_head.weight", state.get("language_model.lm_head.weight"))
    else:
        norm = t
        s = _strip(state, ("model.",))
        head = state.get("lm_head.weight")
    # Llama's post_attention_layernorm comes before the MLP; Gemma's is on the attention's output
    mlp_norm = "pre_feedforward_layernorm" if spec.gemma else "post_attention_layernorm"
    layers = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        qkv_w, qkv_b = _fused(s, a, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        up_w, _ = _fused(s, p + "mlp.", "gate_up_proj", ("gate_proj", "up_proj"))
        layers.append(
            LayerWeights(
                qkv_w=t(qkv_w),
                qkv_b=t(qkv_b),
                o_w=t(s[a + "o_proj.weight"]),
                o_b=t(s.get(a + "o_proj.bias")),
                norm1_w=norm(s[p + "input_layernorm.weight"]),
                norm1_b=None,
                norm2_w=norm(s[p + mlp_norm + ".weight"]),
                norm2_b=None,
                up_w=t(up_w),
                up_b=None,
                down_w=t(s[p + "mlp.down_proj.weight"]),
                down_b=None,
                q_norm_w=norm(s[a + "q_norm.weight"]) if spec.qk_norm else None,
                k_norm_w=norm(s[a + "k_norm.weight"]) if spec.qk_norm else None,
                post_attn_norm_w=norm(s[p + "post_attention_layernorm.weight"]) if spec.gemma else None,
                post_mlp_norm_w=norm(s[p + "post_feedforward_layernorm.weight"]) if spec.gemma else None,
            )
        )
    embed = t(s["embed_tokens.weight"])
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm_w=norm(s["norm.weight"]),
        final_norm_b=None,
        lm_head=embed if head is None or spec.tie_embeddings else t(head),
    )


def _fused(
    s: dict[str, torch.Tensor], prefix: str, fused: str, parts: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias (None when any part lacks one) of the projection ``prefix + fused``, stored
    fused (Phi-3's ``qkv_proj``, ``gate_up_proj``, already in our row order) or as ``parts`` that
    are concatenated by rows in their order."""
    if prefix + fused + ".weight" in s:
        return s[prefix + fused + ".weight"], s.get(prefix + fused + ".bias")
    bias = [s.get(f"{prefix}{part}.bias") for part in parts]
    weight = torch.cat([s[f"{prefix}{part}.weight"] for part in parts])
    return weight, torch.cat(bias) if all(b is not None for b in bias) else None


def _opt_weights(spec: ModelSpec, s: dict[str, torch.Tensor], t) -> ModelWeights:
    layers = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        has_bias = a + "q_proj.bias" in s
        layers.append(
            LayerWeights(
                qkv_w=t(torch.cat([s[a + "q_proj.weight"], s[a + "k_proj.weight"], s[a + "v_proj.weight"]])),
                qkv_b=t(torch.cat([s[a + "q_proj.bias"], s[a + "k_proj.bias"], s[a + "v_proj.bias"]]))
                if has_bias
                else None,
                o_w=t(s[a + "out_proj.weight"]),
                o_b=t(s.get(a + "out_proj.bias")),
                norm1_w=t(s.get(p + "self_attn_layer_norm.weight")),
                norm1_b=t(s.get(p + "self_attn_layer_norm.bias")),
                norm2_w=t(s.get(p + "final_layer_norm.weight")),
                norm2_b=t(s.get(p + "final_layer_norm.bias")),
                up_w=t(s[p + "fc1.weight"]),
                up_b=t(s.get(p + "fc1.bias")),
                down_w=t(s[p + "fc2.weight"]),
                down_b=t(s.get(p + "fc2.bias")),
            )
        )
    embed = t(s["embed_tokens.weight"])
    head = s.get("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm_w=t(s.get("final_layer_norm.weight")) if spec.final_layer_norm else None,
        final_norm_b=t(s.get("final_layer_norm.bias")) if spec.final_layer_norm else None,
        lm_head=embed if head is None or spec.tie_embeddings else t(head),
        positions=t(s["embed_positions.weight"]),
        project_in=t(s.get("project_in.weight")),
        project_out=t(s.get("project_out.weight")),
    )
