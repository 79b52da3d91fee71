"""Request-manager fixtures: a real Redis for every test, never a fake.

The Redis is the one ``REDIS_URL`` names (password in ``REDIS_PASSWORD``) when set, else an
:class:`EmbeddedRedis` started once per session in a temporary directory. Each test writes under its
own key prefix and deletes those keys afterwards, so tests never see each other's data and a shared
Redis is left as it was found.
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

from specinfer.request_manager.redis_server import EmbeddedRedis, RedisBinaryNotFoundError, connect, find_redis_server
from specinfer.request_manager.store import RequestStore


@dataclass(frozen=True)
class RedisTarget:
    """Where the tests' Redis listens."""

    url: str
    password: str | None

    def sync_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, password=self.password)


@pytest.fixture(scope="session")
def redis_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisTarget]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield RedisTarget(url, os.environ.get("REDIS_PASSWORD") or None)
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield RedisTarget(server.url, server.password)


@pytest.fixture
def key_prefix(redis_target: RedisTarget) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted when the test ends."""
    prefix = f"specinfer-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    with redis_target.sync_client() as client:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)  # one key per call: safe even on a cluster


StoreFactory = Callable[..., AbstractAsyncContextManager[RequestStore]]


@pytest.fixture
def open_store(redis_target: RedisTarget, key_prefix: str) -> StoreFactory:
    """``async with open_store(**kwargs) as store``: a RequestStore on its own connection pool.

    Call it inside the test's event loop (redis.asyncio clients belong to the loop they connect in);
    every store of one test shares the test's key prefix, so two stores see the same requests.
    """

    @contextlib.asynccontextmanager
    async def factory(**kwargs: Any) -> AsyncIterator[RequestStore]:
        client = connect(redis_target.url, redis_target.password)
        try:
            yield RequestStore(client, prefix=key_prefix, **kwargs)
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
