"""Which request manager drives which request, when several share one Redis: leases and adoption.

Every request is owned by one request manager, named by its ``--owner`` (records and keys:
:mod:`.redis_layout`). Terms:

* *lease*: a Redis key per owner holding the token of the process that holds it, with a TTL of
  ``--lease-seconds`` (L); the holder renews it every L/3 (:class:`Lease`, :class:`Ownership`). A
  request manager serves new requests, and adopts others' requests, only while it holds its lease.
* *incarnation*: one process of an owner; each has its own random lease token. The scheduler's writes
  are fenced by owner and token (:meth:`.store.RequestStore.append_tokens`), so only the incarnation
  that last claimed a request can commit to it.
* *adoption*: every L/2 each request manager looks for owners with unfinished requests but no lease
  (:meth:`.store.RequestStore.orphaned_owners`) and claims their requests one by one, each in one
  atomic step (:meth:`.lifecycle.Requests.adopt`): of two adopters racing, each request goes to exactly
  one. Adopted requests resume where their committed tokens end, as after a restart; the workers and
  the verifier rebuild their caches from those tokens.

Bound: a killed request manager's lease lapses at most L after its last renewal, and a survivor's next
scan comes at most L/2 later, so its requests resume elsewhere within 1.5 L (plus one scan's Redis
calls); docs/request-managers.md has the measured times.

Two processes with the same ``--owner``: the second waits (its health NOT_SERVING, logging who holds
the lease) until the first stops or its lease lapses, then claims the owner's requests for itself. A
restart needs no wait: a lease token names its process (host and pid), so a process that finds its
owner's lease held by a process of its own host that no longer runs (``specinfer up`` or a container
runtime restarting a killed request manager) releases that lease and takes it at once. A
process that finds its lease taken by another incarnation (it stalled for longer than L) stops serving
new requests, and the scheduler drops each request the other claimed at its next commit (the fence
refuses it), without publishing anything; it serves again once it holds the lease again. A clean
shutdown releases the lease, so that the others adopt at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis.exceptions

from specinfer.request_manager.state.records import validate_id
from specinfer.request_manager.state.store import LeaseReply, RequestStore

if TYPE_CHECKING:
    from specinfer.request_manager.state.lifecycle import Requests

log = logging.getLogger("specinfer.request_manager")

WAIT_LOG_SECONDS = 10.0  # how often a process waiting for its owner's lease says so


def new_token() -> str:
    """A lease token: new for every process, readable in logs (host, pid), unguessable."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(8)}"


def holder_is_gone(holder: str, token: str) -> bool:
    """Whether the process whose lease token is ``holder`` has stopped, as seen by the process holding ``token``
    (another one): it ran on this host and its pid is ours (a restarted container's first process has the pid its
    predecessor had) or runs no process (or a zombie). Tokens of other hosts, or not of :func:`new_token`'s form,
    are never judged gone: only their lease's lapse says so. A host name shared by two hosts that reach the same
    Redis could take over a live lease; the fence (:mod:`.store`) still keeps every request's commits to one."""
    parts, ours = holder.split("/"), token.split("/")
    if len(parts) != 3 or not parts[1].isdigit() or holder == token or parts[0] != ours[0]:
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except OSError:  # no /proc to read: only the lease's lapse tells
        return False
    return state in ("Z", "X")


