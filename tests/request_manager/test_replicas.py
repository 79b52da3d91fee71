"""Request managers sharing a Redis, at the level of their request operations (``Requests`` and
``Ownership`` over a real scheduler and a real Redis; the scheduler's loop is not started, so no
verifier is needed: what is committed comes from the store, as another replica would write it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from specinfer.core.errors import Unavailable
from specinfer.core.requests import GenerationRequest
from specinfer.request_manager.api.admission import ApiLimits
from specinfer.request_manager.cluster.remote import Verifiers
from specinfer.request_manager.scheduling.live import Live
from specinfer.request_manager.scheduling.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.state.lifecycle import Requests
from specinfer.request_manager.state.live_records import live_record
from specinfer.request_manager.state.ownership import Lease, Ownership
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis, free_tcp_port
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import OwnershipError
from specinfer.serving.scheduler_metrics import SchedulerMetrics

LIMITS = ApiLimits(
    vocab_size=100,
    max_positions=256,
    max_new_tokens=64,
    default_expansion=(),
    default_ssms=(),
    ssm_names=(),
    draft_support=8,
    llm_name="llm",
    eos_token_id=None,
)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def value(metric) -> float:
    """A counter's or a gauge's value."""
    return next(s.value for s in metric.collect()[0].samples if not s.name.endswith("_created"))


def new_live(rid: str, max_new_tokens: int = 32) -> Live:
    return Live(GenerationRequest(rid, (1, 2, 3), max_new_tokens), seed=5)


@contextlib.asynccontextmanager
async def replica(store: RequestStore, owner: str, lease_seconds: float = 5.0) -> AsyncIterator[Requests]:
    """The request operations of one replica with its lease held; its scheduler does not run (a verifier
    nothing listens for is never called)."""
    verifier = Verifiers(["127.0.0.1:1"], 1.0)
    lease = Lease(store, owner, lease_seconds)
    scheduler = Scheduler(
        SchedulerConfig(4, 8, (), None, owner, lease.token),
        store,
        None,
        verifier,
        SchedulerMetrics(CollectorRegistry()),
    )
    await lease.acquire()
    try:
        yield Requests(scheduler, store, LIMITS, None, lease)
    finally:
        await verifier.close()


async def dead_owners_requests(store: RequestStore, ids: list[str], outputs: int = 2) -> None:
    """Requests of ``rm-dead`` (no lease: it died) with a few committed tokens each."""
    for rid in ids:
        await store.create(live_record(new_live(rid), (), "rm-dead", "t-dead"))
        await store.append_tokens(rid, list(range(10, 10 + outputs)), owner="rm-dead", lease_token="t-dead")
    await store.client.sadd(store.keys.owners(), "rm-dead")


def test_two_replicas_scanning_at_once_adopt_each_request_once_and_resume_it_where_it_was(open_store):
    ids = [f"r{i:02d}" for i in range(24)]

    async def body() -> None:
        async with open_store() as a_store, open_store() as b_store:
            await dead_owners_requests(a_store, ids, outputs=3)
            async with replica(a_store, "rm-a") as a, replica(b_store, "rm-b") as b:
                won_a, won_b = await asyncio.gather(Ownership(a.lease, a).scan(), Ownership(b.lease, b).scan())
                assert set(won_a).isdisjoint(won_b) and set(won_a) | set(won_b) == set(ids)
                for requests, won in ((a, won_a), (b, won_b)):
                    assert sorted(r for r in ids if requests.scheduler.get(r) is not None) == sorted(won)
                    assert all(requests.scheduler.get(r).output == [10, 11, 12] for r in won)
                    assert value(requests.scheduler.metrics.adopted) == len(won)
                assert await a.store.orphaned_owners("rm-a") == []  # nothing left to adopt: rm-dead is forgotten
                assert "rm-dead" not in {m.decode() for m in await a_store.client.smembers(a_store.keys.owners())}

    run(body)


def test_a_replica_that_does_not_run_a_request_follows_it_in_redis_then_live_once_it_adopts_it(open_store):
    """Reattach through a replica while another (rm-dead, still writing) runs the request: its tokens come
    from Redis; then the replica adopts the request, the dead owner's next append is refused, and the
    stream goes on from the scheduler's own events, every token once, up to the final event."""

    async def body() -> None:
        async with open_store() as store:
            await dead_owners_requests(store, ["r1"], outputs=2)
            async with replica(store, "rm-a") as a:
                await store.client.set(store.keys.lease("rm-dead"), "t-dead")  # rm-dead alive (for now)
                events = []

                async def consume() -> None:
                    async for event in a.attach("r1", 1):
                        events.append(event)

                consumer = asyncio.ensure_future(consume())
                await wait_for(lambda: len(events) == 1)
                assert (events[0].offset, events[0].tokens, events[0].finished) == (1, (11,), None)
                await store.append_tokens("r1", [12, 13], owner="rm-dead", lease_token="t-dead")
                await wait_for(lambda: len(events) == 2)
                await store.append_tokens("r1", [14], owner="rm-dead", lease_token="t-dead")
                await wait_for(lambda: len(events) == 3)
                await store.client.delete(store.keys.lease("rm-dead"))  # rm-dead dies
                assert await Ownership(a.lease, a).scan() == ["r1"]
                with pytest.raises(OwnershipError):
                    await store.append_tokens("r1", [99], owner="rm-dead", lease_token="t-dead")
                live = a.scheduler.get("r1")
                await wait_for(lambda: len(live.subscribers) == 1)  # the stream switched to the scheduler's events
                a.scheduler.cancel("r1")
                await a.scheduler.iteration()  # admits r1, finds it cancelled and finishes it (no verifier call)
                await asyncio.wait_for(consumer, 5)
                assert [(e.offset, e.tokens) for e in events] == [(1, (11,)), (2, (12, 13)), (4, (14,)), (5, ())]
                assert [e.finished for e in events[:3]] == [None] * 3
                assert (events[-1].finished.reason, events[-1].finished.usage.completion_tokens) == ("cancelled", 5)
                assert (await store.get("r1")).output_tokens == (10, 11, 12, 13, 14)

    run(body)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms; fail the test, naming it, when it is still false after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, (
            f"{predicate.__code__.co_filename}:{predicate.__code__.co_firstlineno} not true in {timeout} s"
        )
        await asyncio.sleep(0.01)


