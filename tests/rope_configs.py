"""RoPE settings (and other config parts) of real model families, shrunk to the tiny test
checkpoints: one home for the native-logit, parallel-logit and model-family tests (tests/ is on
their import path)."""

from __future__ import annotations

LONGROPE_SWITCH = 64  # original_max_position_embeddings of the tiny LongRoPE models


def llama3_rope(factor: float) -> dict:
    """Llama 3's RoPE scaling (Llama 3.1: factor 8, Llama 3.2: 32), its original context shrunk to 64."""
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


# Phi-3-mini-128k's LongRoPE for head_dim 16: 8 factors each; the short ones differ from 1 so that a
# default RoPE would not pass
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.25 * i for i in range(8)],
    "long_factor": [3.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": LONGROPE_SWITCH,
}
# Phi-4-mini: RoPE on the leading 3/4 of each head
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
PHI3_TOKENS = dict(eos_token_id=2, pad_token_id=0)  # Phi-3's defaults (32000) lie outside a tiny vocabulary


# Gemma 3 4B-27B: linear RoPE scaling (factor 8) on the global layers only, base 1M; the local
# (sliding-window) layers keep an unscaled base of 10k
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def gemma3_multimodal(text_config):
    """A ``gemma3`` config (Gemma 3 4B-27B: ``Gemma3ForConditionalGeneration``) around ``text_config``
    with a tiny SigLIP vision tower; its special image tokens are the vocabulary's last three ids."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    v = text_config.vocab_size
    return Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=v - 3,
        eoi_token_index=v - 2,
        image_token_index=v - 1,
    )
