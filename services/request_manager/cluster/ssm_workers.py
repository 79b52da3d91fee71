"""gRPC client of the SSM workers (:class:`SsmWorkers`): Speculate to each request's worker, moving to
another live worker when that one fails, and Release of the requests' caches.

Its calls send only the context tokens a worker lacks (:mod:`.context_protocol`); the workers are a
pool found by :mod:`.discovery`, from which a failed worker is taken out until it is back
(:mod:`.worker_pool`, :mod:`.failover`). The LLM verifiers' client is :mod:`.remote`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specinfer import wire, wire_jobs
from specinfer.core import DraftTree
from specinfer.core.iteration import DraftSpec
from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2

from .context_protocol import ContextTracker, call_with_context
from .discovery import DNS_REFRESH_SECONDS
from .failover import CALLER_FAULTS, PROBE_SECONDS, REQUEST_FAULTS, STALL_FAULTS, ask_alone, settled_all
from .streamed import SocketFirst, StreamedUnary
from .worker_pool import WorkerPool

log = logging.getLogger("specinfer.request_manager")


@dataclass(frozen=True)
class Drafts:
    """What one SSM drafted in an iteration: ``trees`` by request ID, and the workers' own SSM
    passes as (frontier tokens, seconds) (see ``SpeculateResponse.passes``)."""

    trees: dict[str, DraftTree]
    passes: list[tuple[int, float]]


class SsmWorkers(WorkerPool):
    """The SSM worker pool and its calls: Speculate goes to each request's worker, and moves to
    another live worker when that one fails. ``speculate_timeout`` (default ``timeout``) bounds a
    Speculate call; a slower worker is taken out."""

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        speculate_timeout: float | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(targets, timeout, auth, refresh_seconds, probe_seconds, vocab_size=vocab_size)
        self.speculate_timeout = speculate_timeout or timeout

    async def speculate(self, ssm: str, calls: Sequence[DraftSpec]) -> Drafts:
        """Draft trees of ``calls`` by request ID, and the pass timings. Requests whose worker fails
        move to another live worker within this call; requests left without one are missing from the
        result (their tree is the root alone). A call the worker answered with a fault of what it was asked
        (``REQUEST_FAULTS``) is asked again one request a call: the requests that fail alone are missing from the
        result, the others drafted. Raises only for errors that are the caller's (CALLER_FAULTS but those)."""
        out = Drafts({}, [])
        pending = list(calls)
        retried: set[str] = set()  # workers given a second try after a stall of our own
        while pending:
            by_worker: dict[str, list[DraftSpec]] = {}
            for c in pending:
                address = self.worker_for(c.request_id, ssm)
                if address is not None:
                    by_worker.setdefault(address, []).append(c)
            if not by_worker:
                break  # no worker left for this SSM: the remaining requests verify their root alone
            # stubs and trackers are taken now: a refresh may drop a worker while its call runs
            jobs = [
                self._speculate_on(self.speculate_call(a, ssm), self._trackers[a], ssm, cs)
                for a, cs in by_worker.items()
            ]
            started = asyncio.get_running_loop().time()
            pending = []
            for (address, cs), part in zip(by_worker.items(), await settled_all(jobs), strict=True):
                if isinstance(part, grpc.aio.AioRpcError) and part.code() in REQUEST_FAULTS:
                    pending += await self._isolate(address, ssm, cs, part, out)
                elif isinstance(part, grpc.aio.AioRpcError) and part.code() not in CALLER_FAULTS:
                    # a deadline that passed, or a connection the worker dropped (its keepalive pings unanswered),
                    # while we were not running
                    stalled = part.code() in STALL_FAULTS and self.stalls.stalled_since(started)
                    if stalled and address not in retried:  # we were not running, not the worker: once more there
                        retried.add(address)
                        log.info(
                            "Speculate timed out across a stall of the request manager; retrying",
                            extra={"address": address},
                        )
                    else:
                        self.take_out(address, part)
                    pending += cs  # to the same worker after a stall, else to another live worker, if any
                elif isinstance(part, BaseException):
                    raise part
                else:
                    out.trees.update(part.trees)
                    out.passes.extend(part.passes)
        return out

    async def _isolate(
        self, address: str, ssm: str, cs: Sequence[DraftSpec], error: grpc.aio.AioRpcError, out: Drafts
    ) -> list[DraftSpec]:
        """``address`` answered the call for ``cs`` with ``error``, a fault of what it was asked: each request asked
        alone, at once; the drafted ones go to ``out``, the ones that fail alone verify without this SSM's tree this
        step (speed, not answers). Returns the requests to move to another worker: all of them where every one failed
        alone with a fault a broken worker answers to everything (the worker is taken out), else none."""
        if len(cs) > 1 and address not in self._trackers:  # left the pool meanwhile
            return list(cs)

        def ask(c: DraftSpec):  # only where there are several (one: its answer is the error)
            return self._speculate_on(self.speculate_call(address, ssm), self._trackers[address], ssm, [c])

        singles, faults, broken = await ask_alone(cs, error, ask)
        if broken:
            self.take_out(address, singles[0])
            return list(cs)
        for c, single, fault in zip(cs, singles, faults, strict=True):
            if fault:
                log.warning(
                    "Speculate failed on a request alone; it verifies without this SSM's tree",
                    extra={"address": address, "ssm": ssm, "request_id": c.request_id, "error": single.details()},
                )
            elif isinstance(single, BaseException):
                log.warning("Speculate failed", extra={"address": address, "ssm": ssm, "error": repr(single)})
            else:
                out.trees.update(single.trees)
                out.passes.extend(single.passes)
        return []

    async def _speculate_on(
        self, speculate: StreamedUnary | SocketFirst, tracker: ContextTracker, ssm: str, calls: Sequence[DraftSpec]
    ) -> Drafts:
        passes: list[tuple[int, float]] = []

        async def send(pending, contexts):
            request = internal_pb2.SpeculateRequest(
                ssm=ssm, items=[wire_jobs.draft_job_to_proto(c, ctx) for c, ctx in zip(pending, contexts, strict=True)]
            )
            response = await speculate(request, self.speculate_timeout)
            passes.extend(wire.pass_timings_from_proto(response.passes))
            return response.results

        results = await call_with_context(send, calls, tracker)
        return Drafts({rid: wire.draft_from_proto(r.tree) for rid, r in results.items()}, passes)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop tracking requests another replica drives now, without releasing their caches (it uses them)."""
        for tracker in self._trackers.values():
            for r in request_ids:
                tracker.forget(r)

    async def release(self, request_ids: Sequence[str]) -> None:
        # the workers as they are now: a refresh may change them while the calls run
        for address, stub, tracker in [(a, self._stubs[a], self._trackers[a]) for a in self.addresses]:
            ids = [r for r in request_ids if r in tracker]
            for r in ids:
                tracker.forget(r)
            if ids and address not in self._down:
                try:
                    await stub.Release(
                        internal_pb2.ReleaseRequest(request_ids=ids), timeout=self.timeout, metadata=self.auth.metadata
                    )
                except (
                    grpc.aio.AioRpcError
                ) as exc:  # a cache left behind is only memory: the worker frees it when it restarts
                    log.info("release failed", extra={"address": address, "code": str(exc.code())})
