"""The request manager's start-up steps that keep no state of their own (its application object,
:class:`~specinfer.request_manager.app.RequestManagerApp`, runs them): waiting for the first verifier
replica, the KV budgets and API limits from what the verifier and the workers report, the SSM set that
grows as workers join, and the health of speculation."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

from specinfer import wire
from specinfer.core import ExpansionConfig
from specinfer.core.drafts import merged_tree_nodes
from specinfer.core.kv_budget import KVBudget
from specinfer.core.vocab_map import SHARED_VOCABULARY
from specinfer.request_manager.api.admission import ApiLimits
from specinfer.request_manager.cluster.remote import Verifiers
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.scheduling.adaptive import planner_config, start_planner
from specinfer.request_manager.scheduling.scheduler import Scheduler
from specinfer.request_manager.state.lifecycle import Requests
from specinfer.serving.scheduler_metrics import SchedulerMetrics
from specinfer.serving.server import Service
from specinfer.v1 import internal_pb2

log = logging.getLogger("specinfer.request_manager")

# health service name saying whether speculation runs at full strength (see report_speculation)
SPECULATION_HEALTH = "specinfer.request_manager.Speculation"


class StartUpError(Exception):
    """The request manager cannot serve with this configuration (the message says why)."""


VERIFIER_RETRY_MAX_SECONDS = 10.0  # longest wait between start-up checks for a verifier replica


async def wait_for_verifier(verifiers: Verifiers) -> internal_pb2.LlmInfo:
    """The first verifier replica's GetInfo, once one has joined (replicas that are down, or still
    loading and calibrating their model, do not stop the request manager from starting; they join
    when they answer)."""
    try:
        await verifiers.discover()
        return await verifiers.wait_ready(VERIFIER_RETRY_MAX_SECONDS)
    except (ValueError, PermissionError) as exc:
        raise StartUpError(str(exc)) from None


def worker_kv_budgets(workers: SsmWorkers | None) -> tuple[KVBudget, ...]:
    """The KV budgets every running request holds blocks of: each distinct one the workers reported
    for their SSMs. Each worker's counts, not the smallest per SSM only: when a worker fails, its
    requests move to another, so any one worker may come to hold every running request. (The
    verifier replicas' budgets hold only the requests placed on each: :class:`~specinfer.core.kv_budget.Replicas`.)"""
    if workers is None:
        return ()
    return tuple(
        dict.fromkeys(
            sorted(
                (b for budgets in workers.kv_budgets.values() for b in budgets), key=lambda b: (b.block_size, b.blocks)
            )
        )
    )


def kv_budgets(info: internal_pb2.LlmInfo, workers: SsmWorkers | None) -> tuple[KVBudget, ...]:
    """Every KV budget one request must fit alone (what the API checks a request against): a
    verifier replica's (``info``, the first's: replicas serve the same LLM) and the workers'."""
    verifier = wire.kv_budget_from_proto(info)
    return tuple(dict.fromkeys(b for b in (verifier, *worker_kv_budgets(workers)) if b is not None))


def api_limits(
    cfg: RequestManagerConfig,
    info: internal_pb2.LlmInfo,
    workers: SsmWorkers | None,
    ssm_names: tuple[str, ...],
    eos: int | None,
    budgets: tuple[KVBudget, ...],
) -> ApiLimits:
    """What the API accepts while the workers serve ``ssm_names`` (``--default-ssms`` not among them
    are left out until a worker serving them joins) and the scheduler admits by the KV ``budgets``.
    Raises ValueError when the default static tree would exceed ``--max-tree-nodes``."""
    profiles = workers.profiles if workers is not None else {}
    default_ssms = tuple(n for n in cfg.default_ssms if n in ssm_names) or ssm_names
    limits = ApiLimits(
        vocab_size=info.vocab_size,
        max_positions=info.max_positions,
        max_new_tokens=cfg.max_new_tokens,
        default_expansion=cfg.expansion if ssm_names else (),
        default_ssms=default_ssms,
        ssm_names=ssm_names,
        draft_support=cfg.draft_support,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_tree_nodes=cfg.max_tree_nodes,
        llm_name=info.model,
        eos_token_id=eos,
        default_adaptive=cfg.adaptive and (bool(ssm_names) or info.draft_head),
        draft_head=info.draft_head,
        kv_budgets=budgets,
        draft_vocabulary=tuple(
            (n, (profiles[n].vocabulary if n in profiles else "") or SHARED_VOCABULARY) for n in ssm_names
        ),
    )
    if limits.default_expansion:
        nodes = merged_tree_nodes(ExpansionConfig(limits.default_expansion), len(limits.default_ssms))
        if nodes > cfg.max_tree_nodes:
            ssms = len(limits.default_ssms)
            raise ValueError(
                f"the default tree (--expansion with {ssms} SSMs) has up to {nodes} nodes, "
                f"over --max-tree-nodes {cfg.max_tree_nodes}"
            )
    return limits


class SsmSet:
    """The SSMs the request manager speculates with: those its workers serve, in a fixed order that
    only grows (SSM i keeps index i: running requests and the planner refer to SSMs by index). When
    a worker serving a new SSM joins (it was down at start-up, or scaled out), :meth:`grow` adds it to
    the planner, the scheduler and the API limits, in that order, so no request can name an SSM the
    others do not know yet."""

    def __init__(
        self,
        cfg: RequestManagerConfig,
        info: internal_pb2.LlmInfo,
        verifier: Verifiers,
        workers: SsmWorkers,
        scheduler: Scheduler,
        requests: Requests,
        metrics: SchedulerMetrics,
    ) -> None:
        self.cfg, self.info, self.verifier, self.workers = cfg, info, verifier, workers
        self.scheduler, self.requests, self.metrics = scheduler, requests, metrics
        self._lock = asyncio.Lock()

    async def grow(self) -> None:
        async with self._lock:  # joins close together grow once each, in turn
            names = self.scheduler.config.ssm_names
            new = tuple(sorted(set(self.workers.models) - set(names)))
            if not new:
                return
            names += new
            try:
                # the KV budgets stay those known at start-up: workers that join later are not counted
                limits = api_limits(
                    self.cfg,
                    self.info,
                    self.workers,
                    names,
                    self.requests.limits.eos_token_id,
                    self.requests.limits.kv_budgets,
                )
            except ValueError as exc:
                log.error("SSM not added", extra={"ssms": new, "error": str(exc)})
                return
            adaptive = await start_planner(
                self.info,
                self.verifier,
                self.workers,
                names,
                planner_config(self.cfg.max_tree_nodes, self.cfg.speculation_gate),
            )
            self.scheduler.add_ssms(names, adaptive)
            self.requests.limits = limits
            log.info("speculating with more SSMs", extra={"added": new, "ssms": names})


def health_name(serving: bool) -> str:
    return "SERVING" if serving else "NOT_SERVING"


async def report_speculation(service: Service, workers: SsmWorkers, metrics: SchedulerMetrics) -> None:
    """Health of SPECULATION_HEALTH: SERVING while every SSM has a live worker, NOT_SERVING while
    some SSM has none, or no worker has answered yet, and requests decode incrementally (the
    service as a whole stays SERVING);
    the same in the metrics (live workers per SSM)."""
    for name in workers.models:
        metrics.ssm_workers_live.labels(name).set(len(workers.live_workers(name)))
    # no SSM known yet (every worker down since start-up) is degraded too
    degraded = not workers.models or any(not workers.live_workers(name) for name in workers.models)
    status = health_pb2.HealthCheckResponse.NOT_SERVING if degraded else health_pb2.HealthCheckResponse.SERVING
    await service.health.set(SPECULATION_HEALTH, status)
