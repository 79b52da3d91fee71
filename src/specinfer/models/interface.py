"""The model interface shared by every backend.

One operation covers both roles: run a causal LM over new *tree nodes* of several requests at
once, each request on top of its committed context, and return logits for those nodes.

- LLM role (verify): ``context`` = committed tokens without the root, ``tokens``/``parents`` =
  the whole token tree (root first, ``parents[0] == -1``).
- SSM role (expand): the same context, first the root alone, then each depth's frontier nodes
  with parents indexing the nodes sent before in this round.

A backend keeps a KV cache per request. It holds the committed context plus the *pending*
nodes sent since the context last changed. When a call arrives with a longer context, pending
nodes on the path that context took are adopted into the cache (the accepted path of the last
verify step) and the rest are dropped; context tokens the cache does not hold (a new request,
a lost cache, a moved request) are computed in the same forward pass as a chain before the
nodes. A cache is therefore only ever a cache: the committed tokens rebuild it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specinfer.core.kv_budget import KVBudget, PrefixCacheStats

if TYPE_CHECKING:
    from specinfer.models.native.graphs import GraphStats


@dataclass(frozen=True)
class TreeForward:
    """One request's share of a batched forward pass.

    ``parents[j]`` indexes the request's pending nodes (sent earlier with the same context,
    then the ones before j in this call); -1 attaches the node right after the context. Only
    the first node of a round may attach to the context: a call whose first node does starts
    a new round and drops the pending nodes of the previous one.
    """

    request_id: str
    context_tokens: Sequence[int]  # the committed tokens before the nodes (the whole context, every call)
    tokens: Sequence[int]
    parents: Sequence[int]


class CausalLM(Protocol):
    """A causal LM with per-request KV caches (see the module docstring)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def max_requests(self) -> int | None:
        """Most requests whose caches fit at once, each at its longest (None: bounded only by memory)."""
        ...

    @property
    def kv_budget(self) -> KVBudget | None:
        """The KV cache's size in KV blocks (:mod:`specinfer.core.kv_budget`; one block per request
        for a cache of contiguous slots), which drivers admit and preempt by; None: bounded only by
        memory."""
        ...

    @property
    def kv_blocks_free(self) -> int | None:
        """KV blocks of :attr:`kv_budget` no request holds now (None: no budget)."""
        ...

    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        """Logits for the new nodes of each request, in ``batch`` order.  # each [n_new, V]

        They live on the model's device (a backend's ``device`` option), and are returned without
        waiting for the device to finish computing them. Callers read values only through one
        device-to-host copy per call of small results (:mod:`specinfer.models.on_device`): any other
        read (``.numpy()``, ``.item()``, ``.cpu()``, ...) is a copy and a wait of its own on a GPU."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request's cache (finished or moved)."""
        ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Totals of the prefix cache since load (None: the backend has none, or it is off)."""
        ...

    @property
    def graph_stats(self) -> GraphStats | None:
        """What the backend's CUDA graphs captured at warm-up and since (None: it replays none)."""
        ...

    def prefix_hits(self, request_id: str) -> int:
        """Context tokens of the request that its latest forward took from the prefix cache instead
        of computing (0: none, no prefix cache, or an unknown request)."""
        ...
