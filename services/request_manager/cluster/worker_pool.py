"""The SSM worker replicas in service: which SSMs each serves, and stable hashing of requests onto them.

Membership, discovery and failover are :class:`~.replica_pool.ReplicaPool`'s: a worker *joins* once it
answers ListModels with the pool's vocabulary. A request sticks to one worker per SSM (its KV cache
lives there): stable hashing over the *live* workers serving the SSM, so when one is taken out its
requests move to the others, which rebuild their caches from the full context. With no live worker
for an SSM, its requests draft nothing: verification of the root alone is incremental decoding.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

import grpc

from specinfer import wire
from specinfer.core.kv_budget import KVBudget
from specinfer.serving.security import ClientAuth
from specinfer.v1 import internal_pb2, internal_pb2_grpc

from .discovery import DNS_REFRESH_SECONDS
from .failover import PROBE_SECONDS
from .replica_pool import JOIN_SECONDS, ReplicaPool
from .streamed import SocketFirst, StreamedUnary, stream_calls

log = logging.getLogger("specinfer.request_manager")


class WorkerPool(ReplicaPool):
    """The SSM workers ``targets`` stand for, each with its stub and the SSMs it serves."""

    kind = "SSM worker"

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
        super().__init__(targets, timeout, auth, refresh_seconds, probe_seconds, join_seconds)
        self._stubs: dict[str, internal_pb2_grpc.SsmWorkerStub] = {}
        # each worker's Speculate calls per SSM, over one stream each (a worker's SSMs draft concurrently)
        self._speculate_calls: dict[tuple[str, str], StreamedUnary | SocketFirst] = {}
        self._socket_ports: dict[str, int] = {}  # address -> its socket's port (0: none)
        self._served: dict[str, tuple[str, ...]] = {}  # address -> SSM names
        self.models: dict[str, list[str]] = {}  # SSM name -> addresses serving it
        self.vocab_size: int | None = vocab_size
        # SSM name -> the first profile a worker reported (calibration, slot prior)
        self.profiles: dict[str, internal_pb2.SsmProfile] = {}
        # SSM name -> the KV budgets its workers reported, each worker's SSM cache
        self.kv_budgets: dict[str, set[KVBudget]] = {}

    async def _introduce(self, channel: grpc.aio.Channel) -> internal_pb2.ListModelsResponse:
        return await internal_pb2_grpc.SsmWorkerStub(channel).ListModels(
            internal_pb2.ListModelsRequest(), timeout=self.join_seconds, metadata=self.auth.metadata
        )

    def _join(self, address: str, channel: grpc.aio.Channel, info: internal_pb2.ListModelsResponse) -> None:
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            raise ValueError(
                f"SSM worker {address} has vocabulary {info.vocab_size}; the pool (the LLM) has {self.vocab_size}"
            )
        self.vocab_size = info.vocab_size
        super()._join(address, channel, info)
        self._stubs[address] = internal_pb2_grpc.SsmWorkerStub(channel)
        self._served[address] = tuple(info.models)
        self._socket_ports[address] = info.socket_port
        for profile in info.profiles:
            if profile.model not in self.profiles or not self.profiles[profile.model].draft_costs:
                self.profiles[profile.model] = profile
            budget = wire.kv_budget_from_proto(profile)
            if budget is not None:
                self.kv_budgets.setdefault(profile.model, set()).add(budget)
        self._index()

    def _leave(self, address: str) -> None:
        super()._leave(address)
        del self._stubs[address], self._served[address], self._socket_ports[address]
        for key in [k for k in self._speculate_calls if k[0] == address]:
            self._speculate_calls.pop(key).close()
        self._index()

    def speculate_call(self, address: str, ssm: str) -> StreamedUnary | SocketFirst:
        """The Speculate calls to the worker at ``address`` for ``ssm`` (over one connection of its socket, or one
        stream, opened at the first call)."""
        call = self._speculate_calls.get((address, ssm))
        if call is None:
            stub = self._stubs[address]

            async def ask_port(timeout: float) -> int:
                models = await stub.ListModels(
                    internal_pb2.ListModelsRequest(), timeout=timeout, metadata=self.auth.metadata
                )
                return models.socket_port

            call = self._speculate_calls[(address, ssm)] = stream_calls(
                stub.SpeculateStream,
                stub.Speculate,
                self.auth,
                address,
                self._socket_ports[address],
                internal_pb2.SpeculateResponse,
                ask_port,
                self._tls_names.get(address, ""),
            )
        return call

    def _index(self) -> None:
        self.models = {}
        for address in self.addresses:
            for name in self._served[address]:
                self.models.setdefault(name, []).append(address)

    def _report_taken_out(self, address: str, error: BaseException) -> None:
        left = {name: len(self.live_workers(name)) for name in self.models}
        log.warning(
            "SSM worker taken out; its requests move to the others",
            extra={"address": address, "error": repr(error), "live_workers": self.live_count(), "live_per_ssm": left},
        )
        for name, count in left.items():
            if count == 0:
                log.warning(
                    "no SSM worker left for an SSM: its requests fall back to incremental decoding", extra={"ssm": name}
                )

    def live_workers(self, ssm: str) -> list[str]:
        """The workers serving ``ssm`` that are not taken out."""
        return [a for a in self.models.get(ssm, ()) if a not in self._down]

    def worker_for(self, request_id: str, ssm: str) -> str | None:
        """The worker that drafts ``request_id`` with ``ssm``: stable hashing over the live workers
        serving it, so a request keeps hitting the worker that holds its cache. None: none is live."""
        serving = self.live_workers(ssm)
        if not serving:
            return None
        return serving[zlib.crc32(f"{request_id}/{ssm}".encode()) % len(serving)]
