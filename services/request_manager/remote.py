"""gRPC clients of the SSM workers and the LLM verifier, with the context protocol.

Each callee caches a request's context (committed tokens without the tree root). The request
manager remembers how much of it each callee already has and sends only the rest; a callee that
lost it (restart, moved request) answers ``cache_miss`` and gets the whole context once more.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specinfer import wire
from specinfer.core import DraftTree, ExpansionConfig, SamplingParams
from specinfer.v1 import internal_pb2, internal_pb2_grpc


@dataclass(frozen=True)
class DraftCall:
    """One request's share of a Speculate call."""

    request_id: str
    context: Sequence[int]
    root_token: int
    expansion: ExpansionConfig
    sampling: SamplingParams
    draft_support: int
    seed: int
    step: int
    stream: int


@dataclass(frozen=True)
class VerifyCall:
    request_id: str
    context: Sequence[int]
    draft: DraftTree
    sampling: SamplingParams
    seed: int
    step: int


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided: accepted tree tokens and the bonus token."""

    accepted_tokens: tuple[int, ...]
    bonus_token: int

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return self.accepted_tokens + (self.bonus_token,)


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


class SsmWorkers:
    """The SSM worker replicas. A request sticks to one worker per SSM (its KV cache lives there)."""

    def __init__(self, addresses: Sequence[str], timeout: float) -> None:
        if not addresses:
            raise ValueError("no SSM worker addresses")
        self.addresses = list(addresses)
        self.timeout = timeout
        self._channels = {a: grpc.aio.insecure_channel(a) for a in self.addresses}
        self._stubs = {a: internal_pb2_grpc.SsmWorkerStub(ch) for a, ch in self._channels.items()}
        self._trackers = {a: _ContextTracker() for a in self.addresses}
        self.models: dict[str, list[str]] = {}  # SSM name -> addresses serving it
        self.vocab_size: int | None = None

    async def discover(self) -> None:
        """Ask every worker which SSMs it serves."""
        self.models.clear()
        for address, stub in self._stubs.items():
            info = await stub.ListModels(internal_pb2.ListModelsRequest(), timeout=self.timeout, wait_for_ready=True)
            if self.vocab_size is not None and info.vocab_size != self.vocab_size:
                raise ValueError(f"SSM worker {address} has vocabulary {info.vocab_size}, others {self.vocab_size}")
            self.vocab_size = info.vocab_size
            for name in info.models:
                self.models.setdefault(name, []).append(address)

    def worker_for(self, request_id: str, ssm: str) -> str:
        """The worker that drafts ``request_id`` with ``ssm``: stable hashing over the workers
        serving it, so a request keeps hitting the worker that holds its cache."""
        serving = self.models[ssm]
        return serving[zlib.crc32(f"{request_id}/{ssm}".encode()) % len(serving)]

    async def speculate(self, ssm: str, calls: Sequence[DraftCall]) -> dict[str, DraftTree]:
        by_worker: dict[str, list[DraftCall]] = {}
        for c in calls:
            by_worker.setdefault(self.worker_for(c.request_id, ssm), []).append(c)
        parts = await asyncio.gather(*(self._speculate_on(a, ssm, cs) for a, cs in by_worker.items()))
        return {rid: tree for part in parts for rid, tree in part.items()}

    async def _speculate_on(self, address: str, ssm: str, calls: Sequence[DraftCall]) -> dict[str, DraftTree]:
        stub = self._stubs[address]

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
            response = await stub.Speculate(request, timeout=self.timeout)
            return response.results

        results = await _call_with_context(send, calls, self._trackers[address])
        return {rid: wire.draft_from_proto(r.tree) for rid, r in results.items()}

    async def release(self, request_ids: Sequence[str]) -> None:
        for address, stub in self._stubs.items():
            ids = [r for r in request_ids if r in self._trackers[address]]
            for r in ids:
                self._trackers[address].forget(r)
            if ids:
                await stub.Release(internal_pb2.ReleaseRequest(request_ids=ids), timeout=self.timeout)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class Verifier:
    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = internal_pb2_grpc.LlmVerifierStub(self._channel)
        self._tracker = _ContextTracker()

    async def info(self) -> internal_pb2.LlmInfo:
        return await self._stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=self.timeout, wait_for_ready=True)

    async def verify(self, calls: Sequence[VerifyCall]) -> dict[str, Verdict]:
        async def send(pending, contexts):
            request = internal_pb2.VerifyRequest()
            for c, ctx in zip(pending, contexts, strict=True):
                request.items.add(context=ctx, tree=wire.draft_to_proto(c.draft), sampling=wire.sampling_to_proto(c.sampling), seed=c.seed, step=c.step)
            response = await self._stub.Verify(request, timeout=self.timeout)
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
            await self._stub.Release(internal_pb2.ReleaseRequest(request_ids=list(request_ids)), timeout=self.timeout)

    async def close(self) -> None:
        await self._channel.close()
