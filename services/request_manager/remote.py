"""gRPC clients of the SSM workers and the LLM verifier, with the context protocol.

Each callee caches a request's context (committed tokens without the tree root). The request
manager remembers how much of it each callee already has and sends only the rest; a callee that
lost it (restart, moved request) answers ``cache_miss`` and gets the whole context once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer import wire
from specinfer.core import DraftTree
from specinfer.core.iteration import DraftSpec as DraftCall  # one request's share of a Speculate call
from specinfer.core.iteration import VerifySpec as VerifyCall  # one request's share of a Verify call
from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("specinfer.request_manager")


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided: accepted tree tokens and the bonus token."""

    accepted_tokens: tuple[int, ...]
    bonus_token: int


class _ContextTracker:
    """How many context tokens one callee holds per request."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def message(self, request_id: str, context: Sequence[int]) -> internal_pb2.Context:
        known = min(self._known.get(request_id, 0), len(context))
        return wire.context_to_proto(request_id, context, known)

    def sent(self, request_id: str, length: int) -> None:
        self._known[request_id] = length

    def forget(self, request_id: str) -> None:
        self._known.pop(request_id, None)

    def reset(self) -> None:
        self._known.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._known


async def _call_with_context(send, calls, tracker: _ContextTracker):
    """Send ``calls`` through ``send(contexts)``; items answered with cache_miss are sent once
    more with their whole context. Returns the callee's results by request ID."""
    results = {}
    pending = list(calls)
    for attempt in range(2):
        contexts = [tracker.message(c.request_id, c.context) if attempt == 0 else wire.context_to_proto(c.request_id, c.context, 0) for c in pending]
        response = await send(pending, contexts)
        retry = []
        for call, result in zip(pending, response, strict=True):
            if result.cache_miss:
                tracker.forget(call.request_id)
                retry.append(call)
            else:
                tracker.sent(call.request_id, len(call.context))
                results[call.request_id] = result
        if not retry:
            return results
        pending = retry
    raise RuntimeError(f"callee reported a cache miss for a full context: {[c.request_id for c in pending]}")


# -- DNS discovery of SSM workers -----------------------------------------------------------
# ``dns:///ssm-worker:50052`` names one worker per A/AAAA record of ``ssm-worker``: Docker Compose
# (``--scale ssm-worker=N``) and Kubernetes headless Services publish one record per replica.
# gRPC's own dns resolver would spread calls over them, but a request must keep drafting on the
# worker that holds its cache, so the request manager resolves the name itself and keeps one
# channel per address (see :meth:`SsmWorkers.worker_for`).

DNS_REFRESH_SECONDS = 30.0  # how often SsmWorkers re-resolves its dns: targets
PROBE_SECONDS = 1.0  # how often a worker taken out is health-checked
# keepalive pings find a dead peer on an idle connection (the servers permit pings every 10 s);
# reconnect backoff capped at 5 s (gRPC's default grows to 120 s): a restarted worker or verifier
# is back in seconds, and calls to it fail fast until it is
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)
# statuses that say the call was wrong, not the worker: they do not take the worker out
CALLER_FAULTS = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
)


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int

    @staticmethod
    def parse(target: str) -> DnsTarget | None:
        """``dns:///host:port`` or ``dns:host:port`` (gRPC's target syntax); None for a plain ``host:port``."""
        if not target.startswith("dns:"):
            return None
        rest = target.removeprefix("dns:")
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                raise ValueError(f"SSM worker target {target!r}: a DNS server (authority) is not supported; write dns:///host:port")
        host, sep, port = rest.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [IPv6 literal]
        if not sep or not host or not port.isdigit():
            raise ValueError(f"SSM worker target {target!r}: expected dns:///host:port")
        return DnsTarget(host, int(port))

    async def resolve(self) -> list[str]:
        """Every address of ``host`` (A and AAAA records), sorted, as ``ip:port`` or ``[ip]:port``."""
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return sorted({f"[{addr[0]}]:{self.port}" if family == socket.AF_INET6 else f"{addr[0]}:{self.port}" for family, _, _, _, addr in infos})


