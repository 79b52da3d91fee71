"""Request state in Redis, the source of truth of the request manager.

Key layout (``P`` is the store's prefix, ``specinfer`` by default)::

    P:{<request_id>}:meta      hash    params (JSON), prompt (packed int32), status, reason, error,
                                       llm_steps, accepted_tokens, tree_nodes, created, updated, owner
    P:{<request_id>}:out       string  output token IDs, packed little-endian int32, grown by APPEND
    P:owner:{<owner>}:active   set     IDs of the owner's unfinished requests (an index, see below)

The braces are Redis Cluster hash tags: both keys of a request hash to the same slot, so every
operation on one request is a single Lua script over ``KEYS`` of one slot, which Redis runs atomically
(standalone or cluster). Terms (committed tokens, owner, ...) are defined in :mod:`.records`.

Durability: :meth:`RequestStore.append_tokens` returns only after Redis applied the append, so a
caller that streams tokens after it returns never shows a client a token Redis does not hold (how much
survives a Redis crash is Redis' persistence setting: AOF with ``appendfsync always`` loses nothing).

The owner index lives in another slot than the request, so it cannot change in the same atomic step;
the request's ``owner`` field is the truth and the set is kept a *superset* of it: an ID is added to a
set before the request names that owner and removed only after it no longer does. A crash between the
two steps leaves a stale ID in a set (never a running request missing from its owner's set); ``active``
skips stale IDs and ``prune_stale`` removes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio

from .records import (
    TOKEN_BYTES,
    FinishReason,
    RequestRecord,
    RequestSnapshot,
    RequestStatus,
    StepStats,
    pack_tokens,
    params_json,
    unpack_tokens,
    validate_id,
)

# Result codes of the Lua scripts (first element of every script's reply).
_OK = 1
_UNCHANGED = 0
_NOT_FOUND = -1
_FINISHED = -2
_WRONG_OWNER = -3
_OFFSET_CONFLICT = -4
_EXISTS = -5

# check(owner): the state of the request in KEYS[1] (its meta hash) as a result code plus its
# {status, owner}; owner '' skips the owner test. Prepended to the scripts that need it.
_CHECK = """
local function check(owner)
  local m = redis.call('HMGET', KEYS[1], 'status', 'owner')
  if not m[1] then return -1, m end
  if m[1] == 'finished' then return -2, m end
  if owner ~= '' and m[2] ~= owner then return -3, m end
  return 0, m
end
"""

# KEYS: meta, out. ARGV: params JSON, packed prompt, owner, now. A finished request's ID may be reused:
# its old keys (already expiring) are dropped first.
_CREATE = """
local m = redis.call('HMGET', KEYS[1], 'status', 'owner')
if m[1] and m[1] ~= 'finished' then return {-5, m[2]} end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'params', ARGV[1], 'prompt', ARGV[2], 'owner', ARGV[3], 'status', 'queued',
  'llm_steps', 0, 'accepted_tokens', 0, 'tree_nodes', 0, 'created', ARGV[4], 'updated', ARGV[4])
return {1, ARGV[3]}
"""

# KEYS: meta, out. ARGV: packed tokens, llm_steps, accepted_tokens, tree_nodes, now, owner, offset (-1: any).
# Reply {code, output length in tokens, owner}. With an offset, an append whose tokens already end the
# output at that offset is a retry of an applied append: reported as _UNCHANGED, not applied twice.
_APPEND = (
    _CHECK
    + """
local code, m = check(ARGV[6])
if code < 0 then return {code, 0, m[2]} end
local len = redis.call('STRLEN', KEYS[2])
local offset = tonumber(ARGV[7])
if offset >= 0 and len ~= offset * 4 then
  if #ARGV[1] > 0 and len == offset * 4 + #ARGV[1] and redis.call('GETRANGE', KEYS[2], offset * 4, -1) == ARGV[1] then
    return {0, len / 4, m[2]}
  end
  return {-4, len / 4, m[2]}
end
if #ARGV[1] > 0 then len = redis.call('APPEND', KEYS[2], ARGV[1]) end
redis.call('HINCRBY', KEYS[1], 'llm_steps', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'accepted_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'tree_nodes', ARGV[4])
redis.call('HSET', KEYS[1], 'status', 'running', 'updated', ARGV[5])
return {1, len / 4, m[2]}
"""
)

# KEYS: meta, out. ARGV: reason, error, now, ttl in ms, owner. Reply {code, owner}.
_FINISH = (
    _CHECK
    + """
local code, m = check(ARGV[5])
if code == -2 then return {0, m[2]} end
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'status', 'finished', 'reason', ARGV[1], 'error', ARGV[2], 'updated', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, m[2]}
"""
)

# KEYS: meta. ARGV: now, owner. Reply {code, owner}.
_MARK_RUNNING = (
    _CHECK
    + """
