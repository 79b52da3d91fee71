"""RequestStore against a real Redis: round trips, TTLs, owners, offsets, concurrency, durability, auth."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.exceptions
from hypothesis import given
from hypothesis import strategies as st

from specinfer.core.requests import TokenLogprob
from specinfer.request_manager.state.records import (
    INT32_MAX,
    INT32_MIN,
    FinishReason,
    RequestRecord,
    RequestStatus,
    StepStats,
    pack_tokens,
    unpack_tokens,
)
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import (
    OffsetConflictError,
    OwnershipError,
    RequestExistsError,
    RequestFinishedError,
    RequestNotFoundError,
)

PARAMS = {
    "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 7},
    "max_new_tokens": 64,
    "stop_token_ids": [2],
    "stop": ["\n\n"],
    "speculation": {"disabled": False, "expansion": [1, 1, 3], "ssms": ["ssm-a"]},
    "ignore_eos": False,
}


def run(body: Callable[[], Awaitable[None]]) -> None:
    """Run one test's async body in a fresh event loop (pytest-asyncio is not used)."""
    asyncio.run(body())


def ticking_clock(start: float = 1000.0) -> Callable[[], float]:
    """A clock that advances one second per reading, so creation order is unambiguous."""
    counter = itertools.count()
    return lambda: start + next(counter)


def record(rid: str, owner: str = "rm-0", prompt: tuple[int, ...] = (1, 2, 3)) -> RequestRecord:
    return RequestRecord(request_id=rid, prompt=prompt, params=PARAMS, owner=owner)


# -- round trip ---------------------------------------------------------------------------------


def test_logprobs_are_stored_with_their_tokens(open_store):
    """A request that asks logprobs keeps one record per output token beside its output: appended in the same
    atomic step (a retried append adds none twice), read by get and by tail from any offset, expiring with it."""
    lp = [TokenLogprob(t, -0.25 * t, ((t, -0.25 * t), (9, -4.0))) for t in (1, 2, 3, 4)]

    async def body() -> None:
        async with open_store(finished_ttl_s=120) as store:
            await store.create(RequestRecord("r1", (1, 2, 3), {**PARAMS, "logprobs": 2}, "rm-0"))
            await store.append_tokens("r1", [1, 2], offset=0, logprobs=lp[:2], top_logprobs=2)
            await store.append_tokens("r1", [1, 2], offset=0, logprobs=lp[:2], top_logprobs=2)  # a retry
            await store.append_tokens("r1", [3, 4], offset=2, logprobs=lp[2:], top_logprobs=2)
            assert (await store.get("r1")).output_logprobs == tuple(lp)
            for offset in range(5):
                tail = await store.tail("r1", offset, 2)
                assert tail.tokens == (1, 2, 3, 4)[offset:] and tail.logprobs == tuple(lp[offset:])
            assert (await store.tail("r1", 1)).logprobs == ()  # a reader that asks none gets none
            assert await store.finish("r1", "length")
            assert 0 < await store.client.pttl(store.keys.logprobs("r1")) <= 120_000
            with pytest.raises(ValueError, match="alternatives"):
                await store.append_tokens("r1", [5], logprobs=lp[:1], top_logprobs=3)

    run(body)


