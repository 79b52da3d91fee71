"""The request manager's application object: its components, its background tasks, and the steps that
start and stop them (``python -m specinfer.request_manager`` runs one:
:func:`specinfer.request_manager.__main__.serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import grpc
import redis.exceptions

from specinfer.checkpoint import eos_token_id, load_tokenizer
from specinfer.core.constraints import grammars_for
from specinfer.core.kv_budget import KVBudget
from specinfer.request_manager.api.chat_template import ChatTemplate
from specinfer.request_manager.api.http_api import HttpApi
from specinfer.request_manager.api.http_transport import HttpMetrics, HttpServer
from specinfer.request_manager.api.servicer import SpecInferServicer
from specinfer.request_manager.cluster.remote import Verifiers
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.scheduling.adaptive import planner_config, start_planner
from specinfer.request_manager.scheduling.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.startup import (
    SsmSet,
    StartUpError,
    api_limits,
    health_name,
    kv_budgets,
    report_speculation,
    wait_for_verifier,
    worker_kv_budgets,
)
from specinfer.request_manager.state.lifecycle import Requests
from specinfer.request_manager.state.ownership import Lease, Ownership
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.request_manager.state.store import RequestStore
from specinfer.serving.messages import BadMessageInterceptor
from specinfer.serving.metrics import ServiceMetrics
from specinfer.serving.scheduler_metrics import SchedulerMetrics
from specinfer.serving.server import Service, run_service, write_port_file
from specinfer.v1 import api_pb2, api_pb2_grpc, internal_pb2

log = logging.getLogger("specinfer.request_manager")


class RequestManagerApp:
    """One request manager process. :meth:`start` opens what serving needs before the verifier answers
    (Redis, the request store, the lease, the verifier clients, the gRPC service and the HTTP API);
    :meth:`run_until_stopped` opens the port (health NOT_SERVING, calls UNAVAILABLE), runs the rest of
    the start-up (:meth:`_start_up`: the workers, the scheduler, the recovered requests, the ownership
    lease) and serves until SIGTERM/SIGINT; :meth:`stop` ends every background task and closes
    whatever :meth:`start` and the start-up opened, on every way out, a failed start-up included."""

    def __init__(self, cfg: RequestManagerConfig) -> None:
        self.cfg = cfg
        self._resources = contextlib.AsyncExitStack()  # closed by stop(), the last opened first
        # every background task (the scheduler's loop, the ownership's renewals and adoption scans, the
        # health reports), referenced until done: the loop keeps only weak references to tasks
        self._tasks: set[asyncio.Task] = set()
        self._scheduler_task: asyncio.Task | None = None
        self._ownership_task: asyncio.Task | None = None
        # opened by start()
        self.store: RequestStore | None = None
        self.lease: Lease | None = None
        self.verifier: Verifiers | None = None
        self.metrics: ServiceMetrics | None = None
        self.scheduler_metrics: SchedulerMetrics | None = None
        self.servicer = SpecInferServicer()
        self.service: Service | None = None
        self.http: HttpServer | None = None
        # built by the start-up, once the verifier answers
        self.workers: SsmWorkers | None = None
        self.scheduler: Scheduler | None = None
        self.requests: Requests | None = None
        self.ssms: SsmSet | None = None

    # -- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        """Open Redis, the store and the verifier clients, and build the gRPC service; start the HTTP
        API, which answers at once (503 until the start-up is done)."""
        cfg = self.cfg
        if cfg.redis_username and not cfg.redis_url:
            raise SystemExit("--redis-username needs --redis-url: the embedded Redis has only its default user")
        await self._open_store()
        self.lease = Lease(self.store, cfg.owner, cfg.lease_seconds)
        self.verifier = Verifiers(cfg.verifiers, cfg.rpc_timeout_seconds, cfg.internal)
        self._resources.push_async_callback(self.verifier.close)
        api_name = api_pb2.DESCRIPTOR.services_by_name["SpecInfer"].full_name
        self.metrics = ServiceMetrics(api_name)
        self.scheduler_metrics = SchedulerMetrics(self.metrics.registry)
        self.service = Service(
            cfg.server,
            [api_name],
            self._register,
            credentials=cfg.security.tls.credentials(),
            interceptors=[*cfg.security.interceptors(), BadMessageInterceptor()],
            metrics=self.metrics,
        )
        if cfg.http_port:
            self._start_http()

    async def run_until_stopped(self) -> int:
        """Serve until SIGTERM/SIGINT (0), after the start-up (:func:`~specinfer.serving.server.run_service`)."""
        ready = self._write_port_file if self.cfg.port_file else None
        return await run_service(self.service, self._on_stop, ready, start_up=self._start_up)

    async def stop(self) -> None:
        """End every background task and close what was opened, the last opened first: the way out of
        every run, after :meth:`_on_stop` (a graceful one) or without it (a failed start-up)."""
        await self._stop_owning()
        if self._scheduler_task is not None and not self._scheduler_task.done():  # a way out that skipped _on_stop
            self.scheduler.stop()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._resources.aclose()

    async def _open_store(self) -> None:
        cfg = self.cfg
        if cfg.redis_url:
            redis_url = cfg.redis_url
        else:
            embedded = EmbeddedRedis(
                cfg.state_dir, appendonly=True, password=cfg.redis_password or None, die_with_parent=True
            )
            self._resources.enter_context(embedded.owned())
            redis_url = embedded.url
        client = connect(
            redis_url,
            password=cfg.redis_password or None,
            username=cfg.redis_username or None,
            cluster=cfg.redis_cluster,
        )
        self._resources.push_async_callback(client.aclose)
        self.store = RequestStore(
            client,
            prefix=cfg.redis_key_prefix,
            finished_ttl_s=cfg.result_ttl_seconds,
            min_replica_acks=cfg.redis_min_replica_acks,
            replica_timeout_s=cfg.redis_replica_timeout_seconds,
        )
        await self.store.ping()

    def _register(self, server: grpc.aio.Server) -> None:
        api_pb2_grpc.add_SpecInferServicer_to_server(self.servicer, server)

    def _start_http(self) -> None:
        cfg = self.cfg
        chat = ChatTemplate.load(cfg.model_dir) if cfg.model_dir else None
        self.http = HttpServer(
            HttpApi(self.servicer, cfg.security, HttpMetrics(self.metrics.registry), chat).app,
            cfg.host,
            cfg.http_port,
            cfg.security,
        )
        self._resources.push_async_callback(self.http.stop)
        self.http.start()  # answers at once: /health says 503 and calls 503 until start-up is done
        log.info("HTTP API listening", extra={"url": f"{self.http.scheme}://{cfg.host}:{self.http.port}/v1"})
        if cfg.http_port_file:
            write_port_file(cfg.http_port_file, self.http.port)

    def _write_port_file(self, port: int) -> None:
        write_port_file(self.cfg.port_file, port)

    async def _on_stop(self) -> None:
        """A graceful shutdown, once the gRPC service has stopped: the HTTP API, the ownership, the
        scheduler's loop (after its iteration), then the lease."""
        if self.http is not None:
            await self.http.stop()
        await self._stop_owning()
        if self._scheduler_task is not None:
            self.scheduler.stop()
            await self._scheduler_task
        if self.lease.held:  # nothing commits any more: the other replicas may adopt at once
            with contextlib.suppress(redis.exceptions.RedisError):
                await self.lease.release()

    async def _stop_owning(self) -> None:
        """End the lease's renewals and the adoption scans."""
        task, self._ownership_task = self._ownership_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the start-up, once the port is open -------------------------------------------------

    async def _start_up(self) -> None:
        """Once the verifier answers: the workers, the API limits, the planner and the scheduler; then
        the lease, the recovered requests, the scheduler's loop and the ownership; the API opens last."""
        cfg = self.cfg
        info = await wait_for_verifier(self.verifier)
        self.verifier.on_change = self._on_verifiers_changed
        self._on_verifiers_changed()
        await self._join_workers(info)
        workers = self.workers
        ssm_names = tuple(sorted(workers.models)) if workers is not None else ()
        unknown = [n for n in cfg.default_ssms if n not in ssm_names]
        if unknown and (workers is None or not workers.pending):
            raise StartUpError(
                f"--default-ssms names unknown SSM {unknown[0]!r} (workers serve: {', '.join(ssm_names) or 'none'})"
            )
        eos = eos_token_id(cfg.model_dir) if cfg.model_dir else None
        budgets = kv_budgets(info, workers)
        max_batch = self._max_batch(info, budgets)
        try:
            limits = api_limits(cfg, info, workers, ssm_names, eos, budgets)
        except ValueError as exc:
            raise StartUpError(str(exc)) from None
        adaptive = await start_planner(
            info, self.verifier, workers, ssm_names, planner_config(cfg.max_tree_nodes, cfg.speculation_gate)
        )
        scheduler_config = SchedulerConfig(
            max_batch,
            cfg.max_queue,
            ssm_names,
            eos,
            cfg.owner,
            self.lease.token,
            kv_budgets=worker_kv_budgets(workers),
            max_prefill_tokens=cfg.max_prefill_tokens,
            draft_head=info.draft_head,
        )
        tokenizer = load_tokenizer(cfg.model_dir) if cfg.model_dir else None
        self.scheduler = Scheduler(
            scheduler_config,
            self.store,
            workers,
            self.verifier,
            self.scheduler_metrics,
            adaptive,
            grammars_for(tokenizer, info.vocab_size, eos),
        )
        self.requests = Requests(self.scheduler, self.store, limits, tokenizer, self.lease)
        await self.lease.acquire(force=not cfg.redis_url)  # nobody else reaches the embedded Redis
        await self.requests.recover()
        self._scheduler_task = self._spawn(self.scheduler.run())
        self._ownership_task = self._spawn(Ownership(self.lease, self.requests, self._on_lease_changed).run())
        self.scheduler.on_verifier_change = self._on_verifier_change
        self.servicer.open(self.requests)
        if workers is not None:
            self.ssms = SsmSet(cfg, info, self.verifier, workers, self.scheduler, self.requests, self.scheduler_metrics)
            workers.on_change = self._on_workers_changed
            await self._workers_changed()  # workers may have joined while the planner calibrated

    async def _join_workers(self, info: internal_pb2.LlmInfo) -> None:
        """The SSM workers' clients (none without ``--ssm-workers``); those that answer join now, the
        others when they come up."""
        cfg = self.cfg
        if not cfg.ssm_workers:
            return
        self.workers = SsmWorkers(
            cfg.ssm_workers,
            cfg.rpc_timeout_seconds,
            cfg.internal,
            cfg.ssm_failure_seconds,
            vocab_size=info.vocab_size,
        )
        self._resources.push_async_callback(self.workers.close)
        try:
            await self.workers.discover()
        except ValueError as exc:
            raise StartUpError(str(exc)) from None

    def _max_batch(self, info: internal_pb2.LlmInfo, budgets: tuple[KVBudget, ...]) -> int:
        """The most requests per iteration. With KV budgets the scheduler admits by KV blocks; without,
        a running request holds a KV slot in the verifier until it finishes: never run more than it has."""
        cfg = self.cfg
        max_batch = min(cfg.max_batch, info.max_requests) if info.max_requests and not budgets else cfg.max_batch
        if max_batch < cfg.max_batch:
            log.warning(
                "batch limited by the verifier's KV cache",
                extra={"max_batch": max_batch, "configured": cfg.max_batch},
            )
        if budgets:
            log.info("admitting by KV blocks", extra={"kv_budgets": [f"{b.blocks} x {b.block_size}" for b in budgets]})
        return max_batch

    # -- what the components report ----------------------------------------------------------

    def _serving(self) -> bool:
        # health follows the verifier and the lease: NOT_SERVING while requests cannot be answered (they
        # wait), or while this replica may not take new ones
        return self.scheduler.verifier_reachable and self.lease.held

    def _on_verifiers_changed(self) -> None:
        self.scheduler_metrics.verifier_replicas_live.set(self.verifier.live_count())

    def _on_verifier_change(self, reachable: bool) -> None:
        log.warning(
            "the verifier answers again" if reachable else "the verifier is unreachable",
            extra={"health": health_name(self._serving())},
        )
        self._spawn(self.service.set_serving(self._serving()))

    def _on_lease_changed(self, held: bool) -> None:  # ownership logs the change
        self._spawn(self.service.set_serving(self._serving()))

    def _on_workers_changed(self) -> None:
        self._spawn(self._workers_changed())

    async def _workers_changed(self) -> None:
        await self.ssms.grow()
        await report_speculation(self.service, self.workers, self.scheduler_metrics)