local code, m = check(ARGV[2])
if code < 0 then return {code, m[2]} end
if m[1] ~= 'queued' then return {0, m[2]} end
redis.call('HSET', KEYS[1], 'status', 'running', 'updated', ARGV[1])
return {1, m[2]}
"""
)

# KEYS: meta. ARGV: new owner, expected owner ('' any), now. Reply {code, previous owner}.
_CLAIM = (
    _CHECK
    + """
local code, m = check(ARGV[2])
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'updated', ARGV[3])
return {1, m[2]}
"""
)

# KEYS: meta, out. Reply {meta as a flat field/value list, packed output or nil}.
_GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
"""

# KEYS: meta, out. ARGV: first byte. Reply {1 if the request exists else 0, packed tokens from that byte}.
_TOKENS_FROM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
return {1, redis.call('GETRANGE', KEYS[2], ARGV[1], -1)}
"""


class StoreError(Exception):
    """Base of the request store's errors."""


class RequestExistsError(StoreError):
    """``create`` with the ID of a request that is not finished (client IDs are unique among running requests)."""


class RequestNotFoundError(StoreError):
    """No request with this ID (never created, or finished and expired)."""


class RequestFinishedError(StoreError):
    """A write to a request that is already finished."""


class OwnershipError(StoreError):
    """The request is owned by another replica than the caller says (it was claimed away)."""

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


@dataclass(frozen=True)
class KeySpace:
    """Names of the Redis keys of one store (see the module docstring for the layout)."""

    prefix: str = "specinfer"

    def __post_init__(self) -> None:
        # The prefix is outside the hash tag, so only braces (which would move the tag) are refused.
        if not self.prefix or "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"key prefix must be non-empty and brace-free, got {self.prefix!r}")

    def meta(self, request_id: str) -> str:
        return f"{self.prefix}:{{{request_id}}}:meta"

    def out(self, request_id: str) -> str:
        return f"{self.prefix}:{{{request_id}}}:out"

    def request(self, request_id: str) -> list[str]:
        """Both keys of a request, in the order the scripts take them (meta, out)."""
        return [self.meta(request_id), self.out(request_id)]

    def active(self, owner: str) -> str:
        return f"{self.prefix}:owner:{{{owner}}}:active"


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


