"""Per-request KV storage with the context/pending bookkeeping of the model interface.

Pure tensor bookkeeping, independent of how attention is computed: a backend asks
:meth:`RequestCache.sync` which context tokens still need computing, runs its forward pass,
and hands the new keys/values back with :meth:`RequestCache.append`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class _Buffer:
    """Growable ``[layers, 2, kv_heads, length, head_dim]`` tensor (capacity doubles)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._data = torch.empty(layers, 2, kv_heads, 16, head_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def kv(self) -> torch.Tensor:
        return self._data[:, :, :, : self.length]  # [layers, 2, kv_heads, length, head_dim]

    def append(self, kv: torch.Tensor) -> None:
        n = kv.shape[3]
        need = self.length + n
        if need > self._data.shape[3]:
            cap = max(need, 2 * self._data.shape[3])
            grown = torch.empty(*self._data.shape[:3], cap, self._data.shape[4], dtype=self._data.dtype, device=self._data.device)
            grown[:, :, :, : self.length] = self.kv
            self._data = grown
        self._data[:, :, :, self.length : need] = kv
        self.length = need

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class RequestCache:
    """KV of one request: the committed context plus pending tree nodes."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.context = _Buffer(layers, kv_heads, head_dim, dtype, device)
        self.context_tokens: list[int] = []
        self.pending = _Buffer(layers, kv_heads, head_dim, dtype, device)
        self.pending_tokens: list[int] = []
        self.pending_parents: list[int] = []
        self.pending_depths: list[int] = []

    def sync(self, context: Sequence[int]) -> list[int]:
        """Make the cache stand for ``context``; returns the context tokens still to compute.

        Keeps the longest cached prefix of ``context``, adopting pending nodes along the path
        ``context`` continues with; drops every other pending node.
        """
        context = list(context)
        if context == self.context_tokens:
            return []
        common = 0
        limit = min(len(context), len(self.context_tokens))
        while common < limit and context[common] == self.context_tokens[common]:
            common += 1
        if common < len(self.context_tokens):
            self.context.truncate(common)
            del self.context_tokens[common:]
        else:
            self._adopt(context[common:])
        self._clear_pending()
        return context[len(self.context_tokens) :]

    def _adopt(self, continuation: list[int]) -> None:
        node, path = -1, []
        for token in continuation:
            nxt = next(
                (j for j, (t, p) in enumerate(zip(self.pending_tokens, self.pending_parents, strict=True)) if t == token and p == node),
                None,
            )
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        if path:
            self.context.append(self.pending.kv[:, :, :, path])
            self.context_tokens.extend(self.pending_tokens[j] for j in path)

    def _clear_pending(self) -> None:
        self.pending.truncate(0)
        self.pending_tokens.clear()
        self.pending_parents.clear()
        self.pending_depths.clear()

    def append_context(self, tokens: Sequence[int], kv: torch.Tensor) -> None:
        """Store computed context tokens.  kv: [layers, 2, kv_heads, len(tokens), head_dim]"""
        self.context.append(kv)
        self.context_tokens.extend(tokens)

    def append_pending(self, tokens: Sequence[int], parents: Sequence[int], kv: torch.Tensor) -> None:
        for t, p in zip(tokens, parents, strict=True):
            if not -1 <= p < len(self.pending_tokens):
                raise ValueError(f"parent {p} does not name a pending node")
            self.pending_depths.append(0 if p < 0 else self.pending_depths[p] + 1)
            self.pending_tokens.append(int(t))
            self.pending_parents.append(int(p))
        self.pending.append(kv)

    def node_depths(self, parents: Sequence[int]) -> list[int]:
        """Depths (0 = right after the context) of new nodes with these parents."""
        depths = list(self.pending_depths)
        out = []
        for p in parents:
            if not -1 <= p < len(depths):
                raise ValueError(f"parent {p} does not name a pending or earlier node")
            d = 0 if p < 0 else depths[p] + 1
            depths.append(d)
            out.append(d)
        return out

    def ancestors(self, parents: Sequence[int]) -> list[list[int]]:
        """For each new node, the pending/new node indices it attends to (itself included)."""
        chains: list[list[int]] = []
        all_parents = self.pending_parents + list(parents)
        memo: dict[int, list[int]] = {}

        def anc(j: int) -> list[int]:
            if j not in memo:
                p = all_parents[j]
                memo[j] = ([] if p < 0 else anc(p)) + [j]
            return memo[j]

        for i in range(len(parents)):
            chains.append(anc(len(self.pending_parents) + i))
        return chains
