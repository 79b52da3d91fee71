"""Request-manager replicas on a real Redis: leases, claims that fence earlier writers, adoption races,
the owners registry, cancel marks and the tail a follower polls (services/request_manager/state/ownership.py)."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import pytest

from specinfer.request_manager.state.ownership import Lease, holder_is_gone, new_token
from specinfer.request_manager.state.records import RequestRecord
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import OwnershipError

PARAMS = {"max_new_tokens": 8}


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def record(rid: str, owner: str, token: str = "") -> RequestRecord:
    return RequestRecord(request_id=rid, prompt=(1, 2, 3), params=PARAMS, owner=owner, lease_token=token)


async def members(store: RequestStore, key: str) -> set[str]:
    return {m.decode() for m in await store.client.smembers(key)}


# -- leases -------------------------------------------------------------------------------------


def elsewhere() -> str:
    """The lease token of a process of another host (only the lease's lapse says it stopped)."""
    return f"other-{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(8)}"


def stopped_pid() -> int:
    """The pid of a process of this host that has stopped (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_holder_is_gone_only_for_a_stopped_process_of_this_host():
    host = socket.gethostname()
    ours = new_token()
    assert holder_is_gone(f"{host}/{stopped_pid()}/00", ours)
    assert holder_is_gone(f"{host}/{os.getpid()}/00", ours)  # our pid, another token: a restarted container's
    assert not holder_is_gone(f"{host}/{os.getppid()}/00", ours)  # runs
    assert not holder_is_gone(ours, ours)
    assert not holder_is_gone(f"other-{host}/{stopped_pid()}/00", ours)  # another host's: its lease must lapse
    for odd in ("", "x", f"{host}/abc/00", f"{host}/12/00/extra"):
        assert not holder_is_gone(odd, ours), odd


def test_a_restart_takes_the_lease_of_its_stopped_predecessor_at_once(open_store):
    """kill -9 of a request manager leaves its lease in Redis for its TTL; the process started after it on the
    same host (``specinfer up``'s restart) takes it at once instead of waiting it out, and a live holder of
    another host still makes it wait."""

    async def body() -> None:
        async with open_store() as a, open_store() as b:
            dead = Lease(a, "rm-a", 30.0, token=f"{socket.gethostname()}/{stopped_pid()}/00")
            await dead.acquire()
            start = time.monotonic()
            restarted = Lease(b, "rm-a", 30.0)
            await asyncio.wait_for(restarted.acquire(), 5)
            assert restarted.held and time.monotonic() - start < 2
            assert (await dead.hold()).holder == restarted.token
            live = Lease(a, "rm-b", 30.0, token=elsewhere())
            await live.acquire()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(Lease(b, "rm-b", 30.0).acquire(), 1.5)

    run(body)


def test_lease_is_held_by_one_process_renewed_and_released(open_store):
    async def body() -> None:
        async with open_store() as a, open_store() as b:
            first, second = Lease(a, "rm-a", 5.0, token=elsewhere()), Lease(b, "rm-a", 5.0)
            assert first.token != second.token and not first.held
            await first.acquire()
            assert first.held
            reply = await second.hold()
            assert (reply.held, reply.holder, second.held) == (False, first.token, False)
            reply = await first.hold()  # a renewal
            assert (reply.held, reply.taken) == (True, False)
            ttl = await a.client.pttl(a.keys.lease("rm-a"))
            assert 4000 < ttl <= 5000
            assert "rm-a" in await members(a, a.keys.owners())
            await second.release()  # not its lease: nothing happens
            assert (await first.hold()).held
            await first.release()
            assert not first.held
            reply = await second.hold()
            assert (reply.held, reply.taken, second.held) == (True, True, True)
            assert not (await first.hold()).held

    run(body)


def test_a_second_process_with_the_same_owner_waits_until_the_first_stops_renewing(open_store):
    lease_s = 0.6

    async def body() -> None:
        async with open_store() as a, open_store() as b:
            first, second = Lease(a, "rm-a", lease_s, token=elsewhere()), Lease(b, "rm-a", lease_s)
            await first.acquire()
            waiting = asyncio.ensure_future(second.acquire())
            for _ in range(4):  # the first keeps renewing: the second keeps waiting
                await asyncio.sleep(lease_s / 3)
                assert (await first.hold()).held
                assert not waiting.done()
            stopped = time.monotonic()  # the first stops renewing (a kill -9)
            await waiting
            waited = time.monotonic() - stopped
            assert second.held
            assert lease_s / 3 <= waited <= lease_s + lease_s / 3 + 0.5, waited
            assert not first.held  # its own view lapsed with the TTL, before anyone else could take it
            reply = await first.hold()
            assert (reply.held, reply.holder) == (False, second.token)

    run(body)


def test_force_takes_the_lease_from_any_holder(open_store):
    async def body() -> None:
        async with open_store() as a:
            first, second = Lease(a, "rm-a", 5.0), Lease(a, "rm-a", 5.0)
            await first.acquire()
            await second.acquire(force=True)
            assert second.held and not (await first.hold()).held

    run(body)


def test_lease_settings_are_checked():
    with pytest.raises(ValueError, match="positive"):
        Lease(None, "rm-a", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner"):
        Lease(None, "rm{a}", 1.0)  # type: ignore[arg-type]


# -- claims and fences --------------------------------------------------------------------------


def test_a_claim_fences_every_earlier_writer(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("r1", "rm-a", "t1"))
            assert (await store.append_tokens("r1", [1], owner="rm-a", lease_token="t1")).length == 1
            # a new incarnation of rm-a claims it: the earlier one can neither append nor finish any more
            assert await store.claim("r1", "rm-a", "rm-a", "t2")
            with pytest.raises(OwnershipError):
                await store.append_tokens("r1", [2], owner="rm-a", lease_token="t1")
            with pytest.raises(OwnershipError):
                await store.finish("r1", "eos", owner="rm-a", lease_token="t1")
            assert (await store.append_tokens("r1", [2], owner="rm-a", offset=1, lease_token="t2")).length == 2
            # adopted by rm-b: rm-a is fenced whatever its token
            assert not await store.claim("r1", "rm-x", "rm-b", "t3")  # not rm-x's to give
            assert await store.claim("r1", "rm-a", "rm-b", "t3")
            with pytest.raises(OwnershipError):
                await store.append_tokens("r1", [3], owner="rm-a", lease_token="t2")
            snap = await store.get("r1")
            assert (snap.owner, snap.output_tokens) == ("rm-b", (1, 2))
            assert await store.active("rm-a") == [] and await store.active("rm-b") == ["r1"]
            await store.finish("r1", "eos", owner="rm-b", lease_token="t3")
            assert not await store.claim("r1", "rm-b", "rm-c", "t4")  # finished: nothing to adopt
            assert await members(store, store.keys.active("rm-c")) == set()

    run(body)


def test_two_adopters_racing_each_request_goes_to_exactly_one(open_store):
    ids = [f"r{i:02d}" for i in range(40)]

    async def adopt_all(store: RequestStore, me: str, token: str, order: list[str]) -> set[str]:
        won = set()
        for rid in order:
            if await store.claim(rid, "rm-dead", me, token):
                won.add(rid)
        return won

    async def body() -> None:
        async with open_store() as setup, open_store() as a, open_store() as b:
            for rid in ids:
                await setup.create(record(rid, "rm-dead", "td"))
            live, stale = await setup.index("rm-dead")
            assert (live, stale) == (ids, [])
            rng = random.Random(7)
            order_a, order_b = rng.sample(ids, len(ids)), rng.sample(ids, len(ids))
            won_a, won_b = await asyncio.gather(
                adopt_all(a, "rm-a", "ta", order_a), adopt_all(b, "rm-b", "tb", order_b)
            )
            assert won_a.isdisjoint(won_b) and won_a | won_b == set(ids)
            assert won_a and won_b, "the race was not a race: one adopter took everything"
            for rid in ids:
                snap = await setup.get(rid)
                assert snap.owner == ("rm-a" if rid in won_a else "rm-b")
            # the indexes are exact: no loser kept an ID, the dead owner kept none
            assert await members(setup, setup.keys.active("rm-a")) == won_a
            assert await members(setup, setup.keys.active("rm-b")) == won_b
            assert await members(setup, setup.keys.active("rm-dead")) == set()
            # the winners write, the others are fenced
            rid = sorted(won_a)[0]
            assert (await a.append_tokens(rid, [5], owner="rm-a", lease_token="ta")).length == 1
            for owner, token in (("rm-b", "tb"), ("rm-dead", "td")):
                with pytest.raises(OwnershipError):
                    await b.append_tokens(rid, [5], owner=owner, lease_token=token)

    run(body)


# -- the owners registry --------------------------------------------------------------------------


def test_orphaned_owners_have_requests_and_no_lease(open_store):
    async def body() -> None:
        async with open_store() as store:
            alive, dead, empty = (
                Lease(store, "rm-alive", 5.0),
                Lease(store, "rm-dead", 5.0),
                Lease(store, "rm-empty", 5.0),
            )
            for lease in (alive, dead, empty):
                await lease.acquire()
            await store.create(record("a1", "rm-alive", alive.token))
            await store.create(record("d1", "rm-dead", dead.token))
            assert await members(store, store.keys.owners()) == {"rm-alive", "rm-dead", "rm-empty"}
            assert await store.orphaned_owners("rm-me") == []
            await dead.release()
            await empty.release()
            assert await store.orphaned_owners("rm-me") == ["rm-dead"]
            assert await store.orphaned_owners("rm-dead") == []  # never one's own
            # an owner with neither lease nor requests is forgotten; one holding either stays
            assert await members(store, store.keys.owners()) == {"rm-alive", "rm-dead"}
            await empty.acquire()  # a new incarnation registers again
            assert "rm-empty" in await members(store, store.keys.owners())

    run(body)


def test_stale_index_entries_are_pruned_only_while_nobody_holds_the_lease(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("live", "rm-dead"))
            await store.create(record("done", "rm-dead"))
            await store.finish("done", "eos")
            await store.client.sadd(
                store.keys.active("rm-dead"), "done", "gone"
            )  # as a crash between two steps leaves them
            live, stale = await store.index("rm-dead")
            assert (live, sorted(stale)) == (["live"], ["done", "gone"])
            lease = Lease(store, "rm-dead", 5.0)
            await lease.acquire()
            assert await store.prune_index("rm-dead", stale) == -1
            await lease.release()
            assert await store.prune_index("rm-dead", stale) == 2
            assert await members(store, store.keys.active("rm-dead")) == {"live"}

    run(body)


# -- cancel and follow through any replica ----------------------------------------------------------


def test_a_cancel_mark_reaches_the_owner_with_its_next_append(open_store):
    async def body() -> None:
        async with open_store() as owner, open_store() as other:
            await owner.create(record("r1", "rm-a", "t"))
            assert not (await owner.append_tokens("r1", [1], owner="rm-a", lease_token="t")).cancel_requested
            assert await other.request_cancel("r1")
            appended = await owner.append_tokens("r1", [2], owner="rm-a", lease_token="t")
            assert (appended.length, appended.cancel_requested) == (2, True)
            await owner.finish("r1", "cancelled", owner="rm-a", lease_token="t")
            assert not await other.request_cancel("r1")  # finished
            assert not await other.request_cancel("missing")

    run(body)


def test_tail_reads_the_output_from_an_offset(open_store):
    async def body() -> None:
        async with open_store() as store:
            assert await store.tail("r1", 0) is None
            await store.create(record("r1", "rm-a"))
            assert await store.tail("r1", 0) == (await store.tail("r1", 5)) and (await store.tail("r1", 0)).tokens == ()
            await store.append_tokens("r1", [7, 8, 9])
            tail = await store.tail("r1", 1)
            assert (tail.tokens, tail.finished) == ((8, 9), False)
            assert (await store.tail("r1", 3)).tokens == ()
            await store.finish("r1", "length")
            tail = await store.tail("r1", 2)
            assert (tail.tokens, tail.finished) == ((9,), True)

    run(body)
