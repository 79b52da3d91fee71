"""The SSM worker replicas in service: membership, stable hashing and failover.

A request sticks to one worker per SSM (its KV cache lives there). The *targets* (see
:mod:`.discovery`) are looked up by :meth:`WorkerPool.discover` and again every ``refresh_seconds``
(:meth:`WorkerPool.refresh`), so workers that scale up or move are found without a restart; a worker
*joins* once it answers ListModels with the pool's vocabulary. Start-up never waits for a worker
that is down: :meth:`WorkerPool.discover` gives each address ``join_seconds``, and the addresses
that did not answer (or a name with no address yet) are *pending*, tried again every
``probe_seconds`` until they join.

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

from specinfer import wire
from specinfer.core.kv_budget import KVBudget
from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2, internal_pb2_grpc

from .context_protocol import ContextTracker
from .discovery import DNS_REFRESH_SECONDS, DnsTarget, resolve_targets
from .failover import CHANNEL_OPTIONS, PROBE_SECONDS, HealthProbes, StallWatch

log = logging.getLogger("specinfer.request_manager")

JOIN_SECONDS = 1.0  # how long a join waits for a worker's ListModels (a refused connection fails at once) before it stays pending


class WorkerPool:
    """The SSM workers ``targets`` stand for, each with its channel, stub and context tracker."""

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
        join_seconds: float = JOIN_SECONDS,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the LLM's; a worker with another vocabulary never joins (None: the first
        worker's sets it)."""
        if not targets:
            raise ValueError("no SSM worker addresses")
        self.targets = list(targets)
        self._dns = [DnsTarget.parse(t) for t in self.targets]  # bad dns: targets fail here, at start-up
        self.timeout = timeout
        self.join_seconds = min(join_seconds, timeout)
        self.probe_seconds = probe_seconds
        self.auth = auth or ClientAuth()
        self._down = HealthProbes(probe_seconds, self.auth.metadata, self._back)
        self.stalls = StallWatch()  # started by discover(), on the running loop
        self.on_change: Callable[[], object] | None = None  # called when a worker is taken out or back
        self.refresh_seconds = refresh_seconds
        self.addresses: list[str] = []  # the workers, in the order of the stable hashing
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, internal_pb2_grpc.SsmWorkerStub] = {}
        self._trackers: dict[str, ContextTracker] = {}
        self._served: dict[str, tuple[str, ...]] = {}  # address -> SSM names
        self.models: dict[str, list[str]] = {}  # SSM name -> addresses serving it
        self.vocab_size: int | None = vocab_size
        self.pending: list[str] = []  # addresses found but not joined yet (down, or still starting)
        self._tls_names: dict[str, str] = {}  # address -> TLS name (discovery module), from the last lookup
        self._resolved = False  # whether the last lookup found any address
        self.profiles: dict[str, internal_pb2.SsmProfile] = {}  # SSM name -> the first profile a worker reported (calibration, slot prior)
        self.kv_budgets: dict[str, set[KVBudget]] = {}  # SSM name -> the KV budgets its workers reported, each worker's SSM cache
        self._refresher: asyncio.Task | None = None

    @property
    def uses_dns(self) -> bool:
        return any(self._dns)

    def _join(self, address: str, channel: grpc.aio.Channel, info: internal_pb2.ListModelsResponse) -> None:
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            raise ValueError(f"SSM worker {address} has vocabulary {info.vocab_size}; the pool (the LLM) has {self.vocab_size}")
        self.vocab_size = info.vocab_size
        self._channels[address] = channel
        self._stubs[address] = internal_pb2_grpc.SsmWorkerStub(channel)
        self._trackers[address] = ContextTracker()
        self._served[address] = tuple(info.models)
        self.addresses.append(address)
        for profile in info.profiles:
            if profile.model not in self.profiles or not self.profiles[profile.model].draft_costs:
                self.profiles[profile.model] = profile
            budget = wire.kv_budget_from_proto(profile)
            if budget is not None:
                self.kv_budgets.setdefault(profile.model, set()).add(budget)

    def _index(self) -> None:
        self.models = {}
        for address in self.addresses:
            for name in self._served[address]:
                self.models.setdefault(name, []).append(address)

    async def discover(self) -> None:
        """Look the targets up and ask every address which SSMs it serves, all at once, each for at
        most ``join_seconds``. The workers that answer join; the others stay pending and join in the
        background when they answer (so start-up never waits for a worker that is down). Raises
        ValueError for a worker whose vocabulary is not the pool's: that is a configuration error."""
        self.stalls.start()
        try:
            self._tls_names = await resolve_targets(self.targets, self._dns)
        except OSError as exc:
            self._tls_names = {}
            log.warning("SSM worker lookup failed; trying again in the background", extra={"targets": self.targets, "error": repr(exc)})
        addresses = list(self._tls_names)
        self._resolved = bool(addresses)
        if self.uses_dns:
            log.info("SSM workers resolved", extra={"targets": self.targets, "addresses": addresses})
        joined = await self._try_join([a for a in addresses if a not in self._stubs], strict=True)
        self.pending = [a for a in addresses if a not in self._stubs]
        self._index()
        if self.pending or not addresses:
            log.warning("SSM workers not answering yet; they join when they do", extra={"pending": self.pending or self.targets, "joined": joined})
        self._ensure_background()

    def _ensure_background(self) -> None:
        """Run the background lookups while there is something to find: ``dns:`` targets (every
        ``refresh_seconds``), pending addresses or a name with no address yet (every ``probe_seconds``)."""
        needed = (self.uses_dns and self.refresh_seconds > 0) or self.pending or not self._resolved
        if needed and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _try_join(self, addresses: Sequence[str], strict: bool) -> list[str]:
        """Ask ``addresses`` for ListModels concurrently (each for at most ``join_seconds``; an
        address that refuses connections fails at once); those that answer with the pool's
        vocabulary join, in the order given. ``strict``: a vocabulary mismatch raises ValueError
        (otherwise it is logged and the address stays out)."""
        channels = [self.auth.aio_channel(a, CHANNEL_OPTIONS, tls_name=self._tls_names.get(a, "")) for a in addresses]
        calls = [
            internal_pb2_grpc.SsmWorkerStub(ch).ListModels(internal_pb2.ListModelsRequest(), timeout=self.join_seconds, metadata=self.auth.metadata)
            for ch in channels
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        joined: list[str] = []
        mismatch: ValueError | None = None
        for address, channel, info in zip(addresses, channels, answers, strict=True):
            error: BaseException | None = info if isinstance(info, BaseException) else None
            if error is None:
                try:
                    self._join(address, channel, info)
                    joined.append(address)
                    continue
                except ValueError as exc:
                    error = mismatch = exc
            await channel.close()
            if not isinstance(error, grpc.aio.AioRpcError | ValueError):
                raise error
            # a worker still down is retried every probe_seconds: only the first try is worth a log line
            level = logging.WARNING if isinstance(error, ValueError) else logging.INFO if strict else logging.DEBUG
            log.log(level, "SSM worker not joined (yet)", extra={"address": address, "error": repr(error)})
        if strict and mismatch is not None:
            raise mismatch
        return joined

    async def _refresh_forever(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            incomplete = bool(self.pending) or not self._resolved
            if not incomplete and not (self.uses_dns and self.refresh_seconds > 0):
                break  # every plain address joined: nothing left to look for
            await asyncio.sleep(self.probe_seconds if incomplete else max(0.0, self.refresh_seconds - (loop.time() - last)))
            last = loop.time()
            try:
                await self.refresh()
            except Exception:  # the next round tries again; the workers in use stay
                log.exception("SSM worker refresh failed")
        self._refresher = None

    async def refresh(self) -> None:
        """Look the targets up again: new addresses join once they answer ListModels with the
        same vocabulary, addresses no longer found leave (their requests move to other workers,
        which rebuild the caches through the context protocol). A failed or empty lookup keeps
        the current workers."""
        try:
            names = await resolve_targets(self.targets, self._dns)
        except OSError as exc:
            log.warning("SSM worker lookup failed; keeping the current workers", extra={"error": repr(exc)})
            return
        if not names:
            log.warning("SSM worker lookup found no address; keeping the current workers", extra={"targets": self.targets})
            return
        self._tls_names = names
        found = list(names)
        self._resolved = True
        joined = await self._try_join([a for a in found if a not in self._stubs], strict=False)
        self.pending = [a for a in found if a not in self._stubs]
        gone = [a for a in self.addresses if a not in found]
        closing = [self._channels.pop(a) for a in gone]
        for address in gone:
            del self._stubs[address], self._trackers[address], self._served[address]
            self._down.forget(address)
        self.addresses = [a for a in self.addresses if a not in gone]
        self._index()
        if joined or gone:
            log.info("SSM workers changed", extra={"added": joined, "removed": gone, "workers": self.addresses})
            if self.on_change is not None:
                self.on_change()
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
        self.stalls.close()
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for ch in self._channels.values():
            await ch.close()
