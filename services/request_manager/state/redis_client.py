"""The request manager's Redis clients: :func:`connect` opens one to a Redis server (embedded,
:mod:`.redis_server`; external; or a Redis Cluster) with ``decode_responses=False``: the request store keeps
packed token IDs in Redis strings, so every reply is bytes and callers decode text fields themselves.
"""

from __future__ import annotations

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

SOCKET_TIMEOUT_S = 5.0  # a Redis reply that takes longer is a dead connection (redis-py's default, made ours)


def connect(
    url: str,
    password: str | None = None,
    username: str | None = None,
    *,
    cluster: bool = False,
    socket_timeout: float = SOCKET_TIMEOUT_S,
    socket_connect_timeout: float | None = None,
) -> redis.asyncio.Redis | RedisCluster:
    """A ``redis.asyncio`` client for ``url`` (``redis://``, ``rediss://`` or ``unix://``), replies as bytes.
    ``username``: a Redis ACL user (None: the default user, authenticated by ``password`` alone);
    ``socket_connect_timeout``: how long connecting may take (None: redis-py's default, no bound).
    ``cluster``: ``url`` names any node of a Redis Cluster (``redis://`` or ``rediss://``); the client
    learns the others and each slot's master from it, and refreshes that map on ``MOVED`` and on
    connection errors (riding out a failover, which takes a few node timeouts: :mod:`.redis_failover`).

    The client connects lazily: errors (refused connection, wrong password) surface on the first command.
    """
    if cluster and not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"a Redis Cluster needs a redis:// or rediss:// URL (TCP), got {url.split('://')[0]}://")
    from_url = RedisCluster.from_url if cluster else redis.asyncio.from_url
    return from_url(
        url,
        password=password,
        username=username,
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
    )
