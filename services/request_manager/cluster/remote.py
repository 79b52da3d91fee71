"""gRPC client of the LLM verifier replicas (:class:`Verifiers`): their membership and the calls to
them, each request's call to the replica its placement names (the SSM workers' client is
:mod:`.ssm_workers`). Where each request is placed, and what each replica's KV blocks hold, is
:class:`~.placement_map.PlacementMap`'s: the pool tells it who joins, leaves or is taken out and what
free-block counts the replicas report, and asks it where a request lives.

Its calls send only the context tokens a replica lacks (:mod:`.context_protocol`); the replicas are a
pool found by :mod:`.discovery`, from which a failed replica is taken out until it is back
(:mod:`.replica_pool`, :mod:`.failover`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from specinfer import wire, wire_jobs
from specinfer.core.engine_core import Verdict, VerifyRound  # what a verification round gives the engine core
from specinfer.core.iteration import VerifySpec
from specinfer.core.kv_budget import StepRows
from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2, internal_pb2_grpc

from .context_protocol import ContextTracker, call_with_context
from .discovery import DNS_REFRESH_SECONDS
from .failover import CALLER_FAULTS, PROBE_SECONDS, REQUEST_FAULTS, STALL_FAULTS, ask_alone, settled_all
from .placement_map import PlacementMap
from .replica_pool import ReplicaPool
from .streamed import SocketFirst, StreamedUnary, stream_calls

log = logging.getLogger("specinfer.request_manager")


class VerifierUnavailable(Exception):
    """No verify call of a round got through: no replica is live, or every one failed."""


@dataclass
class _Round:
    """What a verification round's calls gave so far (:class:`VerifyRound`'s fields, and the calls' errors)."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    timings: list[tuple[str, tuple[VerifySpec, ...], float]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    errors: list[grpc.aio.AioRpcError] = field(default_factory=list)


