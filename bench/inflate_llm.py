"""Make a costlier copy of a small Llama-family checkpoint (llama, mistral, qwen2) with the shapes of a real LLM
that computes the same logits up to float rounding (~1e-6 relative in fp32).

Why: speculative decoding pays when one forward pass of the LLM is expensive, and how that cost grows with the
number of tokens verified at once depends on the GEMM shapes. Widening only the MLP and stacking layers would
keep the tiny hidden size: every GEMM would have K = h (the small model's hidden size) and 1e9 parameters would
take ~150 thin layers, shapes and per-layer overheads no real model has (in bf16 a step of such a model costs
1.6-2x that of a real-shaped 1B one). Real 1B-7B models: hidden 2048-4096, 16-32 heads of 64-128 dims, GQA.
The default shape is a 1B Llama's: hidden 2048, 32 query / 8 KV heads of the source's head_dim, MLP 8192,
layers up to ~1e9 parameters. Compare the inflated model's greedy tokens with its own incremental decoding,
not the small model's: the wider sums round differently.

Terms: the source has hidden size h, nq0 query / nkv0 KV heads of head_dim d (GQA ratio r0 = nq0 / nkv0), MLP
width I0 and n0 layers; the copy has H, NQ / NKV (ratio r), M and L >= n0. *Ghost* heads, MLP rows and layers
are the ones the copy adds.

- ``--hidden H``: dims 0..h-1 of the residual stream carry the small model; the extra dims stay exactly zero
  (the embedding's extra columns and every output projection's extra rows are zero). Projections that read the
  residual (q/k/v, gate/up, an untied lm_head) get random weights on the extra input dims (they multiply
  zeros), so every GEMM has the K of a real model. RMSNorm then averages over H dims of which h are non-zero:
  eps' = eps * h / H (written to the config) and w' = w * sqrt(h / H) give the same result.
- ``--heads NQ --kv-heads NKV``: head_dim and RoPE are kept. Source KV head k stays at index k; source query
  head i moves to (i // r0) * r + i % r0, so it keeps its KV head. Ghost heads get random q/k/v weights and
  biases; their o_proj columns are zero.
- ``--mlp-dim M``: ghost gate/up rows random, ghost down_proj columns zero.
- ``--params P``: ghost layers appended until about P parameters: random reads, zero o_proj/down_proj, norms 1.

0 for ``--hidden``/``--heads``/``--kv-heads`` keeps the source's value.

    python bench/inflate_llm.py models/demo/llm /tmp/llm-1b --params 1e9
    python bench/inflate_llm.py LLM /tmp/llm-7b --params 7e9 --hidden 4096 --heads 32 --kv-heads 8 --mlp-dim 14336
"""

from __future__ import annotations

import argparse
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

FAMILIES = ("llama", "mistral", "qwen2")  # the Llama-family blocks this rewrites
# files copied verbatim (a round trip through AutoTokenizer can rewrite them)
COPIED = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")
WRITES_RESIDUAL = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")


@dataclass(frozen=True)
class Shape:
    """The copy's shape (terms: the module docstring). ``hidden``, ``heads``, ``kv_heads``: 0 keeps the
    source's; ``params``: the total parameter count the ghost layers fill up to."""

    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    mlp_dim: int = 8192
    params: float = 1e9


def inflated_config(src: Path, c: PretrainedConfig, shape: Shape) -> PretrainedConfig:
    """The copy's config: ``src``'s with ``shape`` (SystemExit when the shape cannot hold the source)."""
    if c.model_type not in FAMILIES:
        raise SystemExit(f"{c.model_type}: only Llama-family blocks ({', '.join(FAMILIES)})")
    h, nq0, nkv0, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim(c)
    hidden, heads, kv_heads = shape.hidden or h, shape.heads or nq0, shape.kv_heads or nkv0
    if hidden < h or shape.mlp_dim < c.intermediate_size:
        raise SystemExit(f"--hidden and --mlp-dim must be at least the source's ({h}, {c.intermediate_size})")
    if kv_heads < nkv0 or heads % kv_heads or heads // kv_heads < nq0 // nkv0:
        raise SystemExit(
            f"--kv-heads must be >= {nkv0} and divide --heads with a ratio >= {nq0 // nkv0} "
            f"(source: {nq0}/{nkv0} heads)"
        )
    cfg = AutoConfig.from_pretrained(src)
    cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = hidden, heads, kv_heads, d
    cfg.intermediate_size, cfg.rms_norm_eps = shape.mlp_dim, c.rms_norm_eps * h / hidden
    per_layer = 2 * hidden * heads * d + 2 * hidden * kv_heads * d + 3 * hidden * shape.mlp_dim
    embed = c.vocab_size * hidden * (1 if c.tie_word_embeddings else 2)
    n0 = c.num_hidden_layers
    cfg.num_hidden_layers = layers = max(n0, round((shape.params - embed) / per_layer))
    if getattr(c, "layer_types", None) is not None:  # real layers keep theirs; ghost layers repeat the pattern
        cfg.layer_types = [c.layer_types[i % n0] for i in range(layers)]
    try:  # transformers' own rules (llama: hidden % heads == 0) before the slow part
        getattr(cfg, "validate", lambda: None)()
    except Exception as exc:  # whatever transformers raises for a shape it refuses
        raise SystemExit(f"transformers rejects this shape: {exc}") from exc
    return cfg


