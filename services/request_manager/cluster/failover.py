"""How the request manager notices a failed callee and finds it back.

A call that fails for a reason that is not the caller's (any status but ``CALLER_FAULTS``) *takes out*
its SSM worker: no more work goes to it, and :class:`HealthProbes` checks its gRPC health every
``PROBE_SECONDS`` until it is SERVING again, then puts it back. Meanwhile its requests draft on the
other workers serving the same SSM (:class:`.worker_pool.WorkerPool`). The channels' keepalive and
reconnect settings (``CHANNEL_OPTIONS``) make a dead peer show up as a failed call and a restarted one
reachable again within seconds, for the workers and the verifier alike.

A deadline missed, or a connection dropped, because the request manager itself was not running
(SIGSTOP, a paused VM, a long stall of its event loop) is not the worker's fault: :class:`StallWatch`
notices such gaps, and a call that failed across one is retried once on the same worker instead of
taking it out (which would also change what sampling requests draw: their drafts would be missing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

T = TypeVar("T")

PROBE_SECONDS = 1.0  # how often a worker taken out is health-checked
# keepalive pings find a dead peer on an idle connection (the servers permit pings every 10 s);
# reconnect backoff capped at PROBE_SECONDS (gRPC's default grows to 120 s): a health probe of a
# worker taken out runs on the worker's own channel and fails fast while that channel backs off, so
# a longer cap delays taking a restarted worker back by up to the cap (the fault campaign measured
# up to 5 s with a 5 s cap, long enough for the other worker to fail meanwhile and leave its SSM
# with none); a connection attempt a second to a dead address costs nothing worth saving
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", int(PROBE_SECONDS * 1000)),
)
# statuses that say the call was wrong, not the worker: they do not take the worker out
CALLER_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
STALL_FAULTS = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)  # what a stall of ours can cause
# statuses a verifier answers when what it was asked failed there (a bad job, or a bug its inputs meet): the same call
# would fail again, so the request manager finds the requests at fault by asking for each alone
# (:meth:`.remote.Verifiers.verify`) instead of retrying the call, or taking the replica out, forever
REQUEST_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
# of those, the ones a broken replica answers to everything (a CUDA error, a lost rank)
REPLICA_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class HealthProbes:
    """The workers taken out, each with the task that probes its health.

    ``on_serving(address)`` runs when a probe finds its worker SERVING, after the worker is back.
    """

    def __init__(
        self, probe_seconds: float, metadata: Sequence[tuple[str, str]], on_serving: Callable[[str], None]
    ) -> None:
        self.probe_seconds = probe_seconds
        self._metadata = metadata
        self._on_serving = on_serving
        self._probes: dict[str, asyncio.Task] = {}  # worker taken out -> its health probe

    def __contains__(self, address: str) -> bool:
        """Whether ``address`` is taken out."""
        return address in self._probes

    def take_out(self, address: str, channel: grpc.aio.Channel) -> None:
        """Start probing ``address`` (taken out until the probe finds it SERVING)."""
        self._probes[address] = asyncio.get_running_loop().create_task(self._probe(address, channel))

    def forget(self, address: str) -> None:
        """Stop probing a worker that left (no-op for one that is in service)."""
        probe = self._probes.pop(address, None)
        if probe is not None:
            probe.cancel()

    def close(self) -> None:
        for probe in self._probes.values():
            probe.cancel()

    async def _probe(self, address: str, channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            await asyncio.sleep(self.probe_seconds)
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=self.probe_seconds, metadata=self._metadata
                )
            except grpc.aio.AioRpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        del self._probes[address]
        self._on_serving(address)


class StallWatch:
    """Notices when this process stopped running: a task ticks every ``tick`` seconds, and a gap
    between ticks longer than ``gap`` seconds is a stall (the event loop, or the whole process, was
    not running). :meth:`stalled_since` says whether a stall ended after a given time."""

    def __init__(self, tick: float = 0.05, gap: float = 0.5) -> None:
        self.tick, self.gap = tick, gap
        self._last_stall_end = float("-inf")
        self._last_tick = float("inf")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_tick = loop.time()
        while True:
            await asyncio.sleep(self.tick)
            now = loop.time()
            if now - self._last_tick > self.gap:
                self._last_stall_end = now
            self._last_tick = now

    def stalled_since(self, started: float) -> bool:
        """Whether a stall ended after ``started`` (``loop.time()``), or one is just ending (the
        ticker has not run for over ``gap``: after SIGCONT a timed-out call may be handled before
        it): a call that began before may have timed out only because of it."""
        if self._task is None:
            return False
        return self._last_stall_end > started or asyncio.get_running_loop().time() - self._last_tick > self.gap

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def settled_all(calls: Sequence[Awaitable[T]]) -> list[T | BaseException]:
    """``asyncio.gather(*calls, return_exceptions=True)``: each call's result, or the exception it raised; a lone
    call (one worker, one replica, one SSM: the common case) is awaited in place, without gather's task, which costs
    a turn of the event loop on every step. As gather, a call's own cancellation is its result, while this task's
    cancellation propagates."""
    if len(calls) != 1:
        return await asyncio.gather(*calls, return_exceptions=True)
    try:
        return [await calls[0]]
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return [exc]
    except Exception as exc:
        return [exc]


async def ask_alone(
    items: Sequence[T], error: grpc.aio.AioRpcError, ask: Callable[[T], Awaitable[object]]
) -> tuple[list[object], list[bool], bool]:
    """After a call for ``items`` failed with ``error`` (a ``REQUEST_FAULTS`` status), each item asked alone, at once,
    with ``ask`` (one item: ``error`` is its answer already). Returns the answers (results or exceptions), whether each
    is a fault of its item (a ``REQUEST_FAULTS`` status), and whether the callee is at fault instead: two or more items
    that each failed alone with a status a broken callee answers to everything (``REPLICA_FAULTS``)."""
    answers: list[object] = [error] if len(items) == 1 else await settled_all([ask(item) for item in items])
    faults = [isinstance(a, grpc.aio.AioRpcError) and a.code() in REQUEST_FAULTS for a in answers]
    broken = len(items) > 1 and all(faults) and all(a.code() in REPLICA_FAULTS for a in answers)
    return answers, faults, broken
