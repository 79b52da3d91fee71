"""Adaptive speculation in the request manager: the scheduler's :class:`~specinfer.core.adaptive.AdaptiveSpeculation`
fed with what the remote calls report, and its metrics.

Start: the cost model comes from the tables the verifier (``LlmInfo.verify_costs``) and the SSM
workers (``ListModelsResponse.profiles``) measured at their start-up (:func:`costs_from_reports`);
when the verifier reports none (``--calibrate-tokens 0``), :func:`calibrate_through_calls` times a
few real Verify and Speculate calls on synthetic requests instead. Each SSM's slot prior is the one
its worker reports (from the SSM's tuning file), else the default.

Each iteration the engine core (:mod:`specinfer.core.engine_core`) plans the adaptive requests' trees
and hears the workers' SSM pass times, the verify round trips and each request's outcome;
:class:`PlannerMetrics` publishes what it learned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from specinfer import wire
from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
from specinfer.core.adaptive import AdaptiveSpeculation
from specinfer.core.costs import BUCKETS, CostTable, StepCosts
from specinfer.core.drafter import DrafterKey
from specinfer.core.engine_core import StepReport
from specinfer.core.iteration import DraftSpec, VerifySpec, draft_stream
from specinfer.core.planner import PlannerConfig
from specinfer.core.tree import binary_tree_parents
from specinfer.request_manager.cluster.remote import Verifiers
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.serving.scheduler_metrics import SchedulerMetrics
from specinfer.v1 import internal_pb2

log = logging.getLogger("specinfer.request_manager")

CALIBRATION_SIZES = tuple(
    b for b in BUCKETS if b <= 32
)  # tree nodes of the synthetic verify calls (and requests of the draft calls)
TABLES_EVERY_SECONDS = 1.0  # a step publishes the cost model's tables at most this often (their gauges, PlannerMetrics)
CALIBRATION_CONTEXT = 32  # context tokens of each synthetic request
CALIBRATION_REPEATS = 3  # timed calls per size, after a warm-up call; the median is kept


def costs_from_reports(
    info: internal_pb2.LlmInfo, profiles: Mapping[str, internal_pb2.SsmProfile], ssm_names: Sequence[str]
) -> StepCosts | None:
    """The cost model the services measured at their start-up (SSM i: ``ssm_names[i]``); None when the verifier
    reported no table."""
    verify = wire.cost_table_from_proto(info.verify_costs)
    if verify is None:
        return None
    drafts = {}
    for i, name in enumerate(ssm_names):
        table = wire.cost_table_from_proto(profiles[name].draft_costs) if name in profiles else None
        if table is not None:
            drafts[i] = table
    return StepCosts(verify, info.verify_seconds_per_context_token, drafts)


def priors_from_reports(
    profiles: Mapping[str, internal_pb2.SsmProfile], ssm_names: Sequence[str]
) -> dict[int, tuple[float, ...]]:
    """Each SSM's prior slot acceptance: what its worker reported, else the default."""
    priors = {}
    for i, name in enumerate(ssm_names):
        reported = wire.slot_prior_from_proto(profiles[name].slot_prior) if name in profiles else None
        priors[i] = reported or DEFAULT_SLOT_PRIOR
    return priors


def _synthetic(tag: str, n: int, vocab: int, rng: np.random.Generator) -> tuple[str, list[int], list[int]]:
    """A calibration request: its ID, context and ``n`` tree tokens (root first)."""
    return (
        f"__calibrate-{tag}-{n}",
        rng.integers(0, vocab, size=CALIBRATION_CONTEXT).tolist(),
        rng.integers(0, vocab, size=n).tolist(),
    )


