"""The request manager's operations on requests, as the public API offers them.

A request lives in two places: the scheduler of its owner holds it while it runs (:class:`Live`), the
store holds its durable record from admission on, and after it finished
(:mod:`specinfer.request_manager.state.live_records` maps one onto the other). :class:`Requests` spans both;
failures are the domain errors of :mod:`specinfer.core.errors`, which ``rpc_errors`` turns into statuses.

Any replica serves any request: one that does not run a request streams it from Redis
(:meth:`Requests.attach`), marks it for its owner to cancel (:meth:`Requests.cancel`) and reads its
state from the store; who runs what, and how requests move between replicas, is :mod:`.ownership`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import redis.exceptions
from tokenizers import Tokenizer

from specinfer.core.errors import AlreadyExists, NotFound, Unavailable
from specinfer.request_manager.api.admission import ApiLimits
from specinfer.request_manager.api.text import TextStream
from specinfer.request_manager.scheduling.live import MOVED, Finish, Live, StreamEvent
from specinfer.request_manager.scheduling.scheduler import Scheduler
from specinfer.request_manager.state.live_records import (
    live_from_snapshot,
    live_record,
    resumed_text,
    snapshot_finish,
    snapshot_text_stream,
)
from specinfer.request_manager.state.ownership import Lease
from specinfer.request_manager.state.records import RequestSnapshot, RequestStatus
from specinfer.request_manager.state.store import RequestStore, Tail
from specinfer.request_manager.state.store_errors import RequestExistsError, StoreError

log = logging.getLogger("specinfer.request_manager")

# how often a replica that does not run a request reads its new tokens from Redis while streaming it:
# one small script call (the output from the offset on, a few bytes) per stream and poll, and at most
# this much latency added to a token; Redis pub/sub would save the polls but loses messages sent while
# a subscriber reconnects, and its channels are per node on a cluster
FOLLOW_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class RequestState:
    """What a reader sees of a request: its stored record, where it stands, and its final state once finished."""

    snapshot: RequestSnapshot
    status: RequestStatus
    finish: Finish | None


class Requests:
    """Admits, streams, reattaches to, looks up, cancels, recovers and adopts requests; this replica's
    owner ID and the token its writes are fenced with are ``lease``'s."""

    def __init__(
        self, scheduler: Scheduler, store: RequestStore, limits: ApiLimits, tokenizer: Tokenizer | None, lease: Lease
    ) -> None:
        self.scheduler = scheduler
        self.store = store
        self.limits = limits
        self.tokenizer = tokenizer
        self.lease = lease
        self.grammars = scheduler.core.grammars.grammars  # structured outputs' (None: constrained requests refused)
        self.owner = lease.owner

    async def start(self, live: Live) -> AsyncIterator[StreamEvent]:
        """Admit a new (validated) request, persisted before it is queued, then stream its events up to the
        finishing one. A request still unfinished when the caller stops reading is cancelled: the client went
        away or its deadline passed, and its batch slot is freed. Refused (Unavailable) while this replica
        does not hold its lease: another replica may be adopting what it owns."""
        rid = live.request_id
        if self.scheduler.get(rid) is not None:
            raise AlreadyExists("request_id", f"{rid!r} is already running")
        if not self.lease.held:
            raise Unavailable(
                "this request manager does not hold its ownership lease "
                "(Redis unreachable, or another process with its --owner runs); retry"
            )
        queue: asyncio.Queue = asyncio.Queue()
        live.subscribers.append(queue)
        try:
            self.scheduler.check_room()
            await self.store.create(live_record(live, self.limits.ssm_names, self.owner, self.lease.token))
            await self.scheduler.submit(live)
        except RequestExistsError as exc:
            raise AlreadyExists("request_id", str(exc)) from None
        try:
            async with contextlib.aclosing(
                self._stream(rid, 0, live.request.logprobs, live, queue, live.text)
            ) as events:
                async for event in events:
                    yield event
        finally:
            if live.finished is None and not self.scheduler.cancel(rid) and live.moved:
                # another replica runs it now: ask it to stop the request (a Redis outage leaves it running)
                with contextlib.suppress(StoreError, redis.exceptions.RedisError):
                    await self.store.request_cancel(rid)

    async def attach(self, request_id: str, offset: int) -> AsyncIterator[StreamEvent]:
        """Reattach to a request from output offset ``offset`` on: one event with the tokens committed
        already (possibly none), then its new ones up to the finishing event, no token twice and none
        left out, wherever it runs: live from the scheduler while this replica runs it, else followed in
        Redis. Their text continues the text the request's stream released for its first ``offset`` tokens,
        so a client that reattaches where it stopped receives the same text as if nothing had happened. A
        finished request: one event with its stored tokens and final state."""
        live = self.scheduler.get(request_id)
        queue = None
        if live is not None and live.finished is None:
            queue = asyncio.Queue()
            live.subscribers.append(queue)  # subscribe first, then send the backlog: nothing is lost in between
            output, logprobs = tuple(live.output), tuple(live.logprobs[offset:])
            top, finish = live.request.logprobs, None
            text = live.text.fresh() if live.text is not None else None
        else:
            snapshot = await self._snapshot(request_id)
            output, logprobs = snapshot.output_tokens, snapshot.output_logprobs[offset:]
            top, finish = snapshot.params.get("logprobs"), snapshot_finish(snapshot)
            text = snapshot_text_stream(snapshot, self.tokenizer) if self.tokenizer is not None else None
        backlog, delta = tuple(output[offset:]), resumed_text(text, output, offset, finish)
        try:
            yield StreamEvent(offset, backlog, delta, finish, logprobs)
        except BaseException:
            if queue is not None:
                live.subscribers.remove(queue)
            raise
        if finish is not None:
            return
        # while this replica runs it, the scheduler's own text stream goes on from the end of ``output``
        events = (
            self._stream(request_id, offset + len(backlog), top, live, queue, live.text)
            if queue is not None
            else self._stream(request_id, offset + len(backlog), top, text=text, output=output)
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _stream(
        self,
        request_id: str,
        sent: int,
        top: int | None,
        live: Live | None = None,
        queue: asyncio.Queue | None = None,
        text: TextStream | None = None,
        output: Sequence[int] = (),
    ) -> AsyncIterator[StreamEvent]:
        """The events of ``request_id`` after output offset ``sent``, up to the finishing one, trimmed so that
        no token comes twice: from the scheduler while this replica runs the request (``queue``: a
        subscription to ``live`` already taken), else from its record in Redis, polled every
        FOLLOW_POLL_SECONDS; it switches as the request moves between replicas (adopted here, or taken
        over by another). ``text``: decodes the followed tokens into text deltas (as the scheduler does), having
        released the text of ``output`` (the output up to ``sent``, when following from the start); ``top``:
        the alternatives the request asks at each token's logprobs (None: no logprobs)."""
        output = list(output) if text is not None else []  # the output up to ``sent``, kept while following with text
        while True:
            backlog: tuple[int, ...] = ()
            if queue is None:
                live = self.scheduler.get(request_id)
                if live is not None and live.finished is None:  # adopted here meanwhile
                    queue = asyncio.Queue()
                    live.subscribers.append(queue)  # subscribe first, then send the backlog
                    backlog = tuple(live.output[sent:])
            if queue is not None:
                assert live is not None
                try:
                    if backlog:
                        yield StreamEvent(sent, backlog, "", logprobs=tuple(live.logprobs[sent:]))
                        sent += len(backlog)
                    while (event := await queue.get()) is not MOVED:
                        yield StreamEvent(
                            max(sent, event.offset),
                            event.tokens[max(0, sent - event.offset) :],
                            event.text,
                            event.finished,
                            event.logprobs[max(0, sent - event.offset) :],
                        )
                        if event.finished is not None:
                            return
                        sent = max(sent, event.offset + len(event.tokens))
                finally:
                    live.subscribers.remove(queue)
                log.info("following a request another replica took over in Redis", extra={"request_id": request_id})
                output = list(live.output[:sent]) if text is not None else []
                queue = None
                continue
            tail = await self.store.tail(request_id, sent, top)
            if tail is None:
                raise NotFound("request_id", f"no request {request_id!r}")
            finish = None
            if tail.finished:  # its last tokens and final state, read together
                snapshot = await self._snapshot(request_id)
                tail = Tail(snapshot.output_tokens[sent:], True, snapshot.output_logprobs[sent:])
                finish = snapshot_finish(snapshot)
            delta = ""
            if text is not None:
                output += tail.tokens
                delta = text.update(output)[0] + (
                    text.flush(output) if finish is not None and finish.reason != "stop" else ""
                )
            if tail.tokens or finish is not None:
                yield StreamEvent(sent, tail.tokens, delta, finish, tail.logprobs)
                sent += len(tail.tokens)
            if finish is not None:
                return
            await asyncio.sleep(FOLLOW_POLL_SECONDS)

    async def cancel(self, request_id: str) -> bool:
        """Stop a request at its next iteration; False when no unfinished request has this ID. One that
        another replica runs is marked in Redis, and its owner stops it at its next commit."""
        if self.scheduler.cancel(request_id):
            return True
        return await self.store.request_cancel(request_id)

    async def state(self, request_id: str) -> RequestState:
        live = self.scheduler.get(request_id)
        snapshot = await self._snapshot(request_id)
        finish = snapshot_finish(snapshot)
        if finish is not None:
            status = RequestStatus.FINISHED
        elif live is not None:  # run here: queued while it waits for a batch slot (also when preempted)
            status = RequestStatus.QUEUED if self.scheduler.is_queued(request_id) else RequestStatus.RUNNING
        else:  # run by another replica, or waiting for one to adopt it: as stored
            status = snapshot.status
        return RequestState(snapshot, status, finish)

    async def _snapshot(self, request_id: str) -> RequestSnapshot:
        snapshot = await self.store.get(request_id)
        if snapshot is None:
            raise NotFound("request_id", f"no request {request_id!r}")
        return snapshot

    async def recover(self) -> list[str]:
        """Resume the unfinished requests this replica owns in Redis (after a restart, or once its lease is
        held again after it had lapsed); their IDs. Each is claimed for this incarnation first, which
        fences any earlier one (:meth:`.store.RequestStore.claim`)."""
        resumed = []
        for rid in await self.store.active(self.owner):
            if await self.store.claim(rid, self.owner, self.owner, self.lease.token) and await self._resume(rid):
                resumed.append(rid)
        if resumed:
            log.info("resumed requests from Redis", extra={"count": len(resumed)})
        return resumed

    async def adopt(self, dead_owner: str) -> list[str]:
        """Take over the unfinished requests of ``dead_owner``, a replica whose lease nobody holds, and
        resume them here; their IDs. Each is claimed atomically, so of two replicas adopting at once each
        request goes to exactly one. Stale IDs in its index are pruned."""
        live_ids, stale = await self.store.index(dead_owner)
        adopted = []
        for rid in live_ids:
            if not self.lease.held:  # what we adopt is fenced by our lease: stop while it lapsed
                break
            if await self.store.claim(rid, dead_owner, self.owner, self.lease.token) and await self._resume(rid):
                adopted.append(rid)
        await self.store.prune_index(dead_owner, stale)
        if adopted:
            self.scheduler.metrics.adopted.inc(len(adopted))
            extra = {"from_owner": dead_owner, "count": len(adopted), "request_ids": adopted}
            log.warning("adopted the requests of a request manager whose lease lapsed", extra=extra)
        return adopted

    async def _resume(self, rid: str) -> bool:
        """Queue the claimed request ``rid`` in the scheduler where its committed tokens end (its caches are
        rebuilt on the workers and the verifier from them); False when it finished meanwhile or already runs here."""
        if self.scheduler.get(rid) is not None:
            return False
        snapshot = await self.store.get(rid)
        if snapshot is None or snapshot.is_finished:
            return False
        try:
            live = live_from_snapshot(snapshot, self.limits, self.tokenizer)
        except (KeyError, TypeError, ValueError) as exc:  # a record this version cannot read
            log.error("cannot resume request", extra={"request_id": rid, "error": repr(exc)})
            await self.store.finish(
                rid, "error", f"cannot resume: {exc}", owner=self.owner, lease_token=self.lease.token
            )
            return False
        return self.scheduler.resume(live)  # False if a concurrent recovery or adoption resumed it first
