"""Riding out a Redis failover: calls that follow a cluster's new topology, and writes that replicas
acknowledged (which survive one).

**Retries.** When a Redis Cluster master dies, its slots are unserved until the cluster marks it failed
(``cluster-node-timeout``) and promotes one of its replicas, a few node timeouts in all. redis-py's
cluster client refreshes its slot map after a connection error or ``MOVED`` but retries at once, so
its retries are spent before the promotion. :func:`retrying` retries a call on such errors with
backoff (50 ms doubling to 1 s) for up to ``FAILOVER_S``, refreshing the slot map before each try.

**Acknowledged writes.** Redis replicates asynchronously: a master acknowledges a write before its
replicas have it, so a master that dies right after a write can lose it to the replica promoted in
its place. ``WAIT numreplicas timeout`` blocks until that many replicas acknowledged every write *its
own connection* made, or until the timeout, and returns how many did. So the write and the WAIT must
travel on one connection, to the master of the key's slot: :func:`write_acked` sends both back to back
on one connection it holds meanwhile, which a client's ordinary calls cannot promise (a pool hands
each call any connection; a cluster pipeline resends a redirected command on another one).

The caller's part of the bargain: a command that finds its effect already applied (a retry) must
still *write* something (touch a field), because ``WAIT`` covers only its connection's writes: after
a write-free reply, ``WAIT`` would answer for an older write of that connection, not for the data
the command found.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection

log = logging.getLogger("specinfer.redis")
T = TypeVar("T")

FAILOVER_S = 10.0  # how long a cluster call keeps retrying through a failover before its error is raised
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0
STANDALONE_ATTEMPTS = 3  # on a standalone server: a pooled connection the server dropped is retried
# Errors after which the slot map may be stale (a failover, a slot migration): refresh and try again.
TOPOLOGY_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.AskError,  # MovedError is one
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,  # a master demoted to replica, under a stale map
    redis.exceptions.SlotNotCoveredError,
    OSError,
)


async def retrying(client: redis.asyncio.Redis | RedisCluster, call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, tried again after a topology error (see the module docstring): on a cluster until it
    succeeds or ``FAILOVER_S`` passed, on a standalone server ``STANDALONE_ATTEMPTS`` times in all.
    ``call`` must be safe to repeat (the store's scripts are)."""
    cluster = isinstance(client, RedisCluster)
    deadline = time.monotonic() + FAILOVER_S
    pause = FIRST_PAUSE_S
    for attempt in itertools.count(1):
        try:
            return await call()
        except TOPOLOGY_ERRORS as exc:
            if (cluster and time.monotonic() + pause > deadline) or (not cluster and attempt >= STANDALONE_ATTEMPTS):
                raise
            log.info("redis call retried", extra={"error": repr(exc), "attempt": attempt})
        await asyncio.sleep(pause)
        pause = min(MAX_PAUSE_S, 2 * pause)
        if cluster:
            await _refresh(client)
    raise AssertionError("unreachable")


async def write_acked(
    client: redis.asyncio.Redis | RedisCluster,
    key: str,
    command: Sequence[Any],
    replicas: int,
    timeout_ms: int,
    script: bytes | str | None = None,
) -> tuple[Any, int]:
    """Run ``command`` on the master that holds ``key`` (every key of the command shares its slot), then
    ``WAIT replicas timeout_ms`` on the same connection; returns (the command's reply, how many replicas
    acknowledged it). ``script``: the source of an ``EVALSHA`` command, loaded when the server lacks it.
    Retried as :func:`retrying` says.

    An error reply of the command itself is raised (after the WAIT's reply is read: the connection
    stays in step).
    """

    async def once() -> tuple[Any, int]:
        try:
            return await _exchange(client, key, command, replicas, timeout_ms)
        except redis.exceptions.NoScriptError:
            if script is None:
                raise
            await client.script_load(
                script
            )  # a cluster client loads it on every master: any may own the slot after a failover
            return await _exchange(client, key, command, replicas, timeout_ms)

    return await retrying(client, once)


async def _exchange(
    client: redis.asyncio.Redis | RedisCluster, key: str, command: Sequence[Any], replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """The command and WAIT on one connection; raises the command's error, else WAIT's."""
    async with _master_connection(client, key) as conn:
        await conn.send_packed_command(conn.pack_commands([tuple(command), ("WAIT", replicas, timeout_ms)]))
        replies: list[Any] = []
        for _ in range(2):  # both replies are read even when the first is an error
            try:
                replies.append(await conn.read_response())
            except redis.exceptions.ResponseError as exc:
                replies.append(exc)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies[0], int(replies[1])


@contextlib.asynccontextmanager
async def _master_connection(client: redis.asyncio.Redis | RedisCluster, key: str) -> AsyncIterator[AbstractConnection]:
    """One connection to the master of ``key``'s slot, held for the block and then given back to its pool
    (disconnected first when the block failed on it: its replies may be out of step)."""
    node: ClusterNode | None = None
    if isinstance(client, RedisCluster):
        await client.initialize()  # a no-op once the slot map is known
        node = client.get_node_from_key(key)
        conn = node.acquire_connection()
    else:
        conn = await client.connection_pool.get_connection()
    try:
        yield conn
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        if node is not None:
            node.release(conn)
        else:
            await client.connection_pool.release(conn)


async def _refresh(client: RedisCluster) -> None:
    """Learn the cluster's slot map again; a failure is left to the next try."""
    try:
        await client.nodes_manager.initialize()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        log.info("redis cluster slot map not refreshed", extra={"error": repr(exc)})
