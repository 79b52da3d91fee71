"""The request store's errors (:mod:`.store`), and the one mapping from a store script's result code to them."""

from __future__ import annotations

from .redis_layout import ScriptCode


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


# the store's answers to a fenced write: the request is not this replica's to drive any more
NOT_OURS = (OwnershipError, RequestFinishedError, RequestNotFoundError)


class ReplicationError(StoreError):
    """Fewer replicas than ``min_replica_acks`` acknowledged a write within the timeout. The master applied
    it, so a retry of the same call (an append at the same offset) finds it and waits again; until one
    succeeds, nothing of it may be shown to a client."""

    def __init__(self, key: str, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(f"write to {key!r}: {acked} of {wanted} replicas acknowledged it within {timeout_ms} ms")
        self.acked = acked
        self.wanted = wanted


def raise_for(code: int, request_id: str, owner: str | None, actual: bytes | None) -> None:
    """Raise the error a store script's result ``code`` stands for (nothing for OK / UNCHANGED); ``actual``:
    the owner the script found, for :class:`OwnershipError`."""
    if code == ScriptCode.NOT_FOUND:
        raise RequestNotFoundError(f"no request {request_id!r}")
    if code == ScriptCode.FINISHED:
        raise RequestFinishedError(f"request {request_id!r} is finished")
    if code == ScriptCode.WRONG_OWNER:
        raise OwnershipError(request_id, owner or "", None if actual is None else actual.decode())
    if code not in (ScriptCode.OK, ScriptCode.UNCHANGED):
        raise StoreError(f"unexpected store script result {code} for request {request_id!r}")
