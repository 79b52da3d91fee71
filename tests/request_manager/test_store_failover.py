"""The request store on a real 3-master Redis Cluster through a master's failure, and writes that
replicas must acknowledge (--redis-min-replica-acks): refused while a replica is frozen, taken again
(once) when it is back; the settings that choose all this."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.exceptions
from redis_cluster import LocalRedisCluster, wait_for  # tests/redis_cluster.py

from specinfer.core import InvalidArgument
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.state.records import RequestRecord, StepStats
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import ReplicationError

REQUESTS = 24  # hashed over 16384 slots: every master holds some (asserted)


def record(rid: str) -> RequestRecord:
    return RequestRecord(request_id=rid, prompt=(1, 2, 3), owner="rm-0")


def token(i: int, position: int) -> int:
    """Request i's token at output position p: a retried append at an offset always carries the same tokens."""
    return 1000 * i + position


async def drive(
    store: RequestStore,
    rid: str,
    i: int,
    acked: list[int],
    until: asyncio.Event,
    extra: dict[str, int],
    errors: list[Exception],
) -> None:
    """Append two tokens per step to request ``rid``, recording in ``acked`` only what the store acknowledged;
    a failed append is retried at the same offset with the same tokens (as the scheduler does). Runs until
    ``until`` is set and ``extra[rid]`` more tokens were acknowledged after that."""
    target: int | None = None
    while target is None or len(acked) < target:
        if target is None and until.is_set():
            target = len(acked) + extra[rid]
        tokens = [token(i, len(acked)), token(i, len(acked) + 1)]
        try:
            await store.append_tokens(rid, tokens, StepStats(1, 1, 2, 2), offset=len(acked))
        except Exception as exc:  # what a failover throws at a caller, redis' or the store's
            errors.append(exc)
            await asyncio.sleep(0.05)
            continue
        acked.extend(tokens)
        await asyncio.sleep(0.005)  # let the others and the failover run


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block: alive, connected, silent."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_acknowledged_tokens_survive_the_failover_of_a_master(tmp_path: Path, redis_binary: Path):
    """kill -9 a master while every request appends (each write acknowledged by a replica): its replica
    takes over, the client follows the new topology, every acknowledged token is there, once, and, once
    the failed node is back as the new master's replica, the requests of every master go on appending."""
    with LocalRedisCluster(tmp_path) as cluster:

        async def body() -> None:
            client = connect(cluster.url, cluster=True)
            store = RequestStore(client, prefix="failover", min_replica_acks=1)
            try:
                await store.ping()
                ids = [f"req-{i}" for i in range(REQUESTS)]
                homes = {rid: cluster.master_of(store.keys.meta(rid)).port for rid in ids}
                assert len(set(homes.values())) == 3, "the requests do not span every master"
                for rid in ids:
                    await store.create(record(rid))
                victim = cluster.master_of(store.keys.meta(ids[0]))
                acked = {rid: [] for rid in ids}
                promoted, errors = asyncio.Event(), []
                extra = dict.fromkeys(ids, 10)
                drivers = [
                    asyncio.create_task(drive(store, rid, i, acked[rid], promoted, extra, errors))
                    for i, rid in enumerate(ids)
                ]
                while min(len(a) for a in acked.values()) < 10:  # every request mid-way
                    await asyncio.sleep(0.01)
                replica = await asyncio.to_thread(cluster.kill_master, victim)
                await asyncio.to_thread(cluster.wait_promoted, replica)
                # the promoted master has no replica: its writes are applied but not acknowledged
                # (ReplicationError) until the failed node is back, as its replica
                await asyncio.to_thread(cluster.restart, victim)
                await asyncio.to_thread(cluster.wait_replica_of, victim, replica)
                promoted.set()
                await asyncio.wait_for(asyncio.gather(*drivers), 60)

                assert {rid for rid in ids if homes[rid] == victim.port} == {
                    rid for rid in ids if cluster.master_of(store.keys.meta(rid)) is replica
                }
                for i, rid in enumerate(ids):
                    snap = await store.get(rid)
                    assert snap is not None
                    # every acknowledged token, in order, none twice, nothing unacknowledged
                    assert snap.output_tokens == tuple(acked[rid]) == tuple(token(i, p) for p in range(len(acked[rid])))
                    assert snap.stats.llm_steps == len(acked[rid]) // 2
                assert await store.active("rm-0") == ids  # the owner index too
                # only errors of the failover: the client's while the master was gone, ReplicationError while its
                # shard had no replica
                assert all(isinstance(e, (ReplicationError, redis.exceptions.RedisError)) for e in errors), errors
            finally:
                await client.aclose()

        asyncio.run(body())


