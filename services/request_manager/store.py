"""Request state in Redis, the source of truth of the request manager: :class:`RequestStore`.

How a request is laid out in Redis (keys, atomic scripts, the owner index) is :mod:`.redis_layout`.

The client is a ``redis.asyncio.Redis`` or a ``redis.asyncio.cluster.RedisCluster`` (a Redis Cluster):
every operation on one request touches keys of one slot only, and the owner index is written key by key.

Durability: :meth:`RequestStore.append_tokens` returns only after Redis applied the append, so a
caller that streams tokens after it returns never shows a client a token Redis does not hold (how much
survives a Redis crash is Redis' persistence setting: AOF with ``appendfsync always`` loses nothing).
Replication is asynchronous, so a master that fails right after a write may lose it to the replica
promoted in its place; with ``min_replica_acks`` > 0 every write of :meth:`~RequestStore.create`,
:meth:`~RequestStore.append_tokens` and :meth:`~RequestStore.finish` returns only once that many replicas
acknowledged it, and raises :class:`ReplicationError` otherwise (:mod:`.redis_failover`, which also
retries a cluster's calls through a failover).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from . import redis_layout
from .records import (
    FinishReason,
    RequestRecord,
    RequestSnapshot,
    RequestStatus,
    StepStats,
    pack_tokens,
    params_json,
    unpack_tokens,
)
from .redis_failover import retrying, write_acked
from .redis_layout import KeySpace, ScriptCode


class StoreError(Exception):
    """Base of the request store's errors."""


class RequestExistsError(StoreError):
    """``create`` with the ID of a request that is not finished (client IDs are unique among running requests)."""


class RequestNotFoundError(StoreError):
    """No request with this ID (never created, or finished and expired)."""


class RequestFinishedError(StoreError):
    """A write to a request that is already finished."""


class OwnershipError(StoreError):
    """The request is owned by another replica than the caller says."""

    def __init__(self, request_id: str, expected: str, actual: str | None) -> None:
        super().__init__(f"request {request_id!r} is owned by {actual!r}, not {expected!r}")
        self.expected = expected
        self.actual = actual


class OffsetConflictError(StoreError):
    """``append_tokens`` at an offset that is not the output's current length (a lost or duplicated step)."""

    def __init__(self, request_id: str, offset: int, length: int) -> None:
        super().__init__(f"request {request_id!r}: append at offset {offset} but the output has {length} tokens")
        self.offset = offset
        self.length = length


