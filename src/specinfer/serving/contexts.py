"""The callee's side of the context protocol (see ``Context`` in protos/specinfer/v1/internal.proto).

Per request, a service keeps the context tokens it was told: the request's committed tokens
without the tree root. A call carries only ``context[offset:]``; the service rebuilds the whole
list from what it knows, or reports a cache miss when it knows less than ``offset`` tokens (it
restarted, or the request moved to it), and the caller resends from offset 0. The model
backends rebuild or adopt their KV caches from the full list, so this record is all the state
the protocol needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specinfer.wire_jobs import ContextUpdate, check_distinct_requests, context_from_proto

Job = TypeVar("Job")
Output = TypeVar("Output")
Message = TypeVar("Message")


@dataclass(frozen=True)
class AdmittedCall(Generic[Job]):
    """The items of one call after the context protocol: ``hits[i]`` says whether item ``i``'s context
    was resolved; ``jobs`` are the work of the hits, in call order (a miss gets no work)."""

    request_ids: tuple[str, ...]
    hits: tuple[bool, ...]
    jobs: list[Job]

    @property
    def misses(self) -> int:
        return len(self.hits) - len(self.jobs)

    def results(self, outputs: Sequence[Output], to_proto: Callable[[str, Output | None], Message]) -> list[Message]:
        """One result per item: ``to_proto(request_id, output)`` with the hits' ``outputs`` in order,
        ``to_proto(request_id, None)`` (a cache miss) for the others."""
        hit_outputs = iter(outputs)
        return [
            to_proto(rid, next(hit_outputs) if hit else None)
            for rid, hit in zip(self.request_ids, self.hits, strict=True)
        ]


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

    def admit(
        self,
        items: Sequence[Any],
        vocab_size: int,
        max_positions: int,
        job_from_proto: Callable[[Any, list[int], int, int, str], Job],
    ) -> AdmittedCall[Job]:
        """Resolve the contexts of a call's ``items`` (messages with a ``context`` field) and build each
        one's job with ``job_from_proto(item, context, vocab_size, max_positions, field)``. Every item
        is validated, misses included, before any context is stored: an invalid call changes nothing."""
        updates = [context_from_proto(item.context, vocab_size, f"items[{i}].context") for i, item in enumerate(items)]
        contexts = self.resolve_all(updates)
        pairs = enumerate(zip(items, contexts, strict=True))
        jobs = [job_from_proto(item, ctx or [], vocab_size, max_positions, f"items[{i}]") for i, (item, ctx) in pairs]
        self.store_all(updates, contexts)
        hits = tuple(ctx is not None for ctx in contexts)
        return AdmittedCall(
            tuple(u.request_id for u in updates), hits, [job for job, hit in zip(jobs, hits, strict=True) if hit]
        )
