"""Request state in Redis, the source of truth of the request manager: :class:`RequestStore`.

How a request is laid out in Redis (keys, atomic scripts, the owner index) is :mod:`.redis_layout`.

Durability: :meth:`RequestStore.append_tokens` returns only after Redis applied the append, so a
caller that streams tokens after it returns never shows a client a token Redis does not hold (how much
survives a Redis crash is Redis' persistence setting: AOF with ``appendfsync always`` loses nothing).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio

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


@dataclass(frozen=True)
class LeaseReply:
    """The outcome of :meth:`RequestStore.hold_lease`: ``held`` (renewed, or taken because it was free;
    ``taken``: the latter) and the token of whoever holds it now."""

    held: bool
    taken: bool
    holder: str


class RequestStore:
    """Every request's state in Redis, through a ``redis.asyncio`` client with ``decode_responses=False``.

    ``finished_ttl_s``: how long a finished request stays readable (``get``) before Redis
    expires its keys. ``clock`` gives the ``created``/``updated`` times (seconds since the epoch).
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = "specinfer",
        finished_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if finished_ttl_s <= 0:
            raise ValueError("finished_ttl_s must be positive")
        self.client = client
        self.keys = KeySpace(prefix)
        self.finished_ttl_ms = max(1, round(finished_ttl_s * 1000))
        self._clock = clock
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
        """Store a new queued request; RequestExistsError when its ID belongs to an unfinished request.

        The ID enters the owner's set first (the set stays a superset, see :mod:`.redis_layout`); when
        the ID turns out to be taken, it leaves the set again unless the existing request is ours too.
        """
        rid, owner = record.request_id, record.owner
        active_key = self.keys.active(owner)
        await self.client.sadd(active_key, rid)
        args = [params_json(record.params), pack_tokens(record.prompt), owner, repr(self._clock()), record.lease_token]
        code, existing_owner = await self._create(keys=self.keys.request(rid), args=args)
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
    ) -> Appended:
        """Append committed tokens and add ``step_stats`` (default: one LLM step) in one atomic step.

        Its ``llm_steps``, ``accepted``, ``tree_size`` and ``cached_prompt`` are added (a snapshot's ``committed`` is its output's
        length). Returns the output length after the append and the request's cancel mark. A queued request becomes running.
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
        ]
        code, length, actual, cancel = await self._append(keys=self.keys.request(request_id), args=args)
        if code == ScriptCode.OFFSET_CONFLICT:
            assert offset is not None
            raise OffsetConflictError(request_id, offset, int(length))
        self._raise_for(code, request_id, owner, actual)
        return Appended(int(length), bool(cancel))

    async def finish(
        self, request_id: str, reason: FinishReason | str, error: str | None = None, *, owner: str | None = None, lease_token: str | None = None
    ) -> bool:
        """Mark the request finished, drop it from its owner's set, let its keys expire after the TTL.

        Returns False when it was already finished (finishing is idempotent; the first reason stays).
        ``owner`` and ``lease_token`` fence as in :meth:`append_tokens`.
        """
        reason = FinishReason(reason)
        args = [reason.value, error or "", repr(self._clock()), self.finished_ttl_ms, owner or "", lease_token or ""]
        code, actual = await self._finish(keys=self.keys.request(request_id), args=args)
        self._raise_for(code, request_id, owner, actual)
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
        if moves:
            await self.client.sadd(self.keys.active(to_owner), rid)
        code, actual = await self._claim(keys=[self.keys.meta(rid)], args=[from_owner, to_owner, lease_token])
        if code == ScriptCode.OK:
            if moves:
                await self.client.srem(self.keys.active(from_owner), rid)
            return True
        if moves and _text(actual) != to_owner:  # never ours: our index must not keep it
            await self.client.srem(self.keys.active(to_owner), rid)
        return False

    async def request_cancel(self, request_id: str) -> bool:
        """Mark an unfinished request for its owner to cancel at its next commit (:meth:`append_tokens`
        returns the mark); False when there is no unfinished request under this ID."""
        code, _ = await self._cancel(keys=[self.keys.meta(request_id)], args=[])
        return code == ScriptCode.OK

    # -- leases and owners ------------------------------------------------------------------------

    async def hold_lease(self, owner: str, token: str, ttl_s: float) -> LeaseReply:
        """Renew ``owner``'s lease for ``ttl_s`` seconds if ``token`` holds it, take it if it is free.
        While held, the owner is registered in the owners set (again at every renewal: an adopter may
        have removed it just before)."""
        code, holder = await self._hold(keys=[self.keys.lease(owner)], args=[token, max(1, round(ttl_s * 1000))])
        held = code != 0
        if held:
            await self.client.sadd(self.keys.owners(), owner)
        return LeaseReply(held, code == 2, _text(holder) or "")

    async def take_lease(self, owner: str, token: str, ttl_s: float) -> None:
        """Take ``owner``'s lease whoever holds it (only where nobody else can reach this Redis)."""
        await self.client.set(self.keys.lease(owner), token, px=max(1, round(ttl_s * 1000)))
        await self.client.sadd(self.keys.owners(), owner)

    async def release_lease(self, owner: str, token: str) -> bool:
        """Give ``owner``'s lease up if ``token`` holds it (a clean shutdown: others adopt at once)."""
        return bool(await self._release(keys=[self.keys.lease(owner)], args=[token]))

    async def orphaned_owners(self, exclude: str) -> list[str]:
        """Owners other than ``exclude`` whose index holds IDs while nobody holds their lease: the owners
        whose requests wait for adoption. Owners with neither are forgotten (see :mod:`.redis_layout`)."""
        orphaned = []
        for owner in sorted(m.decode() for m in await self.client.smembers(self.keys.owners())):
            if owner == exclude:
                continue
            leased, indexed = await self._owner_state(keys=self.keys.owner(owner), args=[])
            if leased:
                continue
            if indexed:
                orphaned.append(owner)
                continue
            await self.client.srem(self.keys.owners(), owner)
            leased, indexed = await self._owner_state(keys=self.keys.owner(owner), args=[])
            if leased or indexed:  # it came back meanwhile
                await self.client.sadd(self.keys.owners(), owner)
        return orphaned

    async def index(self, owner: str) -> tuple[list[str], list[str]]:
        """The owner's index split in two: its unfinished requests, oldest first (what :meth:`active`
        returns), and the stale IDs (finished, expired, or owned by another replica)."""
        ids = sorted(member.decode() for member in await self.client.smembers(self.keys.active(owner)))
        if not ids:
            return [], []
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hmget(self.keys.meta(rid), "status", "owner", "created")
            rows = await pipe.execute()
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
        return int(await self._prune(keys=self.keys.owner(owner), args=list(request_ids)))

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, request_id: str) -> RequestSnapshot | None:
        """The request's state (meta and output read atomically together), None when it does not exist."""
        flat, packed = await self._get(keys=self.keys.request(request_id))
        if not flat:
            return None
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return _snapshot(request_id, meta, packed)

    async def active(self, owner: str) -> list[str]:
        """IDs of the owner's unfinished requests, oldest first (what a restarted replica resumes).

        Stale IDs in the owner's set (finished, expired or owned by another replica) are skipped.
        """
        return (await self.index(owner))[0]

    async def tail(self, request_id: str, offset: int) -> Tail | None:
        """The request's output from ``offset`` on and whether it finished (None: no such request): what
        a replica that does not run the request polls to stream it."""
        status, packed = await self._tail(keys=self.keys.request(request_id), args=[offset])
        if status is None:
            return None
        return Tail(unpack_tokens(packed), status == b"finished")

    # -- helpers ----------------------------------------------------------------------------------

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
    "Appended",
    "LeaseReply",
    "OffsetConflictError",
    "OwnershipError",
    "RequestExistsError",
    "RequestFinishedError",
    "RequestNotFoundError",
    "RequestStore",
    "StoreError",
    "Tail",
]
