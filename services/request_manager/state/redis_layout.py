"""How the request store lays requests out in Redis: the key names and the Lua scripts that change them.

Key layout (``P`` is the store's prefix, ``specinfer`` by default)::

    P:{<request_id>}:meta      hash    params (JSON), prompt (packed int32), status, reason, error,
                                       llm_steps, accepted_tokens, tree_nodes, cached_prompt_tokens,
                                       created, updated, owner, lease_token, cancel_requested
    P:{<request_id>}:out       string  output token IDs, packed little-endian int32, grown by APPEND
    P:{<request_id>}:logprobs  string  with params' logprobs N set: one record per output token, grown with it
                                       (:func:`.records.pack_logprobs`: float32 logprob, N x (int32, float32))
    P:owner:{<owner>}:active   set     IDs of the owner's unfinished requests (an index, see below)
    P:owner:{<owner>}:lease    string  the owner's lease: the token of the process holding it, with a TTL
    P:owners                   set     owners that may hold requests (where adopters look, see below)

The braces are Redis Cluster hash tags: the keys of a request hash to the same slot, so every
operation on one request is a single Lua script over ``KEYS`` of one slot, which Redis runs atomically
(standalone or cluster); an owner's index and lease share a slot too. Terms (committed tokens, owner,
...) are defined in :mod:`.records`.

**The owner index.** It lives in another slot than the request, so it cannot change in the same atomic
step; the request's ``owner`` field is the truth and the set is kept a *superset* of it: an ID is added
to a set before the request names that owner and removed only after it no longer does. A crash between
the two steps leaves a stale ID in a set (never a running request missing from its owner's set), which
:meth:`.store.RequestStore.active` skips. Adoption keeps the rule: the adopter adds the ID to its own
set, changes the owner (:data:`CLAIM`), then removes the ID from the old owner's set.

**Leases.** A request manager drives its requests only while it holds its owner's lease
(:mod:`.ownership`): ``SET`` with a TTL to a token that is new for every process (an *incarnation*),
renewed by :data:`HOLD`. A request's ``lease_token`` names the incarnation that drives it: the writes
of the scheduler are fenced by owner *and* token, so neither a replica whose requests were adopted nor
an earlier incarnation of the same owner (a stalled process whose lease lapsed and whose successor
took over) can commit to them any more. An owner is added to ``P:owners`` while it holds its lease
(every renewal adds it again); an adopter removes an owner that has neither a lease nor an index,
then checks again and puts it back if it got either meanwhile (:meth:`.store.RequestStore.orphaned_owners`),
so that an owner holding requests is never missing from the set for longer than one renewal.

**Cancel through any replica.** A replica that does not run a request marks it ``cancel_requested``
(:data:`CANCEL`); :data:`APPEND` returns the mark, and the owner stops the request at its next commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

from .records import FinishReason, RequestSnapshot, RequestStatus, StepStats, unpack_logprobs, unpack_tokens


class ScriptCode(IntEnum):
    """Result codes of the Lua scripts (first element of every script's reply)."""

    OK = 1
    UNCHANGED = 0
    NOT_FOUND = -1
    FINISHED = -2
    WRONG_OWNER = -3
    OFFSET_CONFLICT = -4
    EXISTS = -5


# check(owner, token): the state of the request in KEYS[1] (its meta hash) as a result code plus its
# {status, owner, lease_token, cancel_requested}; owner '' skips the owner test, token '' the token test.
# touch(): see below. Prepended to the scripts that need them.
_CHECK = """
local function check(owner, token)
  local m = redis.call('HMGET', KEYS[1], 'status', 'owner', 'lease_token', 'cancel_requested')
  if not m[1] then return -1, m end
  if m[1] == 'finished' then return -2, m end
  if owner ~= '' and m[2] ~= owner then return -3, m end
  if token ~= '' and m[3] ~= token then return -3, m end
  return 0, m
end

-- touch(): a write that changes nothing (the meta hash's 'updated' set to itself), for a script
-- that found its effect already applied: WAIT covers only its connection's writes (see .replica_acks).
local function touch()
  redis.call('HSET', KEYS[1], 'updated', redis.call('HGET', KEYS[1], 'updated'))
end
"""

# KEYS: meta, out. ARGV: params JSON, packed prompt, owner, now, lease token. A finished request's ID
# may be reused: its old keys (already expiring) are dropped first. A retry of this very create (its
# reply was lost: same owner, same creation time) is UNCHANGED (touched), not EXISTS.
CREATE = (
    _CHECK
    + """
local m = redis.call('HMGET', KEYS[1], 'status', 'owner', 'created')
if m[1] and m[1] ~= 'finished' then
  if m[2] == ARGV[3] and m[3] == ARGV[4] then
    touch()
    return {0, m[2]}
  end
  return {-5, m[2]}
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'params', ARGV[1], 'prompt', ARGV[2], 'owner', ARGV[3], 'lease_token', ARGV[5], \
'status', 'queued',
  'llm_steps', 0, 'accepted_tokens', 0, 'tree_nodes', 0, 'cached_prompt_tokens', 0, \
'created', ARGV[4], 'updated', ARGV[4])
return {1, ARGV[3]}
"""
)

# KEYS: meta, out, logprobs. ARGV: packed tokens, llm_steps, accepted_tokens, tree_nodes, now, owner, offset (-1:
# any), cached_prompt_tokens, lease token, packed logprobs of the tokens (empty: none asked).
# Reply {code, output length in tokens, owner, cancel_requested}. With an offset, an append whose tokens
# already end the output at that offset is a retry of an applied append: reported as UNCHANGED, not
# applied twice (touched).
APPEND = (
    _CHECK
    + """
local code, m = check(ARGV[6], ARGV[9])
if code < 0 then return {code, 0, m[2], m[4]} end
local len = redis.call('STRLEN', KEYS[2])
local offset = tonumber(ARGV[7])
if offset >= 0 and len ~= offset * 4 then
  if #ARGV[1] > 0 and len == offset * 4 + #ARGV[1] and redis.call('GETRANGE', KEYS[2], offset * 4, -1) == ARGV[1] then
    touch()
    return {0, len / 4, m[2], m[4]}
  end
  return {-4, len / 4, m[2], m[4]}
end
if #ARGV[1] > 0 then len = redis.call('APPEND', KEYS[2], ARGV[1]) end
if #ARGV[10] > 0 then redis.call('APPEND', KEYS[3], ARGV[10]) end
redis.call('HINCRBY', KEYS[1], 'llm_steps', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'accepted_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'tree_nodes', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'cached_prompt_tokens', ARGV[8])
redis.call('HSET', KEYS[1], 'status', 'running', 'updated', ARGV[5])
return {1, len / 4, m[2], m[4]}
"""
)

# KEYS: meta, out, logprobs. ARGV: reason, error, now, ttl in ms, owner, lease token. Reply {code, owner}; an
# already finished request is UNCHANGED (touched).
FINISH = (
    _CHECK
    + """
local code, m = check(ARGV[5], ARGV[6])
if code == -2 then
  touch()
  return {0, m[2]}
end
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'status', 'finished', 'reason', ARGV[1], 'error', ARGV[2], 'updated', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return {1, m[2]}
"""
)

# KEYS: meta, out, logprobs. Reply {meta as a flat field/value list, packed output or nil, packed logprobs or nil}.
GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"""

# KEYS: meta, out, logprobs. ARGV: offset in tokens, bytes of a logprobs record (0: none asked). Reply {status or
# nil, packed output from the offset on, packed logprobs from the offset on}: what a follower of the request polls
# (a few bytes while nothing new was committed).
TAIL = """
local offset, record = tonumber(ARGV[1]), tonumber(ARGV[2])
local logprobs = ''
if record > 0 then logprobs = redis.call('GETRANGE', KEYS[3], offset * record, -1) end
return {redis.call('HGET', KEYS[1], 'status'), redis.call('GETRANGE', KEYS[2], offset * 4, -1), logprobs}
"""

# KEYS: meta. ARGV: the owner it must have, the new owner, the new lease token. Reply {code, owner}.
# Hands an unfinished request to another owner (adoption) or to a new incarnation of the same owner
# (recovery after a restart), which fences every earlier writer (see "Leases" above).
CLAIM = (
    _CHECK
    + """
local code, m = check(ARGV[1], '')
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'lease_token', ARGV[3])
return {1, m[2]}
"""
)

# KEYS: meta. Reply {code, owner}: marks an unfinished request for its owner to cancel at its next commit.
CANCEL = (
    _CHECK
    + """
