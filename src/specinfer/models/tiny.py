"""Tiny random Llama models and a byte-level tokenizer, built on the fly.

Tests use them where the trained pair is absent, and the demo falls back to them on a fresh
clone. The SSM of a tiny pair is the LLM with its upper layers dropped (same embeddings and
first layers), so the two agree often enough for speculation to accept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 259
    hidden_size: int = 64
    layers: int = 4
    ssm_layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0


def tiny_llama(
    vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int, seed: int
) -> LlamaForCausalLM:
    """A random Llama; weights scaled up so its distributions are far from uniform."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
        model.lm_head.weight.mul_(40.0)
    return model


def truncated_copy(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The same model with only its first ``layers`` decoder layers."""
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": layers})
    small = LlamaForCausalLM(config).eval()
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    small.load_state_dict(state)
    return small


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 3 special tokens then the 256 bytes (vocabulary 259)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_pair(out_dir: str | Path, spec: TinySpec = TinySpec()) -> tuple[Path, Path]:
    """Write ``out_dir/llm`` and ``out_dir/ssm`` as Hugging Face checkpoints; returns both paths."""
    out = Path(out_dir)
    llm = tiny_llama(spec.vocab_size, spec.hidden_size, spec.layers, spec.heads, spec.kv_heads, spec.seed)
    ssm = truncated_copy(llm, spec.ssm_layers)
    tokenizer = byte_tokenizer() if spec.vocab_size >= 259 else None
    paths = []
    for name, model in (("llm", llm), ("ssm", ssm)):
        path = out / name
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