class SsmWorkers:
    """The SSM worker replicas. A request sticks to one worker per SSM (its KV cache lives there).

    ``targets`` are ``host:port`` addresses or ``dns:///host:port`` names; a name stands for all
    its addresses, looked up by :meth:`discover` and again every ``refresh_seconds``
    (:meth:`refresh`), so workers that scale up or move are found without a restart.

    Failover: a Speculate call that fails or takes longer than ``speculate_timeout`` takes its
    worker out (:meth:`live_count` drops); its requests move to the other workers serving the SSM
    (stable hashing over the live ones), which rebuild their caches from the full context. A
    background probe brings the worker back once its health is SERVING. With no live worker for
    an SSM, its requests draft nothing: verification of the root alone is incremental decoding.
    """

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        speculate_timeout: float | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
    ) -> None:
        if not targets:
            raise ValueError("no SSM worker addresses")
        self.targets = list(targets)
        self._dns = [DnsTarget.parse(t) for t in self.targets]  # bad dns: targets fail here, at start-up
        self.timeout = timeout
        self.auth = auth or ClientAuth()
        self.speculate_timeout = speculate_timeout or timeout
        self.probe_seconds = probe_seconds
        self._down: dict[str, asyncio.Task] = {}  # worker taken out -> its health probe
        self.on_change: Callable[[], object] | None = None  # called when a worker is taken out or back
        self.refresh_seconds = refresh_seconds
        self.addresses: list[str] = []  # the workers, in the order of the stable hashing
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, internal_pb2_grpc.SsmWorkerStub] = {}
        self._trackers: dict[str, _ContextTracker] = {}
        self._served: dict[str, tuple[str, ...]] = {}  # address -> SSM names
        self.models: dict[str, list[str]] = {}  # SSM name -> addresses serving it
        self.vocab_size: int | None = None
        self._refresher: asyncio.Task | None = None

    @property
    def uses_dns(self) -> bool:
        return any(self._dns)

    async def resolve(self) -> list[str]:
        """The worker addresses the targets stand for now (plain addresses as given). Raises
        OSError when a lookup fails (e.g. a name with no address yet)."""
        out: list[str] = []
        for target, dns in zip(self.targets, self._dns, strict=True):
            found = await dns.resolve() if dns is not None else [target]
            out += [a for a in found if a not in out]
        return out

    def _join(self, address: str, channel: grpc.aio.Channel, info: internal_pb2.ListModelsResponse) -> None:
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            raise ValueError(f"SSM worker {address} has vocabulary {info.vocab_size}, others {self.vocab_size}")
        self.vocab_size = info.vocab_size
        self._channels[address] = channel
        self._stubs[address] = internal_pb2_grpc.SsmWorkerStub(channel)
        self._trackers[address] = _ContextTracker()
        self._served[address] = tuple(info.models)
        self.addresses.append(address)

    def _index(self) -> None:
        self.models = {}
        for address in self.addresses:
            for name in self._served[address]:
                self.models.setdefault(name, []).append(address)

    async def discover(self) -> None:
        """Ask every worker which SSMs it serves (each gets ``timeout`` seconds to come up); a
        ``dns:`` name that has no address yet is looked up again until then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        error: OSError | None = None
        while True:
            try:
                addresses = await self.resolve()
            except OSError as exc:
                addresses, error = [], exc
            if addresses or loop.time() >= deadline:
                break
            await asyncio.sleep(1.0)
        if not addresses:
            raise RuntimeError(f"no SSM worker address found for {', '.join(self.targets)} in {self.timeout:.0f} s (last error: {error!r})")
        if self.uses_dns:
            log.info("SSM workers resolved", extra={"targets": self.targets, "addresses": addresses})
        for address in (a for a in addresses if a not in self._stubs):
            channel = self.auth.aio_channel(address, CHANNEL_OPTIONS)
            info = await internal_pb2_grpc.SsmWorkerStub(channel).ListModels(
                internal_pb2.ListModelsRequest(), timeout=self.timeout, wait_for_ready=True, metadata=self.auth.metadata
            )
            self._join(address, channel, info)
        self._index()
        if self.uses_dns and self.refresh_seconds > 0 and self._refresher is None:
            self._refresher = loop.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # the next round tries again; the workers in use stay
                log.exception("SSM worker refresh failed")

    async def refresh(self) -> None:
        """Look the targets up again: new addresses join once they answer ListModels with the
        same vocabulary, addresses no longer found leave (their requests move to other workers,
        which rebuild the caches through the context protocol). A failed or empty lookup keeps
        the current workers."""
        try:
            found = await self.resolve()
        except OSError as exc:
            log.warning("SSM worker lookup failed; keeping the current workers", extra={"error": repr(exc)})
            return
        if not found:
            log.warning("SSM worker lookup found no address; keeping the current workers", extra={"targets": self.targets})
            return
        joined = []
        for address in (a for a in found if a not in self._stubs):
            channel = self.auth.aio_channel(address, CHANNEL_OPTIONS)
            try:
                info = await internal_pb2_grpc.SsmWorkerStub(channel).ListModels(
                    internal_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.auth.metadata
                )
                self._join(address, channel, info)
                joined.append(address)
            except (grpc.aio.AioRpcError, ValueError) as exc:
                await channel.close()
                log.warning("SSM worker not added; trying again at the next lookup", extra={"address": address, "error": repr(exc)})
        gone = [a for a in self.addresses if a not in found]
        closing = [self._channels.pop(a) for a in gone]
        for address in gone:
            del self._stubs[address], self._trackers[address], self._served[address]
            probe = self._down.pop(address, None)
            if probe is not None:
                probe.cancel()
        self.addresses = [a for a in self.addresses if a not in gone]
        self._index()
        if joined or gone:
            log.info("SSM workers changed", extra={"added": joined, "removed": gone, "workers": self.addresses})
        for channel in closing:  # calls in flight on a removed worker may finish
            await channel.close(grace=self.timeout)

    def live_workers(self, ssm: str) -> list[str]:
        """The workers serving ``ssm`` that are not taken out."""
        return [a for a in self.models.get(ssm, ()) if a not in self._down]

    def live_count(self) -> int:
        """How many workers are in service (a hook for health and metrics)."""
        return sum(1 for a in self.addresses if a not in self._down)

    def worker_for(self, request_id: str, ssm: str) -> str | None:
        """The worker that drafts ``request_id`` with ``ssm``: stable hashing over the live workers
        serving it, so a request keeps hitting the worker that holds its cache. None: none is live."""
        serving = self.live_workers(ssm)
        if not serving:
            return None
        return serving[zlib.crc32(f"{request_id}/{ssm}".encode()) % len(serving)]

    async def speculate(self, ssm: str, calls: Sequence[DraftCall]) -> dict[str, DraftTree]:
        """Draft trees of ``calls`` by request ID. Requests whose worker fails move to another live
        worker within this call; requests left without one are missing from the result (their
        tree is the root alone). Raises only for errors that are the caller's (CALLER_FAULTS)."""
        out: dict[str, DraftTree] = {}
        pending = list(calls)
        while pending:
            by_worker: dict[str, list[DraftCall]] = {}
            for c in pending:
                address = self.worker_for(c.request_id, ssm)
                if address is not None:
                    by_worker.setdefault(address, []).append(c)
            if not by_worker:
                break  # no worker left for this SSM: the remaining requests verify their root alone
            # stubs and trackers are taken now: a refresh may drop a worker while its call runs
            jobs = [self._speculate_on(self._stubs[a], self._trackers[a], ssm, cs) for a, cs in by_worker.items()]
            pending = []
            for (address, cs), part in zip(by_worker.items(), await asyncio.gather(*jobs, return_exceptions=True), strict=True):
                if isinstance(part, grpc.aio.AioRpcError) and part.code() not in CALLER_FAULTS:
                    self.take_out(address, part)
                    pending += cs  # to another live worker, if any
                elif isinstance(part, BaseException):
                    raise part
                else:
                    out.update(part)
        return out

    def take_out(self, address: str, error: BaseException) -> None:
        """Stop sending work to ``address`` until a health probe finds it SERVING again."""
        if address in self._down or address not in self._stubs:
            return
        self._down[address] = asyncio.get_running_loop().create_task(self._probe(address))
        left = {name: len(self.live_workers(name)) for name in self.models}
        log.warning(
            "SSM worker taken out; its requests move to the others",
            extra={"address": address, "error": repr(error), "live_workers": self.live_count(), "live_per_ssm": left},
        )
        for name, count in left.items():
            if count == 0:
                log.warning("no SSM worker left for an SSM: its requests fall back to incremental decoding", extra={"ssm": name})
        if self.on_change is not None:
            self.on_change()

    async def _probe(self, address: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channels[address])
        while True:
            await asyncio.sleep(self.probe_seconds)
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_seconds, metadata=self.auth.metadata)
            except grpc.aio.AioRpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        # it may have restarted: assume it knows no context (a kept one costs a cache-miss round)
        self._trackers[address].reset()
        del self._down[address]
        log.info("SSM worker back in service", extra={"address": address, "live_workers": self.live_count()})
        if self.on_change is not None:
            self.on_change()

    async def _speculate_on(
        self, stub: internal_pb2_grpc.SsmWorkerStub, tracker: _ContextTracker, ssm: str, calls: Sequence[DraftCall]
    ) -> dict[str, DraftTree]:
        async def send(pending, contexts):
            request = internal_pb2.SpeculateRequest(ssm=ssm)
            for c, ctx in zip(pending, contexts, strict=True):
                request.items.add(
                    context=ctx,
                    root_token=c.root_token,
                    expansion=c.expansion.widths,
                    sampling=wire.sampling_to_proto(c.sampling),
                    draft_support=c.draft_support,
                    seed=c.seed,
                    step=c.step,
                    stream=c.stream,
                )
            response = await stub.Speculate(request, timeout=self.speculate_timeout, metadata=self.auth.metadata)
            return response.results

        results = await _call_with_context(send, calls, tracker)
        return {rid: wire.draft_from_proto(r.tree) for rid, r in results.items()}

    async def release(self, request_ids: Sequence[str]) -> None:
        # the workers as they are now: a refresh may change them while the calls run
        for address, stub, tracker in [(a, self._stubs[a], self._trackers[a]) for a in self.addresses]:
            ids = [r for r in request_ids if r in tracker]
            for r in ids:
                tracker.forget(r)
            if ids and address not in self._down:
                try:
                    await stub.Release(internal_pb2.ReleaseRequest(request_ids=ids), timeout=self.timeout, metadata=self.auth.metadata)
                except grpc.aio.AioRpcError as exc:  # a cache left behind is only memory: the worker frees it when it restarts
                    log.info("release failed", extra={"address": address, "code": str(exc.code())})

    async def close(self) -> None:
        for probe in self._down.values():
            probe.cancel()
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for ch in self._channels.values():
            await ch.close()


