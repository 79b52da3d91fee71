"""The request manager's operations on requests, as the public API offers them.

A request lives in two places: the scheduler holds it while it runs (:class:`Live`), the store holds
its durable record from admission on, and after it finished (:mod:`specinfer.request_manager.live_records`
maps one onto the other). :class:`Requests` spans both; failures are the domain errors of
:mod:`specinfer.core.errors`, which ``rpc_errors`` turns into statuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenizers import Tokenizer

from specinfer.core.errors import AlreadyExists, NotFound
from specinfer.request_manager.admission import ApiLimits
from specinfer.request_manager.live_records import live_from_snapshot, live_record, snapshot_finish
from specinfer.request_manager.records import RequestSnapshot, RequestStatus
from specinfer.request_manager.scheduler import Finish, Live, Scheduler, StreamEvent
from specinfer.request_manager.store import RequestExistsError, RequestStore

log = logging.getLogger("specinfer.request_manager")


@dataclass(frozen=True)
class RequestState:
    """What a reader sees of a request: its stored record, where it stands, and its final state once finished."""

    snapshot: RequestSnapshot
    status: RequestStatus
    finish: Finish | None


class Requests:
    """Admits, streams, reattaches to, looks up and recovers the requests of replica ``owner``."""

    def __init__(self, scheduler: Scheduler, store: RequestStore, limits: ApiLimits, tokenizer: Tokenizer | None, owner: str) -> None:
        self.scheduler = scheduler
        self.store = store
        self.limits = limits
        self.tokenizer = tokenizer
        self.owner = owner

    async def start(self, live: Live) -> AsyncIterator[StreamEvent]:
        """Admit a new (validated) request, persisted before it is queued, then stream its events up to the
        finishing one. A request still unfinished when the caller stops reading is cancelled: the client went
        away or its deadline passed, and its batch slot is freed."""
        rid = live.request_id
        if self.scheduler.get(rid) is not None:
            raise AlreadyExists("request_id", f"{rid!r} is already running")
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        live.subscribers.append(queue)
        try:
            self.scheduler.check_room()
            await self.store.create(live_record(live, self.limits.ssm_names, self.owner))
            await self.scheduler.submit(live)
        except RequestExistsError as exc:
            raise AlreadyExists("request_id", str(exc)) from None
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finished is not None:
                    return
        finally:
            if live.finished is None:
                self.scheduler.cancel(rid)

    async def attach(self, request_id: str, offset: int) -> AsyncIterator[StreamEvent]:
        """Reattach to a request from output offset ``offset`` on. A running one: one event with the tokens
        committed already (possibly none), then its new events, trimmed so that no token comes twice, up to
        the finishing one. Any other: one event with its stored tokens (and final state once finished)."""
        live = self.scheduler.get(request_id)
        if live is not None and live.finished is None:
            queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
            live.subscribers.append(queue)  # subscribe first, then send the backlog: nothing is lost in between
            try:
                backlog = tuple(live.output[offset:])
                yield StreamEvent(offset, backlog, "")
                sent = offset + len(backlog)  # output offset up to which tokens went out
                while True:
                    event = await queue.get()
                    yield StreamEvent(max(sent, event.offset), event.tokens[max(0, sent - event.offset) :], event.text, event.finished)
                    if event.finished is not None:
                        return
                    sent = max(sent, event.offset + len(event.tokens))
            finally:
                live.subscribers.remove(queue)
        snapshot = await self._snapshot(request_id)
        yield StreamEvent(offset, snapshot.output_tokens[offset:], "", snapshot_finish(snapshot))

    def cancel(self, request_id: str) -> bool:
        """Stop a running request at the next iteration; False when none runs under this ID."""
        return self.scheduler.cancel(request_id)

    async def state(self, request_id: str) -> RequestState:
        live = self.scheduler.get(request_id)
        snapshot = await self._snapshot(request_id)
        finish = snapshot_finish(snapshot)
        if finish is not None:
            status = RequestStatus.FINISHED
        elif live is not None and self.scheduler.is_queued(request_id):
            status = RequestStatus.QUEUED
        else:
            status = RequestStatus.RUNNING
        return RequestState(snapshot, status, finish)

    async def _snapshot(self, request_id: str) -> RequestSnapshot:
        snapshot = await self.store.get(request_id)
        if snapshot is None:
            raise NotFound("request_id", f"no request {request_id!r}")
        return snapshot

    async def recover(self) -> list[str]:
        """Resume the unfinished requests this replica owns in Redis (after a restart); their IDs."""
        resumed = []
        for rid in await self.store.active(self.owner):
            snapshot = await self.store.get(rid)
            if snapshot is None or snapshot.is_finished:
                continue
            try:
                live = live_from_snapshot(snapshot, self.limits, self.tokenizer)
            except (KeyError, TypeError, ValueError) as exc:  # a record this version cannot read
                log.error("cannot resume request", extra={"request_id": rid, "error": repr(exc)})
                await self.store.finish(rid, "error", f"cannot resume: {exc}", owner=self.owner)
                continue
            self.scheduler.resume(live)
            resumed.append(rid)
        if resumed:
            log.info("resumed requests from Redis", extra={"count": len(resumed)})
        return resumed
