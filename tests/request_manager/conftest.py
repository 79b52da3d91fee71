"""Request-manager fixtures: a real Redis for every test, never a fake.

Store tests run three times: against a standalone Redis, against a 3-master Redis Cluster, and against
that cluster with every write acknowledged by a replica (``min_replica_acks=1``). The standalone Redis
is the one ``REDIS_URL`` names (password in ``REDIS_PASSWORD``) when set, else an :class:`EmbeddedRedis`
started once per session; the cluster is the one ``REDIS_CLUSTER_URL`` names (any node; password in
``REDIS_PASSWORD``), else a :class:`~redis_cluster.LocalRedisCluster` started once per session. Each
test writes under its own key prefix and deletes those keys afterwards, so tests never see each
other's data and a shared Redis is left as it was found.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from redis_cluster import LocalRedisCluster  # tests/redis_cluster.py

from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import (
    EmbeddedRedis,
    RedisBinaryNotFoundError,
    find_redis_server,
)
from specinfer.request_manager.state.store import RequestStore


@dataclass(frozen=True)
class RedisTarget:
    """Where the tests' Redis listens, and how the store writes to it."""

    url: str
    password: str | None
    cluster: bool = False
    min_replica_acks: int = 0

    def sync_client(self) -> redis.Redis | redis.cluster.RedisCluster:
        if self.cluster:
            return redis.cluster.RedisCluster.from_url(self.url, password=self.password)
        return redis.Redis.from_url(self.url, password=self.password)


@pytest.fixture(scope="session")
def standalone_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisTarget]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield RedisTarget(url, os.environ.get("REDIS_PASSWORD") or None)
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield RedisTarget(server.url, server.password)


@pytest.fixture(scope="session")
def cluster_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisTarget]:
    url = os.environ.get("REDIS_CLUSTER_URL")
    if url:
        yield RedisTarget(url, os.environ.get("REDIS_PASSWORD") or None, cluster=True)
        return
    try:
        find_redis_server()
    except RedisBinaryNotFoundError as exc:
        pytest.skip(str(exc))
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield RedisTarget(cluster.url, None, cluster=True)


@pytest.fixture(params=["standalone", "cluster", "cluster-acked"])
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    """Each store test runs against a standalone Redis, a cluster, and a cluster with acknowledged writes."""
    if request.param == "standalone":
        return request.getfixturevalue("standalone_redis")
    target: RedisTarget = request.getfixturevalue("cluster_redis")
    return RedisTarget(
        target.url, target.password, cluster=True, min_replica_acks=1 if request.param == "cluster-acked" else 0
    )


@pytest.fixture
def key_prefix(redis_target: RedisTarget) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted when the test ends."""
    prefix = f"specinfer-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    with redis_target.sync_client() as client:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):  # a cluster client scans every master
            client.delete(key)  # one key per call: safe even on a cluster


StoreFactory = Callable[..., AbstractAsyncContextManager[RequestStore]]


@pytest.fixture
def open_store(redis_target: RedisTarget, key_prefix: str) -> StoreFactory:
    """``async with open_store(**kwargs) as store``: a RequestStore on its own connection pool (or cluster client).

    Call it inside the test's event loop (redis.asyncio clients belong to the loop they connect in);
    every store of one test shares the test's key prefix, so two stores see the same requests.
    """

    @contextlib.asynccontextmanager
    async def factory(**kwargs: Any) -> AsyncIterator[RequestStore]:
        client = connect(redis_target.url, redis_target.password, cluster=redis_target.cluster)
        kwargs.setdefault("min_replica_acks", redis_target.min_replica_acks)
        try:
            store = RequestStore(client, prefix=key_prefix, **kwargs)
            # as the request manager does before serving: a cluster client learns the slot map first
            # (redis-py 8.1's cluster client, used concurrently before that, races its own connections)
            await store.ping()
            yield store
        finally:
            await client.aclose()

    return factory


@pytest.fixture
def redis_binary() -> Path:
    """The redis-server binary, for tests that start their own servers (skipped when there is none)."""
    try:
        return find_redis_server()
    except RedisBinaryNotFoundError as exc:
        pytest.skip(str(exc))