class Verifier:
    """The LLM verifier. Calls carry ``timeout`` (the deadline of internal calls) and the
    credentials of ``auth``."""

    def __init__(self, address: str, timeout: float, auth: ClientAuth | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.auth = auth or ClientAuth()
        self._channel = self.auth.aio_channel(address, CHANNEL_OPTIONS)
        self._stub = internal_pb2_grpc.LlmVerifierStub(self._channel)
        self._tracker = _ContextTracker()

    async def info(self) -> internal_pb2.LlmInfo:
        return await self._stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=self.timeout, wait_for_ready=True, metadata=self.auth.metadata)

    async def verify(self, calls: Sequence[VerifyCall]) -> dict[str, Verdict]:
        async def send(pending, contexts):
            request = internal_pb2.VerifyRequest()
            for c, ctx in zip(pending, contexts, strict=True):
                request.items.add(context=ctx, tree=wire.draft_to_proto(c.draft), sampling=wire.sampling_to_proto(c.sampling), seed=c.seed, step=c.step)
            response = await self._stub.Verify(request, timeout=self.timeout, metadata=self.auth.metadata)
            return response.results

        results = await _call_with_context(send, calls, self._tracker)
        return {rid: Verdict(tuple(r.accepted_tokens), int(r.bonus_token)) for rid, r in results.items()}

    def lost_caches(self) -> None:
        """After a verifier failure: assume it restarted and knows nothing."""
        self._tracker.reset()

    async def release(self, request_ids: Sequence[str]) -> None:
        for r in request_ids:
            self._tracker.forget(r)
        if request_ids:
            await self._stub.Release(internal_pb2.ReleaseRequest(request_ids=list(request_ids)), timeout=self.timeout, metadata=self.auth.metadata)

    async def close(self) -> None:
        await self._channel.close()
