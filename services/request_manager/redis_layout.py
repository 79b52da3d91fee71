"""How the request store lays requests out in Redis: the key names and the Lua scripts that change them.

Key layout (``P`` is the store's prefix, ``specinfer`` by default)::

    P:{<request_id>}:meta      hash    params (JSON), prompt (packed int32), status, reason, error,
                                       llm_steps, accepted_tokens, tree_nodes, cached_prompt_tokens,
                                       created, updated, owner
    P:{<request_id>}:out       string  output token IDs, packed little-endian int32, grown by APPEND
    P:owner:{<owner>}:active   set     IDs of the owner's unfinished requests (an index, see below)

The braces are Redis Cluster hash tags: both keys of a request hash to the same slot, so every
operation on one request is a single Lua script over ``KEYS`` of one slot, which Redis runs atomically
(standalone or cluster). Terms (committed tokens, owner, ...) are defined in :mod:`.records`.

The owner index lives in another slot than the request, so it cannot change in the same atomic step;
the request's ``owner`` field is the truth and the set is kept a *superset* of it: an ID is added to a
set before the request names that owner and removed only after it no longer does. A crash between the
two steps leaves a stale ID in a set (never a running request missing from its owner's set), which
:meth:`.store.RequestStore.active` skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class ScriptCode(IntEnum):
    """Result codes of the Lua scripts (first element of every script's reply)."""

    OK = 1
    UNCHANGED = 0
    NOT_FOUND = -1
    FINISHED = -2
    WRONG_OWNER = -3
    OFFSET_CONFLICT = -4
    EXISTS = -5


# check(owner): the state of the request in KEYS[1] (its meta hash) as a result code plus its
# {status, owner}; owner '' skips the owner test. touch(): see below. Prepended to the scripts that need them.
_CHECK = """
local function check(owner)
  local m = redis.call('HMGET', KEYS[1], 'status', 'owner')
  if not m[1] then return -1, m end
  if m[1] == 'finished' then return -2, m end
  if owner ~= '' and m[2] ~= owner then return -3, m end
  return 0, m
end

-- touch(): a write that changes nothing (the meta hash's 'updated' set to itself), for a script
-- that found its effect already applied: WAIT covers only its connection's writes (see .replica_acks).
local function touch()
  redis.call('HSET', KEYS[1], 'updated', redis.call('HGET', KEYS[1], 'updated'))
end
"""

# KEYS: meta, out. ARGV: params JSON, packed prompt, owner, now. A finished request's ID may be reused:
# its old keys (already expiring) are dropped first. A retry of this very create (its reply was lost:
# same owner, same creation time) is UNCHANGED (touched), not EXISTS.
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
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'params', ARGV[1], 'prompt', ARGV[2], 'owner', ARGV[3], 'status', 'queued',
  'llm_steps', 0, 'accepted_tokens', 0, 'tree_nodes', 0, 'cached_prompt_tokens', 0, 'created', ARGV[4], 'updated', ARGV[4])
return {1, ARGV[3]}
"""
)

# KEYS: meta, out. ARGV: packed tokens, llm_steps, accepted_tokens, tree_nodes, now, owner, offset (-1: any),
# cached_prompt_tokens.
# Reply {code, output length in tokens, owner}. With an offset, an append whose tokens already end the
# output at that offset is a retry of an applied append: reported as UNCHANGED, not applied twice (touched).
APPEND = (
    _CHECK
    + """
local code, m = check(ARGV[6])
if code < 0 then return {code, 0, m[2]} end
local len = redis.call('STRLEN', KEYS[2])
local offset = tonumber(ARGV[7])
if offset >= 0 and len ~= offset * 4 then
  if #ARGV[1] > 0 and len == offset * 4 + #ARGV[1] and redis.call('GETRANGE', KEYS[2], offset * 4, -1) == ARGV[1] then
    touch()
    return {0, len / 4, m[2]}
  end
  return {-4, len / 4, m[2]}
end
if #ARGV[1] > 0 then len = redis.call('APPEND', KEYS[2], ARGV[1]) end
redis.call('HINCRBY', KEYS[1], 'llm_steps', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'accepted_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'tree_nodes', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'cached_prompt_tokens', ARGV[8])
redis.call('HSET', KEYS[1], 'status', 'running', 'updated', ARGV[5])
return {1, len / 4, m[2]}
"""
)

# KEYS: meta, out. ARGV: reason, error, now, ttl in ms, owner. Reply {code, owner}; an already finished
# request is UNCHANGED (touched).
FINISH = (
    _CHECK
    + """
local code, m = check(ARGV[5])
if code == -2 then
  touch()
  return {0, m[2]}
end
if code < 0 then return {code, m[2]} end
redis.call('HSET', KEYS[1], 'status', 'finished', 'reason', ARGV[1], 'error', ARGV[2], 'updated', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, m[2]}
"""
)

# KEYS: meta, out. Reply {meta as a flat field/value list, packed output or nil}.
GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
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

    def request(self, request_id: str) -> list[str]:
        """Both keys of a request, in the order the scripts take them (meta, out)."""
        return [self.meta(request_id), self.out(request_id)]

    def active(self, owner: str) -> str:
        return f"{self.prefix}:owner:{{{owner}}}:active"