local code, m = check('', '')
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'cancel_requested', 1)
return {1, m[2]}
"""
)

# KEYS: lease. ARGV: token, TTL in ms. Reply {code, holder}: 1 renewed (we hold it), 2 taken (it was
# free), 0 held by another token (the holder's token in the reply).
HOLD = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return {1, v} end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return {2, ARGV[1]} end
return {0, v}
"""

# KEYS: lease. ARGV: token. Reply 1 when the lease was ours and is now free, else 0.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease, active. Reply {1 when the lease is held, the number of IDs in the index}.
OWNER_STATE = """
return {redis.call('EXISTS', KEYS[1]), redis.call('SCARD', KEYS[2])}
"""

# KEYS: lease, active. ARGV: IDs. Removes the IDs from a dead owner's index (stale entries the adopter
# found), only while nobody holds the owner's lease (a new incarnation may be creating requests). Reply:
# IDs removed, or -1 when the lease is held.
PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
return redis.call('SREM', KEYS[2], unpack(ARGV))
"""


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

    def logprobs(self, request_id: str) -> str:
        return f"{self.prefix}:{{{request_id}}}:logprobs"

    def request(self, request_id: str) -> list[str]:
        """The keys of a request, in the order the scripts take them (meta, out, logprobs)."""
        return [self.meta(request_id), self.out(request_id), self.logprobs(request_id)]

    def active(self, owner: str) -> str:
        return f"{self.prefix}:owner:{{{owner}}}:active"

    def lease(self, owner: str) -> str:
        return f"{self.prefix}:owner:{{{owner}}}:lease"

    def owner(self, owner: str) -> list[str]:
        """Both keys of an owner (one slot), in the order the scripts take them (lease, active)."""
        return [self.lease(owner), self.active(owner)]

    def owners(self) -> str:
        return f"{self.prefix}:owners"


def decode_snapshot(
    request_id: str, meta: dict[bytes, bytes], packed: bytes | None, packed_logprobs: bytes | None = None
) -> RequestSnapshot:
    """A request's snapshot from its ``meta`` hash, packed output and packed logprobs, as laid out above."""

    def text(field: str) -> str | None:
        value = meta.get(field.encode())
        return value.decode() if value else None

    def count(field: str) -> int:
        return int(meta.get(field.encode(), b"0"))

    reason = text("reason")
    output = unpack_tokens(packed)
    params = json.loads(meta.get(b"params", b"{}"))
    return RequestSnapshot(
        request_id=request_id,
        owner=text("owner") or "",
        status=RequestStatus(text("status")),
        params=params,
        prompt_tokens=unpack_tokens(meta.get(b"prompt")),
        output_tokens=output,
        finish_reason=FinishReason(reason) if reason else None,
        error=text("error"),
        stats=StepStats(
            count("llm_steps"),
            count("accepted_tokens"),
            count("tree_nodes"),
            len(output),
            count("cached_prompt_tokens"),
        ),
        created=float(text("created") or 0),
        updated=float(text("updated") or 0),
        output_logprobs=unpack_logprobs(packed_logprobs, output, params.get("logprobs")),
    )
