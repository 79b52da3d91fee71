"""Reading a checkpoint's safetensors into plain tensors, fused for fewer matmuls: the tensors every family fills
(:class:`ModelWeights`) and the naming helpers the families share; which names a family reads is its own
(:mod:`specinfer.models.native.families`)."""

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


@dataclass(frozen=True)
class Placement:
    """Where built weights go: each tensor, copied to ``dtype`` on ``device``, contiguous (None stays None)."""

    dtype: torch.dtype
    device: torch.device

    def __call__(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device=self.device, dtype=self.dtype).contiguous()


def build_weights(
    spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """``spec``'s weights from its checkpoint's ``state`` (:func:`read_state_dict`), named as its family names them
    (:mod:`specinfer.models.native.families`), in ``dtype`` on ``device``."""
    return spec.family.weights(spec, state, Placement(dtype, device))


def strip(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``state`` with each name's first matching prefix of ``prefixes`` (tried in order) removed."""
    out = {}
    for k, v in state.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p) :]
                break
        out[k] = v
    return out


def fused_projection(
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
