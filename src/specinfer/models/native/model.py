"""Our own forward pass over packed tokens, for every family (:mod:`specinfer.models.native.families`: Llama 1/2/3,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 / 3, OPT), whose blocks it runs.

Every token of every request of a batch is one row of the packed activations; attention reads
and writes the KV pool (either layout) through the tree-attention kernel, whose per-step metadata is
built once by the backend and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.kernels import TreeAttentionMetadata, cpu_layers, cpu_qgemm, soft_cap, tree_attention
from specinfer.kernels.cpu_layers import Segments
from specinfer.models.native.fused import build as build_fused
from specinfer.models.native.gemm import GemmPlan
from specinfer.models.native.kv_pool import PoolTensors
from specinfer.models.native.offload import OffloadedLayers, ResidentLayers
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import ModelWeights


@dataclass(frozen=True)
class RopeTables:
    """A model's RoPE: the inverse frequencies and cos/sin scale of its layers, and, for Gemma 3,
    the unscaled frequencies of its sliding-window (*local*) layers."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] float32
    scale: float = 1.0  # cos/sin multiplier of some RoPE scalings (yarn, longrope)
    local_inv_freq: torch.Tensor | None = None  # [rotary_dim / 2] float32; None: every layer uses inv_freq


class NativeModel:
    """The forward pass. The family's blocks (embedding extras, decoder layer, final norm, query/key
    norms: :class:`specinfer.models.native.families.base.Blocks`) are picked once here, so the
    per-layer path runs no family branch; they call back :meth:`linear`, :meth:`attention` and
    :meth:`reduce`, the pieces every family shares."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        rope: RopeTables | None,
        attention_impl: str,
        gemm: GemmPlan | None = None,
        layers: OffloadedLayers | None = None,
        fused: bool = True,
    ) -> None:
        """``rope``: None for OPT (learned positions). ``layers``: where the decoder layers come from
        when offloaded (:mod:`.offload`; ``weights.layers`` are then in host memory); None:
        ``weights.layers``, on the device. ``fused``: run the decode and verify steps through the fused CPU layers
        where they can run this model (:mod:`.fused`)."""
        self.spec = spec
        self.w = weights
        self.layers = ResidentLayers(weights.layers) if layers is None else layers
        self.linear = (gemm or GemmPlan()).linear  # x @ w.T (+ b) in the form measured fastest for the shape
        self.rope = rope
        self.attention_impl = attention_impl
        self.hidden_shape = (spec.hidden_size,)  # normalized shape of every norm over hidden states
        self.head_shape = (spec.head_dim,)  # normalized shape of the query and key norms
        self._rotate = self._rotate_all if spec.rotary_dim == spec.head_dim else self._rotate_leading
        # per layer: its sliding window, and which of the step's RoPE tables it uses (1: the local one)
        self._windows = spec.layer_windows
        local = rope is not None and rope.local_inv_freq is not None
        self._rope_index = tuple(int(local and w is not None) for w in spec.layer_windows)
        self._sm_scale = (
            None if spec.query_pre_attn_scalar is None else spec.query_pre_attn_scalar**-0.5
        )  # None: head_dim ** -0.5
        self.blocks = spec.family.blocks(spec, weights.embed.dtype)
        # without query/key norms, queries and keys are side by side in the qkv product: one RoPE over both
        self._rope_qk_together = self.blocks.qk_norm is None
        self.fused = build_fused(self) if fused else None  # None: every step per operation

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache_rows: torch.Tensor,  # [T] int64, pool row where each token's K/V go
        meta: TreeAttentionMetadata | Segments,  # Segments: a step the fused CPU layers serve whole
        pool: PoolTensors,
        logit_rows: torch.Tensor,  # [N] int64, rows whose logits are wanted
    ) -> torch.Tensor:  # [N, vocab] float32
        h = self.embed(tokens, positions)
        h = self.run_layers(h, positions, cache_rows, meta, pool)
        return self.head(h, logit_rows)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """Token (and for OPT, position) embeddings of the packed tokens."""
        return self.blocks.embed(self, self._embed_tokens(tokens), positions)

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        meta: TreeAttentionMetadata | Segments,
        pool: PoolTensors,
    ) -> torch.Tensor:
        """Every decoder layer over ``h``  # [T, hidden]; layer i's K/V go to ``pool`` layer i."""
        if self.fused is not None and self.fused.serves(h, meta):
            return self.fused.run(h, positions, cache_rows, meta, pool)
        ropes = self._ropes(positions, h.dtype)  # once per step, shared by every layer
        layer = self.blocks.layer
        for i in range(len(self.layers)):
            h = layer(self, i, self.layers.acquire(i), h, ropes[self._rope_index[i]], cache_rows, meta, pool)
            self.layers.release()  # after the layer's last kernel: its staging buffer may be refilled
        return h

    def forward_features(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache_rows: torch.Tensor,  # [T] int64
        meta: TreeAttentionMetadata,
        pool: PoolTensors,
        logit_rows: torch.Tensor,  # [N] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s logits, and the *features* of every row: the last hidden state after the final
        norm, which the LM head reads (what a draft head, :mod:`specinfer.models.draft_head`, drafts from).
        # [N, vocab] float32, [T, lm_head_dim]"""
        h = self.run_layers(self.embed(tokens, positions), positions, cache_rows, meta, pool)
        features = self._final(h)  # [T, lm_head_dim]
        return self.logits(features[logit_rows]), features

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        """The LM head on features (final-normed hidden states)  # [N, lm_head_dim]; Gemma 2's soft cap."""
        return soft_cap(self._lm_head(features).float(), self.spec.final_softcap)

    def logits_after(
        self, proj: torch.Tensor, rows: torch.Tensor | None = None, threads: int = 0
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head after a linear map into features ``proj``  # [lm_head_dim, k]: a function of ``x``
        # [N, k] giving :meth:`logits` of ``x @ proj.T``  # [N, vocab] float32. Where ``k`` is narrower than
        the features (a draft head's width), the two products are folded into one ``[vocab, k]`` matrix,
        multiplied once in fp32 here: each call then reads ``k / lm_head_dim`` of the LM head's bytes. ``rows``
        # [K] int64: only those tokens' logits are computed (a draft vocabulary), and the function gives those
        columns alone, in ``rows``' order  # [N, K] float32. ``threads`` > 0: a folded matrix the CPU kernels read is
        multiplied by them on that many threads (a draft head's products,
        :meth:`~specinfer.models.draft_head.DraftHead.cpu_products`)."""
        index = None if rows is None else rows.to(self.w.lm_head.device)  # [K]
        lm_head = self.w.lm_head if index is None else self.w.lm_head.index_select(0, index)  # [vocab or K, dim]
        cap = self.spec.final_softcap
        if proj.shape[1] >= proj.shape[0]:
            part = lambda x: soft_cap(self.linear(F.linear(x, proj), lm_head).float(), cap)  # noqa: E731
        else:
            folded = (lm_head.float() @ proj.float()).to(lm_head.dtype).contiguous()  # [vocab or K, k]
            if threads > 0 and cpu_layers.weight_kind(folded) is not None and cpu_qgemm.library() is not None:
                part = lambda x: soft_cap(cpu_layers.dense_linear(x, folded, threads), cap)  # noqa: E731
            else:
                part = lambda x: soft_cap(self.linear(x, folded).float(), cap)  # noqa: E731
        return part

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, word_embed_dim]
        """The token embedding table's rows of ``tokens``  # [N] int64 (no scale, no positions)."""
        return self._embed_tokens(tokens)

    def head(self, h: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        """Final norm and LM head on the rows ``logit_rows`` of ``h``  # [T, hidden]; Gemma 2 soft-caps the logits
        (in fp32, where transformers does it in the model's dtype: the same in the fp32 tests, finer otherwise)."""
        if self.fused is not None and self.fused.serves_head(h, logit_rows):
            return soft_cap(self.fused.head(h, logit_rows), self.spec.final_softcap)  # the same, one C call
        return soft_cap(self._lm_head(self._final(h[logit_rows])).float(), self.spec.final_softcap)

    # Hooks a tensor-parallel shard overrides (specinfer.models.native.parallel.stage): here the
    # whole vocabulary and full-width row-parallel layers, so nothing is communicated.

    def _embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:  # [T, word_embed_dim]
        return F.embedding(tokens, self.w.embed)

    def _final(self, h: torch.Tensor) -> torch.Tensor:  # [N, lm_head_dim]
        if self.fused is not None and self.fused.final_norm is not None:
            return self.fused.norm(h)
        return self.blocks.final(self, h)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:  # [N, vocab]
        if self.fused is not None and self.fused.head_weight is not None and self.fused.takes(h.shape[0]):
            return self.fused.logits(h)
        return self.linear(h, self.w.lm_head if self.w.logits_head is None else self.w.logits_head)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the partial outputs of a row-parallel layer (o_proj, down_proj) over the shards."""
        return x

    # Shared by every family.

    def _ropes(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]:
        """The step's cos/sin tables: ``(global,)``, Gemma 3 ``(global, local)``, OPT ``(None,)``."""
        if self.rope is None:
            return (None,)
        tables = (self._rope(positions, dtype, self.rope.inv_freq, self.rope.scale),)
        if self.rope.local_inv_freq is not None:
            tables += (self._rope(positions, dtype, self.rope.local_inv_freq, 1.0),)
        return tables

    @staticmethod
    def _rope(
        positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(cos, signed_sin)``  # [T, 1, rotary_dim] each: ``signed_sin`` is sin with its first half
        negated, so that :meth:`_rotate_all` needs no negation (the sign moves from x to sin: the same products)."""
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
        c, s = freqs.cos(), freqs.sin()
        cos = (torch.cat([c, c], dim=-1) * scale).to(dtype)[:, None, :]  # [T, 1, rotary_dim]
        signed_sin = (torch.cat([-s, s], dim=-1) * scale).to(dtype)[:, None, :]
        return cos, signed_sin

    @staticmethod
    def _rotate_all(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE as transformers' ``x * cos + rotate_half(x) * sin``, bit for bit, in four operations instead of five:
        ``rotate_half(x) * sin`` is ``[-x2, x1] * [s1, s2]`` = ``[x2, x1] * [-s1, s2]``."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin

    @staticmethod
    def _rotate_leading(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the leading ``rotary_dim`` of each head (``partial_rotary_factor`` < 1), the rest unchanged."""
        rotary_dim = cos.shape[-1]
        return torch.cat([NativeModel._rotate_all(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]], dim=-1)

    def attention(self, i, layer, x, rope, cache_rows, meta, pool) -> torch.Tensor:
        """Attention of layer ``i`` (its weights ``layer``) over ``x``  # [T, hidden], normed as its family norms
        it: q/k/v, the family's query/key norms, RoPE, K/V into ``pool``, tree attention, o_proj (reduced).
        # [T, hidden]"""
        spec = self.spec
        t = x.shape[0]
        qkv = self.linear(x, layer.qkv_w, layer.qkv_b)  # [T, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        v = qkv[:, q_size + kv_size :].view(t, spec.kv_heads, spec.head_dim)  # [T, kv_heads, head_dim]
        if self._rope_qk_together:
            # queries and keys side by side in qkv: one RoPE over both (half the launches of one each, which a GPU
            # step, bound by the host launching kernels, pays for)
            qk = qkv[:, : q_size + kv_size].view(t, spec.heads + spec.kv_heads, spec.head_dim)
            if rope is not None:
                qk = self._rotate(qk, *rope)
            q, k = qk[:, : spec.heads], qk[:, spec.heads :]  # [T, heads, head_dim], [T, kv_heads, head_dim]
        else:
            q = qkv[:, :q_size].view(t, spec.heads, spec.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, spec.kv_heads, spec.head_dim)
            q, k = self.blocks.qk_norm(self, layer, q, k)
            if rope is not None:
                q, k = self._rotate(q, *rope), self._rotate(k, *rope)
        # rows of layer i: [capacity, kv_heads, head_dim], a paged pool's [num_blocks, block_size, ...]
        # flattened (a view, so the write lands in the pool); cache_rows index them in either layout
        pool.k[i].flatten(0, -3)[cache_rows] = k
        pool.v[i].flatten(0, -3)[cache_rows] = v
        out = tree_attention(
            q.contiguous(),
            pool.k[i],
            pool.v[i],
            meta,
            self._sm_scale,
            self.attention_impl,
            spec.attn_softcap,
            self._windows[i],
        )  # [T, heads, head_dim]
        return self.reduce(self.linear(out.reshape(t, q_size), layer.o_w, layer.o_b))
