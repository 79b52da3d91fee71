"""``specinfer.v1.LlmVerifier``: translates messages (:mod:`specinfer.wire_jobs`) and verifies with
:func:`specinfer.models.verification.verify_trees`; nothing else happens here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable

import grpc

from specinfer import wire, wire_jobs
from specinfer.core import VerifyResult
from specinfer.core.constraints import Grammars
from specinfer.core.costs import StepCosts
from specinfer.core.grammar_states import DraftGrammars
from specinfer.core.iteration import VerifySpec
from specinfer.models.head_drafter import WithHead
from specinfer.models.interface import CausalLM
from specinfer.models.verification import verify_trees
from specinfer.serving.contexts import ContextStore
from specinfer.serving.metrics import ModelMetrics, ServiceMetrics
from specinfer.serving.rpc import rpc_errors
from specinfer.serving.runner import ModelRunner, ModelThread
from specinfer.serving.security import ServerSecurity
from specinfer.serving.socket_calls import SocketServer, proto_handler
from specinfer.v1 import internal_pb2, internal_pb2_grpc

SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["LlmVerifier"].full_name

log = logging.getLogger("specinfer.llm_verifier")


def verify_counting_hits(
    llm: CausalLM, jobs: list[VerifySpec], grammars: DraftGrammars | None
) -> list[tuple[VerifyResult, int]]:
    """:func:`verify_trees`, each verdict with the context tokens the LLM took from its prefix cache
    for that job (read in the model's thread, before another call changes them)."""
    verdicts = verify_trees(llm, jobs, grammars)
    return [(verdict, llm.prefix_hits(job.request_id)) for verdict, job in zip(verdicts, jobs, strict=True)]


class LlmVerifierServicer(internal_pb2_grpc.LlmVerifierServicer):
    """The LLM and the contexts of the requests it verifies."""

    def __init__(
        self,
        name: str,
        llm: CausalLM,
        metrics: ModelMetrics,
        costs: StepCosts | None = None,
        grammars: Grammars | None = None,
        thread: ModelThread | None = None,
    ) -> None:
        """``costs``: the LLM's calibrated verify cost model (:func:`~specinfer.serving.runner.calibrate_verifier`),
        reported by GetInfo; ``grammars``: its tokenizer's, which mask the draft head's trees of constrained
        requests (:class:`~specinfer.core.grammar_states.DraftGrammars`; None: unmasked); ``thread``: the one that
        loaded ``llm``, where its calls run (:class:`~specinfer.serving.runner.ModelThread`; None: a new one)."""
        self.name = name
        self.socket: SocketServer | None = None  # VerifyStream's exchanges over a plain socket, where served
        self.costs = costs
        self.metrics = metrics
        self.vocab_size = llm.vocab_size
        self.runner = ModelRunner(name, llm, thread)  # the thread the model's calls run in (one at a time)
        self._contexts = ContextStore()
        self._grammars = DraftGrammars(grammars) if grammars is not None else None  # the head's, per request
        metrics.observe_graphs(name, llm.graph_stats)  # the start-up warm-up's, before any call

    @property
    def llm(self) -> CausalLM:
        return self.runner.model

    def register(self, server: grpc.aio.Server) -> None:
        internal_pb2_grpc.add_LlmVerifierServicer_to_server(self, server)

    def socket_server(self, security: ServerSecurity, metrics: ServiceMetrics, port: int) -> SocketServer:
        """VerifyStream's exchanges over a plain socket beside the gRPC port (:mod:`specinfer.serving.socket_calls`),
        on ``port`` (0: a free one), which GetInfo reports once it listens."""
        handle = proto_handler(internal_pb2.VerifyRequest, self._verify)
        self.socket = SocketServer(handle, "VerifySocket", security, metrics, port, "socket-port")
        return self.socket

    @rpc_errors
    async def Verify(
        self, request: internal_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.VerifyResponse:
        return await self._verify(request)

    @rpc_errors
    async def VerifyStream(
        self, requests: AsyncIterator[internal_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[internal_pb2.VerifyResponse]:
        """:meth:`Verify` of each request of the stream, in order; the first error ends the stream with its status."""
        async for request in requests:
            yield await self._verify(request)

    async def _verify(self, request: internal_pb2.VerifyRequest) -> internal_pb2.VerifyResponse:
        started = time.monotonic()
        call = self._contexts.admit(
            request.items, self.vocab_size, self.llm.max_positions, wire_jobs.verify_job_from_proto
        )
        try:
            verdicts = await self.runner.call(verify_counting_hits, call.jobs, self._grammars) if call.jobs else []
        except Exception:
            # a call that failed part way may leave its requests' caches half written: they go with their contexts,
            # so that the caller's next call misses and sends the whole contexts, from which they are rebuilt
            await self._forget([job.request_id for job in call.jobs])
            raise
        response = internal_pb2.VerifyResponse(results=call.results(verdicts, wire_jobs.verify_result_to_proto))
        if self.llm.kv_budget is not None:
            response.kv_blocks_free = self.llm.kv_blocks_free or 0
        seconds = time.monotonic() - started
        self.metrics.observe(
            self.name,
            len(call.jobs),
            sum(len(job.draft.tree) for job in call.jobs),
            call.misses,
            seconds,
            len(self._contexts),
        )
        self.metrics.observe_kv(self.llm.kv_budget, self.llm.kv_blocks_free)
        self.metrics.observe_prefix_cache(self.name, self.llm.prefix_cache_stats)
        self.metrics.observe_graphs(self.name, self.llm.graph_stats)
        log.debug("verify", extra={"items": len(call.hits), "misses": call.misses, "seconds": round(seconds, 4)})
        return response

    @rpc_errors
    async def Release(
        self, request: internal_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.ReleaseResponse:
        await self._forget(request.request_ids)
        self.metrics.observe_kv(self.llm.kv_budget, self.llm.kv_blocks_free)
        return internal_pb2.ReleaseResponse()

    async def _forget(self, request_ids: Iterable[str]) -> None:
        """Drop what this verifier holds for ``request_ids``: contexts, caches, the head's grammar states."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self._contexts.forget(rid)
        # the head's grammar states under the runner's lock: its thread uses them
        await self.runner.release(request_ids, None if self._grammars is None else self._grammars.forget)

    @rpc_errors
    async def GetInfo(
        self, request: internal_pb2.LlmInfoRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.LlmInfo:
        llm = self.llm
        # proto3 has no "unset" for uint32: 0 stands for "bounded only by memory"
        block_size, blocks = wire.kv_budget_to_proto(llm.kv_budget)
        info = internal_pb2.LlmInfo(
            model=self.name,
            vocab_size=llm.vocab_size,
            max_positions=llm.max_positions,
            max_requests=llm.max_requests or 0,
            kv_block_size=block_size,
            kv_blocks=blocks,
            kv_blocks_free=llm.kv_blocks_free or 0,
            draft_head=isinstance(llm, WithHead),
            socket_port=(self.socket.port or 0) if self.socket is not None else 0,
        )
        if self.costs is not None:
            info.verify_costs.extend(wire.cost_points_to_proto(self.costs.verify_table))
            info.verify_seconds_per_context_token = self.costs.per_context
        return info
