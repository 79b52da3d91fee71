"""Per-request KV bookkeeping shared by the backends (see :mod:`specinfer.models.interface`).

:class:`RequestCache` tracks which tokens a request's cache holds: the committed *context*
and the *pending* tree nodes sent since the context last changed. Where the keys and values
physically live is a :class:`KVStorage`: growable tensors for the reference backend
(:class:`BufferStorage`), a slot of a preallocated pool for the native backend. A backend asks
:meth:`RequestCache.sync` which context tokens still need computing, runs its forward pass,
stores the new keys/values and records them with :meth:`record_context` / :meth:`record_pending`.
A storage with a prefix cache (:mod:`specinfer.models.native.paged_pool`) may hold some context
tokens it never computed: :meth:`RequestCache.sync` asks it for them before answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVStorage(Protocol):
    """Where one request's keys and values live: context entries, then pending entries."""

    def truncate_context(self, length: int) -> int:
        """Keep at most the first ``length`` context entries; returns how many it kept (fewer when
        entries it shares with other requests would be overwritten)."""
        ...

    def adopt_pending(self, context_len: int, path: list[int]) -> None:
        """Append pending entries ``path`` (indices, increasing) to the context (now
        ``context_len`` long), in order."""
        ...

    def clear_pending(self) -> None: ...

    def reuse_cached(self, context: Sequence[int], held: int) -> int:
        """Take entries for tokens of ``context`` past the ``held`` ones from a prefix cache
        (entries other requests computed); returns how many leading tokens of ``context[held:]``
        it now holds (0: no prefix cache, or no hit)."""
        ...

    def cache_context(self, context: Sequence[int]) -> None:
        """The storage holds the entries of ``context`` (all of it is committed): a prefix cache
        may offer them to other requests."""
        ...


class RequestCache:
    """Token bookkeeping of one request's KV cache."""

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.context_tokens: list[int] = []
        self.pending_tokens: list[int] = []
        self.pending_parents: list[int] = []  # -1: attached to the context; j: pending node j
        self.reused = 0  # context tokens the last sync took from the storage's prefix cache

    @property
    def context_len(self) -> int:
        return len(self.context_tokens)

    @property
    def pending_len(self) -> int:
        return len(self.pending_tokens)

    def sync(self, context: Sequence[int], new_round: bool = False) -> list[int]:
        """Make the cache stand for ``context``; returns the context tokens still to compute.

        Keeps the longest cached prefix of ``context``, adopting pending nodes along the path
        ``context`` continues with (the accepted path of the last verify step); drops every
        other pending node. ``new_round``: the caller starts a new tree (its first node attaches
        to the context), so pending nodes of an earlier round on the same context are dropped.
        """
        context = list(context)
        self.reused = 0
        if context == self.context_tokens:
            if new_round:
                self._drop_pending()
            return []
        cached = len(self.context_tokens)
        if context[:cached] == self.context_tokens:  # the usual step: the cache's context, then more (one C compare)
            common = cached
        else:
            common, limit = 0, min(len(context), cached)
            while common < limit and context[common] == self.context_tokens[common]:
                common += 1
        if common < len(self.context_tokens):
            del self.context_tokens[self.storage.truncate_context(common) :]
        else:
            path = self._matching_path(context[common:])
            if path:
                self.storage.adopt_pending(len(self.context_tokens), path)
                self.context_tokens.extend(self.pending_tokens[j] for j in path)
        self._drop_pending()
        held = len(self.context_tokens)
        self.reused = self.storage.reuse_cached(context, held)
        self.context_tokens.extend(context[held : held + self.reused])
        return context[len(self.context_tokens) :]

    def _drop_pending(self) -> None:
        self.storage.clear_pending()
        self.pending_tokens.clear()
        self.pending_parents.clear()

    def _matching_path(self, continuation: list[int]) -> list[int]:
        children: dict[tuple[int, int], int] = {}
        for j, (t, p) in enumerate(zip(self.pending_tokens, self.pending_parents, strict=True)):
            children.setdefault((p, t), j)
        node, path = -1, []
        for token in continuation:
            nxt = children.get((node, token))
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return path

    def record_context(self, tokens: Sequence[int]) -> None:
        self.context_tokens.extend(int(t) for t in tokens)
        self.storage.cache_context(self.context_tokens)

    def record_pending(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        self.pending_tokens.extend(int(t) for t in tokens)
        self.pending_parents.extend(int(p) for p in parents)

    def node_parents(self, parents: Sequence[int]) -> list[int]:
        """The parent array of the pending nodes followed by new nodes with ``parents``; its depths
        (:func:`specinfer.core.node_depths`, 0 = right after the context) give positions and its
        :func:`specinfer.core.ancestor_matrix` the attention mask."""
        nodes = self.pending_parents + [int(p) for p in parents]
        for i in range(self.pending_len, len(nodes)):
            if not -1 <= nodes[i] < i:
                raise ValueError(f"parent {nodes[i]} does not name a pending or earlier node")
        return nodes


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
            grown = torch.empty(
                *self._data.shape[:3], cap, self._data.shape[4], dtype=self._data.dtype, device=self._data.device
            )
            grown[:, :, :, : self.length] = self.kv
            self._data = grown
        self._data[:, :, :, self.length : need] = kv
        self.length = need

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class BufferStorage:
    """KV in two growable tensors (context, pending): the reference backend's storage."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.context = _Buffer(layers, kv_heads, head_dim, dtype, device)
        self.pending = _Buffer(layers, kv_heads, head_dim, dtype, device)

    def truncate_context(self, length: int) -> int:
        self.context.truncate(length)
        return length

    def adopt_pending(self, context_len: int, path: list[int]) -> None:
        self.context.append(self.pending.kv[:, :, :, path])

    def clear_pending(self) -> None:
        self.pending.truncate(0)

    def reuse_cached(self, context: Sequence[int], held: int) -> int:
        return 0  # no prefix cache

    def cache_context(self, context: Sequence[int]) -> None:
        """No prefix cache."""
