"""A step's Redis append overlapped with the next step: tokens committed in memory at once, published once durable.

Through the services, a step of the bundled demo LLM spent ~0.57 ms of its ~3.6 ms waiting for the append of its
tokens (one script call on Redis, and the wake-ups of two processes), before the next step's trees could go out
(BENCHMARKS.md, "The step loop through the services"). Here a verified step is committed to the request in memory at
once, so the next step drafts and verifies on top of it while its append is in flight, as SGLang's overlap scheduler
overlaps a batch's bookkeeping with the next one's forward pass. What stays as before:

- A token reaches a client stream only after Redis acknowledged its append (:meth:`Appends.start` publishes the
  step's event when the append returns).
- A request has at most one append in flight. Its next commit, and its finish, settle it first
  (:meth:`Appends.settle`), so appends reach Redis in order, each at the offset it expects.
- A failed append is not lost: :meth:`Appends.settle` raises its error (the scheduler's iteration fails and backs
  off, as when an awaited append failed) and starts the same append again. The store recognizes a retried append
  of tokens it already holds at that offset, so a retry never counts them twice.
- A replica that crashes with appends in flight published none of their tokens; the replica that adopts the request
  from Redis computes them again (the same tokens: greedy, or the request's seeded stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from specinfer.core.requests import StepStats, TokenLogprob
from specinfer.request_manager.scheduling.live import Live, StreamEvent
from specinfer.request_manager.state.store import Appended, RequestStore
from specinfer.request_manager.state.store_errors import NOT_OURS


@dataclass(frozen=True)
class Append:
    """One step's append: its tokens at ``offset`` in the output, their statistics and logprobs (``top_logprobs``
    alternatives each), and ``event``: what the request's streams get once Redis holds them (None: nothing, the
    finish publishes them)."""

    tokens: tuple[int, ...]
    stats: StepStats
    offset: int
    logprobs: tuple[TokenLogprob, ...]
    top_logprobs: int
    event: StreamEvent | None


class Appends:
    """The appends in flight, at most one per request (by request ID)."""

    def __init__(self, store: RequestStore, owner: str, lease_token: str) -> None:
        self.store = store
        self.owner = owner
        self.lease_token = lease_token
        self._inflight: dict[str, tuple[asyncio.Task[Appended], Append]] = {}

    def start(self, live: Live, append: Append) -> None:
        """Send ``append`` of ``live`` (whose previous one is settled) to Redis, in the background."""
        assert live.request_id not in self._inflight, "settle a request's append before its next"
        task = asyncio.get_running_loop().create_task(self._append(live, append))
        self._inflight[live.request_id] = (task, append)

    async def settle(self, live: Live) -> None:
        """Wait for ``live``'s append in flight, if any. Its error is raised (the store's fencing errors as they
        are: the request is not ours); any other leaves the same append in flight again, retried."""
        entry = self._inflight.get(live.request_id)
        if entry is None:
            return
        task, append = entry
        try:
            await asyncio.shield(task)  # an iteration cancelled while it waits leaves the append to finish
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the waiter was cancelled, not the append: it stays in flight
            self._retry(live, append)
            raise
        except NOT_OURS:
            del self._inflight[live.request_id]
            raise
        except Exception:
            self._retry(live, append)
            raise
        del self._inflight[live.request_id]

    def forget(self, request_id: str) -> None:
        """Stop following a request's append (it is not ours any more): its outcome is not needed."""
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            entry[0].add_done_callback(_retrieve)

    async def drain(self) -> None:
        """Wait for every append in flight (the scheduler stops): those that fail are left to the replica that
        adopts their requests, which computes their tokens again."""
        tasks = [task for task, _ in self._inflight.values()]
        self._inflight.clear()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _retry(self, live: Live, append: Append) -> None:
        del self._inflight[live.request_id]
        self.start(live, append)

    async def _append(self, live: Live, append: Append) -> Appended:
        appended = await self.store.append_tokens(
            live.request_id,
            append.tokens,
            append.stats,
            owner=self.owner,
            offset=append.offset,
            lease_token=self.lease_token,
            logprobs=append.logprobs,
            top_logprobs=append.top_logprobs,
        )
        if appended.cancel_requested:  # by a replica that does not run it: stopped at the next iteration boundary
            live.stop_reason = live.stop_reason or "cancelled"
        if append.event is not None:
            live.publish(append.event)
        return appended


def _retrieve(task: asyncio.Task) -> None:
    """Mark a forgotten append's outcome as seen (asyncio logs errors no one retrieved)."""
    with contextlib.suppress(asyncio.CancelledError):
        task.exception()
