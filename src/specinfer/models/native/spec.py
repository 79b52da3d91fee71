"""What the native runtime needs to know about a checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# RMSNorm, RoPE and SwiGLU blocks; Qwen3 adds an RMSNorm on each query and key head, Phi-3 ships
# q/k/v and gate/up fused in its checkpoint (the layout our weights use anyway)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")
SUPPORTED = (*LLAMA_FAMILY, "opt")


class UnsupportedModel(ValueError):
    """The native runtime cannot run this checkpoint; the reference backend can."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a Llama-family or OPT checkpoint.

    Terms: the *rotary dimensions* are the leading ``rotary_dim`` of each head's ``head_dim`` that
    RoPE rotates (all of them unless the config sets ``partial_rotary_factor``); the *RoPE switch*
    of a LongRoPE config is its ``original_max_position_embeddings``, past which transformers
    recomputes every position with the long factors instead of the short ones."""

    arch: str  # one of SUPPORTED
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
    sliding_window: int | None
    rope_type: str = "default"  # Llama family: "default" or a scaled RoPE transformers computes (llama3, yarn, ...)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every query and key head, before RoPE
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    rope_switch: int | None = None  # LongRoPE: sequences up to this length use the short factors
    # OPT only
    layer_norm_before: bool = True
    final_layer_norm: bool = True
    activation: str = "silu"

    @staticmethod
    def from_dir(path: str | Path) -> ModelSpec:
        return ModelSpec.from_config(json.loads((Path(path) / "config.json").read_text()))

    @staticmethod
    def from_config(cfg: dict) -> ModelSpec:
        arch = cfg.get("model_type")
        if arch not in SUPPORTED:
            raise UnsupportedModel(f"model_type {arch!r} is not one of {SUPPORTED}")
        opt = arch == "opt"
        rope_type = "default" if opt else _llama_rope_type(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        before = bool(cfg.get("do_layer_norm_before", True))  # OPT only
        return ModelSpec(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=heads if opt else int(cfg.get("num_key_value_heads") or heads),
            head_dim=hidden // heads if opt else int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["ffn_dim"] if opt else cfg["intermediate_size"]),
            max_positions=int(cfg["max_position_embeddings"] if opt else cfg.get("max_position_embeddings", 2048)),
            norm_eps=1e-5 if opt else float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", opt)),  # OPT ties by default, Llama does not
            qkv_bias=bool(cfg.get("enable_bias", True)) if opt else arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_theta=0.0 if opt else float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
            sliding_window=None if opt else _sliding_window(cfg),
            rope_type=rope_type,
            qk_norm=arch == "qwen3",
            partial_rotary_factor=1.0 if opt else _partial_rotary_factor(cfg),
            rope_switch=_rope_switch(cfg) if rope_type == "longrope" else None,
            layer_norm_before=before if opt else True,
            final_layer_norm=before and not cfg.get("_remove_final_layer_norm", False) if opt else True,
            activation=str(cfg.get("activation_function", "relu")) if opt else "silu",
        )

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def positions_limit(self) -> int:
        """Longest sequence the native runtime runs: without a sliding-window kernel, a
        sliding-window model is exact only up to its window; a LongRoPE model only up to its RoPE
        switch (past it transformers rotates every position, cached ones included, with other
        frequencies, which a KV cache that keeps rotated keys cannot follow)."""
        return min(limit for limit in (self.max_positions, self.sliding_window, self.rope_switch) if limit)


def _llama_rope_type(cfg: dict) -> str:
    """The RoPE variant of a Llama-family config; raises :class:`UnsupportedModel` for what the native blocks cannot run."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg.get('hidden_act')!r} (native Llama blocks use SwiGLU)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias (native Llama blocks have no MLP biases; the reference backend runs it)")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "dynamic":
        raise UnsupportedModel("dynamic NTK RoPE changes with the sequence length")
    return rope_type


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


def _sliding_window(cfg: dict) -> int | None:
    """The attention window of a Llama-family config (None: full attention)."""
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types")
    if sliding and layer_types and "sliding_attention" not in layer_types:
        sliding = None
    if sliding and layer_types and "full_attention" in layer_types:
        raise UnsupportedModel("mixed sliding/full attention layers")
    return int(sliding) if sliding else None
