"""One rank's part of the model: its tensor shard of one pipeline stage, and a forward step on it.

A stage's tensor ranks hold replicated activations ``h`` [T, hidden] between layers: column-
parallel projections produce this rank's heads / MLP columns, the row-parallel o_proj and
down_proj produce partial sums that one all-reduce per projection completes (2 per layer). The
first stage embeds the tokens (vocabulary-parallel: each rank looks up the ids in its range,
zeros elsewhere, one all-reduce); every later stage receives ``h`` from the previous stage's rank
with the same tensor index; the last stage applies the final norm and the vocabulary-parallel LM
head (each rank its vocabulary block, one all-gather), and its tensor rank 0 sends the logits to
rank 0 when rank 0 is not on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specinfer.kernels import TreeAttentionMetadata
from specinfer.models.native.gemm import GemmPlan
from specinfer.models.native.kv_pool import PoolTensors
from specinfer.models.native.model import NativeModel, RopeTables
from specinfer.models.native.offload import OffloadedLayers
from specinfer.models.native.parallel.groups import ParallelGroups
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.step import PackedStep
from specinfer.models.native.weights import ModelWeights


class StageModel(NativeModel):
    """:class:`NativeModel` on a shard: ``spec`` is the shard's (:func:`shard_spec`), ``vocab_size``
    the full model's."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        rope: RopeTables | None,
        attention_impl: str,
        vocab_size: int,
        groups: ParallelGroups,
        gemm: GemmPlan,
        layers: OffloadedLayers | None = None,
    ) -> None:
        super().__init__(spec, weights, rope, attention_impl, gemm, layers)
        self.vocab_size = vocab_size
        self.groups = groups
        self.vocab = groups.layout.vocab_range(vocab_size)

    def _embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:  # [T, word_embed_dim]
        if self.groups.tensor is None:
            return super()._embed_tokens(tokens)
        mine = (tokens >= self.vocab.start) & (tokens < self.vocab.stop)  # [T] bool
        if len(self.vocab):
            h = F.embedding(torch.where(mine, tokens - self.vocab.start, 0), self.w.embed) * mine[:, None].to(
                self.w.embed.dtype
            )
        else:  # more ranks than vocabulary blocks: this one owns no row
            h = self.w.embed.new_zeros(tokens.shape[0], self.w.embed.shape[1])
        return self.reduce(h)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:  # [N, vocab]
        if self.groups.tensor is None:
            return super()._lm_head(h)
        tp = self.groups.layout.tp
        block = -(-self.vocab_size // tp)
        part = F.pad(self.linear(h, self.w.lm_head), (0, block - len(self.vocab)))  # [N, block]
        parts = [torch.empty_like(part) for _ in range(tp)]
        dist.all_gather(parts, part, group=self.groups.tensor)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size].contiguous()

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups.tensor is not None:
            dist.all_reduce(x, group=self.groups.tensor)
        return x


def run_stage(
    model: StageModel, pool: PoolTensors, step: PackedStep, meta: TreeAttentionMetadata, device: torch.device
) -> torch.Tensor | None:
    """This rank's share of ``step`` (``meta``: its tree-attention metadata); the logits
    # [N, vocab] float32 on the last stage, else None."""
    layout, world = model.groups.layout, model.groups.world
    tokens, positions, rows, logit_rows = step.tensors(device)
    if layout.is_first_stage:
        h = model.embed(tokens, positions)  # [T, hidden]
    else:
        h = torch.empty(len(step.tokens), model.spec.hidden_size, dtype=pool.k.dtype, device=device)
        dist.recv(h, src=layout.peer(layout.stage - 1), group=world)
    h = model.run_layers(h, positions, rows, meta, pool)
    if not layout.is_last_stage:
        dist.send(h.contiguous(), dst=layout.peer(layout.stage + 1), group=world)
        return None
    if not step.logit_rows:  # a prefill: no logits wanted (and no empty all-gather)
        return torch.empty(0, model.vocab_size, device=device)
    return model.head(h, logit_rows)