class ReplicationError(StoreError):
    """Fewer replicas than ``min_replica_acks`` acknowledged a write within the timeout. The master applied
    it, so a retry of the same call (an append at the same offset) finds it and waits again; until one
    succeeds, nothing of it may be shown to a client."""

    def __init__(self, key: str, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(f"write to {key!r}: {acked} of {wanted} replicas acknowledged it within {timeout_ms} ms")
        self.acked = acked
        self.wanted = wanted


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


class RequestStore:
    """Every request's state in Redis, through a ``redis.asyncio`` client (standalone or cluster) with
    ``decode_responses=False``.

    ``finished_ttl_s``: how long a finished request stays readable (``get``) before Redis
    expires its keys. ``clock`` gives the ``created``/``updated`` times (seconds since the epoch).
    ``min_replica_acks``: how many replicas must acknowledge each write before it returns (0: none,
    Redis' asynchronous replication), waiting at most ``replica_timeout_s``.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis | RedisCluster,
        *,
        prefix: str = "specinfer",
        finished_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        min_replica_acks: int = 0,
        replica_timeout_s: float = 1.0,
    ) -> None:
        if finished_ttl_s <= 0:
            raise ValueError("finished_ttl_s must be positive")
        if min_replica_acks < 0:
            raise ValueError("min_replica_acks must be >= 0")
        if replica_timeout_s <= 0:
            raise ValueError("replica_timeout_s must be positive")
        self.client = client
        self.keys = KeySpace(prefix)
        self.finished_ttl_ms = max(1, round(finished_ttl_s * 1000))
        self._clock = clock
        self.min_replica_acks = min_replica_acks
        self.replica_timeout_ms = max(1, round(replica_timeout_s * 1000))
        # register_script runs by EVALSHA and loads the script on NOSCRIPT (e.g. after a Redis restart).
        self._create = client.register_script(redis_layout.CREATE)
        self._append = client.register_script(redis_layout.APPEND)
        self._finish = client.register_script(redis_layout.FINISH)
        self._get = client.register_script(redis_layout.GET)

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    # -- writes -----------------------------------------------------------------------------------

    async def create(self, record: RequestRecord) -> None:
        """Store a new queued request; RequestExistsError when its ID belongs to an unfinished request (a
        retry of this call, whose first reply was lost after Redis applied it, is recognized and succeeds).

        The ID enters the owner's set first (the set stays a superset, see :mod:`.redis_layout`); when
        the ID turns out to be taken, it leaves the set again unless the existing request is ours too.
        """
        rid, owner = record.request_id, record.owner
        active_key = self.keys.active(owner)
        await self._write(active_key, ("SADD", active_key, rid))  # acknowledged too: the superset must survive a failover
        args = [params_json(record.params), pack_tokens(record.prompt), owner, repr(self._clock())]
        code, existing_owner = await self._run(self._create, self.keys.request(rid), args)
        if code == ScriptCode.EXISTS:
            if _text(existing_owner) != owner:
                await self.client.srem(active_key, rid)
            raise RequestExistsError(f"request {rid!r} exists and is not finished")

    async def append_tokens(
        self,
        request_id: str,
        tokens: Sequence[int],
        step_stats: StepStats | None = None,
        *,
        owner: str | None = None,
        offset: int | None = None,
    ) -> int:
        """Append committed tokens and add ``step_stats`` (default: one LLM step) in one atomic step.

        Its ``llm_steps``, ``accepted``, ``tree_size`` and ``cached_prompt`` are added (a snapshot's ``committed`` is its output's
        length). Returns the output length after the append. A queued request becomes running.
        ``owner``, when given, fences a replica that no longer owns the request (OwnershipError).
        ``offset``, when given, is the output length the caller expects before ``tokens``: a mismatch raises
        OffsetConflictError, except that a retry of an append Redis already applied (the tokens already end
        the output at that offset) is recognized and not applied twice, so a timed-out append can be retried
        safely (a retried append of zero tokens cannot be recognized and counts its step again).
        """
        stats = step_stats if step_stats is not None else StepStats()
        if offset is not None and offset < 0:
            raise ValueError("offset must be >= 0")
        args = [
            pack_tokens(tokens),
            stats.llm_steps,
            stats.accepted,
            stats.tree_size,
            repr(self._clock()),
            owner or "",
            -1 if offset is None else offset,
            stats.cached_prompt,
        ]
        code, length, actual = await self._run(self._append, self.keys.request(request_id), args)
        if code == ScriptCode.OFFSET_CONFLICT:
            assert offset is not None
            raise OffsetConflictError(request_id, offset, int(length))
        self._raise_for(code, request_id, owner, actual)
        return int(length)

    async def finish(self, request_id: str, reason: FinishReason | str, error: str | None = None, *, owner: str | None = None) -> bool:
        """Mark the request finished, drop it from its owner's set, let its keys expire after the TTL.

        Returns False when it was already finished (finishing is idempotent; the first reason stays).
        """
        reason = FinishReason(reason)
        args = [reason.value, error or "", repr(self._clock()), self.finished_ttl_ms, owner or ""]
        code, actual = await self._run(self._finish, self.keys.request(request_id), args)
        self._raise_for(code, request_id, owner, actual)
        if actual is not None:
            # After the status change, never before: the set must stay a superset of running requests.
            await self.client.srem(self.keys.active(actual.decode()), request_id)
        return code == ScriptCode.OK

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, request_id: str) -> RequestSnapshot | None:
        """The request's state (meta and output read atomically together), None when it does not exist."""
        keys = self.keys.request(request_id)
        flat, packed = await self._retrying(lambda: self._get(keys=keys))
        if not flat:
            return None
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return _snapshot(request_id, meta, packed)

    async def active(self, owner: str) -> list[str]:
        """IDs of the owner's unfinished requests, oldest first (what a restarted replica resumes).

        Stale IDs in the owner's set (finished, expired or owned by another replica) are skipped.
        """
        ids = sorted(member.decode() for member in await self.client.smembers(self.keys.active(owner)))
        if not ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hmget(self.keys.meta(rid), "status", "owner", "created")
            rows = await pipe.execute()
        live = [
            (float(created or 0), rid)
            for rid, (status, row_owner, created) in zip(ids, rows, strict=True)
            if status is not None and status != b"finished" and _text(row_owner) == owner
        ]
        return [rid for _, rid in sorted(live)]

    # -- helpers ----------------------------------------------------------------------------------

    async def _run(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        """A write script over ``keys`` (one slot), acknowledged by ``min_replica_acks`` replicas when set
        (:class:`ReplicationError` when fewer did in time); its reply."""
        if not self.min_replica_acks:
            return await self._retrying(lambda: script(keys=keys, args=args))
        return await self._write(keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args), script.script)

    async def _write(self, key: str, command: tuple[Any, ...], script: bytes | str | None = None) -> Any:
        """One write command on ``key``'s slot, acknowledged by ``min_replica_acks`` replicas when set
        (:class:`ReplicationError` when fewer did in time); its reply."""
        if not self.min_replica_acks:
            return await self._retrying(lambda: self.client.execute_command(*command))
        reply, acked = await write_acked(self.client, key, command, self.min_replica_acks, self.replica_timeout_ms, script)
        if acked < self.min_replica_acks:
            raise ReplicationError(key, acked, self.min_replica_acks, self.replica_timeout_ms)
        return reply

    async def _retrying(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A cluster's calls ride out a failover; a standalone client's are redis-py's alone (as before)."""
        return await retrying(self.client, call) if isinstance(self.client, RedisCluster) else await call()

    @staticmethod
    def _raise_for(code: int, request_id: str, owner: str | None, actual: bytes | None) -> None:
        if code == ScriptCode.NOT_FOUND:
            raise RequestNotFoundError(f"no request {request_id!r}")
        if code == ScriptCode.FINISHED:
            raise RequestFinishedError(f"request {request_id!r} is finished")
        if code == ScriptCode.WRONG_OWNER:
            raise OwnershipError(request_id, owner or "", _text(actual))
        if code not in (ScriptCode.OK, ScriptCode.UNCHANGED):
            raise StoreError(f"unexpected store script result {code} for request {request_id!r}")


def _snapshot(request_id: str, meta: dict[bytes, bytes], packed: bytes | None) -> RequestSnapshot:
    def text(field: str) -> str | None:
        value = meta.get(field.encode())
        return value.decode() if value else None

    def count(field: str) -> int:
        return int(meta.get(field.encode(), b"0"))

    reason = text("reason")
    output = unpack_tokens(packed)
    return RequestSnapshot(
        request_id=request_id,
        owner=text("owner") or "",
        status=RequestStatus(text("status")),
        params=json.loads(meta.get(b"params", b"{}")),
        prompt_tokens=unpack_tokens(meta.get(b"prompt")),
        output_tokens=output,
        finish_reason=FinishReason(reason) if reason else None,
        error=text("error"),
        stats=StepStats(count("llm_steps"), count("accepted_tokens"), count("tree_nodes"), len(output), count("cached_prompt_tokens")),
        created=float(text("created") or 0),
        updated=float(text("updated") or 0),
    )


__all__ = [
    "OffsetConflictError",
    "OwnershipError",
    "ReplicationError",
    "RequestExistsError",
    "RequestFinishedError",
    "RequestNotFoundError",
    "RequestStore",
    "StoreError",
]
