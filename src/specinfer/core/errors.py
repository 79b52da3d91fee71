"""Errors raised by the core for bad input.

Every validation error names the offending field, so the services can map it onto a gRPC
``INVALID_ARGUMENT`` status whose message a client can act on.
"""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A caller-supplied value is out of range or malformed.

    ``field`` is the dotted name of the offending field as the public API spells it
    (e.g. ``sampling.top_p``), ``message`` says what is wrong with it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
