"""The fault campaign's client (not a script; bench/fault_campaign.py imports it): one request streamed to its end
through any failure of the stack, reattaching from the tokens received, and what it received (:class:`Outcome`:
tokens by offset, duplicated and lost offsets, retries).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from specinfer.client import Client
from specinfer.v1 import api_pb2

RETRY_SECONDS = 0.2
# what a client sees while the manager is down, stopped or starting: try again
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass
class Outcome:
    """What one client received: tokens by offset, and protocol violations."""

    tokens: list[int] = field(default_factory=list)
    finished: api_pb2.Finished | None = None
    duplicated: int = 0  # tokens sent again at an offset already received
    lost: int = 0  # offsets skipped
    retries: int = 0  # calls that failed and were tried again (reattach or resend)
    resubmitted: int = 0


def run_client(address: str, request: api_pb2.GenerateRequest, deadline: float, out: Outcome | None = None) -> Outcome:
    """Stream ``request`` to the end through any failure: reattach from the tokens received, send
    the request again when the manager never stored it. A fresh channel per attempt (a channel's
    reconnect backoff would outlast a restart). ``out``: filled as tokens arrive."""
    out = out if out is not None else Outcome()
    submit = True
    while time.monotonic() < deadline:
        try:
            # failover_seconds=0: this loop reattaches itself, counting retries and resubmissions
            with Client(address, timeout=max(1.0, deadline - time.monotonic()), failover_seconds=0) as client:
                stream = client.stream(request) if submit else client.resume(request.request_id, len(out.tokens))
                for msg in stream:
                    submit = False  # it exists: from now on reattach
                    if msg.offset < len(out.tokens):
                        out.duplicated += min(len(out.tokens) - msg.offset, len(msg.token_ids))
                        out.tokens[msg.offset :] = list(msg.token_ids)
                    else:
                        out.lost += msg.offset - len(out.tokens)
                        out.tokens.extend([-1] * (msg.offset - len(out.tokens)))
                        out.tokens.extend(msg.token_ids)
                    if msg.HasField("finished"):
                        out.finished = msg.finished
                        return out
        except grpc.RpcError as exc:
            code = exc.code()
            if submit and code == grpc.StatusCode.ALREADY_EXISTS:
                submit = False
            elif not submit and code == grpc.StatusCode.NOT_FOUND:
                submit = True  # the manager died before storing it
                out.resubmitted += 1
                continue
            elif code not in RETRYABLE:
                raise
        if submit and out.tokens:
            submit = False
        out.retries += 1
        time.sleep(RETRY_SECONDS)
    raise TimeoutError(f"request {request.request_id} did not finish in time")