def test_create_append_get_finish_round_trip(open_store):
    async def body() -> None:
        async with open_store(clock=ticking_clock()) as store:
            assert await store.ping()
            assert await store.get("r1") is None
            await store.create(record("r1", prompt=(5, 6, 7, 8)))

            snap = await store.get("r1")
            assert snap is not None
            assert (snap.request_id, snap.owner, snap.status) == ("r1", "rm-0", RequestStatus.QUEUED)
            assert snap.params == PARAMS
            assert snap.prompt_tokens == (5, 6, 7, 8)
            assert snap.output_tokens == ()
            assert snap.stats == StepStats(0, 0, 0)
            assert snap.finish_reason is None and snap.error is None and not snap.is_finished

            assert (await store.append_tokens("r1", [10, 11, 12], StepStats(1, 2, 5, 3))).length == 3
            assert (await store.append_tokens("r1", [INT32_MAX, INT32_MIN], StepStats(1, 1, 4, 2))).length == 5
            assert (await store.append_tokens("r1", [], StepStats(1, 0, 1))).length == 5  # a step that commits nothing

            snap = await store.get("r1")
            assert snap.status is RequestStatus.RUNNING
            assert snap.output_tokens == (10, 11, 12, INT32_MAX, INT32_MIN)
            assert snap.stats == StepStats(llm_steps=3, accepted=3, tree_size=10, committed=5)
            assert snap.created == 1000.0 and snap.updated > snap.created

            assert await store.finish("r1", FinishReason.ERROR, "verifier unreachable")
            snap = await store.get("r1")
            assert snap.is_finished and snap.status is RequestStatus.FINISHED
            assert snap.finish_reason is FinishReason.ERROR and snap.error == "verifier unreachable"
            assert snap.output_tokens == (10, 11, 12, INT32_MAX, INT32_MIN)

    run(body)


def test_first_append_starts_a_queued_request_and_counts_its_step(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("r1"))
            await store.append_tokens("r1", [4, 5], StepStats(accepted=1, tree_size=6, committed=2))  # one step
            await store.append_tokens("r1", [6])  # default: one LLM step, nothing else counted
            snap = await store.get("r1")
            assert snap.status is RequestStatus.RUNNING
            assert snap.stats == StepStats(llm_steps=2, accepted=1, tree_size=6, committed=3)

    run(body)


def test_finish_is_idempotent_and_sets_ttl(open_store, key_prefix):
    async def body() -> None:
        async with open_store(finished_ttl_s=120) as store:
            await store.create(record("r1"))
            await store.append_tokens("r1", [1])
            for key in store.keys.request("r1")[:2]:  # no logprobs key: the request asks none
                assert await store.client.pttl(key) == -1  # running requests never expire

            assert await store.finish("r1", "length")
            assert not await store.finish("r1", "cancelled")  # already finished: first reason stays
            assert (await store.get("r1")).finish_reason is FinishReason.LENGTH
            for key in store.keys.request("r1")[:2]:
                assert key.startswith(key_prefix)
                assert 0 < await store.client.pttl(key) <= 120_000

    run(body)


def test_finished_request_expires_after_ttl(open_store):
    async def body() -> None:
        async with open_store(finished_ttl_s=0.15) as store:
            await store.create(record("r1"))
            await store.append_tokens("r1", [1, 2])
            await store.finish("r1", "eos")
            assert (await store.get("r1")).output_tokens == (1, 2)
            await asyncio.sleep(0.3)
            assert await store.get("r1") is None

    run(body)


# -- owners -------------------------------------------------------------------------------------


def test_active_lists_unfinished_requests_oldest_first(open_store):
    async def body() -> None:
        async with open_store(clock=ticking_clock()) as store:
            for rid in ("c", "a", "b"):  # creation order differs from ID order
                await store.create(record(rid, owner="rm-0"))
            await store.create(record("x", owner="rm-1"))
            assert await store.active("rm-0") == ["c", "a", "b"]
            assert await store.active("rm-1") == ["x"]
            assert await store.active("rm-9") == []

            await store.finish("a", "eos")
            assert await store.active("rm-0") == ["c", "b"]
            assert not await store.client.sismember(store.keys.active("rm-0"), "a")

    run(body)


def test_writes_of_another_owner_are_refused(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("r1", owner="rm-0"))
            assert (await store.append_tokens("r1", [1], owner="rm-0")).length == 1

            # Another replica's writes are refused and change nothing; the owner's go through.
            with pytest.raises(OwnershipError) as info:
                await store.append_tokens("r1", [2], owner="rm-1")
            assert info.value.actual == "rm-0"
            with pytest.raises(OwnershipError):
                await store.finish("r1", "cancelled", owner="rm-1")
            assert (await store.get("r1")).output_tokens == (1,)
            assert await store.active("rm-0") == ["r1"] and await store.active("rm-1") == []
            assert (await store.append_tokens("r1", [2], owner="rm-0")).length == 2

            await store.finish("r1", "eos", owner="rm-0")
            assert await store.active("rm-0") == []
            assert await store.client.scard(store.keys.active("rm-0")) == 0
            assert await store.client.scard(store.keys.active("rm-1")) == 0

    run(body)