class Verifiers(ReplicaPool):
    """The LLM verifier replicas ``targets`` stand for (one address, several, or ``dns:`` names; see
    :mod:`.replica_pool`). Every replica must serve the same LLM (model name, vocabulary, positions):
    another one never joins. Each request is *placed* on one replica, which holds its KV cache, and
    stays there (:attr:`placement_map`, the one owner of placements; see :mod:`.placement_map`); when
    its replica is taken out or leaves, it is unplaced and placed anew, and the new replica rebuilds its
    cache from the committed tokens (context protocol). Calls carry ``timeout`` and ``auth``'s credentials."""

    kind = "LLM verifier"

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
    ) -> None:
        super().__init__(targets, timeout, auth, refresh_seconds, probe_seconds)
        self._stubs: dict[str, internal_pb2_grpc.LlmVerifierStub] = {}
        # each replica's Verify calls, over its socket or one gRPC stream
        self._verify_calls: dict[str, StreamedUnary | SocketFirst] = {}
        self.infos: dict[str, internal_pb2.LlmInfo] = {}  # address -> what it reported when it joined
        self.reference: internal_pb2.LlmInfo | None = None  # the first replica's report: what every replica must match
        # where each request runs and the replicas' KV block counts: this pool only reports to it and asks it
        self.placement_map = PlacementMap()
        # the last join refused for our credentials (start-up reports it)
        self.refusal: grpc.aio.AioRpcError | None = None

    # -- membership -------------------------------------------------------------------------------

    async def _introduce(self, channel: grpc.aio.Channel) -> internal_pb2.LlmInfo:
        try:
            stub = internal_pb2_grpc.LlmVerifierStub(channel)
            return await stub.GetInfo(
                internal_pb2.LlmInfoRequest(), timeout=self.join_seconds, metadata=self.auth.metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self.refusal = exc
            raise

    def _join(self, address: str, channel: grpc.aio.Channel, info: internal_pb2.LlmInfo) -> None:
        ref = self.reference
        if ref is not None and (info.model, info.vocab_size, info.max_positions) != (
            ref.model,
            ref.vocab_size,
            ref.max_positions,
        ):
            raise ValueError(
                f"LLM verifier {address} serves {info.model!r} "
                f"(vocabulary {info.vocab_size}, {info.max_positions} positions); "
                f"the other replicas serve {ref.model!r} (vocabulary {ref.vocab_size}, {ref.max_positions} positions)"
            )
        self.reference = ref or info
        super()._join(address, channel, info)
        stub = self._stubs[address] = internal_pb2_grpc.LlmVerifierStub(channel)

        async def ask_port(timeout: float) -> int:
            info = await stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=timeout, metadata=self.auth.metadata)
            return info.socket_port

        self._verify_calls[address] = stream_calls(
            stub.VerifyStream,
            stub.Verify,
            self.auth,
            address,
            info.socket_port,
            internal_pb2.VerifyResponse,
            ask_port,
            self._tls_names.get(address, ""),
        )
        self.infos[address] = info
        self.placement_map.join(address, wire.kv_budget_from_proto(info), info.kv_blocks_free)

    def _leave(self, address: str) -> None:
        super()._leave(address)
        del self._stubs[address], self.infos[address]
        self._verify_calls.pop(address).close()
        self.placement_map.leave(address)

    def _report_taken_out(self, address: str, error: BaseException) -> None:
        moved = self.placement_map.unplace_from(address)
        log.warning(
            "LLM verifier taken out; its requests move to the others",
            extra={"address": address, "error": repr(error), "live": self.live_count(), "requests_moved": moved},
        )
        if not self.live():
            log.warning("no LLM verifier left: requests wait until one answers")

    async def wait_ready(self, retry_max_seconds: float) -> internal_pb2.LlmInfo:
        """The first replica's report, once one has joined (a verifier that is down, or still loading
        and calibrating its model, does not stop the request manager from starting). Raises
        PermissionError when a replica refused our credentials and none has joined."""
        wait = 0.25
        while self.reference is None:
            if self.refusal is not None:
                raise PermissionError(f"the LLM verifier refused our credentials: {self.refusal.details()}")
            await asyncio.sleep(wait)
            wait = min(2 * wait, retry_max_seconds)
        return self.reference

    # -- calls -------------------------------------------------------------------------------------

    async def info(self, address: str) -> internal_pb2.LlmInfo:
        return await self._stubs[address].GetInfo(
            internal_pb2.LlmInfoRequest(), timeout=self.timeout, metadata=self.auth.metadata
        )

    async def verify(self, calls: Sequence[VerifySpec]) -> VerifyRound:
        """One verify call per replica for the requests placed on it, concurrently. A replica that
        fails is taken out and its requests are unplaced (they fail this round); a call that failed
        across a stall of ours, or that the replica refused as the caller's fault, fails its requests
        without taking the replica out. A call the replica answered with a fault of what it was asked
        (``REQUEST_FAULTS``) is asked again one request a call, and the requests that fail alone are
        *rejected* (:attr:`VerifyRound.rejected`): the others go on. Raises VerifierUnavailable when no
        call got through, unless every refusal was for lack of KV blocks (the replicas answer; the next
        schedule preempts)."""
        live = self.live()
        round_ = _Round()
        by_replica: dict[str, list[VerifySpec]] = {}
        for c in calls:
            address = self.placement_map.home(c.request_id, verify_rows(c), live)
            if address is None:
                round_.failed.append(c.request_id)
            else:
                by_replica.setdefault(address, []).append(c)
        if not by_replica:
            raise VerifierUnavailable("no LLM verifier is live")
        started = asyncio.get_running_loop().time()
        # stubs and trackers are taken now: a refresh may drop a replica while its call runs
        handles = {a: (self._verify_calls[a], self.tracker(a)) for a in by_replica}
        replicas = list(by_replica.items())
        parts = await settled_all([self._verify_on(*handles[a], cs) for a, cs in replicas])
        for (address, cs), part in zip(replicas, parts, strict=True):
            if isinstance(part, grpc.aio.AioRpcError) and part.code() in REQUEST_FAULTS:
                await self._isolate(address, handles[address], cs, part, started, round_)
            else:
                await self._settle(address, cs, part, started, round_)
        # a full KV cache answers: it is there
        unreachable = [e for e in round_.errors if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED]
        if not round_.verdicts and not round_.rejected and unreachable:
            raise VerifierUnavailable(f"every verify call failed: {unreachable[0].code()} {unreachable[0].details()}")
        return VerifyRound(
            round_.verdicts, tuple(round_.failed), tuple(round_.timings), tuple(round_.refused), round_.rejected
        )

    async def _settle(self, address: str, cs: Sequence[VerifySpec], part, started: float, round_: _Round) -> None:
        """Add what ``address``'s call for ``cs`` gave (``part``: its result or its error) to ``round_``."""
        if isinstance(part, grpc.aio.AioRpcError):
            round_.errors.append(part)
            round_.failed += [c.request_id for c in cs]
            stalled = part.code() in STALL_FAULTS and self.stalls.stalled_since(started)
            if part.code() in CALLER_FAULTS or stalled:
                log.warning(
                    "verify call failed; its requests retry",
                    extra={"address": address, "code": str(part.code()), "details": part.details()},
                )
                if (
                    part.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ):  # its KV blocks ran out (shared with another manager)
                    round_.refused.append(address)
                    await self._ask_free(address)
            else:
                self.take_out(address, part)  # when it is back, its tracker starts empty (ReplicaPool._back)
        elif isinstance(part, BaseException):
            raise part
        else:
            results, seconds, free = part
            round_.verdicts.update(results)
            round_.timings.append((address, tuple(cs), seconds))
            if free is not None:
                self.placement_map.heard_free(address, free)

    async def _isolate(
        self,
        address: str,
        handle: tuple[StreamedUnary | SocketFirst, ContextTracker],
        cs: Sequence[VerifySpec],
        error: grpc.aio.AioRpcError,
        started: float,
        round_: _Round,
    ) -> None:
        """``address`` answered the call for ``cs`` with ``error``, a fault of what it was asked: ask for each request
        alone (at once), so that the requests at fault are rejected and the others verified. When every one fails
        alone with a fault a broken replica answers to everything, the replica is at fault instead: taken out, its
        requests retry elsewhere."""
        if len(cs) > 1:
            log.warning(
                "verify call failed; its requests are asked one by one",
                extra={"address": address, "code": str(error.code()), "details": error.details(), "requests": len(cs)},
            )
        singles, faults, broken = await ask_alone(cs, error, lambda c: self._verify_on(*handle, [c]))
        if broken:
            await self._settle(address, cs, singles[0], started, round_)
            return
        for c, single, fault in zip(cs, singles, faults, strict=True):
            if not fault:
                await self._settle(address, [c], single, started, round_)
                continue
            why = f"the LLM verifier failed on this request: {single.code().name}: {single.details()}"
            round_.rejected[c.request_id] = why
            log.warning(
                "verification of a request failed alone; it ends", extra={"request_id": c.request_id, "error": why}
            )

    async def _verify_on(
        self, verify: StreamedUnary | SocketFirst, tracker: ContextTracker, calls: Sequence[VerifySpec]
    ) -> tuple[dict[str, Verdict], float, int | None]:
        """The verdicts, the round trip in seconds and the KV blocks the replica said were free (None: it has no
        budget)."""
        started = time.perf_counter()  # the round trip of every attempt: the network is part of what a step costs
        free: list[int | None] = [None]

        async def send(pending, contexts):
            request = internal_pb2.VerifyRequest()
            request.items.extend(
                wire_jobs.verify_job_to_proto(c, ctx) for c, ctx in zip(pending, contexts, strict=True)
            )
            response = await verify(request, self.timeout)
            free[0] = response.kv_blocks_free if response.HasField("kv_blocks_free") else None
            return response.results

        results = await call_with_context(send, calls, tracker)
        verdicts = {
            rid: Verdict(
                tuple(r.accepted_tokens),
                int(r.bonus_token),
                int(r.prefix_hit_tokens),
                wire_jobs.next_tree_from_proto(r, "results"),
                wire.token_logprobs_from_proto(r.logprobs) if r.logprobs else None,
            )
            for rid, r in results.items()
        }
        return verdicts, time.perf_counter() - started, free[0]

    async def _ask_free(self, address: str) -> None:
        try:
            info = await self.info(address)
        except grpc.aio.AioRpcError:
            return
        if self.placement_map.counts_free(address):
            self.placement_map.heard_free(address, info.kv_blocks_free)

    async def refresh_free(self, max_age: float) -> None:
        """Ask the live replicas whose free-block count is older than ``max_age`` seconds (those no
        verify call of ours reached lately) for a new one, concurrently."""
        stale = self.placement_map.stale(self.live(), max_age)
        if stale:
            await asyncio.gather(*(self._ask_free(a) for a in stale))

    async def release(self, request_ids: Sequence[str]) -> None:
        """Free the caches of ``request_ids`` on their replicas and unplace them. A replica that
        fails the call keeps them (only memory: it frees them when it restarts)."""
        by_replica: dict[str, list[str]] = {}
        for rid in request_ids:
            address = self.placement_map.where(rid)
            if address is not None and address in self._stubs:
                by_replica.setdefault(address, []).append(rid)
        self.forget(request_ids)
        for address, ids in by_replica.items():
            if not self.is_live(address):
                continue
            try:
                await self._stubs[address].Release(
                    internal_pb2.ReleaseRequest(request_ids=ids), timeout=self.timeout, metadata=self.auth.metadata
                )
            except grpc.aio.AioRpcError as exc:
                log.info("release failed", extra={"address": address, "code": str(exc.code())})

    def forget(self, request_ids: Sequence[str]) -> None:
        """Stop tracking requests another request manager drives now, without releasing their caches (it uses them)."""
        self.placement_map.unplace(request_ids)
        for rid in request_ids:
            for a in self.addresses:
                self.tracker(a).forget(rid)


def verify_rows(call: VerifySpec) -> StepRows:
    """The KV rows ``call`` takes on the replica that verifies it: its context and its tree."""
    rows = len(call.context_tokens) + len(call.draft.tree.tokens)
    return StepRows(rows, rows)
