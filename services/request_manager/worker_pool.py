"""The SSM worker replicas in service: membership, stable hashing and failover.

A request sticks to one worker per SSM (its KV cache lives there). The *targets* (see
:mod:`.discovery`) are looked up by :meth:`WorkerPool.discover` and again every ``refresh_seconds``
(:meth:`WorkerPool.refresh`), so workers that scale up or move are found without a restart; a worker
*joins* once it answers ListModels with the pool's vocabulary.

Failover (see :mod:`.failover`): a worker that fails a call is *taken out* (:meth:`WorkerPool.live_count`
drops); its requests move to the other *live* workers serving the SSM (stable hashing over the live
ones), which rebuild their caches from the full context. A background probe brings the worker back once
its health is SERVING. With no live worker for an SSM, its requests draft nothing: verification of the
root alone is incremental decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Callable, Sequence

import grpc

from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2, internal_pb2_grpc

from .context_protocol import ContextTracker
from .discovery import DNS_REFRESH_SECONDS, DnsTarget, resolve_targets
from .failover import CHANNEL_OPTIONS, PROBE_SECONDS, HealthProbes

log = logging.getLogger("specinfer.request_manager")


class WorkerPool:
    """The SSM workers ``targets`` stand for, each with its channel, stub and context tracker."""

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
    ) -> None:
        if not targets:
            raise ValueError("no SSM worker addresses")
        self.targets = list(targets)
        self._dns = [DnsTarget.parse(t) for t in self.targets]  # bad dns: targets fail here, at start-up
        self.timeout = timeout
        self.auth = auth or ClientAuth()
        self._down = HealthProbes(probe_seconds, self.auth.metadata, self._back)
        self.on_change: Callable[[], object] | None = None  # called when a worker is taken out or back
        self.refresh_seconds = refresh_seconds
        self.addresses: list[str] = []  # the workers, in the order of the stable hashing
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, internal_pb2_grpc.SsmWorkerStub] = {}
        self._trackers: dict[str, ContextTracker] = {}
        self._served: dict[str, tuple[str, ...]] = {}  # address -> SSM names
        self.models: dict[str, list[str]] = {}  # SSM name -> addresses serving it
        self.vocab_size: int | None = None
        self.profiles: dict[str, internal_pb2.SsmProfile] = {}  # SSM name -> the first profile a worker reported (calibration, slot prior)
        self._refresher: asyncio.Task | None = None

    @property
    def uses_dns(self) -> bool:
        return any(self._dns)

    def _join(self, address: str, channel: grpc.aio.Channel, info: internal_pb2.ListModelsResponse) -> None:
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            raise ValueError(f"SSM worker {address} has vocabulary {info.vocab_size}, others {self.vocab_size}")
        self.vocab_size = info.vocab_size
        self._channels[address] = channel
        self._stubs[address] = internal_pb2_grpc.SsmWorkerStub(channel)
        self._trackers[address] = ContextTracker()
        self._served[address] = tuple(info.models)
        self.addresses.append(address)
        for profile in info.profiles:
            if profile.model not in self.profiles or not self.profiles[profile.model].draft_costs:
                self.profiles[profile.model] = profile

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
                addresses = await resolve_targets(self.targets, self._dns)
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
            found = await resolve_targets(self.targets, self._dns)
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
            self._down.forget(address)
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

    def take_out(self, address: str, error: BaseException) -> None:
        """Stop sending work to ``address`` until a health probe finds it SERVING again."""
        if address in self._down or address not in self._stubs:
            return
        self._down.take_out(address, self._channels[address])
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

    def _back(self, address: str) -> None:
        # it may have restarted: assume it knows no context (a kept one costs a cache-miss round)
        self._trackers[address].reset()
        log.info("SSM worker back in service", extra={"address": address, "live_workers": self.live_count()})
        if self.on_change is not None:
            self.on_change()

    async def close(self) -> None:
        self._down.close()
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for ch in self._channels.values():
            await ch.close()