def test_stale_index_entries_are_skipped(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("live", owner="rm-0"))
            await store.create(record("done", owner="rm-0"))
            await store.create(record("moved", owner="rm-1"))
            await store.finish("done", "eos")
            # What crashes between the two steps of create/finish could leave behind:
            await store.client.sadd(store.keys.active("rm-0"), "ghost", "done", "moved")

            assert await store.active("rm-0") == ["live"]

    run(body)


# -- reads and writes at offsets ----------------------------------------------------------------


def test_append_at_offset_rejects_gaps_and_absorbs_retries(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("r1"))
            assert (await store.append_tokens("r1", [1, 2], StepStats(1, 1, 3, 2), offset=0)).length == 2
            # A retry of an append that Redis already applied (e.g. its reply was lost) is not applied twice.
            assert (await store.append_tokens("r1", [1, 2], StepStats(1, 1, 3, 2), offset=0)).length == 2
            snap = await store.get("r1")
            assert snap.output_tokens == (1, 2) and snap.stats == StepStats(1, 1, 3, 2)

            with pytest.raises(OffsetConflictError) as info:
                await store.append_tokens("r1", [9], offset=5)  # a gap: steps were lost
            assert (info.value.offset, info.value.length) == (5, 2)
            with pytest.raises(OffsetConflictError):
                await store.append_tokens("r1", [9, 9], offset=0)  # overlaps different tokens
            assert (await store.append_tokens("r1", [3], offset=2)).length == 3
            assert (await store.get("r1")).output_tokens == (1, 2, 3)

    run(body)


# -- refusals -----------------------------------------------------------------------------------


def test_duplicate_create_is_refused_until_the_request_finished(open_store):
    async def body() -> None:
        async with open_store() as store:
            await store.create(record("r1", owner="rm-0", prompt=(1,)))
            await store.append_tokens("r1", [7, 8])
            with pytest.raises(RequestExistsError):
                await store.create(record("r1", owner="rm-0", prompt=(2,)))
            with pytest.raises(RequestExistsError):
                await store.create(record("r1", owner="rm-1", prompt=(2,)))
            # The refused creates changed nothing: not the request, not either owner's index.
            snap = await store.get("r1")
            assert (snap.prompt_tokens, snap.output_tokens, snap.owner) == ((1,), (7, 8), "rm-0")
            assert await store.active("rm-0") == ["r1"]
            assert not await store.client.sismember(store.keys.active("rm-1"), "r1")

            # Once finished, the ID may be reused: a fresh request, keys no longer expiring.
            await store.finish("r1", "eos")
            await store.create(record("r1", owner="rm-1", prompt=(3,)))
            snap = await store.get("r1")
            assert (snap.prompt_tokens, snap.output_tokens, snap.status) == ((3,), (), RequestStatus.QUEUED)
            assert snap.stats == StepStats(0, 0, 0) and snap.finish_reason is None
            assert await store.client.pttl(store.keys.meta("r1")) == -1
            assert await store.active("rm-1") == ["r1"]

    run(body)


def test_a_retried_create_is_recognized(open_store):
    """The same create again (as after a reply lost in a failover: same owner, same creation time)
    succeeds without change; another create of the ID is refused."""

    async def body() -> None:
        async with open_store(clock=lambda: 1000.0) as store:
            await store.create(record("r1", owner="rm-0"))
            await store.append_tokens("r1", [7])
            await store.create(record("r1", owner="rm-0"))  # the retry
            snap = await store.get("r1")
            assert (snap.output_tokens, snap.created, snap.status) == ((7,), 1000.0, RequestStatus.RUNNING)
            with pytest.raises(RequestExistsError):
                await store.create(record("r1", owner="rm-1"))  # same time, another owner
        async with open_store(clock=lambda: 1001.0) as store:
            with pytest.raises(RequestExistsError):
                await store.create(record("r1", owner="rm-0"))  # same owner, another time
            assert await store.active("rm-0") == ["r1"]

    run(body)