def head_dim(c: PretrainedConfig) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def query_slots(c: PretrainedConfig, cfg: PretrainedConfig) -> list[int]:
    """The copy's index of each source query head: the same KV head serves it (slot // r == i // r0)."""
    r0 = c.num_attention_heads // c.num_key_value_heads
    r = cfg.num_attention_heads // cfg.num_key_value_heads
    return [(i // r0) * r + i % r0 for i in range(c.num_attention_heads)]


def fill_ghosts(dst: PreTrainedModel) -> None:
    """Every parameter as a ghost's: norms 1, whatever writes to the residual stream zero, the rest random
    (what reads it, and the q/k/v, gate/up biases). The source's weights are written over them next."""
    for name, p in dst.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(WRITES_RESIDUAL):
            p.zero_()
        else:
            p.normal_(std=0.02)


def _put(new: torch.nn.Linear, old: torch.nn.Linear) -> None:
    """``old``'s weight (and bias) into the leading block of ``new``'s."""
    o, i = old.weight.shape
    new.weight[:o, :i] = old.weight
    if old.bias is not None:
        new.bias[:o] = old.bias


def copy_attention(sa: torch.nn.Module, ta: torch.nn.Module, slots: list[int], d: int, h: int) -> None:
    """A source attention block ``sa`` into the copy's ``ta``: query head i at ``slots[i]``, KV heads in place."""
    for i, j in enumerate(slots):
        src_rows, dst_rows = slice(i * d, (i + 1) * d), slice(j * d, (j + 1) * d)
        ta.q_proj.weight[dst_rows, :h] = sa.q_proj.weight[src_rows]  # [d, h]
        if sa.q_proj.bias is not None:
            ta.q_proj.bias[dst_rows] = sa.q_proj.bias[src_rows]
        ta.o_proj.weight[:h, dst_rows] = sa.o_proj.weight[:, src_rows]  # [h, d]
    if sa.o_proj.bias is not None:
        ta.o_proj.bias[:h] = sa.o_proj.bias
    _put(ta.k_proj, sa.k_proj)
    _put(ta.v_proj, sa.v_proj)


def copy_source(src: PreTrainedModel, dst: PreTrainedModel) -> None:
    """The source's weights into the leading blocks of the copy's (its first layers are the source's)."""
    c, h = src.config, src.config.hidden_size
    scale = math.sqrt(h / dst.config.hidden_size)  # RMSNorm over H dims of which h are non-zero
    dst.model.embed_tokens.weight.zero_()
    dst.model.embed_tokens.weight[:, :h] = src.model.embed_tokens.weight  # [V, h]
    if not c.tie_word_embeddings:
        dst.lm_head.weight[:, :h] = src.lm_head.weight
    dst.model.norm.weight[:h] = src.model.norm.weight * scale
    slots = query_slots(c, dst.config)
    for s, t in zip(src.model.layers, dst.model.layers, strict=False):  # the copy's extra layers are ghosts
        t.input_layernorm.weight[:h] = s.input_layernorm.weight * scale
        t.post_attention_layernorm.weight[:h] = s.post_attention_layernorm.weight * scale
        copy_attention(s.self_attn, t.self_attn, slots, head_dim(c), h)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _put(getattr(t.mlp, proj), getattr(s.mlp, proj))


def inflate(src: Path, dst: Path, shape: Shape, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """Write the inflated copy of checkpoint ``src`` to ``dst`` (weights in ``dtype``, the ghosts' random
    weights from ``seed``, tokenizer files as they are); returns a one-line summary."""
    torch.manual_seed(seed)
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    c = source.config
    cfg = inflated_config(src, c, shape)
    copy = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        fill_ghosts(copy)
        copy_source(source, copy)
    copy.to(dtype).save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(COPIED):
            shutil.copy(f, dst / f.name)
    total = sum(p.numel() for p in copy.parameters())
    n0, layers, dtype_name = c.num_hidden_layers, cfg.num_hidden_layers, str(dtype).removeprefix("torch.")
    return (
        f"{dst}: hidden {c.hidden_size}->{cfg.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}"
        f"->{cfg.num_attention_heads}/{cfg.num_key_value_heads} x {cfg.head_dim}, mlp {c.intermediate_size}"
        f"->{cfg.intermediate_size}, {n0} real + {layers - n0} ghost layers, {total / 1e6:.1f}M parameters"
        f" ({dtype_name})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the small checkpoint (a Hugging Face folder)")
    ap.add_argument("dst", type=Path, help="where the copy goes")
    default = Shape()
    ap.add_argument("--hidden", type=int, default=default.hidden, help="hidden size (0: the source's)")
    ap.add_argument("--heads", type=int, default=default.heads, help="query heads (0: the source's)")
    ap.add_argument("--kv-heads", type=int, default=default.kv_heads, help="key/value heads (0: the source's)")
    ap.add_argument("--mlp-dim", type=int, default=default.mlp_dim, help="MLP width of every layer")
    ap.add_argument("--params", type=float, default=default.params, help="target total parameter count")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0, help="the ghosts' random weights")
    a = ap.parse_args()
    shape = Shape(a.hidden, a.heads, a.kv_heads, a.mlp_dim, a.params)
    print(inflate(a.src, a.dst, shape, getattr(torch, a.dtype), a.seed))


if __name__ == "__main__":
    main()
