"""A step's Redis append overlapped with the next step (``scheduling.appends``), against a real Redis: tokens reach
the streams only once Redis holds them, in order; a fenced append publishes nothing; a timed-out one is retried at
its offset and counted once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest

from specinfer.core.requests import GenerationRequest, StepStats
from specinfer.request_manager.scheduling.appends import Append, Appends
from specinfer.request_manager.scheduling.live import Live, StreamEvent
from specinfer.request_manager.state.records import RequestRecord
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import OwnershipError


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def step(tokens: tuple[int, ...], offset: int) -> Append:
    """One step's append of ``tokens`` at ``offset``, published as an event of the same tokens."""
    return Append(tokens, StepStats(llm_steps=1, accepted=len(tokens) - 1, tree_size=4), offset, (), 0, event(tokens))


def event(tokens: tuple[int, ...]) -> StreamEvent:
    return StreamEvent(0, tokens, "")


def subscribed(rid: str) -> tuple[Live, asyncio.Queue]:
    live = Live(GenerationRequest(rid, (1, 2, 3), 16), seed=5)
    queue: asyncio.Queue = asyncio.Queue()
    live.subscribers.append(queue)
    return live, queue


def test_tokens_are_published_once_redis_holds_them_and_appends_keep_their_order(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(RequestRecord("r", (1, 2, 3), owner="rm-0"))
            live, queue = subscribed("r")
            appends = Appends(store, "rm-0", "")
            appends.start(live, step((7, 8), 0))
            assert queue.empty()  # the append has not even been sent
            await appends.settle(live)
            assert queue.get_nowait().tokens == (7, 8)
            snapshot = await store.get("r")
            assert snapshot is not None and snapshot.output_tokens == (7, 8)
            appends.start(live, step((9,), 2))
            await appends.settle(live)
            await appends.settle(live)  # nothing in flight: returns at once
            assert queue.get_nowait().tokens == (9,) and queue.empty()
            snapshot = await store.get("r")
            assert snapshot is not None and snapshot.output_tokens == (7, 8, 9) and snapshot.stats.llm_steps == 2

    run(body)


def test_an_append_the_store_fences_publishes_nothing_and_says_the_request_is_not_ours(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(RequestRecord("theirs", (1, 2, 3), owner="rm-1"))
            live, queue = subscribed("theirs")
            appends = Appends(store, "rm-0", "")
            appends.start(live, step((7,), 0))
            with pytest.raises(OwnershipError):
                await appends.settle(live)
            await appends.settle(live)  # not retried: nothing in flight
            assert queue.empty()
            snapshot = await store.get("theirs")
            assert snapshot is not None and snapshot.output_tokens == ()

    run(body)


def test_a_timed_out_append_is_retried_at_its_offset_and_counted_once(standalone_redis):
    """Redis pauses writes for longer than the client waits: the append times out, though Redis applies it when the
    pause ends. Settling raises the timeout and sends the same append again, which the store recognizes (settled as
    the scheduler's next iterations would, until it goes through)."""

    async def body() -> None:
        prefix = f"specinfer-test-{uuid.uuid4().hex[:12]}"
        client = connect(standalone_redis.url, standalone_redis.password, socket_timeout=0.4)
        admin = connect(standalone_redis.url, standalone_redis.password)
        try:
            store = RequestStore(client, prefix=prefix)
            await store.create(RequestRecord("r", (1, 2, 3), owner="rm-0"))
            live, queue = subscribed("r")
            appends = Appends(store, "rm-0", "")
            await admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
            appends.start(live, step((7, 8), 0))
            with pytest.raises(Exception) as failed:
                await appends.settle(live)
            assert "imeout" in type(failed.value).__name__ and queue.empty()
            for _ in range(5):  # the pause ends while the retry waits: Redis applies the first append, then the retry
                try:
                    await appends.settle(live)
                    break
                except Exception as exc:
                    assert "imeout" in type(exc).__name__
            assert queue.get_nowait().tokens == (7, 8) and queue.empty()
            snapshot = await store.get("r")
            assert snapshot is not None and snapshot.output_tokens == (7, 8) and snapshot.stats.llm_steps == 1
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            for key in [k async for k in admin.scan_iter(match=f"{prefix}:*")]:
                await admin.delete(key)
            await client.aclose()
            await admin.aclose()

    run(body)