def test_a_frozen_replica_fails_acknowledged_writes_until_it_is_back(tmp_path: Path, redis_binary: Path):
    """SIGSTOP the only replica of a master: writes to that master are applied but not acknowledged
    (ReplicationError, which the scheduler answers by publishing nothing and retrying); SIGCONT: the
    retry at the same offset finds the append and succeeds without applying it twice. The other
    masters' requests are not held up."""
    with LocalRedisCluster(tmp_path) as cluster:

        async def body() -> None:
            client = connect(cluster.url, cluster=True)
            store = RequestStore(client, prefix="frozen", min_replica_acks=1, replica_timeout_s=0.3)
            try:
                await store.ping()
                ids = [f"req-{i}" for i in range(REQUESTS)]
                for rid in ids:
                    await store.create(record(rid))
                frozen_master = cluster.master_of(store.keys.meta(ids[0]))
                on_frozen = {rid for rid in ids if cluster.master_of(store.keys.meta(rid)) is frozen_master}
                replica = cluster.replicas_of(frozen_master)[0]
                with frozen(replica.server.pid):
                    for i, rid in enumerate(ids):
                        tokens = [token(i, 0), token(i, 1)]
                        if rid in on_frozen:
                            with pytest.raises(ReplicationError, match="0 of 1 replicas"):
                                await store.append_tokens(rid, tokens, offset=0)
                        else:
                            assert (await store.append_tokens(rid, tokens, offset=0)).length == 2
                for i, rid in enumerate(ids):  # the retry of every append, the refused ones included
                    assert (
                        await store.append_tokens(rid, [token(i, 0), token(i, 1)], StepStats(1, 1, 2, 2), offset=0)
                    ).length == 2
                    snap = await store.get(rid)
                    assert snap.output_tokens == (token(i, 0), token(i, 1)) and snap.stats.llm_steps == 1
            finally:
                await client.aclose()

        asyncio.run(body())


def test_acknowledged_writes_on_a_standalone_master_and_replica(tmp_path: Path, redis_binary: Path):
    """--redis-min-replica-acks works on a plain master with a replica too: acknowledged while the
    replica follows, ReplicationError while it is frozen, acknowledged again (once) when it is back."""
    master = EmbeddedRedis(tmp_path / "master", transport="tcp", executable=redis_binary)
    with master:
        replica = EmbeddedRedis(
            tmp_path / "replica",
            transport="tcp",
            executable=redis_binary,
            extra_config=[f"replicaof 127.0.0.1 {master.port}"],
        )
        with replica:
            with replica.client() as probe:
                wait_for(lambda: probe.info("replication").get("master_link_status") == "up", 30, "the replica in sync")

            async def body() -> None:
                client = connect(master.url)
                store = RequestStore(client, prefix="standalone", min_replica_acks=1, replica_timeout_s=0.3)
                try:
                    await store.create(record("r1"))
                    assert (await store.append_tokens("r1", [1, 2], offset=0)).length == 2
                    with frozen(replica.pid), pytest.raises(ReplicationError):
                        await store.append_tokens("r1", [3], offset=2)
                    assert (await store.append_tokens("r1", [3], offset=2)).length == 3  # found, not applied again
                    with frozen(replica.pid), pytest.raises(ReplicationError):
                        await store.finish("r1", "eos")
                    assert not await store.finish("r1", "eos")  # finished already: unchanged, and now acknowledged
                    snap = await store.get("r1")
                    assert snap.output_tokens == (1, 2, 3) and snap.is_finished
                finally:
                    await client.aclose()

            asyncio.run(body())
            with replica.client() as on_replica:  # what the store acknowledged is on the replica
                assert on_replica.strlen("standalone:{r1}:out") == 12


@pytest.mark.parametrize(
    ("argv", "field", "message"),
    [
        (["--redis-cluster", "1"], "redis-cluster", "needs --redis-url"),
        (["--redis-cluster", "1", "--redis-url", "unix:///tmp/redis.sock"], "redis-url", "redis:// or rediss://"),
        (["--redis-min-replica-acks", "1"], "redis-min-replica-acks", "needs --redis-url"),
        (["--redis-url", "redis://h:1", "--redis-min-replica-acks", "-1"], "redis-min-replica-acks", ">= 0"),
        (
            ["--redis-url", "redis://h:1", "--redis-replica-timeout-seconds", "0"],
            "redis-replica-timeout-seconds",
            "> 0",
        ),
        (
            ["--redis-url", "redis://h:1", "--redis-replica-timeout-seconds", "9"],
            "redis-replica-timeout-seconds",
            "socket timeout",
        ),
    ],
)
def test_redis_settings_that_do_not_fit_are_refused(argv, field, message):
    with pytest.raises(InvalidArgument, match=message) as info:
        RequestManagerConfig.from_args(argv)
    assert info.value.field == field


def test_redis_cluster_settings(monkeypatch):
    cfg = RequestManagerConfig.from_args(
        ["--redis-url", "redis://node-0:6379", "--redis-cluster", "on", "--redis-min-replica-acks", "1"]
    )
    assert (cfg.redis_cluster, cfg.redis_min_replica_acks, cfg.redis_replica_timeout_seconds) == (True, 1, 1.0)
    monkeypatch.setenv("SPECINFER_REDIS_CLUSTER", "1")
    monkeypatch.setenv("SPECINFER_REDIS_URL", "redis://node-0:6379")
    assert RequestManagerConfig.from_args([]).redis_cluster
    assert not RequestManagerConfig.from_args(["--redis-cluster", "0"]).redis_cluster