async def calibrate_through_calls(
    verifier: Verifiers, workers: SsmWorkers | None, ssm_names: Sequence[str], vocab: int, costs: StepCosts | None
) -> StepCosts:
    """``costs`` with what is missing timed through real calls: the verify table (binary trees of
    :data:`CALIBRATION_SIZES` nodes) and the draft table of every SSM without one (one pass over n
    roots, as the worker reports it). The synthetic requests are released afterwards."""
    rng = np.random.default_rng(0)
    greedy = SamplingParams()
    if costs is None:
        seconds = {}
        for n in CALIBRATION_SIZES:
            rid, context, tokens = _synthetic("verify", n, vocab, rng)
            spec = VerifySpec(rid, context, DraftTree(TokenTree(tuple(tokens), binary_tree_parents(n))), greedy, 0, 0)
            times = []
            for _ in range(CALIBRATION_REPEATS + 1):  # the first call prefills the context
                started = time.perf_counter()
                await verifier.verify([spec])
                times.append(time.perf_counter() - started)
            seconds[n] = statistics.median(times[1:])
            await verifier.release([rid])
            log.info(
                "calibrating", extra={"step": f"verify: {n} tokens {seconds[n] * 1e3:.1f} ms (through Verify calls)"}
            )
        costs = StepCosts(CostTable(seconds), 0.0, {})
    for i, name in enumerate(ssm_names):
        if i in costs.drafts or workers is None:
            continue
        passes: dict[int, list[float]] = {}
        for n in CALIBRATION_SIZES:
            specs = []
            for k in range(n):
                rid, context, tokens = _synthetic(f"{name}-{k}", n, vocab, rng)
                specs.append(
                    DraftSpec(rid, context, tokens[0], ExpansionConfig((1,)), greedy, 1, 0, 0, draft_stream(i))
                )
            for _ in range(CALIBRATION_REPEATS + 1):
                drafts = await workers.speculate(name, specs)
                for tokens, secs in drafts.passes:
                    passes.setdefault(tokens, []).append(secs)
            await workers.release([s.request_id for s in specs])
        if passes:
            costs.drafts[i] = CostTable({tokens: statistics.median(secs) for tokens, secs in passes.items()})
            log.info(
                "calibrating", extra={"step": f"ssm {name}: {costs.drafts[i].as_dict()} (through Speculate calls)"}
            )
    return costs


def planner_config(max_tree_nodes: int, speculation_gate: bool = True) -> PlannerConfig:
    """The planner's settings when the API allows trees of at most ``max_tree_nodes`` nodes: its trees stay within
    them; ``speculation_gate``: False speculates as planned every step (the gate does not measure)."""
    gate = (
        PlannerConfig.speculation_gate if speculation_gate else replace(PlannerConfig.speculation_gate, measure=False)
    )
    return PlannerConfig(max_nodes=min(PlannerConfig.max_nodes, max_tree_nodes), speculation_gate=gate)


