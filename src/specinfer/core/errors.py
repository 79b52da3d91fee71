"""Errors raised by the core and the services for bad or impossible requests.

Every error names the offending field (as the public API spells it, e.g. ``sampling.top_p``) where
there is one, so the services can map it onto a gRPC status whose message a client can act on
(:func:`specinfer.serving.rpc.rpc_errors` holds that mapping: one class, one status).
"""

from __future__ import annotations

from collections.abc import Iterable


class FieldError(Exception):
    """An error about one field of a request: ``field`` is its dotted name as the public API spells it
    (e.g. ``sampling.top_p``), ``message`` says what is wrong; ``str()`` is ``"field: message"``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidArgument(FieldError, ValueError):
    """A caller-supplied value is out of range or malformed."""


class NotFound(FieldError, LookupError):
    """The field names something that does not exist."""


class AlreadyExists(FieldError):
    """The field names something that exists already, which the request would create."""


class ResourceExhausted(Exception):
    """The service has no room for the request now; the caller may retry later."""


class Unavailable(Exception):
    """The service cannot compute now (it is going down, or still waiting for a service it needs);
    another replica, or a retry later, may answer."""


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """``ids`` as a tuple, or :class:`InvalidArgument` when one is outside the vocabulary ``[0, vocab_size)``
    (it would index past the embedding table)."""
    ids = tuple(int(t) for t in ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(field, f"token IDs must be in [0, {vocab_size}), got {bad[:5]}")
    return ids


def check_positions(context_len: int, depth: int, max_positions: int, field: str) -> None:
    """The deepest tree node sits at position ``context_len + depth``; the model has ``max_positions``."""
    if context_len + depth >= max_positions:
        raise InvalidArgument(
            field,
            f"context of {context_len} tokens plus a tree of depth {depth} "
            f"exceeds the model's {max_positions} positions",
        )
