"""What the native runtime needs to know about a checkpoint, read from its config.json by its family
(:mod:`specinfer.models.native.families`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specinfer.models.native.families.base import Family


class UnsupportedModel(ValueError):
    """The native runtime cannot run this checkpoint; the reference backend can."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a Llama-family, Gemma or OPT checkpoint.

    Terms: the *rotary dimensions* are the leading ``rotary_dim`` of each head's ``head_dim`` that
    RoPE rotates (all of them unless the config sets ``partial_rotary_factor``); the *RoPE switch*
    of a LongRoPE config is its ``original_max_position_embeddings``, past which transformers
    recomputes every position with the long factors instead of the short ones. A *sliding window*
    of w lets a token attend to the w latest tokens, itself included (:mod:`specinfer.kernels.metadata`);
    a *Gemma RMSNorm* computes in fp32 and multiplies by ``1 + weight``."""

    arch: str  # its config's model_type, one the family registry knows
    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    layer_windows: tuple[int | None, ...]  # per decoder layer, its sliding window; None: full attention
    rope_type: str = "default"  # Llama family: "default" or a scaled RoPE transformers computes (llama3, yarn, ...)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on every query and key head, before RoPE
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    rope_switch: int | None = None  # LongRoPE: sequences up to this length use the short factors
    # Gemma only
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scaled attention scores capped to c * tanh(scores / c)
    final_softcap: float | None = None  # Gemma 2: the same on the LM head's logits
    # Gemma 3: the sliding-window layers' RoPE base (unscaled); the others use rope_theta / rope_type
    local_rope_theta: float | None = None
    # the MLP's (transformers' name): SwiGLU's silu (Llama family), GeGLU's gelu_pytorch_tanh (Gemma), OPT's
    activation: str = "silu"
    # OPT only
    layer_norm_before: bool = True
    final_layer_norm: bool = True

    @staticmethod
    def from_dir(path: str | Path) -> ModelSpec:
        return ModelSpec.from_config(json.loads((Path(path) / "config.json").read_text()))

    @staticmethod
    def from_config(cfg: dict) -> ModelSpec:
        """The spec of ``cfg`` (a config.json) as its ``model_type``'s family reads it; :class:`UnsupportedModel`
        for a model_type no family runs, or a config its family refuses."""
        return _family(cfg.get("model_type")).spec(cfg)

    @property
    def family(self) -> Family:
        """The family that reads this checkpoint's weights and runs its blocks."""
        return _family(self.arch)

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def positions_limit(self) -> int:
        """Longest sequence the native runtime runs: a LongRoPE model only up to its RoPE switch
        (past it transformers rotates every position, cached ones included, with other frequencies,
        which a KV cache that keeps rotated keys cannot follow). Sliding windows set no limit: the
        kernel masks the keys out of a layer's window, which stay cached."""
        return min(limit for limit in (self.max_positions, self.rope_switch) if limit)


def runnable_rope_type(rope_type: str | None) -> str:
    """``rope_type`` of a config (None: ``default``); :class:`UnsupportedModel` for one the native blocks cannot run."""
    if rope_type == "dynamic":
        raise UnsupportedModel("dynamic NTK RoPE changes with the sequence length")
    return rope_type or "default"


def _family(model_type: str | None) -> Family:
    """The registry's family of ``model_type`` (:func:`specinfer.models.native.families.registry.family_of`)."""
    # imported here, not at the top: the families build ModelSpecs, so they import this module
    from specinfer.models.native.families.registry import family_of

    return family_of(model_type)
