"""``specinfer.v1.LlmVerifier``: translates messages (:mod:`specinfer.wire`) and verifies with
:func:`specinfer.engine.steps.verify_trees`; nothing else happens here."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc
import torch

from specinfer import wire
from specinfer.engine.steps import verify_trees
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.serving.contexts import ContextStore
from specinfer.serving.metrics import ModelMetrics
from specinfer.serving.rpc import rpc_errors
from specinfer.serving.runner import ModelRunner
from specinfer.v1 import internal_pb2, internal_pb2_grpc

SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["LlmVerifier"].full_name

log = logging.getLogger("specinfer.llm_verifier")


def prefill(llm: CausalLM, contexts: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
    """Bring the caches up to ``(request_id, context)`` without a tree: a forward with no nodes
    computes exactly the context tokens a cache lacks."""
    return llm.forward_tree([TreeForward(rid, context, [], []) for rid, context in contexts])


class LlmVerifierServicer(internal_pb2_grpc.LlmVerifierServicer):
    """The LLM and the contexts of the requests it verifies."""

    def __init__(self, name: str, llm: CausalLM, metrics: ModelMetrics) -> None:
        self.name = name
        self.metrics = metrics
        self.vocab_size = llm.vocab_size
        self._runner = ModelRunner(name, llm)
        self._contexts = ContextStore()

    @property
    def llm(self) -> CausalLM:
        return self._runner.model

    @property
    def runner(self) -> ModelRunner:
        """The thread the model's calls run in (one at a time)."""
        return self._runner

    def register(self, server: grpc.aio.Server) -> None:
        internal_pb2_grpc.add_LlmVerifierServicer_to_server(self, server)

    @rpc_errors
    async def Verify(self, request: internal_pb2.VerifyRequest, context: grpc.aio.ServicerContext) -> internal_pb2.VerifyResponse:
        started = time.monotonic()
        items = list(request.items)
        updates = [wire.context_from_proto(item.context, self.vocab_size, f"items[{i}].context") for i, item in enumerate(items)]
        contexts = self._contexts.resolve_all(updates)
        # every item is validated, misses included, before anything is stored or computed
        limit = self.llm.max_positions
        pairs = enumerate(zip(items, contexts, strict=True))
        jobs = [wire.verify_job_from_proto(item, ctx or [], self.vocab_size, limit, f"items[{i}]") for i, (item, ctx) in pairs]
        self._contexts.store_all(updates, contexts)
        live = [job for job, ctx in zip(jobs, contexts, strict=True) if ctx is not None]
        verdicts = iter(await self._runner.call(verify_trees, live) if live else [])
        response = internal_pb2.VerifyResponse(
            results=[wire.verify_result_to_proto(u.request_id, None if ctx is None else next(verdicts)) for u, ctx in zip(updates, contexts, strict=True)]
        )
        seconds = time.monotonic() - started
        self.metrics.observe(self.name, len(live), sum(len(job.draft.tree) for job in live), len(items) - len(live), seconds, len(self._contexts))
        log.debug("verify", extra={"items": len(items), "misses": len(items) - len(live), "seconds": round(seconds, 4)})
        return response

    @rpc_errors
    async def Prefill(self, request: internal_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> internal_pb2.PrefillResponse:
        updates = [wire.context_from_proto(item.context, self.vocab_size, f"items[{i}].context") for i, item in enumerate(request.items)]
        contexts = self._contexts.resolve_all(updates)
        for i, ctx in enumerate(contexts):
            if ctx is not None:
                wire.check_positions(len(ctx), 0, self.llm.max_positions, f"items[{i}].context.tokens")
        self._contexts.store_all(updates, contexts)
        live = [(u.request_id, ctx) for u, ctx in zip(updates, contexts, strict=True) if ctx is not None]
        if live:
            await self._runner.call(prefill, live)
        return internal_pb2.PrefillResponse(cache_misses=[u.request_id for u, ctx in zip(updates, contexts, strict=True) if ctx is None])

    @rpc_errors
    async def Release(self, request: internal_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> internal_pb2.ReleaseResponse:
        for rid in request.request_ids:
            self._contexts.forget(rid)
        await self._runner.release(request.request_ids)
        return internal_pb2.ReleaseResponse()

    @rpc_errors
    async def GetInfo(self, request: internal_pb2.LlmInfoRequest, context: grpc.aio.ServicerContext) -> internal_pb2.LlmInfo:
        llm = self.llm
        # proto3 has no "unset" for uint32: 0 stands for "bounded only by memory"
        return internal_pb2.LlmInfo(model=self.name, vocab_size=llm.vocab_size, max_positions=llm.max_positions, max_requests=llm.max_requests or 0)
