"""``python -m specinfer.request_manager`` / ``specinfer-request-manager``: the public API service."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from grpc_health.v1 import health_pb2

from specinfer.checkpoint import eos_token_id, load_tokenizer
from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.drafts import merged_tree_nodes
from specinfer.request_manager.adaptive import start_planner
from specinfer.request_manager.admission import ApiLimits
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.lifecycle import Requests
from specinfer.request_manager.redis_server import EmbeddedRedis, connect
from specinfer.request_manager.remote import SsmWorkers, Verifier
from specinfer.request_manager.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.servicer import SpecInferServicer
from specinfer.request_manager.store import RequestStore
from specinfer.serving.messages import BadMessageInterceptor
from specinfer.serving.metrics import SchedulerMetrics, ServiceMetrics
from specinfer.serving.server import Service, run_service, setup_logging, write_port_file
from specinfer.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger("specinfer.request_manager")

# health service name saying whether speculation runs at full strength (see report_speculation)
SPECULATION_HEALTH = "specinfer.request_manager.Speculation"


async def serve(cfg: RequestManagerConfig) -> None:
    embedded = None
    if cfg.redis_url:
        redis_url = cfg.redis_url
    elif cfg.redis_username:
        raise SystemExit("--redis-username needs --redis-url: the embedded Redis has only its default user")
    else:
        embedded = EmbeddedRedis(cfg.state_dir, appendonly=True, password=cfg.redis_password or None).start()
        redis_url = embedded.url
    client = connect(redis_url, password=cfg.redis_password or None, username=cfg.redis_username or None)
    store = RequestStore(client, finished_ttl_s=cfg.result_ttl_seconds)
    await store.ping()
    verifier = Verifier(cfg.verifier, cfg.rpc_timeout_seconds, cfg.internal)
    info = await verifier.info()
    workers = SsmWorkers(cfg.ssm_workers, cfg.rpc_timeout_seconds, cfg.internal, cfg.ssm_failure_seconds) if cfg.ssm_workers else None
    ssm_names: tuple[str, ...] = ()
    if workers is not None:
        await workers.discover()
        if workers.vocab_size != info.vocab_size:
            raise SystemExit(f"SSM vocabulary {workers.vocab_size} differs from the LLM's {info.vocab_size}")
        ssm_names = tuple(sorted(workers.models))
    unknown = [n for n in cfg.default_ssms if n not in ssm_names]
    if unknown:
        raise SystemExit(f"--default-ssms names unknown SSM {unknown[0]!r} (workers serve: {', '.join(ssm_names) or 'none'})")
    eos = eos_token_id(cfg.model_dir) if cfg.model_dir else None
    # a running request holds a KV slot in the verifier until it finishes: never run more than it has
    max_batch = min(cfg.max_batch, info.max_requests) if info.max_requests else cfg.max_batch
    if max_batch < cfg.max_batch:
        log.warning("batch limited by the verifier's KV cache", extra={"max_batch": max_batch, "configured": cfg.max_batch})
    api_name = api_pb2.DESCRIPTOR.services_by_name["SpecInfer"].full_name
    metrics = ServiceMetrics(api_name)
    scheduler_metrics = SchedulerMetrics(metrics.registry)
    planner = await start_planner(info, verifier, workers, ssm_names, cfg.max_tree_nodes, scheduler_metrics)
    scheduler = Scheduler(SchedulerConfig(max_batch, cfg.max_queue, ssm_names, eos, cfg.owner), store, workers, verifier, scheduler_metrics, planner)
    limits = ApiLimits(
        vocab_size=info.vocab_size,
        max_positions=info.max_positions,
        max_new_tokens=cfg.max_new_tokens,
        default_expansion=cfg.expansion if ssm_names else (),
        default_ssms=cfg.default_ssms or ssm_names,
        ssm_names=ssm_names,
        draft_support=cfg.draft_support,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_tree_nodes=cfg.max_tree_nodes,
        llm_name=info.model,
        eos_token_id=eos,
        default_adaptive=cfg.adaptive and bool(ssm_names),
    )
    if limits.default_expansion:
        nodes = merged_tree_nodes(ExpansionConfig(limits.default_expansion), len(limits.default_ssms))
        if nodes > cfg.max_tree_nodes:
            raise SystemExit(
                f"the default tree (--expansion with {len(limits.default_ssms)} SSMs) has up to {nodes} nodes, over --max-tree-nodes {cfg.max_tree_nodes}"
            )
    requests = Requests(scheduler, store, limits, load_tokenizer(cfg.model_dir) if cfg.model_dir else None, cfg.owner)
    await requests.recover()
    servicer = SpecInferServicer(requests)
    loop_task = asyncio.get_running_loop().create_task(scheduler.run())

    async def on_stop() -> None:
        scheduler.stop()
        await loop_task
        if workers is not None:
            await workers.close()
        await verifier.close()
        await client.aclose()
        if embedded is not None:
            embedded.close()

    service = Service(
        cfg.server,
        [api_name],
        lambda server: api_pb2_grpc.add_SpecInferServicer_to_server(servicer, server),
        credentials=cfg.security.tls.credentials(),
        interceptors=[*cfg.security.interceptors(), BadMessageInterceptor()],
        metrics=metrics,
    )
    if workers is not None:
        reports: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references to tasks

        def on_change() -> None:
            task = asyncio.get_running_loop().create_task(report_speculation(service, workers, scheduler_metrics))
            reports.add(task)
            task.add_done_callback(reports.discard)

        workers.on_change = on_change
        await report_speculation(service, workers, scheduler_metrics)
    ready = (lambda port: write_port_file(cfg.port_file, port)) if cfg.port_file else None
    await run_service(service, on_stop, ready)
    if workers is not None:
        workers.on_change = None


async def report_speculation(service: Service, workers: SsmWorkers, metrics: SchedulerMetrics) -> None:
    """Health of SPECULATION_HEALTH: SERVING while every SSM has a live worker, NOT_SERVING while
    some SSM has none and its requests decode incrementally (the service as a whole stays SERVING);
    the same in the metrics (live workers per SSM)."""
    for name in workers.models:
        metrics.ssm_workers_live.labels(name).set(len(workers.live_workers(name)))
    degraded = any(not workers.live_workers(name) for name in workers.models)
    status = health_pb2.HealthCheckResponse.NOT_SERVING if degraded else health_pb2.HealthCheckResponse.SERVING
    await service.health.set(SPECULATION_HEALTH, status)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = RequestManagerConfig.from_args(argv)
    except InvalidArgument as exc:
        print(f"specinfer-request-manager: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