class RequestStore:
    """Every request's state in Redis, through a ``redis.asyncio`` client with ``decode_responses=False``.

    ``finished_ttl_s``: how long a finished request stays readable (``get``, ``tokens_from``) before Redis
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
        self._create = client.register_script(_CREATE)
        self._append = client.register_script(_APPEND)
        self._finish = client.register_script(_FINISH)
        self._mark_running = client.register_script(_MARK_RUNNING)
        self._claim = client.register_script(_CLAIM)
        self._get = client.register_script(_GET)
        self._tokens_from = client.register_script(_TOKENS_FROM)

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    # -- writes -----------------------------------------------------------------------------------

    async def create(self, record: RequestRecord) -> None:
        """Store a new queued request; RequestExistsError when its ID belongs to an unfinished request.

        The ID enters the owner's set first (the set stays a superset, see the module docstring); when
        the ID turns out to be taken, it leaves the set again unless the existing request is ours too.
        """
        rid, owner = record.request_id, record.owner
        active_key = self.keys.active(owner)
        await self.client.sadd(active_key, rid)
        args = [params_json(record.params), pack_tokens(record.prompt), owner, repr(self._clock())]
        code, existing_owner = await self._create(keys=self.keys.request(rid), args=args)
        if code == _EXISTS:
            if _text(existing_owner) != owner:
                await self.client.srem(active_key, rid)
            raise RequestExistsError(f"request {rid!r} exists and is not finished")

    async def mark_running(self, request_id: str, *, owner: str | None = None) -> bool:
        """queued -> running (the request joined a batch); False when it was already running."""
        code, actual = await self._mark_running(keys=[self.keys.meta(request_id)], args=[repr(self._clock()), owner or ""])
        self._raise_for(code, request_id, owner, actual)
        return code == _OK

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

        Its ``llm_steps``, ``accepted`` and ``tree_size`` are added (a snapshot's ``committed`` is its output's
        length). Returns the output length after the append. A queued request becomes running.
        ``owner``, when given, fences a replica that lost the request to a claim (OwnershipError).
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
        ]
        code, length, actual = await self._append(keys=self.keys.request(request_id), args=args)
        if code == _OFFSET_CONFLICT:
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
        code, actual = await self._finish(keys=self.keys.request(request_id), args=args)
        self._raise_for(code, request_id, owner, actual)
        if actual is not None:
            # After the status change, never before: the set must stay a superset of running requests.
            await self.client.srem(self.keys.active(actual.decode()), request_id)
        return code == _OK

    async def claim(self, request_id: str, owner: str, *, expected_owner: str | None = None) -> bool:
        """Make ``owner`` the request's owner (e.g. to take over a dead replica's requests).

        Returns False, changing nothing, when the request does not exist, is finished, or (with
        ``expected_owner``) is owned by someone else, e.g. another replica claimed it first.
        """
        validate_id(owner, "owner")
        new_key = self.keys.active(owner)
        await self.client.sadd(new_key, request_id)
        args = [owner, expected_owner or "", repr(self._clock())]
        code, previous = await self._claim(keys=[self.keys.meta(request_id)], args=args)
        if code != _OK:
            # Undo the SADD unless the request is unfinished and already ours (then the ID belongs there).
            if code != _WRONG_OWNER or _text(previous) != owner:
                await self.client.srem(new_key, request_id)
            return False
        if previous is not None and previous.decode() != owner:
            await self.client.srem(self.keys.active(previous.decode()), request_id)
        return True

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, request_id: str) -> RequestSnapshot | None:
        """The request's state (meta and output read atomically together), None when it does not exist."""
        flat, packed = await self._get(keys=self.keys.request(request_id))
        if not flat:
            return None
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return _snapshot(request_id, meta, packed)

    async def tokens_from(self, request_id: str, offset: int = 0) -> tuple[int, ...]:
        """Output tokens ``[offset:]`` (empty past the end); RequestNotFoundError when there is no such request."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        exists, packed = await self._tokens_from(keys=self.keys.request(request_id), args=[offset * TOKEN_BYTES])
        if not exists:
            raise RequestNotFoundError(f"no request {request_id!r}")
        return unpack_tokens(packed)

    async def active(self, owner: str) -> list[str]:
        """IDs of the owner's unfinished requests, oldest first (what a restarted replica resumes)."""
        live, _ = await self._scan_owner(owner)
        return live

    async def prune_stale(self, owner: str) -> int:
        """Remove IDs of finished, expired or claimed-away requests from the owner's set; returns how many.

        Run it while nothing creates or claims requests into this owner (e.g. when the replica starts):
        an ID added by a concurrent ``create`` whose request is not written yet looks stale.
        """
        _, stale = await self._scan_owner(owner)
        if stale:
            await self.client.srem(self.keys.active(owner), *stale)
        return len(stale)

    # -- helpers ----------------------------------------------------------------------------------

    async def _scan_owner(self, owner: str) -> tuple[list[str], list[str]]:
        """(live IDs oldest first, stale IDs) of the owner's set: live means unfinished and owned by ``owner``."""
        ids = sorted(member.decode() for member in await self.client.smembers(self.keys.active(owner)))
        if not ids:
            return [], []
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hmget(self.keys.meta(rid), "status", "owner", "created")
            rows = await pipe.execute()
        live: list[tuple[float, str]] = []
        stale: list[str] = []
        for rid, (status, row_owner, created) in zip(ids, rows, strict=True):
            if status is None or status == b"finished" or _text(row_owner) != owner:
                stale.append(rid)
            else:
                live.append((float(created or 0), rid))
        return [rid for _, rid in sorted(live)], stale

    @staticmethod
    def _raise_for(code: int, request_id: str, owner: str | None, actual: bytes | None) -> None:
        if code == _NOT_FOUND:
            raise RequestNotFoundError(f"no request {request_id!r}")
        if code == _FINISHED:
            raise RequestFinishedError(f"request {request_id!r} is finished")
        if code == _WRONG_OWNER:
            raise OwnershipError(request_id, owner or "", _text(actual))
        if code not in (_OK, _UNCHANGED):
            raise StoreError(f"unexpected store script result {code} for request {request_id!r}")


def _snapshot(request_id: str, meta: dict[bytes, bytes], packed: bytes | None) -> RequestSnapshot:
    def text(field: str) -> str | None:
        value = meta.get(field.encode())
        return value.decode() if value else None

    def count(field: str) -> int:
        return int(meta.get(field.encode(), b"0"))

    reason = text("reason")
    return RequestSnapshot(
        request_id=request_id,
        owner=text("owner") or "",
        status=RequestStatus(text("status")),
        params=json.loads(meta.get(b"params", b"{}")),
        prompt_tokens=unpack_tokens(meta.get(b"prompt")),
        output_tokens=unpack_tokens(packed),
        finish_reason=FinishReason(reason) if reason else None,
        error=text("error"),
        stats=StepStats(count("llm_steps"), count("accepted_tokens"), count("tree_nodes"), len(packed or b"") // TOKEN_BYTES),
        created=float(text("created") or 0),
        updated=float(text("updated") or 0),
    )


__all__ = [
    "KeySpace",
    "OffsetConflictError",
    "OwnershipError",
    "RequestExistsError",
    "RequestFinishedError",
    "RequestNotFoundError",
    "RequestStore",
    "StoreError",
]