def test_a_lease_lost_with_redis_refuses_new_requests_and_is_held_again_when_redis_returns(
    tmp_path: Path, redis_binary: Path
):
    port = free_tcp_port()
    lease_s = 0.6

    async def body() -> None:
        server = EmbeddedRedis(tmp_path / "redis", transport="tcp", port=port, executable=redis_binary).start()
        client = connect(server.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            store = RequestStore(client)
            async with replica(store, "rm-a", lease_s) as requests:
                changes: list[bool] = []
                ownership = Ownership(requests.lease, requests, changes.append)
                await ownership.renew()
                assert requests.lease.held and changes == []
                server.kill()
                deadline = asyncio.get_running_loop().time() + 10
                while not changes:  # the next renewals find Redis gone and report the lease lost
                    assert asyncio.get_running_loop().time() < deadline, (
                        "the lease was not reported lost within 10 s of Redis going away"
                    )
                    await ownership.renew()
                    await asyncio.sleep(lease_s / 3)
                assert not requests.lease.held
                assert changes == [False] and value(requests.scheduler.metrics.lease_held) == 0
                with pytest.raises(Unavailable, match="lease"):
                    await anext(requests.start(new_live("new")))
                server.start()  # an empty Redis on the same port: the lease is free
                await ownership.renew()
                assert requests.lease.held and changes == [False, True]
                assert (await store.client.get(store.keys.lease("rm-a"))).decode() == requests.lease.token
        finally:
            await client.aclose()
            server.close()

    run(body)
