"""Replicas of one kind of callee (SSM workers, LLM verifiers): membership, discovery and failover.

A *replica* is one process at one address, found from *targets* (see :mod:`.discovery`): plain
``host:port`` addresses and ``dns:///host:port`` names, looked up by :meth:`ReplicaPool.discover` and
again every ``refresh_seconds`` (:meth:`ReplicaPool.refresh`), so replicas that scale up or move are
found without a restart. A replica *joins* once it answers the pool's introduction call (an SSM
worker's ListModels, a verifier's GetInfo) with what the pool accepts; start-up never waits for one
that is down: :meth:`ReplicaPool.discover` gives each address ``join_seconds``, and those that did not
answer (or a name with no address yet) are *pending*, tried again every ``probe_seconds``.

Failover (see :mod:`.failover`): a replica that fails a call is *taken out* (:meth:`ReplicaPool.live`
leaves it out); the requests it served move to other live replicas, which rebuild their caches from
the full context (each replica has its own :class:`~.context_protocol.ContextTracker`). A background
health probe brings it back once it is SERVING again; it may have restarted, so its tracker is reset.

Subclasses say what a replica is: :meth:`ReplicaPool._introduce` (the call that makes it join),
:meth:`ReplicaPool._join` (accept or refuse its answer, with ValueError) and :meth:`ReplicaPool._leave`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from specinfer.serving.security import ClientAuth

from .context_protocol import ContextTracker
from .discovery import DNS_REFRESH_SECONDS, DnsTarget, resolve_targets
from .failover import CHANNEL_OPTIONS, PROBE_SECONDS, HealthProbes, StallWatch

log = logging.getLogger("specinfer.request_manager")

# how long a join waits for a replica's answer (a refused connection fails at once) before it stays pending
JOIN_SECONDS = 1.0


class ReplicaPool:
    """The replicas ``targets`` stand for, each with its channel and context tracker. ``kind`` names
    them in logs and errors ("SSM worker", "LLM verifier")."""

    kind = "replica"

    def __init__(
        self,
        targets: Sequence[str],
        timeout: float,
        auth: ClientAuth | None = None,
        refresh_seconds: float = DNS_REFRESH_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
        join_seconds: float = JOIN_SECONDS,
    ) -> None:
        if not targets:
            raise ValueError(f"no {self.kind} addresses")
        self.targets = list(targets)
        self._dns = [DnsTarget.parse(t) for t in self.targets]  # bad dns: targets fail here, at start-up
        self.timeout = timeout
        self.join_seconds = min(join_seconds, timeout)
        self.probe_seconds = probe_seconds
        self.auth = auth or ClientAuth()
        self._down = HealthProbes(probe_seconds, self.auth.metadata, self._back)
        self.stalls = StallWatch()  # started by discover(), on the running loop
        # called when a replica joins, leaves, is taken out or comes back
        self.on_change: Callable[[], object] | None = None
        self.refresh_seconds = refresh_seconds
        self.addresses: list[str] = []  # the joined replicas, in the order they joined
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._trackers: dict[str, ContextTracker] = {}
        self.pending: list[str] = []  # addresses found but not joined yet (down, or still starting)
        self._tls_names: dict[str, str] = {}  # address -> TLS name (discovery module), from the last lookup
        self._resolved = False  # whether the last lookup found any address
        self._refresher: asyncio.Task | None = None

    # -- what a replica is (subclasses) ---------------------------------------------------------

    async def _introduce(self, channel: grpc.aio.Channel) -> Any:
        """The call a replica must answer to join (its answer goes to :meth:`_join`)."""
        raise NotImplementedError

    def _join(self, address: str, channel: grpc.aio.Channel, info: Any) -> None:
        """Take ``address`` in with its answer ``info``; ValueError when the pool must refuse it
        (e.g. another vocabulary). The base records the channel and a fresh tracker."""
        self._channels[address] = channel
        self._trackers[address] = ContextTracker()
        self.addresses.append(address)

    def _leave(self, address: str) -> None:
        """``address`` is no longer found (already out of ``addresses``): forget it (the base drops its tracker)."""
        del self._trackers[address]

    def _report_taken_out(self, address: str, error: BaseException) -> None:
        log.warning(
            f"{self.kind} taken out; its requests move to the others",
            extra={"address": address, "error": repr(error), "live": self.live_count()},
        )

    # -- membership ---------------------------------------------------------------------------------

    @property
    def uses_dns(self) -> bool:
        return any(self._dns)

    def live(self) -> list[str]:
        """The joined replicas that are not taken out, in join order."""
        return [a for a in self.addresses if a not in self._down]

    def live_count(self) -> int:
        """How many replicas are in service (a hook for health and metrics)."""
        return len(self.live())

    def is_live(self, address: str) -> bool:
        return address in self._channels and address not in self._down

    def tracker(self, address: str) -> ContextTracker:
        return self._trackers[address]

    async def discover(self) -> None:
        """Look the targets up and introduce every address, all at once, each for at most
        ``join_seconds``. Those that answer join; the others stay pending and join in the background
        when they answer (start-up never waits for a replica that is down). Raises ValueError for a
        replica the pool refuses (a configuration error, e.g. another vocabulary)."""
        self.stalls.start()
        try:
            self._tls_names = await resolve_targets(self.targets, self._dns)
        except OSError as exc:
            self._tls_names = {}
            log.warning(
                f"{self.kind} lookup failed; trying again in the background",
                extra={"targets": self.targets, "error": repr(exc)},
            )
        addresses = list(self._tls_names)
        self._resolved = bool(addresses)
        if self.uses_dns:
            log.info(f"{self.kind}s resolved", extra={"targets": self.targets, "addresses": addresses})
        joined = await self._try_join([a for a in addresses if a not in self._channels], strict=True)
        self.pending = [a for a in addresses if a not in self._channels]
        if self.pending or not addresses:
            log.warning(
                f"{self.kind}s not answering yet; they join when they do",
                extra={"pending": self.pending or self.targets, "joined": joined},
            )
        self._ensure_background()

    def _ensure_background(self) -> None:
        """Run the background lookups while there is something to find: ``dns:`` targets (every
        ``refresh_seconds``), pending addresses or a name with no address yet (every ``probe_seconds``)."""
        needed = (self.uses_dns and self.refresh_seconds > 0) or self.pending or not self._resolved
        if needed and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _try_join(self, addresses: Sequence[str], strict: bool) -> list[str]:
        """Introduce ``addresses`` concurrently (each for at most ``join_seconds``; an address that
        refuses connections fails at once); those that answer and are accepted join, in the order
        given. ``strict``: a refusal raises ValueError (otherwise it is logged and the address stays out)."""
        channels = [self.auth.aio_channel(a, CHANNEL_OPTIONS, tls_name=self._tls_names.get(a, "")) for a in addresses]
        answers = await asyncio.gather(*(self._introduce(ch) for ch in channels), return_exceptions=True)
        joined: list[str] = []
        refused: ValueError | None = None
        for address, channel, info in zip(addresses, channels, answers, strict=True):
            error: BaseException | None = info if isinstance(info, BaseException) else None
            if error is None:
                try:
                    self._join(address, channel, info)
                    joined.append(address)
                    continue
                except ValueError as exc:
                    error = refused = exc
            await channel.close()
            if not isinstance(error, grpc.aio.AioRpcError | ValueError):
                raise error
            # a replica still down is retried every probe_seconds: only the first try is worth a log line
            level = logging.WARNING if isinstance(error, ValueError) else logging.INFO if strict else logging.DEBUG
            log.log(level, f"{self.kind} not joined (yet)", extra={"address": address, "error": repr(error)})
        if strict and refused is not None:
            raise refused
        return joined

    async def _refresh_forever(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            incomplete = bool(self.pending) or not self._resolved
            if not incomplete and not (self.uses_dns and self.refresh_seconds > 0):
                break  # every plain address joined: nothing left to look for
            await asyncio.sleep(
                self.probe_seconds if incomplete else max(0.0, self.refresh_seconds - (loop.time() - last))
            )
            last = loop.time()
            try:
                await self.refresh()
            except Exception:  # the next round tries again; the replicas in use stay
                log.exception(f"{self.kind} refresh failed")
        self._refresher = None

    async def refresh(self) -> None:
        """Look the targets up again: new addresses join once they answer and are accepted,
        addresses no longer found leave (their requests move to other replicas, which rebuild the
        caches through the context protocol). A failed or empty lookup keeps the current replicas."""
        try:
            names = await resolve_targets(self.targets, self._dns)
        except OSError as exc:
            log.warning(f"{self.kind} lookup failed; keeping the current ones", extra={"error": repr(exc)})
            return
        if not names:
            log.warning(
                f"{self.kind} lookup found no address; keeping the current ones", extra={"targets": self.targets}
            )
            return
        self._tls_names = names
        found = list(names)
        self._resolved = True
        joined = await self._try_join([a for a in found if a not in self._channels], strict=False)
        self.pending = [a for a in found if a not in self._channels]
        gone = [a for a in self.addresses if a not in found]
        self.addresses = [a for a in self.addresses if a not in gone]
        closing = [self._channels.pop(a) for a in gone]
        for address in gone:
            self._leave(address)
            self._down.forget(address)
        if joined or gone:
            log.info(f"{self.kind}s changed", extra={"added": joined, "removed": gone, "replicas": self.addresses})
            if self.on_change is not None:
                self.on_change()
        for channel in closing:  # calls in flight on a removed replica may finish
            await channel.close(grace=self.timeout)

    def take_out(self, address: str, error: BaseException) -> None:
        """Stop sending work to ``address`` until a health probe finds it SERVING again."""
        if address in self._down or address not in self._channels:
            return
        self._down.take_out(address, self._channels[address])
        self._report_taken_out(address, error)
        if self.on_change is not None:
            self.on_change()

    def _back(self, address: str) -> None:
        # it may have restarted: assume it knows no context (a kept one costs a cache-miss round)
        self._trackers[address].reset()
        log.info(f"{self.kind} back in service", extra={"address": address, "live": self.live_count()})
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
