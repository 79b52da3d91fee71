"""The callee's side of the context protocol (see ``Context`` in protos/specinfer/v1/internal.proto).

Per request, a service keeps the context tokens it was told: the request's committed tokens
without the tree root. A call carries only ``context[offset:]``; the service rebuilds the whole
list from what it knows, or reports a cache miss when it knows less than ``offset`` tokens (it
restarted, or the request moved to it), and the caller resends from offset 0. The model
backends rebuild or adopt their KV caches from the full list, so this record is all the state
the protocol needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from specinfer.wire import ContextUpdate, check_distinct_requests


class ContextStore:
    """Known context tokens per request."""

    def __init__(self) -> None:
        self._known: dict[str, list[int]] = {}

    def resolve(self, update: ContextUpdate) -> list[int] | None:
        """The full context ``update`` names, or None (cache miss) when the prefix it builds on
        is unknown. Changes nothing: the caller stores the result once the whole call is valid."""
        known = self._known.get(update.request_id, [])
        if update.offset > len(known):
            return None
        # an offset below len(known) rewinds: the caller's context diverged there
        return known[: update.offset] + list(update.tokens)

    def resolve_all(self, updates: Sequence[ContextUpdate]) -> list[list[int] | None]:
        """:meth:`resolve` for the items of one call (one item per request)."""
        check_distinct_requests(updates)
        return [self.resolve(u) for u in updates]

    def store(self, request_id: str, context: Sequence[int]) -> None:
        self._known[request_id] = list(context)

    def store_all(self, updates: Sequence[ContextUpdate], contexts: Sequence[list[int] | None]) -> None:
        """Record the resolved contexts of a valid call (misses stay unknown)."""
        for update, context in zip(updates, contexts, strict=True):
            if context is not None:
                self.store(update.request_id, context)

    def forget(self, request_id: str) -> None:
        self._known.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._known

    def __len__(self) -> int:
        return len(self._known)
