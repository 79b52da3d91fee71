"""The caller's side of the context protocol (see ``Context`` in protos/specinfer/v1/internal.proto).

A request's *context* is its committed tokens without the tree root. Each callee (an SSM worker or
the LLM verifier) caches the contexts it was sent, per request; the caller remembers how many tokens
of it each callee holds (:class:`ContextTracker`) and sends only the rest, from that *offset* on. A
callee that lost a context (it restarted, or the request moved to it) answers the item with
``cache_miss``, and :func:`call_with_context` sends that item once more with its whole context.
The callee's side is :mod:`specinfer.serving.contexts`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from specinfer import wire_jobs
from specinfer.v1 import internal_pb2


class ContextTracker:
    """How many context tokens one callee holds per request."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def message(self, request_id: str, context: Sequence[int]) -> internal_pb2.Context:
        known = min(self._known.get(request_id, 0), len(context))
        return wire_jobs.context_to_proto(request_id, context, known)

    def sent(self, request_id: str, length: int) -> None:
        self._known[request_id] = length

    def forget(self, request_id: str) -> None:
        self._known.pop(request_id, None)

    def reset(self) -> None:
        self._known.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._known


async def call_with_context(
    send: Callable[[list[Any], list[internal_pb2.Context]], Awaitable[Sequence[Any]]],
    calls: Sequence[Any],
    tracker: ContextTracker,
):
    """Send ``calls`` (each with ``request_id`` and ``context``) through ``send(calls, contexts)``,
    which returns one result per call; items answered with cache_miss are sent once more with
    their whole context. Returns the callee's results by request ID."""
    results = {}
    pending = list(calls)
    for attempt in range(2):
        contexts = [
            tracker.message(c.request_id, c.context_tokens)
            if attempt == 0
            else wire_jobs.context_to_proto(c.request_id, c.context_tokens, 0)
            for c in pending
        ]
        response = await send(pending, contexts)
        retry = []
        for call, result in zip(pending, response, strict=True):
            if result.cache_miss:
                tracker.forget(call.request_id)
                retry.append(call)
            else:
                tracker.sent(call.request_id, len(call.context_tokens))
                results[call.request_id] = result
        if not retry:
            return results
        pending = retry
    raise RuntimeError(f"callee reported a cache miss for a full context: {[c.request_id for c in pending]}")
