"""Reading a checkpoint's safetensors into plain tensors, fused for fewer matmuls: the tensors every family fills
(:class:`ModelWeights`) and the naming helpers the families share; which names a family reads is its own
(:mod:`specinfer.models.native.families`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

from specinfer.models.native.quant import QuantizedWeight
from specinfer.models.native.spec import ModelSpec

Matrix = torch.Tensor | QuantizedWeight  # a decoder layer's projection: plain, or kept quantized (:mod:`.quant`)


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
    LayerNorm weight and bias, ``up`` is fc1. The four projections (``qkv_w``, ``o_w``, ``up_w``, ``down_w``) are
    plain tensors or, quantized, :class:`QuantizedWeight` of the same ``shape``."""

    qkv_w: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_b: torch.Tensor | None
    o_w: Matrix  # [hidden, heads * head_dim]
    o_b: torch.Tensor | None
    norm1_w: torch.Tensor
    norm1_b: torch.Tensor | None
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor | None
    up_w: Matrix  # Llama: [2 * intermediate, hidden] (gate rows first); OPT: fc1 [ffn, hidden]
    up_b: torch.Tensor | None
    down_w: Matrix  # [hidden, intermediate]
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
    # [vocab, word_embed_dim] the LM head kept int8 for the model's own logits where the layers are quantized and our
    # CPU kernels serve (quant.quantize_weights); None: lm_head. Draft heads fold and slice the plain lm_head.
    logits_head: QuantizedWeight | None = None

    def matrices(self) -> list[torch.Tensor]:
        """Every plain weight the forward pass multiplies activations by (``x @ w.T``); quantized ones have their
        one kernel (:mod:`.quant`)."""
        per_layer = [w for layer in self.layers for w in (layer.qkv_w, layer.o_w, layer.up_w, layer.down_w)]
        every = [*per_layer, self.lm_head, *(w for w in (self.project_in, self.project_out) if w is not None)]
        return [w for w in every if isinstance(w, torch.Tensor)]


Weights = TypeVar("Weights", ModelWeights, LayerWeights)


def map_tensors(weights: Weights, fn: Callable[[torch.Tensor], torch.Tensor]) -> Weights:
    """``weights`` (a model's: its layers too; or one layer's) with ``fn`` applied to every tensor, those a quantized
    weight holds included (a copy to a device, pinned memory, an empty copy); None stays None. Tensors that are one
    (tied embeddings) stay one."""
    done: dict[int, torch.Tensor | QuantizedWeight] = {}

    def apply(value):
        if isinstance(value, list):  # ModelWeights.layers
            return [map_tensors(layer, fn) for layer in value]
        if not isinstance(value, torch.Tensor | QuantizedWeight):
            return value
        if id(value) not in done:
            done[id(value)] = fn(value) if isinstance(value, torch.Tensor) else value.map(fn)
        return done[id(value)]

    return dataclasses.replace(
        weights, **{f.name: apply(getattr(weights, f.name)) for f in dataclasses.fields(weights)}
    )


def named_tensors(layer: LayerWeights) -> dict[str, torch.Tensor]:
    """Every tensor of ``layer`` by name, a quantized weight's as ``field.part`` (fields that are None left out)."""
    out = {}
    for f in dataclasses.fields(layer):
        value = getattr(layer, f.name)
        if isinstance(value, QuantizedWeight):
            out.update({f"{f.name}.{part}": t for part, t in value.tensors().items()})
        elif value is not None:
            out[f.name] = value
    return out


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
