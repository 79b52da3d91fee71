"""``python -m specinfer.request_manager`` / ``specinfer-request-manager``: the public API service."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from specinfer.checkpoint import eos_token_id, load_tokenizer
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.redis_server import EmbeddedRedis, connect
from specinfer.request_manager.remote import SsmWorkers, Verifier
from specinfer.request_manager.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.servicer import ApiLimits, SpecInferServicer
from specinfer.request_manager.store import RequestStore
from specinfer.serving.metrics import SchedulerMetrics, ServiceMetrics
from specinfer.serving.server import serve as serve_grpc
from specinfer.serving.server import setup_logging
from specinfer.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger("specinfer.request_manager")


async def serve(cfg: RequestManagerConfig) -> None:
    embedded = None
    if cfg.redis_url:
        redis_url = cfg.redis_url
    else:
        embedded = EmbeddedRedis(cfg.state_dir, appendonly=True, password=cfg.redis_password or None).start()
        redis_url = embedded.url
    client = connect(redis_url, password=cfg.redis_password or None)
    store = RequestStore(client, finished_ttl_s=cfg.result_ttl_seconds)
    await store.ping()
    verifier = Verifier(cfg.verifier, cfg.rpc_timeout_seconds)
    info = await verifier.info()
    workers = SsmWorkers(cfg.ssm_workers, cfg.rpc_timeout_seconds) if cfg.ssm_workers else None
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
    scheduler = Scheduler(SchedulerConfig(max_batch, cfg.max_queue, ssm_names, eos, cfg.owner), store, workers, verifier, scheduler_metrics)
    limits = ApiLimits(
        vocab_size=info.vocab_size,
        max_positions=info.max_positions,
        max_new_tokens=cfg.max_new_tokens,
        default_expansion=cfg.expansion if ssm_names else (),
        default_ssms=cfg.default_ssms or ssm_names,
        ssm_names=ssm_names,
        draft_support=cfg.draft_support,
        llm_name=info.model,
        eos_token_id=eos,
    )
    servicer = SpecInferServicer(scheduler, store, limits, load_tokenizer(cfg.model_dir) if cfg.model_dir else None, cfg.owner)
    await servicer.recover()
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

    await serve_grpc(
        cfg.server,
        [api_name],
        lambda server: api_pb2_grpc.add_SpecInferServicer_to_server(servicer, server),
        cfg.port_file or None,
        on_stop,
        metrics,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = RequestManagerConfig.from_args(argv)
    setup_logging(cfg.log_level)
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
