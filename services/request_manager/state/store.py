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

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from . import redis_layout
from .records import (
    FinishReason,
    RequestRecord,
    RequestSnapshot,
    StepStats,
    TokenLogprob,
    logprobs_record_bytes,
    pack_logprobs,
    pack_tokens,
    params_json,
    unpack_logprobs,
    unpack_tokens,
)
from .redis_failover import retrying, write_acked
from .redis_layout import KeySpace, ScriptCode, decode_snapshot
from .store_errors import (
    OffsetConflictError,
    ReplicationError,
    RequestExistsError,
    raise_for,
)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


@dataclass(frozen=True)
class Appended:
    """What :meth:`RequestStore.append_tokens` reports: the output's length after the append, and whether
    a replica asked for the request to be cancelled (:meth:`RequestStore.request_cancel`)."""

    length: int
    cancel_requested: bool


@dataclass(frozen=True)
class Tail:
    """A request's output from an offset on, and whether it is finished (read atomically together)."""

    tokens: tuple[int, ...]
    finished: bool
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens', when the request asked


@dataclass(frozen=True)
class LeaseReply:
    """The outcome of :meth:`RequestStore.hold_lease`: ``held`` (renewed, or taken because it was free;
    ``taken``: the latter) and the token of whoever holds it now."""

    held: bool
    taken: bool
    holder: str


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
        self._tail = client.register_script(redis_layout.TAIL)
        self._claim = client.register_script(redis_layout.CLAIM)
        self._cancel = client.register_script(redis_layout.CANCEL)
        self._hold = client.register_script(redis_layout.HOLD)
        self._release = client.register_script(redis_layout.RELEASE)
        self._owner_state = client.register_script(redis_layout.OWNER_STATE)
        self._prune = client.register_script(redis_layout.PRUNE)

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
        await self._write(
            active_key, ("SADD", active_key, rid)
        )  # acknowledged too: the superset must survive a failover
        args = [params_json(record.params), pack_tokens(record.prompt), owner, repr(self._clock()), record.lease_token]
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
        lease_token: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        top_logprobs: int = 0,
    ) -> Appended:
        """Append committed tokens and add ``step_stats`` (default: one LLM step) in one atomic step; ``logprobs``,
        the tokens' (each with ``top_logprobs`` alternatives), go with them where the request asked for them.

        Its ``llm_steps``, ``accepted``, ``tree_size`` and ``cached_prompt`` are added (a snapshot's ``committed`` is
        its output's length). Returns the output length after the append and the request's cancel mark. A queued
        request becomes running.
        ``owner``, when given, fences a replica that no longer owns the request (OwnershipError); ``lease_token``
        also fences an earlier incarnation of the same owner (:meth:`claim`).
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
            lease_token or "",
            pack_logprobs(logprobs, top_logprobs) if logprobs else b"",
        ]
        code, length, actual, cancel = await self._run(self._append, self.keys.request(request_id), args)
        if code == ScriptCode.OFFSET_CONFLICT:
            assert offset is not None
            raise OffsetConflictError(request_id, offset, int(length))
        raise_for(code, request_id, owner, actual)
        return Appended(int(length), bool(cancel))

    async def finish(
        self,
        request_id: str,
        reason: FinishReason | str,
        error: str | None = None,
        *,
        owner: str | None = None,
        lease_token: str | None = None,
    ) -> bool:
        """Mark the request finished, drop it from its owner's set, let its keys expire after the TTL.

        Returns False when it was already finished (finishing is idempotent; the first reason stays).
        ``owner`` and ``lease_token`` fence as in :meth:`append_tokens`.
        """
        reason = FinishReason(reason)
        args = [reason.value, error or "", repr(self._clock()), self.finished_ttl_ms, owner or "", lease_token or ""]
        code, actual = await self._run(self._finish, self.keys.request(request_id), args)
        raise_for(code, request_id, owner, actual)
        if actual is not None:
            # After the status change, never before: the set must stay a superset of running requests.
            await self.client.srem(self.keys.active(actual.decode()), request_id)
        return code == ScriptCode.OK

    async def claim(self, request_id: str, from_owner: str, to_owner: str, lease_token: str) -> bool:
        """Make the unfinished request of ``from_owner`` one of ``to_owner`` driven under ``lease_token``;
        False when it is finished, gone, or not ``from_owner``'s (another adopter won). Atomic per request,
        so of two replicas claiming the same request exactly one succeeds. With ``to_owner == from_owner``
        (a restarted replica resuming its own requests) only the token changes; otherwise the owner
        indexes follow the superset rule (:mod:`.redis_layout`): ours first, theirs after."""
        rid = request_id
        moves = to_owner != from_owner
        ours, theirs = self.keys.active(to_owner), self.keys.active(from_owner)
        if moves:
            await self._write(ours, ("SADD", ours, rid))
        code, actual = await self._run(self._claim, [self.keys.meta(rid)], [from_owner, to_owner, lease_token])
        if code == ScriptCode.OK:
            if moves:
                await self._write(theirs, ("SREM", theirs, rid))
            return True
        if moves and _text(actual) != to_owner:  # never ours: our index must not keep it
            await self._write(ours, ("SREM", ours, rid))
        return False

    async def request_cancel(self, request_id: str) -> bool:
        """Mark an unfinished request for its owner to cancel at its next commit (:meth:`append_tokens`
        returns the mark); False when there is no unfinished request under this ID."""
        code, _ = await self._run(self._cancel, [self.keys.meta(request_id)], [])
        return code == ScriptCode.OK

    # -- leases and owners ------------------------------------------------------------------------

    async def hold_lease(self, owner: str, token: str, ttl_s: float) -> LeaseReply:
        """Renew ``owner``'s lease for ``ttl_s`` seconds if ``token`` holds it, take it if it is free.
        While held, the owner is registered in the owners set (again at every renewal: an adopter may
        have removed it just before)."""
        code, holder = await self._run(self._hold, [self.keys.lease(owner)], [token, max(1, round(ttl_s * 1000))])
        held = code != 0
        if held:
            await self._write(self.keys.owners(), ("SADD", self.keys.owners(), owner))
        return LeaseReply(held, code == 2, _text(holder) or "")

    async def take_lease(self, owner: str, token: str, ttl_s: float) -> None:
        """Take ``owner``'s lease whoever holds it (only where nobody else can reach this Redis)."""
        await self._write(
            self.keys.lease(owner), ("SET", self.keys.lease(owner), token, "PX", max(1, round(ttl_s * 1000)))
        )
        await self._write(self.keys.owners(), ("SADD", self.keys.owners(), owner))

    async def release_lease(self, owner: str, token: str) -> bool:
        """Give ``owner``'s lease up if ``token`` holds it (a clean shutdown: others adopt at once)."""
        return bool(await self._run(self._release, [self.keys.lease(owner)], [token]))

    async def orphaned_owners(self, exclude: str) -> list[str]:
        """Owners other than ``exclude`` whose index holds IDs while nobody holds their lease: the owners
        whose requests wait for adoption. Owners with neither are forgotten (see :mod:`.redis_layout`)."""
        orphaned = []
        owners_key = self.keys.owners()
        for owner in sorted(m.decode() for m in await self._retrying(lambda: self.client.smembers(owners_key))):
            if owner == exclude:
                continue
            keys = self.keys.owner(owner)
            leased, indexed = await self._retrying(lambda keys=keys: self._owner_state(keys=keys, args=[]))
            if leased:
                continue
            if indexed:
                orphaned.append(owner)
                continue
            await self._write(owners_key, ("SREM", owners_key, owner))
            leased, indexed = await self._retrying(lambda keys=keys: self._owner_state(keys=keys, args=[]))
            if leased or indexed:  # it came back meanwhile
                await self._write(owners_key, ("SADD", owners_key, owner))
        return orphaned

    async def index(self, owner: str) -> tuple[list[str], list[str]]:
        """The owner's index split in two: its unfinished requests, oldest first (what :meth:`active`
        returns), and the stale IDs (finished, expired, or owned by another replica)."""
        active_key = self.keys.active(owner)
        ids = sorted(member.decode() for member in await self._retrying(lambda: self.client.smembers(active_key)))
        if not ids:
            return [], []

        async def read_rows() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:  # a cluster pipeline splits it by slot
                for rid in ids:
                    pipe.hmget(self.keys.meta(rid), "status", "owner", "created")
                return await pipe.execute()

        rows = await self._retrying(read_rows)
        live, stale = [], []
        for rid, (status, row_owner, created) in zip(ids, rows, strict=True):
            if status is not None and status != b"finished" and _text(row_owner) == owner:
                live.append((float(created or 0), rid))
            else:
                stale.append(rid)
        return [rid for _, rid in sorted(live)], stale

    async def prune_index(self, owner: str, request_ids: Sequence[str]) -> int:
        """Remove stale IDs from the index of an owner whose lease nobody holds; the number removed
        (-1: the lease is held again, nothing removed)."""
        if not request_ids:
            return 0
        return int(await self._run(self._prune, self.keys.owner(owner), list(request_ids)))

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, request_id: str) -> RequestSnapshot | None:
        """The request's state (meta and output read atomically together), None when it does not exist."""
        keys = self.keys.request(request_id)
        flat, packed, packed_logprobs = await self._retrying(lambda: self._get(keys=keys))
        if not flat:
            return None
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return decode_snapshot(request_id, meta, packed, packed_logprobs)

    async def active(self, owner: str) -> list[str]:
        """IDs of the owner's unfinished requests, oldest first (what a restarted replica resumes).

        Stale IDs in the owner's set (finished, expired or owned by another replica) are skipped.
        """
        return (await self.index(owner))[0]

    async def tail(self, request_id: str, offset: int, top_logprobs: int | None = None) -> Tail | None:
        """The request's output from ``offset`` on and whether it finished (None: no such request): what
        a replica that does not run the request polls to stream it; with the tokens' logprobs where the request
        asks ``top_logprobs`` alternatives."""
        keys = self.keys.request(request_id)
        args = [offset, logprobs_record_bytes(top_logprobs)]
        status, packed, packed_logprobs = await self._retrying(lambda: self._tail(keys=keys, args=args))
        if status is None:
            return None
        tokens = unpack_tokens(packed)
        logprobs = unpack_logprobs(packed_logprobs[: len(tokens) * args[1]], tokens, top_logprobs)
        return Tail(tokens, status == b"finished", logprobs)

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
        reply, acked = await write_acked(
            self.client, key, command, self.min_replica_acks, self.replica_timeout_ms, script
        )
        if acked < self.min_replica_acks:
            raise ReplicationError(key, acked, self.min_replica_acks, self.replica_timeout_ms)
        return reply

    async def _retrying(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A cluster's calls ride out a failover; a standalone client's are redis-py's alone (as before)."""
        return await retrying(self.client, call) if isinstance(self.client, RedisCluster) else await call()


__all__ = [
    "Appended",
    "LeaseReply",
    "RequestStore",
    "Tail",
]
