"""Records of the request store: what a request is, what one verify step adds, what a reader sees.

Terms (the same as in ``protos/specinfer/v1/api.proto``):

* *prompt*: the request's input token IDs.
* *output*: the token IDs generated so far, in commit order; ``output[i]`` has *offset* ``i``.
* *committed tokens*: the tokens one LLM verify step appends to the output (the accepted tree tokens plus
  the bonus token the LLM samples after them). Committed tokens are persisted before they are streamed.
* *accepted tokens*: tree tokens the verifier accepted (the bonus token not counted).
* *tree nodes*: size of the verified token tree, its root included.
* *owner*: ID of the request-manager replica that drives the request (its ``--owner``); a replica
  resumes the unfinished requests it owns after a restart, and adopts those of a replica whose lease
  lapsed (:mod:`.ownership`).
* *lease token*: the token of the process (one *incarnation* of an owner) that drives the request; the
  owner's writes are fenced by it, so an earlier incarnation cannot write after a later one took over.

Token lists are stored as packed little-endian int32 (4 bytes per token): compact, and appending is a
single O(1) ``APPEND`` that Redis applies atomically. :func:`pack_tokens`/:func:`unpack_tokens` convert.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specinfer.core.requests import StepStats, TokenLogprob

TOKEN_BYTES = 4
"""Bytes per stored token ID (little-endian int32)."""

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


class RequestStatus(str, enum.Enum):  # noqa: UP042 - not StrEnum: its str() and format() would change
    """Lifecycle of a request: queued (accepted, no step yet), running (in a batch), finished (final)."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):  # noqa: UP042 - as RequestStatus
    """Why a request finished; mirrors ``specinfer.v1.FinishReason``."""

    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class RequestRecord:
    """A new request as ``RequestStore.create`` stores it.

    ``params`` is everything about the request but its prompt, as a JSON-able dict (sampling
    {temperature, top_p, top_k, seed}, max_new_tokens, stop token IDs, stop strings, speculation
    {expansion (null: adaptive), ssms}, ignore_eos, ...); the store keeps it as JSON and does not interpret it.
    Treat it as read-only: the dataclass is frozen, the dict inside is not copied.
    """

    request_id: str
    prompt: tuple[int, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    owner: str = "default"
    # the incarnation of ``owner`` that creates it ("": none, the writes are fenced by owner alone)
    lease_token: str = ""

    def __post_init__(self) -> None:
        validate_id(self.request_id, "request_id")
        validate_id(self.owner, "owner")
        # Accept any iterable of ints (a list from a decoder) but keep the record immutable.
        object.__setattr__(self, "prompt", tuple(self.prompt))
        params_json(self.params)  # fail at construction, not half-way through a store write


@dataclass(frozen=True)
class RequestSnapshot:
    """A consistent view of one request, read in one atomic step (meta and output together)."""

    request_id: str
    owner: str
    status: RequestStatus
    params: dict[str, Any]
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    finish_reason: FinishReason | None
    error: str | None
    stats: StepStats
    created: float
    updated: float
    output_logprobs: tuple[TokenLogprob, ...] = ()  # one per output token, when params' logprobs is set

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def validate_id(value: str, what: str) -> None:
    """Request and owner IDs become part of Redis keys inside a ``{hash tag}``, so braces are refused.

    A brace would move the hash tag (Redis hashes the text between the first ``{`` and the next ``}``),
    and control characters make keys unreadable in tools; both are refused rather than escaped so an ID
    reads the same in Redis as in the API.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > 256:
        raise ValueError(f"{what} is longer than 256 characters")
    if "{" in value or "}" in value or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{what} must not contain braces or control characters, got {value!r}")


def params_json(params: Mapping[str, Any]) -> str:
    """Canonical JSON of request params (sorted keys, no NaN), raising ValueError when not JSON-able."""
    try:
        return json.dumps(dict(params), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"request params are not JSON-able: {exc}") from exc


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token IDs -> packed little-endian int32 bytes; ValueError for IDs outside int32."""
    ids = list(tokens)
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise ValueError(f"token IDs must be int32: {exc}") from exc


def unpack_tokens(data: bytes | None) -> tuple[int, ...]:
    """Packed little-endian int32 bytes (None: no tokens) -> token IDs."""
    if not data:
        return ()
    if len(data) % TOKEN_BYTES:
        # Only a torn write outside the store could do this; never guess at a partial token.
        raise ValueError(f"packed token data of {len(data)} bytes is not a multiple of {TOKEN_BYTES}")
    return struct.unpack(f"<{len(data) // TOKEN_BYTES}i", data)


def _logprobs_record(top: int) -> str:
    """The struct format of one token's logprobs record: its logprob (float32), then ``top`` (token ID int32,
    logprob float32) pairs, little-endian (a fixed size, so a record is found by the token's offset)."""
    return f"<f{'if' * top}"


def logprobs_record_bytes(top: int | None) -> int:
    """Bytes of one token's logprobs record for a request that asks ``top`` alternatives (0: it asks none)."""
    return 0 if top is None else struct.calcsize(_logprobs_record(top))


def pack_logprobs(logprobs: Sequence[TokenLogprob], top: int) -> bytes:
    """Each token's record (:func:`_logprobs_record`), one after the other."""
    out = bytearray()
    for lp in logprobs:
        if len(lp.top) != top:
            raise ValueError(f"a logprobs record holds {top} alternatives, got {len(lp.top)}")
        out += struct.pack(_logprobs_record(top), lp.logprob, *(x for pair in lp.top for x in pair))
    return bytes(out)


def unpack_logprobs(data: bytes | None, tokens: Sequence[int], top: int | None) -> tuple[TokenLogprob, ...]:
    """The inverse of :func:`pack_logprobs` for the records of ``tokens`` (none when ``top`` is None)."""
    if top is None or not data:
        return ()
    size = logprobs_record_bytes(top)
    if len(data) != size * len(tokens):
        raise ValueError(f"{len(data)} bytes of logprobs for {len(tokens)} tokens of {size} bytes each")
    out = []
    for k, token in enumerate(tokens):
        values = struct.unpack_from(_logprobs_record(top), data, k * size)
        out.append(TokenLogprob(token, values[0], tuple(zip(values[1::2], values[2::2], strict=True))))
    return tuple(out)
