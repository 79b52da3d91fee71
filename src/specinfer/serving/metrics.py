"""Prometheus metrics of a service process, served on their own HTTP port (``/metrics``).

Every service has a :class:`ServiceMetrics`: its own registry (no process-global state, so tests
can run several services in one process), gRPC handling time and outcome by method (a server
interceptor), and the metrics of its role (:class:`specinfer.serving.scheduler_metrics.SchedulerMetrics`
for the request manager, :class:`ModelMetrics` for the SSM workers and the LLM verifier). Metric names start with
``specinfer_``; docs/metrics.md lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specinfer.core.kv_budget import KVBudget, PrefixCacheStats

if TYPE_CHECKING:  # the request manager imports this module and never torch
    from specinfer.models.native.graphs import GraphStats

# seconds: from sub-millisecond RPCs (Release, health) to multi-second verify steps of a big LLM
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
# tokens accepted per verify step: 0 .. a deep tree's depth
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
# tree nodes per verify step, root included
TREE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
# requests per batched call
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# relative errors of a prediction: |predicted - measured| / measured
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


class ServiceMetrics:
    """The registry of one service and the metrics every service has."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.grpc_seconds = Histogram(
            "specinfer_grpc_server_handling_seconds",
            "Time to handle a gRPC call (streams: until the last message), by method and status code",
            ["service", "method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.grpc_started = Counter(
            "specinfer_grpc_server_started",
            "gRPC calls started, by method",
            ["service", "method"],
            registry=self.registry,
        )
        self._http: ThreadingHTTPServer | None = None

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _TimingInterceptor(self)

    def observe_call(self, service: str, method: str, code: grpc.StatusCode | None, seconds: float) -> None:
        name = (code or grpc.StatusCode.OK).name
        self.grpc_seconds.labels(service, method, name).observe(seconds)

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _status(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode | None:
    """The call's final status: what the handler set or aborted with; UNKNOWN for an uncaught error."""
    code = context.code()
    if isinstance(code, int) and not isinstance(code, grpc.StatusCode):  # grpc.aio may hand back the raw integer
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if code is None and error is not None:  # CancelledError: the client went away or its deadline passed
        return grpc.StatusCode.CANCELLED if isinstance(error, asyncio.CancelledError) else grpc.StatusCode.UNKNOWN
    return code


class _TimingInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every call by method: unary and server-streaming handlers, and each exchange of a
    bidirectional stream of one response per request."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    @contextlib.contextmanager
    def _timed(self, service: str, method: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
        """Count the call, and time it to its end with its final status (also when it raises)."""
        metrics = self.metrics
        metrics.grpc_started.labels(service, method).inc()
        started, error = time.perf_counter(), None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            metrics.observe_call(service, method, _status(context, error), time.perf_counter() - started)

    async def intercept_service(
        self, continuation: Callable, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        # "/grpc.health.v1.Health/Check": the gRPC service the call is to (health, reflection or ours), and its method
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                with self._timed(service, method, context):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(request, context):
                with self._timed(service, method, context):
                    async for message in inner_stream(request, context):
                        yield message

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._per_message(service, method, handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler  # other shapes (none of ours) pass through untimed

    def _per_message(self, service: str, method: str, inner: Callable) -> Callable:
        """A bidirectional stream whose every request is answered by one response (LlmVerifier.VerifyStream), each
        exchange counted and timed as a call would be: from its request's arrival to its response."""
        metrics = self.metrics

        async def stream(requests, context):
            arrivals: list[float] = []

            async def arriving():
                async for request in requests:
                    metrics.grpc_started.labels(service, method).inc()
                    arrivals.append(time.perf_counter())
                    yield request

            try:
                async for response in inner(arriving(), context):
                    metrics.observe_call(service, method, grpc.StatusCode.OK, time.perf_counter() - arrivals.pop(0))
                    yield response
            except BaseException as exc:  # the exchange in progress ends with the stream's status
                for at in arrivals:
                    metrics.observe_call(service, method, _status(context, exc), time.perf_counter() - at)
                raise

        return stream


class ModelMetrics:
    """A model service (SSM worker or LLM verifier): batched model calls and their size."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.calls = Counter(
            "specinfer_model_calls", "Batched model calls, by model", ["role", "model"], registry=registry
        )
        self.batch_size = Histogram(
            "specinfer_model_batch_size",
            "Requests per model call",
            ["role", "model"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.tree_nodes = Counter(
            "specinfer_model_tree_nodes",
            "Tree nodes drafted (SSM) or verified (LLM)",
            ["role", "model"],
            registry=registry,
        )
        self.cache_misses = Counter(
            "specinfer_context_cache_misses",
            "Items whose context had to be resent",
            ["role", "model"],
            registry=registry,
        )
        self.call_seconds = Histogram(
            "specinfer_model_call_seconds",
            "Batched model call time",
            ["role", "model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests_held = Gauge(
            "specinfer_requests_held",
            "Requests whose context and KV cache the service holds",
            ["role"],
            registry=registry,
        )
        self.kv_blocks = Gauge(
            "specinfer_kv_blocks",
            "KV blocks of the model's KV cache (contiguous slots: one block each)",
            ["role"],
            registry=registry,
        )
        self.kv_blocks_free = Gauge(
            "specinfer_kv_blocks_free",
            "KV blocks no request holds, after the last model call",
            ["role"],
            registry=registry,
        )
        self.kv_usage = Gauge(
            "specinfer_kv_usage_ratio",
            "Share of the KV blocks requests hold, after the last model call",
            ["role"],
            registry=registry,
        )
        self.prefix_queries = Counter(
            "specinfer_prefix_cache_queries",
            "Context tokens looked up in the prefix cache (a cache lacked them)",
            ["role", "model"],
            registry=registry,
        )
        self.prefix_hits = Counter(
            "specinfer_prefix_cache_hits",
            "Context tokens the prefix cache held: their KV was reused, not computed",
            ["role", "model"],
            registry=registry,
        )
        self._graph_metrics(registry)
        self._prefix_seen: dict[str, PrefixCacheStats] = {}  # each model's totals at the last observation
        self._graphs_seen: dict[str, GraphStats] = {}
        self._children: dict[str, tuple] = {}  # each model's labelled children of the metrics observe() updates
        self.role = role

    def _graph_metrics(self, registry: CollectorRegistry) -> None:
        """The CUDA graphs' counters (:meth:`observe_graphs`)."""
        self.graph_captures = Counter(
            "specinfer_cuda_graph_captures",
            "CUDA graphs captured, by phase: warmup (at start-up) or serving (each one a 0.3-1 s step in the serving "
            "path; a warmed server keeps it at 0)",
            ["role", "model", "phase"],
            registry=registry,
        )
        self.graph_eager_steps = Counter(
            "specinfer_cuda_graph_eager_steps",
            "Steps run without a CUDA graph where graphs are on (longer than --cuda-graph-tokens, past the graph "
            "limit, or after a failed capture)",
            ["role", "model"],
            registry=registry,
        )
        self.graph_warmup_seconds = Gauge(
            "specinfer_cuda_graph_warmup_seconds",
            "Seconds the start-up capture of CUDA graphs took",
            ["role", "model"],
            registry=registry,
        )

    def observe(self, model: str, requests: int, nodes: int, misses: int, seconds: float, held: int) -> None:
        children = self._children.get(model)
        if children is None:  # labels() looks a child up by its label values each time: a few us, every call
            metrics = (self.calls, self.batch_size, self.tree_nodes, self.cache_misses, self.call_seconds)
            children = self._children[model] = tuple(m.labels(self.role, model) for m in metrics)
        calls, batch_size, tree_nodes, cache_misses, call_seconds = children
        calls.inc()
        batch_size.observe(requests)
        tree_nodes.inc(nodes)
        cache_misses.inc(misses)
        call_seconds.observe(seconds)
        self.requests_held.labels(self.role).set(held)

    def observe_prefix_cache(self, model: str, stats: PrefixCacheStats | None) -> None:
        """Count what ``model``'s prefix cache did since the last call (``stats``: its totals; None: it has none)."""
        if stats is None:
            return
        seen = self._prefix_seen.get(model, PrefixCacheStats())
        if model in self._prefix_seen and stats == seen:  # a decode step queries nothing
            return
        self.prefix_queries.labels(self.role, model).inc(stats.queried_tokens - seen.queried_tokens)
        self.prefix_hits.labels(self.role, model).inc(stats.hit_tokens - seen.hit_tokens)
        self._prefix_seen[model] = stats

    def observe_graphs(self, model: str, stats: GraphStats | None) -> None:
        """Count what ``model``'s CUDA graphs did since the last call (``stats``: its totals; None: it has none)."""
        if stats is None:
            return
        seen = self._graphs_seen.get(model)
        labels = (self.role, model)
        self.graph_captures.labels(*labels, "warmup").inc(stats.warmup - (seen.warmup if seen else 0))
        self.graph_captures.labels(*labels, "serving").inc(stats.serving - (seen.serving if seen else 0))
        self.graph_eager_steps.labels(*labels).inc(stats.eager_steps - (seen.eager_steps if seen else 0))
        self.graph_warmup_seconds.labels(*labels).set(stats.warmup_seconds)
        self._graphs_seen[model] = stats

    def observe_kv(self, budget: KVBudget | None, free: int | None) -> None:
        """The KV cache after a model call (nothing without a KV budget: the cache is bounded only by memory)."""
        if budget is None or free is None or budget.blocks == 0:
            return
        self.kv_blocks.labels(self.role).set(budget.blocks)
        self.kv_blocks_free.labels(self.role).set(free)
        self.kv_usage.labels(self.role).set(1.0 - free / budget.blocks)