class Lease:
    """The lease of this process (``token``) over ``owner``, with a TTL of ``seconds``.

    :attr:`held` is this process's own view: true until ``seconds`` after the start of the last
    renewal Redis confirmed (a renewal's TTL starts when Redis runs it, later), so it never outlasts
    the key in Redis, whatever the network or Redis took to answer.
    """

    def __init__(
        self,
        store: RequestStore,
        owner: str,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
        token: str | None = None,
    ) -> None:
        validate_id(owner, "owner")
        if not seconds > 0:
            raise ValueError(f"lease seconds must be positive, got {seconds!r}")
        self.store = store
        self.owner = owner
        self.seconds = seconds
        self.token = token or new_token()  # ``token``: another process's, in tests
        self._clock = clock
        self._valid_until = float("-inf")

    @property
    def held(self) -> bool:
        return self._clock() < self._valid_until

    async def hold(self) -> LeaseReply:
        """Renew the lease, or take it if it is free; what Redis answered."""
        sent = self._clock()
        reply = await self.store.hold_lease(self.owner, self.token, self.seconds)
        self._valid_until = sent + self.seconds if reply.held else float("-inf")
        return reply

    async def acquire(self, force: bool = False) -> None:
        """Hold the lease, waiting while another process holds it (until it releases it or stops renewing).
        ``force``: take it whoever holds it, for a Redis nobody else can reach (the embedded one)."""
        if force:
            sent = self._clock()
            await self.store.take_lease(self.owner, self.token, self.seconds)
            self._valid_until = sent + self.seconds
            return
        said = float("-inf")
        while True:
            try:
                reply = await self.hold()
            except redis.exceptions.RedisError as exc:
                reply = None
                log.warning(
                    "cannot reach Redis to take the ownership lease; retrying",
                    extra={"owner": self.owner, "error": repr(exc)},
                )
            if reply is not None and reply.held:
                if said > float("-inf"):
                    log.info("ownership lease taken after waiting", extra={"owner": self.owner})
                return
            if (
                reply is not None
                and holder_is_gone(reply.holder, self.token)
                and await self._release_gone(reply.holder)
            ):
                continue  # a restart: our predecessor's lease would only lapse after its TTL
            if reply is not None and self._clock() - said >= WAIT_LOG_SECONDS:
                said = self._clock()
                log.warning(
                    "another process holds the ownership lease of this --owner; "
                    "waiting until it stops or its lease lapses",
                    extra={"owner": self.owner, "holder": reply.holder, "lease_seconds": self.seconds},
                )
            await asyncio.sleep(self.seconds / 3)

    async def _release_gone(self, holder: str) -> bool:
        """Release the lease of ``holder``, a stopped process (:func:`holder_is_gone`); False if Redis failed."""
        try:
            released = await self.store.release_lease(self.owner, holder)
        except redis.exceptions.RedisError as exc:
            log.warning("cannot release a stopped process's lease", extra={"owner": self.owner, "error": repr(exc)})
            return False
        if released:
            log.info(
                "ownership lease of a stopped process of this host released",
                extra={"owner": self.owner, "holder": holder},
            )
        return True

    async def release(self) -> None:
        """Give the lease up (on a clean shutdown), if this process still holds it."""
        self._valid_until = float("-inf")
        await self.store.release_lease(self.owner, self.token)


class Ownership:
    """Keeps ``lease`` (renewed every third of its TTL) and adopts the requests of owners whose lease
    lapsed (a scan every half of it) into ``requests``. ``on_change(held)`` runs when the lease is lost
    or held again."""

    def __init__(self, lease: Lease, requests: Requests, on_change: Callable[[bool], object] | None = None) -> None:
        self.lease = lease
        self.requests = requests
        self.on_change = on_change
        self.renew_seconds = lease.seconds / 3
        self.scan_seconds = lease.seconds / 2
        self._held = lease.held  # as last reported (on_change)

    async def run(self) -> None:
        """Renew and scan until cancelled (the lease was acquired before)."""
        self.requests.scheduler.metrics.lease_held.set(1 if self.lease.held else 0)
        await asyncio.gather(self._renew_forever(), self._scan_forever())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                await self.renew()
            except Exception:  # one failed round must not end the renewals
                log.exception("ownership lease renewal failed")

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # nor the scans
                log.exception("adoption scan failed")
            await asyncio.sleep(self.scan_seconds)

    async def renew(self) -> None:
        """One renewal. A lease lost (taken by another incarnation, or unconfirmed for its whole TTL) is
        logged and reported; one held again after it lapsed first claims back what the owner still owns."""
        try:
            reply = await self.lease.hold()
        except redis.exceptions.RedisError as exc:
            reply = None
            log.warning(
                "ownership lease renewal failed",
                extra={"owner": self.lease.owner, "error": repr(exc), "held": self.lease.held},
            )
        held = self.lease.held
        self.requests.scheduler.metrics.lease_held.set(1 if held else 0)
        if reply is not None and reply.held and (reply.taken or not self._held):
            # it had lapsed: another incarnation may have claimed our requests meanwhile, or adopters taken some
            log.warning("ownership lease held again after it lapsed", extra={"owner": self.lease.owner})
            await self.requests.recover()
        if held != self._held:
            self._held = held
            if not held:
                log.error(
                    "ownership lease lost: new requests are refused, "
                    "and requests another replica takes over are dropped here",
                    extra={"owner": self.lease.owner, "holder": reply.holder if reply is not None else ""},
                )
            self._changed(held)

    async def scan(self) -> list[str]:
        """One adoption scan; the IDs adopted."""
        if not self.lease.held:
            return []
        adopted: list[str] = []
        try:
            for owner in await self.requests.store.orphaned_owners(self.lease.owner):
                adopted += await self.requests.adopt(owner)
        except redis.exceptions.RedisError as exc:
            log.warning("adoption scan failed", extra={"error": repr(exc)})
        return adopted

    def _changed(self, held: bool) -> None:
        if self.on_change is not None:
            self.on_change(held)
