"""``python -m specinfer.request_manager`` / ``specinfer-request-manager``: the public API service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.exceptions

from specinfer.checkpoint import eos_token_id, load_tokenizer
from specinfer.core import InvalidArgument
from specinfer.request_manager.adaptive import start_planner
from specinfer.request_manager.chat_template import ChatTemplate
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.http_api import HttpApi
from specinfer.request_manager.http_transport import HttpMetrics, HttpServer
from specinfer.request_manager.lifecycle import Requests
from specinfer.request_manager.ownership import Lease, Ownership
from specinfer.request_manager.redis_server import EmbeddedRedis, RedisStartError, StateDirInUse, connect
from specinfer.request_manager.remote import SsmWorkers, Verifiers
from specinfer.request_manager.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.servicer import SpecInferServicer
from specinfer.request_manager.startup import (
    SPECULATION_HEALTH,
    SsmSet,
    StartUpError,
    api_limits,
    health_name,
    kv_budgets,
    report_speculation,
    wait_for_verifier,
    worker_kv_budgets,
)
from specinfer.request_manager.store import RequestStore
from specinfer.serving.config import check_ports_free
from specinfer.serving.messages import BadMessageInterceptor
from specinfer.serving.metrics import SchedulerMetrics, ServiceMetrics
from specinfer.serving.server import Service, run_service, setup_logging, write_port_file
from specinfer.v1 import api_pb2, api_pb2_grpc

__all__ = ["SPECULATION_HEALTH", "main", "serve"]

log = logging.getLogger("specinfer.request_manager")


async def serve(cfg: RequestManagerConfig) -> int:
    """Run the request manager until SIGTERM/SIGINT. The port opens at once (health NOT_SERVING,
    calls UNAVAILABLE) and serves once the verifier answers and it holds its ownership lease (another
    process with the same --owner makes it wait: :mod:`.ownership`); SSM workers that are down join
    when they come up. Whatever this starts (the embedded Redis, channels, the scheduler, the lease) is
    stopped or released on every way out, a failed start-up included."""
    if cfg.redis_username and not cfg.redis_url:
        raise SystemExit("--redis-username needs --redis-url: the embedded Redis has only its default user")
    async with contextlib.AsyncExitStack() as resources:
        if cfg.redis_url:
            redis_url = cfg.redis_url
        else:
            embedded = EmbeddedRedis(
                cfg.state_dir, appendonly=True, password=cfg.redis_password or None, die_with_parent=True
            )
            resources.enter_context(embedded.owned())
            redis_url = embedded.url
        client = connect(
            redis_url,
            password=cfg.redis_password or None,
            username=cfg.redis_username or None,
            cluster=cfg.redis_cluster,
        )
        resources.push_async_callback(client.aclose)
        store = RequestStore(
            client,
            prefix=cfg.redis_key_prefix,
            finished_ttl_s=cfg.result_ttl_seconds,
            min_replica_acks=cfg.redis_min_replica_acks,
            replica_timeout_s=cfg.redis_replica_timeout_seconds,
        )
        await store.ping()
        lease = Lease(store, cfg.owner, cfg.lease_seconds)
        verifier = Verifiers(cfg.verifiers, cfg.rpc_timeout_seconds, cfg.internal)
        resources.push_async_callback(verifier.close)
        api_name = api_pb2.DESCRIPTOR.services_by_name["SpecInfer"].full_name
        metrics = ServiceMetrics(api_name)
        scheduler_metrics = SchedulerMetrics(metrics.registry)
        servicer = SpecInferServicer()
        service = Service(
            cfg.server,
            [api_name],
            lambda server: api_pb2_grpc.add_SpecInferServicer_to_server(servicer, server),
            credentials=cfg.security.tls.credentials(),
            interceptors=[*cfg.security.interceptors(), BadMessageInterceptor()],
            metrics=metrics,
        )
        http: HttpServer | None = None
        if cfg.http_port:
            chat = ChatTemplate.load(cfg.model_dir) if cfg.model_dir else None
            http = HttpServer(
                HttpApi(servicer, cfg.security, HttpMetrics(metrics.registry), chat).app,
                cfg.host,
                cfg.http_port,
                cfg.security,
            )
            resources.push_async_callback(http.stop)
            http.start()  # answers at once: /health says 503 and calls 503 until start-up is done
            log.info("HTTP API listening", extra={"url": f"{http.scheme}://{cfg.host}:{http.port}/v1"})
            if cfg.http_port_file:
                write_port_file(cfg.http_port_file, http.port)
        running: list[tuple[Scheduler, asyncio.Task]] = []
        owning: list[asyncio.Task] = []  # the lease's renewals and the adoption scans
        reports: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references to tasks

        def report(work: Coroutine[Any, Any, None]) -> None:
            task = asyncio.get_running_loop().create_task(work)
            reports.add(task)
            task.add_done_callback(reports.discard)

        async def start_up() -> None:
            info = await wait_for_verifier(verifier)

            def verifiers_changed() -> None:
                scheduler_metrics.verifier_replicas_live.set(verifier.live_count())

            verifier.on_change = verifiers_changed
            verifiers_changed()
            workers = None
            if cfg.ssm_workers:
                workers = SsmWorkers(
                    cfg.ssm_workers,
                    cfg.rpc_timeout_seconds,
                    cfg.internal,
                    cfg.ssm_failure_seconds,
                    vocab_size=info.vocab_size,
                )
                resources.push_async_callback(workers.close)
                try:
                    await workers.discover()
                except ValueError as exc:
                    raise StartUpError(str(exc)) from None
            ssm_names = tuple(sorted(workers.models)) if workers is not None else ()
            unknown = [n for n in cfg.default_ssms if n not in ssm_names]
            if unknown and (workers is None or not workers.pending):
                raise StartUpError(
                    f"--default-ssms names unknown SSM {unknown[0]!r} (workers serve: {', '.join(ssm_names) or 'none'})"
                )
            eos = eos_token_id(cfg.model_dir) if cfg.model_dir else None
            budgets = kv_budgets(info, workers)
            # with KV budgets the scheduler admits by KV blocks; without, a running request holds a KV
            # slot in the verifier until it finishes: never run more than it has
            max_batch = min(cfg.max_batch, info.max_requests) if info.max_requests and not budgets else cfg.max_batch
            if max_batch < cfg.max_batch:
                log.warning(
                    "batch limited by the verifier's KV cache",
                    extra={"max_batch": max_batch, "configured": cfg.max_batch},
                )
            if budgets:
                log.info(
                    "admitting by KV blocks", extra={"kv_budgets": [f"{b.blocks} x {b.block_size}" for b in budgets]}
                )
            try:
                limits = api_limits(cfg, info, workers, ssm_names, eos, budgets)
            except ValueError as exc:
                raise StartUpError(str(exc)) from None
            adaptive = await start_planner(info, verifier, workers, ssm_names, cfg.max_tree_nodes)
            scheduler_config = SchedulerConfig(
                max_batch,
                cfg.max_queue,
                ssm_names,
                eos,
                cfg.owner,
                lease.token,
                kv_budgets=worker_kv_budgets(workers),
                max_prefill_tokens=cfg.max_prefill_tokens,
            )
            scheduler = Scheduler(scheduler_config, store, workers, verifier, scheduler_metrics, adaptive)
            requests = Requests(
                scheduler, store, limits, load_tokenizer(cfg.model_dir) if cfg.model_dir else None, lease
            )
            await lease.acquire(force=not cfg.redis_url)  # nobody else reaches the embedded Redis
            await requests.recover()
            running.append((scheduler, asyncio.get_running_loop().create_task(scheduler.run())))

            def serving() -> bool:
                # health follows the verifier and the lease: NOT_SERVING while requests cannot be answered (they
                # wait), or while this replica may not take new ones
                return scheduler.verifier_reachable and lease.held

            def verifier_changed(reachable: bool) -> None:
                log.warning(
                    "the verifier answers again" if reachable else "the verifier is unreachable",
                    extra={"health": health_name(serving())},
                )
                report(service.set_serving(serving()))

            def lease_changed(held: bool) -> None:  # ownership logs the change
                report(service.set_serving(serving()))

            owning.append(asyncio.get_running_loop().create_task(Ownership(lease, requests, lease_changed).run()))
            scheduler.on_verifier_change = verifier_changed
            servicer.open(requests)
            if workers is not None:
                ssms = SsmSet(cfg, info, verifier, workers, scheduler, requests, scheduler_metrics)

                async def changed() -> None:
                    await ssms.grow()
                    await report_speculation(service, workers, scheduler_metrics)

                workers.on_change = lambda: report(changed())
                await changed()  # workers may have joined while the planner calibrated

        async def stop_owning() -> None:
            for task in owning:
                task.cancel()
            await asyncio.gather(*owning, return_exceptions=True)
            owning.clear()

        async def on_stop() -> None:
            if http is not None:
                await http.stop()
            await stop_owning()
            for scheduler, loop_task in running:
                scheduler.stop()
                await loop_task
            if lease.held:  # nothing commits any more: the other replicas may adopt at once
                with contextlib.suppress(redis.exceptions.RedisError):
                    await lease.release()

        ready = (lambda port: write_port_file(cfg.port_file, port)) if cfg.port_file else None
        try:
            return await run_service(service, on_stop, ready, start_up=start_up)
        finally:
            await stop_owning()
            for task in list(reports):
                task.cancel()
            for scheduler, loop_task in running:
                if not loop_task.done():  # a way out that skipped on_stop
                    scheduler.stop()
                    loop_task.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = RequestManagerConfig.parser()
    try:  # a bad setting, found here or when a port binds: one line on stderr, exit status 2
        cfg = RequestManagerConfig.from_namespace(parser.parse_args(argv))
        check_ports_free(
            cfg.host, {"port": cfg.port, "http-port": cfg.http_port, "metrics-port": cfg.server.metrics_port or -1}
        )
        setup_logging(cfg.log_level)
        return asyncio.run(serve(cfg))
    except InvalidArgument as exc:
        return parser.bad_setting(exc)
    except (StartUpError, StateDirInUse, RedisStartError) as exc:
        log.error("cannot start", extra={"error": str(exc)})
        print(f"specinfer-request-manager: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
