"""Reference backend: any Hugging Face causal LM through ``transformers``.

The tree mask is passed as a 4D additive attention mask and node positions as
``position_ids``; keys and values live in per-request :class:`RequestCache` objects and are
packed into a padded ``DynamicCache`` for each batched forward. It is the correctness oracle
for the native backend, not the fast path: every step copies the cached KV into the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from specinfer.core.tree import ancestor_matrix, node_depths
from specinfer.models.interface import TreeForward
from specinfer.models.kv_store import BufferStorage, RequestCache


@dataclass(frozen=True)
class _Row:
    """Layout of one request inside the padded batch."""

    cache: RequestCache
    chain: list[int]  # context tokens computed in this pass
    offset: int  # first query row of this request (queries are right-aligned)
    past: int  # cached entries (context + pending)


class ReferenceBackend:
    """A ``transformers`` model implementing :class:`specinfer.models.interface.CausalLM`."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self._caches: dict[str, RequestCache] = {}
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._layers, self._kv_heads, self._head_dim = self._probe_cache_shape()
        self._sliding = self._sliding_layout()

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ReferenceBackend:
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
        return cls(model.to(device))

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def max_requests(self) -> int | None:
        return None

    @property
    def kv_budget(self) -> None:
        return None  # growable tensors per request

    @property
    def kv_blocks_free(self) -> None:
        return None

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    @property
    def prefix_cache_stats(self) -> None:
        return None  # every request's cache is its own

    @property
    def graph_stats(self) -> None:
        return None  # transformers' forward, no CUDA graphs of ours

    def prefix_hits(self, request_id: str) -> int:
        return 0

    def cached_requests(self) -> list[str]:
        return list(self._caches)

    # -- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        if not batch:
            return []
        rows = []
        for item in batch:
            cache = self._caches.get(item.request_id)
            if cache is None:
                cache = RequestCache(
                    BufferStorage(self._layers, self._kv_heads, self._head_dim, self._dtype, self._device)
                )
                self._caches[item.request_id] = cache
            chain = cache.sync(item.context_tokens, new_round=bool(item.parents) and item.parents[0] < 0)
            rows.append((item, cache, chain))
        q_max = max(len(chain) + len(item.tokens) for item, _, chain in rows)
        if q_max == 0:  # every cache already holds its context and no nodes came (a prefill that is up to date)
            return [torch.empty(0, self.vocab_size) for _ in rows]
        p_max = max(cache.context_len + cache.pending_len for _, cache, _ in rows)
        n_max = max(len(item.tokens) for item, _, _ in rows)
        # transformers reads logits_to_keep=0 as "keep every position", so keep at least one row
        # (a prefill sends no nodes) and slice each request's n rows from the end
        keep = max(n_max, 1)
        bsz = len(rows)

        # filled row by row in NumPy (a slice assignment there costs a tenth of torch's), then shared with torch
        input_ids = np.zeros((bsz, q_max), dtype=np.int64)  # [B, Q]
        positions = np.zeros((bsz, q_max), dtype=np.int64)  # [B, Q]
        allowed = np.zeros((bsz, q_max, p_max + q_max), dtype=bool)  # [B, Q, P+Q]
        key_pos = np.zeros((bsz, p_max + q_max), dtype=np.int64)  # [B, P+Q]
        layout: list[_Row] = []
        for b, (item, cache, chain) in enumerate(rows):
            layout.append(self._fill_row(b, item, cache, chain, q_max, p_max, input_ids, positions, allowed, key_pos))
        input_ids, positions, allowed, key_pos = map(torch.from_numpy, (input_ids, positions, allowed, key_pos))

        mask = self._attention_mask(allowed, positions, key_pos)
        past = self._pack_past(layout, p_max)
        out = self.model(
            input_ids=input_ids.to(self._device),
            position_ids=positions.to(self._device),
            attention_mask=mask,
            past_key_values=past,
            use_cache=True,
            logits_to_keep=keep,
        )
        new_cache = out.past_key_values
        results = []
        for b, ((item, _, _), row) in enumerate(zip(rows, layout, strict=True)):
            q_len = len(row.chain) + len(item.tokens)
            start = p_max + row.offset
            kv = torch.stack(
                [
                    torch.stack([layer.keys[b, :, start : start + q_len], layer.values[b, :, start : start + q_len]])
                    for layer in new_cache.layers
                ]
            )  # [layers, 2, kv_heads, q_len, head_dim]
            m = len(row.chain)
            storage = row.cache.storage
            storage.context.append(kv[:, :, :, :m])
            row.cache.record_context(row.chain)
            storage.pending.append(kv[:, :, :, m:])
            row.cache.record_pending(item.tokens, item.parents)
            n = len(item.tokens)
            results.append(out.logits[b, keep - n :].float())  # [n, V]
        return results

    def _fill_row(self, b, item, cache, chain, q_max, p_max, input_ids, positions, allowed, key_pos) -> _Row:
        lc, lp = cache.context_len, cache.pending_len
        m, n = len(chain), len(item.tokens)
        off = q_max - m - n
        ctx_len = lc + m  # == len(item.context_tokens)
        nodes = cache.node_parents(item.parents)  # pending nodes, then the new ones
        depths = node_depths(nodes)  # [lp + n]
        ancestors = ancestor_matrix(nodes)[lp:]  # [n, lp + n] bool

        input_ids[b, off : off + m] = chain
        input_ids[b, off + m :] = item.tokens
        positions[b, off : off + m] = np.arange(lc, ctx_len)
        positions[b, off + m :] = depths[lp:] + ctx_len
        key_pos[b, :lc] = np.arange(lc)
        key_pos[b, lc : lc + lp] = depths[:lp] + lc
        key_pos[b, p_max:] = positions[b]

        pad = np.arange(off)  # padding rows attend to themselves only, so they stay finite
        allowed[b, pad, p_max + pad] = True
        allowed[b, off:, :lc] = True  # every real query sees the cached context
        chain_cols = p_max + off
        allowed[b, off : off + m, chain_cols : chain_cols + m] = np.tri(m, dtype=bool)
        allowed[b, off + m :, chain_cols : chain_cols + m] = True
        # new nodes see their pending ancestors (cached behind the context) and their new ones (behind the chain)
        allowed[b, off + m :, lc : lc + lp] = ancestors[:, :lp]
        allowed[b, off + m :, chain_cols + m :] = ancestors[:, lp:]
        return _Row(cache, list(chain), off, lc + lp)

    def _attention_mask(self, allowed, positions, key_pos):
        """Additive float mask(s); a dict per layer type when some layers use a sliding window."""
        neg = torch.finfo(self._dtype).min

        def additive(ok: torch.Tensor) -> torch.Tensor:
            m = torch.zeros(ok.shape, dtype=self._dtype).masked_fill_(~ok, neg)
            return m[:, None].to(self._device)  # [B, 1, Q, P+Q]

        if self._sliding is None:
            return additive(allowed)
        window, layer_types = self._sliding
        distance = positions[:, :, None] - key_pos[:, None, :]  # [B, Q, P+Q]
        diag_pad = allowed & (distance == 0)  # keep padding rows' self-attention
        slid = additive((allowed & (distance < window)) | diag_pad)
        if layer_types is None:
            return slid
        return {"full_attention": additive(allowed), "sliding_attention": slid}

    def _pack_past(self, layout: list[_Row], p_max: int) -> DynamicCache:
        if p_max == 0:
            return DynamicCache()
        data = torch.zeros(
            self._layers, 2, len(layout), self._kv_heads, p_max, self._head_dim, dtype=self._dtype, device=self._device
        )
        for b, row in enumerate(layout):
            lc, lp = row.cache.context_len, row.cache.pending_len
            data[:, :, b, :, :lc] = row.cache.storage.context.kv
            data[:, :, b, :, lc : lc + lp] = row.cache.storage.pending.kv
        return DynamicCache(ddp_cache_data=[(data[layer, 0], data[layer, 1]) for layer in range(self._layers)])

    # -- model facts -----------------------------------------------------------------------

    @torch.inference_mode()
    def _probe_cache_shape(self) -> tuple[int, int, int]:
        out = self.model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=self._device),
            past_key_values=DynamicCache(),
            use_cache=True,
        )
        layers = out.past_key_values.layers
        _, kv_heads, _, head_dim = layers[0].keys.shape
        return len(layers), int(kv_heads), int(head_dim)

    def _sliding_layout(self) -> tuple[int, list[str] | None] | None:
        window = getattr(self.config, "sliding_window", None)
        if not window or getattr(self.config, "use_sliding_window", True) is False:
            return None
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        mixed = layer_types is not None and "full_attention" in layer_types
        return int(window), (list(layer_types) if mixed else None)