class PlannerMetrics:
    """The metrics of adaptive speculation, whose state the engine core owns: the planned tree sizes,
    predicted and realised accepted tokens, nodes cut, per-position acceptance, each SSM's kept share
    and the cost model's tables."""

    def __init__(self, metrics: SchedulerMetrics, ssm_names: Sequence[str]) -> None:
        self.metrics = metrics
        self.ssm_names = tuple(ssm_names)
        self._source: AdaptiveSpeculation | None = None  # whose totals _published counts
        self._published = (0.0, 0, 0, np.zeros(0))  # totals already counted in the metrics
        self._drafters: dict[str, dict[DrafterKey, int]] = {}  # per-drafter totals already counted, by counter
        self._tables_at = -math.inf  # when the cost model's tables were last published (time.monotonic)

    def step(self, adaptive: AdaptiveSpeculation, report: StepReport) -> None:
        """One engine-core step's planned tree sizes, then :meth:`publish`."""
        for nodes in report.planned_nodes:
            self.metrics.planned_tree_nodes.observe(nodes)
        for predicted, measured in report.verify_predictions:
            if measured > 0:
                self.metrics.cost_model_verify_error.observe(abs(predicted - measured) / measured)
        if report.step_prediction is not None and report.step_prediction[1] > 0:
            predicted, measured = report.step_prediction
            self.metrics.cost_model_step_error.observe(abs(predicted - measured) / measured)
        self.publish(adaptive, tables=time.monotonic() - self._tables_at >= TABLES_EVERY_SECONDS)

    def publish(self, adaptive: AdaptiveSpeculation, tables: bool = True) -> None:
        """Bring the metrics up to date: prediction and acceptance counters, and (``tables``) the cost model's
        tables, which a step publishes at most every :data:`TABLES_EVERY_SECONDS` (a gauge per table entry: a tenth of
        a millisecond of the manager's host work a step, where one-token steps take a few)."""
        m, totals = self.metrics, adaptive.totals
        if adaptive is not self._source:  # a new planner (SSMs joined): its totals start at zero
            self._source, self._published = adaptive, (0.0, 0, 0, np.zeros_like(totals.position_accepted))
            self._drafters = {}
        for name, counts, counter in (
            ("proposed", totals.drafter_proposed, m.drafter_proposed_tokens),
            ("accepted", totals.drafter_accepted, m.drafter_accepted_tokens),
            ("steps", totals.drafter_steps, m.drafter_steps),
        ):
            seen = self._drafters.setdefault(name, {})
            for drafter, count in counts.items():
                if count > seen.get(drafter, 0):
                    counter.labels(self._name(drafter)).inc(count - seen.get(drafter, 0))
                seen[drafter] = count
        predicted, accepted, cut, positions = self._published
        m.predicted_accepted_tokens.inc(max(0.0, totals.predicted_accepted - predicted))
        m.realised_accepted_tokens.inc(max(0, totals.accepted - accepted))
        m.cut_draft_nodes.inc(max(0, totals.cut - cut))
        for depth, hits in enumerate(totals.position_accepted - positions, start=1):
            if hits > 0:
                m.position_accepted_tokens.labels(str(depth)).inc(float(hits))
        self._published = (totals.predicted_accepted, totals.accepted, totals.cut, totals.position_accepted.copy())
        for ssm, share in adaptive.kept_share.items():
            m.kept_share.labels(self._name(ssm)).set(share)
        if not tables:
            return
        self._tables_at = time.monotonic()
        described = adaptive.costs.describe()
        for tokens, seconds in described["verify_seconds"].items():
            m.cost_verify_seconds.labels(str(tokens)).set(seconds)
        for ssm, table in described["draft_seconds"].items():
            for tokens, seconds in table.items():
                m.cost_draft_seconds.labels(self._name(ssm), str(tokens)).set(seconds)

    def _name(self, drafter: DrafterKey) -> str:
        """A drafter's metrics label: its name, or an SSM's (by its index)."""
        if isinstance(drafter, str):
            return drafter
        return self.ssm_names[drafter] if 0 <= drafter < len(self.ssm_names) else str(drafter)


async def start_planner(
    info: internal_pb2.LlmInfo,
    verifier: Verifiers,
    workers: SsmWorkers | None,
    ssm_names: Sequence[str],
    planner: PlannerConfig,
) -> AdaptiveSpeculation | None:
    """Adaptive speculation's state from the services' reports, calibrated through calls where they
    report nothing, planning with ``planner`` (:func:`planner_config`). Without SSMs: None, unless the verifier
    drafts with a draft head and reported its costs (its trees are then the only model drafts)."""
    if not ssm_names or workers is None:
        costs = costs_from_reports(info, {}, ()) if info.draft_head else None
        return None if costs is None else AdaptiveSpeculation(costs, planner, {})
    profiles = workers.profiles
    costs = costs_from_reports(info, profiles, ssm_names)
    if costs is None or len(costs.drafts) < len(ssm_names):
        costs = await asyncio.wait_for(
            calibrate_through_calls(verifier, workers, ssm_names, info.vocab_size, costs),
            timeout=max(60.0, verifier.timeout),
        )
    priors = priors_from_reports(profiles, ssm_names)
    log.info(
        "adaptive speculation ready",
        extra={"costs": costs.describe(), "slot_priors": {ssm_names[i]: p for i, p in priors.items()}},
    )
    return AdaptiveSpeculation(costs, planner, priors)
