"""Tensor- and pipeline-parallel shards of a built :class:`ModelWeights` (Megatron-style).

- *Column-parallel* (output rows split): the fused q/k/v projection by head groups (rank r gets
  query heads ``[r * heads / tp, (r + 1) * heads / tp)`` and the matching key/value heads, so
  GQA groups stay whole on one rank), and the MLP's input projection (gate and up halves of
  the fused Llama ``[gate; up]`` split separately so each rank keeps the ``[gate_r; up_r]``
  layout; OPT's fc1 by rows). Their outputs need no communication.
- *Row-parallel* (input columns split): o_proj and down_proj. Each rank's output is a partial
  sum, all-reduced by the stage (:mod:`.stage`); their biases stay on tensor rank 0 only so the
  sum counts them once.
- *Vocabulary-parallel*: the embedding and the LM head keep the rows of
  :meth:`ParallelLayout.vocab_range`.
- *Pipeline*: a stage keeps its :meth:`ParallelLayout.layer_range`, the embedding (and OPT's
  positions, project_in) only on the first stage, the final norm and LM head only on the last.
  Tensors a rank does not need are dropped (``None`` or empty), so their memory is freed.
"""

from __future__ import annotations

import dataclasses

import torch

from specinfer.models.native.parallel.layout import ParallelLayout
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import LayerWeights, ModelWeights


def _rows(x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if x is None else x[start:stop].contiguous()


def _qkv_rows(spec: ModelSpec, layout: ParallelLayout) -> torch.Tensor:
    """Row indices of rank's q, k and v heads in the fused qkv projection.
    # [(heads + 2 * kv_heads) / tp * head_dim]"""
    d, r = spec.head_dim, layout.tp_rank
    hq, hkv = spec.heads // layout.tp, spec.kv_heads // layout.tp
    q = torch.arange(r * hq * d, (r + 1) * hq * d)
    k = spec.heads * d + torch.arange(r * hkv * d, (r + 1) * hkv * d)
    v = (spec.heads + spec.kv_heads) * d + torch.arange(r * hkv * d, (r + 1) * hkv * d)
    return torch.cat([q, k, v])


def _shard_layer(spec: ModelSpec, layer: LayerWeights, layout: ParallelLayout) -> LayerWeights:
    tp, r = layout.tp, layout.tp_rank
    qkv = _qkv_rows(spec, layout).to(layer.qkv_w.device)
    width = spec.heads // tp * spec.head_dim  # attention columns of o_proj on this rank
    ffn = spec.intermediate_size // tp
    if spec.family.gated_mlp:
        gate, up = layer.up_w.chunk(2, dim=0)  # [intermediate, hidden] each
        up_w, up_b = torch.cat([gate[r * ffn : (r + 1) * ffn], up[r * ffn : (r + 1) * ffn]]).contiguous(), None
    else:  # OPT's fc1
        up_w, up_b = _rows(layer.up_w, r * ffn, (r + 1) * ffn), _rows(layer.up_b, r * ffn, (r + 1) * ffn)
    keep_bias = r == 0
    return dataclasses.replace(  # the norms stay whole on every rank
        layer,
        qkv_w=layer.qkv_w[qkv].contiguous(),
        qkv_b=None if layer.qkv_b is None else layer.qkv_b[qkv].contiguous(),
        o_w=layer.o_w[:, r * width : (r + 1) * width].contiguous(),
        o_b=layer.o_b if keep_bias else None,
        up_w=up_w,
        up_b=up_b,
        down_w=layer.down_w[:, r * ffn : (r + 1) * ffn].contiguous(),
        down_b=layer.down_b if keep_bias else None,
    )


def shard_weights(spec: ModelSpec, weights: ModelWeights, layout: ParallelLayout) -> ModelWeights:
    """This rank's part of ``weights`` (the full model's, built by :func:`build_weights`)."""
    layers = [_shard_layer(spec, weights.layers[i], layout) for i in layout.layer_range(spec.layers)]
    vocab = layout.vocab_range(spec.vocab_size)
    empty = weights.embed[:0]  # [0, word_embed_dim]: a stage without the table
    first, last = layout.is_first_stage, layout.is_last_stage
    embed = _rows(weights.embed, vocab.start, vocab.stop) if first else empty
    if last and weights.lm_head is weights.embed and first:
        lm_head = embed  # tied embeddings stay one tensor
    else:
        lm_head = _rows(weights.lm_head, vocab.start, vocab.stop) if last else empty
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm_w=weights.final_norm_w if last else None,
        final_norm_b=weights.final_norm_b if last else None,
        lm_head=lm_head,
        positions=weights.positions if first else None,
        project_in=weights.project_in if first else None,
        project_out=weights.project_out if last else None,
    )
