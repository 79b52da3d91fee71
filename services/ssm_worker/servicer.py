"""``specinfer.v1.SsmWorker``: translates messages (:mod:`specinfer.wire_jobs`) and drafts with
:func:`specinfer.models.drafting.draft_trees`; nothing else happens here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc

from specinfer import wire, wire_jobs
from specinfer.core import InvalidArgument
from specinfer.core.constraints import Grammars
from specinfer.core.costs import CostTable
from specinfer.core.grammar_states import DraftGrammars
from specinfer.models.drafting import draft_trees
from specinfer.models.interface import CausalLM
from specinfer.serving.contexts import ContextStore
from specinfer.serving.metrics import ModelMetrics, ServiceMetrics
from specinfer.serving.rpc import rpc_errors
from specinfer.serving.runner import ModelRunner, ModelThread
from specinfer.serving.security import ServerSecurity
from specinfer.serving.socket_calls import SocketServer, proto_handler
from specinfer.v1 import internal_pb2, internal_pb2_grpc

SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["SsmWorker"].full_name

log = logging.getLogger("specinfer.ssm_worker")


class SsmWorkerServicer(internal_pb2_grpc.SsmWorkerServicer):
    """One or more named SSMs sharing a vocabulary, and the contexts of the requests they draft for.

    Contexts are kept per request, not per SSM: they are the request's committed tokens
    whichever SSM drafts, and each model rebuilds its own KV cache from them.
    """

    def __init__(
        self,
        ssms: Mapping[str, CausalLM],
        metrics: ModelMetrics,
        draft_costs: Mapping[str, CostTable] | None = None,
        slot_priors: Mapping[str, Sequence[float]] | None = None,
        vocabularies: Mapping[str, str] | None = None,
        grammars: Grammars | None = None,
        threads: Mapping[str, ModelThread] | None = None,
    ) -> None:
        """``draft_costs``: each SSM's calibrated pass seconds (:func:`~specinfer.serving.runner.calibrate_drafters`);
        ``slot_priors``: those of the SSMs with an installed tuning file (:func:`specinfer.tuning.slot_prior`).
        ListModels reports both to the request manager's planner, and ``vocabularies``: how each SSM's drafts
        reach the LLM's token IDs (:func:`specinfer.models.cross_vocab.vocabulary_method`; missing: shared).
        ``grammars``: the LLM tokenizer's (the IDs every SSM here drafts in), which mask the drafts of constrained
        requests (:class:`~specinfer.core.grammar_states.DraftGrammars`; None: their drafts are pruned after
        drafting only, by the request manager). ``threads``: each SSM's, which loaded it and runs its calls
        (:class:`~specinfer.serving.runner.ModelThread`; missing: a new one)."""
        self.metrics = metrics
        self.vocabularies = dict(vocabularies or {})
        self.draft_costs = dict(draft_costs or {})
        self.slot_priors = dict(slot_priors or {})
        if not ssms:
            raise InvalidArgument("ssm", "name at least one SSM checkpoint")
        sizes = {name: m.vocab_size for name, m in ssms.items()}
        if len(set(sizes.values())) > 1:
            raise InvalidArgument("ssm", f"the SSMs' vocabulary sizes differ: {sizes}")
        self.vocab_size = next(iter(sizes.values()))
        self.socket: SocketServer | None = None  # SpeculateStream's exchanges over a plain socket, where served
        self._runners = {name: ModelRunner(name, m, (threads or {}).get(name)) for name, m in ssms.items()}
        for name, m in ssms.items():
            metrics.observe_graphs(name, m.graph_stats)  # the start-up warm-up's, before any call
        self._budgets = {name: m.kv_budget for name, m in ssms.items()}
        self._contexts = ContextStore()
        # per SSM (each runs in its own thread) and per request, as contexts are; None: drafts unmasked
        self._grammars = {name: DraftGrammars(grammars) for name in ssms} if grammars is not None else None

    @property
    def models(self) -> list[str]:
        return list(self._runners)

    def register(self, server: grpc.aio.Server) -> None:
        internal_pb2_grpc.add_SsmWorkerServicer_to_server(self, server)

    def socket_server(self, security: ServerSecurity, metrics: ServiceMetrics, port: int) -> SocketServer:
        """SpeculateStream's exchanges over a plain socket beside the gRPC port
        (:mod:`specinfer.serving.socket_calls`), on ``port`` (0: a free one), which ListModels reports once it
        listens."""
        handle = proto_handler(internal_pb2.SpeculateRequest, self._speculate)
        self.socket = SocketServer(handle, "SpeculateSocket", security, metrics, port, "socket-port")
        return self.socket

    def _runner(self, name: str) -> ModelRunner:
        runner = self._runners.get(name)
        if runner is None:
            raise InvalidArgument("ssm", f"unknown SSM {name!r} (have: {', '.join(self._runners)})")
        return runner

    @rpc_errors
    async def Speculate(
        self, request: internal_pb2.SpeculateRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.SpeculateResponse:
        return await self._speculate(request)

    @rpc_errors
    async def SpeculateStream(
        self, requests: AsyncIterator[internal_pb2.SpeculateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[internal_pb2.SpeculateResponse]:
        """:meth:`Speculate` of each request of the stream, in order; the first error ends the stream with its
        status."""
        async for request in requests:
            yield await self._speculate(request)

    async def _speculate(self, request: internal_pb2.SpeculateRequest) -> internal_pb2.SpeculateResponse:
        started = time.monotonic()
        runner = self._runner(request.ssm)
        call = self._contexts.admit(
            request.items, self.vocab_size, runner.model.max_positions, wire_jobs.draft_job_from_proto
        )
        passes: list[tuple[int, float]] = []  # appended in the model thread, read after it finished
        drafted = (
            await runner.call(
                draft_trees,
                call.jobs,
                lambda tokens, secs: passes.append((tokens, secs)),
                None if self._grammars is None else self._grammars[request.ssm],
            )
            if call.jobs
            else []
        )
        seconds = time.monotonic() - started
        self.metrics.observe(
            request.ssm, len(call.jobs), sum(len(d.tree) for d in drafted), call.misses, seconds, len(self._contexts)
        )
        self.metrics.observe_prefix_cache(request.ssm, runner.model.prefix_cache_stats)
        self.metrics.observe_graphs(request.ssm, runner.model.graph_stats)
        results = call.results(drafted, wire_jobs.speculate_result_to_proto)
        response = internal_pb2.SpeculateResponse(results=results, passes=wire.pass_timings_to_proto(passes))
        log.debug(
            "speculate",
            extra={"ssm": request.ssm, "items": len(call.hits), "misses": call.misses, "seconds": round(seconds, 4)},
        )
        return response

    @rpc_errors
    async def Release(
        self, request: internal_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.ReleaseResponse:
        for rid in request.request_ids:
            self._contexts.forget(rid)
        for name, runner in self._runners.items():  # grammar states under the runner's lock: its thread uses them
            await runner.release(request.request_ids, None if self._grammars is None else self._grammars[name].forget)
        return internal_pb2.ReleaseResponse()

    @rpc_errors
    async def ListModels(
        self, request: internal_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> internal_pb2.ListModelsResponse:
        return internal_pb2.ListModelsResponse(
            models=self.models,
            vocab_size=self.vocab_size,
            profiles=wire.ssm_profiles_to_proto(
                self.models, self.draft_costs, self.slot_priors, self._budgets, self.vocabularies
            ),
            socket_port=(self.socket.port or 0) if self.socket is not None else 0,
        )