def test_writes_to_missing_or_finished_requests_are_refused(open_store):
    async def body() -> None:
        async with open_store() as store:
            with pytest.raises(RequestNotFoundError):
                await store.append_tokens("missing", [1])
            with pytest.raises(RequestNotFoundError):
                await store.finish("missing", "eos")
            await store.create(record("r1"))
            await store.finish("r1", "cancelled")
            with pytest.raises(RequestFinishedError):
                await store.append_tokens("r1", [1])
            assert (await store.get("r1")).output_tokens == ()
            with pytest.raises(ValueError):
                await store.finish("r1", "bored")  # not a FinishReason

    run(body)


def test_records_validate_ids_params_and_tokens():
    with pytest.raises(ValueError):
        RequestRecord(request_id="a{b}", prompt=(1,))  # braces would move the hash tag
    with pytest.raises(ValueError):
        RequestRecord(request_id="", prompt=(1,))
    with pytest.raises(ValueError):
        RequestRecord(request_id="r", prompt=(1,), owner="rm\n0")
    with pytest.raises(ValueError):
        RequestRecord(request_id="r", prompt=(1,), params={"seed": object()})
    with pytest.raises(ValueError):
        RequestRecord(request_id="r", prompt=(1,), params={"temperature": float("nan")})
    with pytest.raises(ValueError):
        pack_tokens([INT32_MAX + 1])
    with pytest.raises(ValueError):
        StepStats(llm_steps=-1)
    assert RequestRecord(request_id="r", prompt=[1, 2]).prompt == (1, 2)


@given(st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=64))
def test_pack_round_trip(tokens):
    packed = pack_tokens(tokens)
    assert len(packed) == 4 * len(tokens)
    assert unpack_tokens(packed) == tuple(tokens)


# -- concurrency --------------------------------------------------------------------------------


def test_concurrent_appends_to_many_requests(open_store):
    n_requests, n_steps = 40, 25

    async def drive(store: RequestStore, rid: str, base: int) -> None:
        # One request's steps are sequential (as in the scheduler); requests interleave freely.
        for step in range(n_steps):
            await store.append_tokens(rid, [base + 2 * step, base + 2 * step + 1], StepStats(1, 1, 3, 2))

    async def body() -> None:
        async with open_store() as a, open_store() as b:
            ids = [f"r{i}" for i in range(n_requests)]
            await asyncio.gather(*(a.create(record(rid)) for rid in ids))
            stores = [a, b]
            await asyncio.gather(*(drive(stores[i % 2], rid, 1000 * i) for i, rid in enumerate(ids)))
            for i, rid in enumerate(ids):
                snap = await a.get(rid)
                assert snap.output_tokens == tuple(range(1000 * i, 1000 * i + 2 * n_steps))
                assert snap.stats == StepStats(n_steps, n_steps, 3 * n_steps, 2 * n_steps)

    run(body)


