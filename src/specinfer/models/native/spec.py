"""What the native runtime needs to know about a checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# RMSNorm, RoPE and SwiGLU blocks; Qwen3 adds an RMSNorm on each query and key head, Phi-3 ships
# q/k/v and gate/up fused in its checkpoint (the layout our weights use anyway)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Gemma 2 and 3 (text; "gemma3" nests it under text_config, beside a vision tower we do not run):
# Gemma RMSNorms before and after both sublayers, GeGLU, scaled embeddings, per-layer sliding windows
GEMMA_FAMILY = ("gemma2", "gemma3_text", "gemma3")
SUPPORTED = (*LLAMA_FAMILY, *GEMMA_FAMILY, "opt")


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
        arch = cfg.get("model_type")
        if arch not in SUPPORTED:
            raise UnsupportedModel(f"model_type {arch!r} is not one of {SUPPORTED}")
        if arch in GEMMA_FAMILY:
            return _gemma_spec(arch, cfg.get("text_config") or {} if arch == "gemma3" else cfg)
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
            qkv_bias=bool(cfg.get("enable_bias", True))
            if opt
            else arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_theta=0.0
            if opt
            else float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
            layer_windows=(None,) * int(cfg["num_hidden_layers"]) if opt else _layer_windows(cfg),
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
    def gemma(self) -> bool:
        return self.arch in GEMMA_FAMILY

    @property
    def positions_limit(self) -> int:
        """Longest sequence the native runtime runs: a LongRoPE model only up to its RoPE switch
        (past it transformers rotates every position, cached ones included, with other frequencies,
        which a KV cache that keeps rotated keys cannot follow). Sliding windows set no limit: the
        kernel masks the keys out of a layer's window, which stay cached."""
        return min(limit for limit in (self.max_positions, self.rope_switch) if limit)


def _llama_rope_type(cfg: dict) -> str:
    """The RoPE variant of a Llama-family config; raises :class:`UnsupportedModel` for what the native blocks cannot
    run."""
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


def _layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's attention window in a Llama-family config (None: full attention), as transformers
    sets it: ``sliding_window`` for the layers ``layer_types`` marks ``sliding_attention``; without
    ``layer_types``, Qwen2/Qwen3 window the layers from ``max_window_layers`` on, Mistral and Phi-3 all."""
    layers = int(cfg["num_hidden_layers"])
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if not sliding:
        return (None,) * layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg.get("max_window_layers") or 0) if cfg.get("model_type") in ("qwen2", "qwen3") else 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return tuple(int(sliding) if t == "sliding_attention" else None for t in layer_types)


GEMMA_ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with tanh-approximated GELU, what every Gemma 2 / 3 uses
GEMMA_WINDOW_PATTERN = {
    "gemma2": 2,
    "gemma3_text": 6,
    "gemma3": 6,
}  # every n-th layer is global when a config lists no layer_types
# What transformers 5's Gemma2Config / Gemma3TextConfig assume for a field a config.json leaves out
# (the hub's Gemma 3 4B-27B configs give their text_config a few fields only)
_GEMMA_SHARED_DEFAULTS = dict(
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
_GEMMA3_DEFAULTS = dict(
    _GEMMA_SHARED_DEFAULTS, vocab_size=262_208, max_position_embeddings=131_072, final_logit_softcapping=None
)
GEMMA_DEFAULTS = {
    "gemma2": dict(
        _GEMMA_SHARED_DEFAULTS,
        vocab_size=256_000,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": _GEMMA3_DEFAULTS,
    "gemma3": _GEMMA3_DEFAULTS,
}


def _gemma_spec(arch: str, cfg: dict) -> ModelSpec:
    """The spec of a Gemma 2 or Gemma 3 text config (``cfg``: for ``gemma3``, its ``text_config``),
    read as transformers 5 reads it, older layouts included (``rope_local_base_freq``,
    ``rope_scaling``, ``sliding_window_pattern`` at the top) and fields left to transformers' defaults."""
    cfg = {**GEMMA_DEFAULTS[arch], **cfg}
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise UnsupportedModel(f"hidden_activation {activation!r} (native Gemma blocks use {GEMMA_ACTIVATION})")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("use_bidirectional_attention (an embedding model, not a causal LM)")
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or GEMMA_WINDOW_PATTERN[arch])
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    sliding = cfg.get("sliding_window")
    windows = tuple(int(sliding) if t == "sliding_attention" and sliding else None for t in layer_types)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    gemma2 = arch == "gemma2"
    rope, local_theta = _gemma_rope(cfg, gemma2)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "dynamic":
        raise UnsupportedModel("dynamic NTK RoPE changes with the sequence length")
    return ModelSpec(
        arch=arch,
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
        layer_windows=windows,
        rope_type=rope_type,
        qk_norm=not gemma2,
        activation=GEMMA_ACTIVATION,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        # Gemma 3's attention passes no soft-cap to the attention function whatever the config
        # says, and its multimodal model (gemma3) caps no logits: as transformers runs them
        attn_softcap=_positive(cfg.get("attn_logit_softcapping")) if gemma2 else None,
        final_softcap=_positive(cfg.get("final_logit_softcapping")) if arch != "gemma3" else None,
        local_rope_theta=local_theta,
    )


def _gemma_rope(cfg: dict, gemma2: bool) -> tuple[dict, float | None]:
    """RoPE parameters of the global layers, and the local layers' base (Gemma 3; None for Gemma 2,
    whose layers share one RoPE). transformers 5 keeps Gemma 3's per layer type in
    ``rope_parameters``; older configs have ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if gemma2:
        return {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {}), **params}, None
    if "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:
        full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModel(f"scaled RoPE {local.get('rope_type')!r} on the sliding-window layers")
    return full, float(local.get("rope_theta", 10000.0))


def _positive(value: float | None) -> float | None:
    """A soft-cap setting: None or 0 mean none."""
    return float(value) if value else None
