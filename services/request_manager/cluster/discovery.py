"""DNS discovery of SSM workers: what the ``--ssm-workers`` targets stand for.

A *target* is a plain ``host:port`` address (one worker) or a ``dns:`` name in gRPC's target syntax:
``dns:///ssm-worker:50052`` names one worker per A/AAAA record of ``ssm-worker``. Docker Compose
(``--scale ssm-worker=N``) and Kubernetes headless Services publish one record per replica. gRPC's own
dns resolver would spread calls over them, but a request must keep drafting on the worker that holds
its cache, so the request manager resolves the name itself and keeps one channel per address (see
:class:`.worker_pool.WorkerPool`), looking the names up again every ``DNS_REFRESH_SECONDS``.

*TLS name* of an address: the name its server's certificate must carry. A plain ``host:port`` is checked
against its own host (gRPC's default); an address a ``dns:`` name resolved to is dialled by IP but checked
against the name looked up, since no certificate can list the addresses replicas will get (the deployments'
certificates name ``ssm-worker``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass

DNS_REFRESH_SECONDS = 30.0  # how often the worker pool re-resolves its dns: targets


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
                raise ValueError(
                    f"SSM worker target {target!r}: a DNS server (authority) is not supported; write dns:///host:port"
                )
        host, sep, port = rest.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [IPv6 literal]
        if not sep or not host or not port.isdigit():
            raise ValueError(f"SSM worker target {target!r}: expected dns:///host:port")
        return DnsTarget(host, int(port))

    async def resolve(self) -> list[str]:
        """Every address of ``host`` (A and AAAA records), sorted, as ``ip:port`` or ``[ip]:port``."""
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return sorted(
            {
                f"[{addr[0]}]:{self.port}" if family == socket.AF_INET6 else f"{addr[0]}:{self.port}"
                for family, _, _, _, addr in infos
            }
        )


async def resolve_targets(targets: Sequence[str], parsed: Sequence[DnsTarget | None]) -> dict[str, str]:
    """The worker addresses ``targets`` stand for now, in order (plain addresses as given, duplicates once),
    each with its TLS name (module docstring; "" for a plain address: its own host), given each target's
    :meth:`DnsTarget.parse`. Raises OSError when a lookup fails (e.g. a name with no address yet)."""
    out: dict[str, str] = {}
    for target, dns in zip(targets, parsed, strict=True):
        found = await dns.resolve() if dns is not None else [target]
        for address in found:
            out.setdefault(address, dns.host if dns is not None else "")
    return out