def test_concurrent_appends_to_one_request_keep_every_token_once_in_commit_order(open_store):
    n_writers, n_chunks = 8, 30

    async def write(store: RequestStore, writer: int, commits: list[tuple[int, tuple[int, ...]]]) -> None:
        for chunk in range(n_chunks):
            # Chunk sizes 1..3, token values unique per (writer, chunk, position).
            tokens = tuple(10_000 * writer + 10 * chunk + k for k in range(1 + (writer + chunk) % 3))
            length = (await store.append_tokens("r1", tokens)).length
            commits.append((length, tokens))

    async def body() -> None:
        async with open_store() as a, open_store() as b, open_store() as c:
            await a.create(record("r1"))
            commits: list[tuple[int, tuple[int, ...]]] = []
            stores = [a, b, c]
            await asyncio.gather(*(write(stores[w % 3], w, commits) for w in range(n_writers)))

            output = (await a.get("r1")).output_tokens
            # Each append returned the length right after it: sorted by that, the chunks rebuild the
            # output exactly, so every append landed whole, once, at the position it reported.
            rebuilt: list[int] = []
            for length, tokens in sorted(commits):
                rebuilt.extend(tokens)
                assert len(rebuilt) == length
            assert tuple(rebuilt) == output
            assert len(set(output)) == len(output)
            for writer in range(n_writers):  # each writer's chunks in the order it committed them
                mine = [t for t in output if t // 10_000 == writer]
                assert mine == sorted(mine)
            assert (await a.get("r1")).stats.llm_steps == n_writers * n_chunks

    run(body)


# -- durability ---------------------------------------------------------------------------------


def test_data_survives_a_new_client_connection(open_store):
    async def write() -> None:
        async with open_store() as store:
            await store.create(record("r1", owner="rm-0"))
            await store.append_tokens("r1", [4, 5, 6], StepStats(1, 2, 4, 3))

    async def read() -> None:
        async with open_store() as store:  # a new pool in a new event loop: nothing cached client-side
            snap = await store.get("r1")
            assert snap.output_tokens == (4, 5, 6) and snap.stats == StepStats(1, 2, 4, 3)
            assert await store.active("rm-0") == ["r1"]

    run(write)
    run(read)


async def _write_history(url: str) -> None:
    client = connect(url)
    store = RequestStore(client, prefix="durable")
    try:
        await store.create(record("open", owner="rm-0"))
        await store.append_tokens("open", [1, 2, 3], StepStats(1, 2, 4, 3))
        await store.create(record("done", owner="rm-0"))
        await store.append_tokens("done", [9])
        await store.finish("done", "eos")
    finally:
        await client.aclose()


async def _check_history(url: str) -> None:
    client = connect(url)
    store = RequestStore(client, prefix="durable")
    try:
        snap = await store.get("open")
        assert snap is not None and snap.output_tokens == (1, 2, 3) and snap.stats == StepStats(1, 2, 4, 3)
        assert await store.active("rm-0") == ["open"]  # what a restarted request manager resumes
        done = await store.get("done")
        assert done.finish_reason is FinishReason.EOS and done.output_tokens == (9,)
        # The script cache did not survive the restart: EVALSHA falls back to loading the script.
        assert (await store.append_tokens("open", [4])).length == 4
    finally:
        await client.aclose()


@pytest.mark.parametrize("stop", ["close", "kill"])
def test_data_survives_a_redis_restart_with_appendonly(tmp_path: Path, redis_binary: Path, stop: str):
    # appendfsync always: every acknowledged write is on disk, so even SIGKILL loses nothing.
    config = {"appendonly": True, "appendfsync": "always", "executable": redis_binary}
    server = EmbeddedRedis(tmp_path, **config).start()
    try:
        asyncio.run(_write_history(server.url))
    finally:
        server.close() if stop == "close" else server.kill()
    with EmbeddedRedis(tmp_path, **config) as restarted:
        asyncio.run(_check_history(restarted.url))


# -- authentication -----------------------------------------------------------------------------


def test_password_is_required_when_set(tmp_path: Path, redis_binary: Path):
    password = 's3cr"et pass'  # quotes and spaces survive the config file

    async def body(url: str) -> None:
        for wrong in (None, "nope"):
            client = connect(url, wrong)
            with pytest.raises(redis.exceptions.AuthenticationError):
                await RequestStore(client).ping()
            await client.aclose()
        client = connect(url, password)
        try:
            store = RequestStore(client, prefix="auth")
            assert await store.ping()
            await store.create(record("r1"))
            assert (await store.get("r1")).prompt_tokens == (1, 2, 3)
        finally:
            await client.aclose()

    with EmbeddedRedis(tmp_path, password=password, transport="tcp", executable=redis_binary) as server:
        assert server.url.startswith("redis://127.0.0.1:") and password not in server.url
        asyncio.run(body(server.url))
