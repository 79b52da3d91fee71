"""The request manager's serving loop: continuous batching over remote SSM workers and verifier.

Each :meth:`Scheduler.iteration` is one iteration of the step loop (docs/architecture.md, "The step
loop"), the in-process engine's too. What is the scheduler's own: admission places the requests on
verifier replicas (:class:`~.placement.Placement`, where the verifier and workers report KV budgets) and
ends cancelled or expired ones; the engine core's executor is :class:`~.executor.RemoteExecutor` (SSMs on
their sticky workers, the verifier replicas); and a verified request's tokens are persisted in Redis
*before* they are published to the client streams (fenced by this replica's owner ID and lease token: a
request another replica took over is dropped here, see :mod:`.state.ownership`), while the next step already
runs on them (:mod:`.appends`). The core owns adaptive
speculation's state; :class:`~.adaptive.PlannerMetrics` publishes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import grpc

from specinfer.core.adaptive import AdaptiveSpeculation
from specinfer.core.admission import Admission
from specinfer.core.constraints import Grammars
from specinfer.core.engine_core import EngineCore
from specinfer.core.errors import ResourceExhausted
from specinfer.core.head_gate import bucket
from specinfer.core.iteration import StepOutcome
from specinfer.core.kv_budget import KVBudget, StepRows, step_rows
from specinfer.core.planner import PlannerConfig
from specinfer.request_manager.cluster.remote import Verifiers, VerifierUnavailable
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.scheduling.adaptive import PlannerMetrics
from specinfer.request_manager.scheduling.appends import Append, Appends
from specinfer.request_manager.scheduling.executor import Backoff, RemoteExecutor
from specinfer.request_manager.scheduling.live import MOVED, Finish, Live, StreamEvent
from specinfer.request_manager.scheduling.placement import Placement
from specinfer.request_manager.state.store import RequestStore
from specinfer.request_manager.state.store_errors import NOT_OURS
from specinfer.serving.scheduler_metrics import SchedulerMetrics

log = logging.getLogger("specinfer.request_manager")
ROOT_ONLY = PlannerConfig(max_nodes=1, max_depth=0)  # the tree limits without a planner: the root alone
IDLE_ADMIT_SECONDS = 0.1  # pause between admission tries while requests wait and none fits


class QueueFull(ResourceExhausted):
    """Admission refused: the waiting queue is at its bound."""


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_batch``: most running requests per iteration; ``max_queue``: most waiting ones;
    ``ssm_names``: the SSMs in a fixed order (SSM i drafts on a request's ``draft_stream(i)``);
    ``kv_budgets``: the KV caches every running request holds blocks of (each worker's SSMs;
    :mod:`specinfer.core.kv_budget`), which requests are admitted and preempted by, together with the
    budget of the verifier replica each is placed on (the verifiers report theirs)."""

    max_batch: int
    max_queue: int
    ssm_names: tuple[str, ...]
    eos_token_id: int | None
    owner: str = "default"
    lease_token: str = ""  # this incarnation's lease token: writes are fenced by it and ``owner`` ("": by owner alone)
    verifier_backoff_seconds: float = 0.5  # first wait after a failed verifier call; doubles per failure in a row
    verifier_backoff_max_seconds: float = 8.0
    kv_budgets: tuple[KVBudget, ...] = ()
    # most step rows admitted in one iteration, past the first (core.kv_budget.schedule; 0: no cap)
    max_prefill_tokens: int = 0
    draft_head: bool = False  # the verifier drafts with a draft head: adaptive requests ask it for their next trees


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        store: RequestStore,
        workers: SsmWorkers | None,
        verifier: Verifiers,
        metrics: SchedulerMetrics,
        adaptive: AdaptiveSpeculation | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``adaptive``: sizes the trees of adaptive requests (None: they verify their root alone, as without SSMs);
        ``grammars``: the LLM tokenizer's, for requests with a constraint (structured outputs)."""
        self.config = config
        self.store = store
        self.workers = workers
        self.verifier = verifier
        self.metrics = metrics
        self._requests: Admission[Live] = Admission()
        self._releases: set[asyncio.Task] = set()  # releases of finished requests still in flight
        self.appends = Appends(store, config.owner, config.lease_token)
        self.placement = Placement(verifier, config.verifier_backoff_seconds)
        backoff = Backoff(config.verifier_backoff_seconds, config.verifier_backoff_max_seconds)
        self.executor = RemoteExecutor(config.ssm_names, workers, verifier, self.placement, metrics, backoff)
        self.core = EngineCore(
            self.executor,
            len(config.ssm_names),
            config.eos_token_id,
            adaptive,
            head=config.draft_head,
            grammars=grammars,
        )
        self.planner_metrics = PlannerMetrics(metrics, config.ssm_names)
        if adaptive is not None:
            self.planner_metrics.publish(adaptive)
        self._wake = asyncio.Event()
        self._stopping = False
        self.iterations = 0

    def add_ssms(self, ssm_names: Sequence[str], adaptive: AdaptiveSpeculation | None) -> None:
        """Speculate with ``ssm_names`` from the next iteration (the old ones first, in their order:
        SSM i keeps index i), planned by ``adaptive`` (built for all of them)."""
        if tuple(ssm_names[: len(self.config.ssm_names)]) != self.config.ssm_names:
            raise ValueError(
                f"SSMs only join after the others: {tuple(ssm_names)} does not extend {self.config.ssm_names}"
            )
        self.config = replace(self.config, ssm_names=tuple(ssm_names))
        self.executor.ssm_names = self.config.ssm_names
        self.core.add_ssms(len(ssm_names), adaptive)
        self.planner_metrics.ssm_names = self.config.ssm_names  # it counts a new planner's totals from zero
        if adaptive is not None:
            self.planner_metrics.publish(adaptive)

    @property
    def on_verifier_change(self) -> Callable[[bool], object] | None:
        """Called with False when a verification round fails after one that answered, with True when one
        answers again (the request manager's health follows it)."""
        return self.executor.on_verifier_change

    @on_verifier_change.setter
    def on_verifier_change(self, callback: Callable[[bool], object] | None) -> None:
        self.executor.on_verifier_change = callback

    # -- requests -----------------------------------------------------------------------

    @property
    def verifier_reachable(self) -> bool:
        """False from a failed verifier call until one answers (requests in flight wait meanwhile)."""
        return self.executor.failures == 0

    def get(self, request_id: str) -> Live | None:
        return self._requests.get(request_id)

    def is_queued(self, request_id: str) -> bool:
        return self._requests.is_queued(request_id)

    def check_room(self) -> None:
        """Raises :class:`QueueFull` when no new request can wait."""
        waiting = len(self._requests.waiting)
        if waiting >= self.config.max_queue:
            raise QueueFull(f"{waiting} requests are waiting (max_queue {self.config.max_queue})")

    async def submit(self, live: Live) -> None:
        """Enqueue a new (already persisted) request; raises :class:`QueueFull` when the queue is full."""
        self.check_room()
        self._requests.enqueue(live)
        self.metrics.admitted.inc()
        self.metrics.prompt_tokens.inc(len(live.request.prompt_tokens))
        self._wake.set()

    def resume(self, live: Live) -> bool:
        """Enqueue a request recovered or adopted from Redis (no queue bound: it was admitted before);
        False, and nothing changes, when a request with its ID runs here already."""
        if self.get(live.request_id) is not None:
            return False
        self._requests.enqueue(live)
        self._wake.set()
        return True

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        live = self.get(request_id)
        if live is None or live.finished is not None:
            return False
        live.stop_reason = live.stop_reason or reason
        self._wake.set()
        return True

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting)"""
        return len(self._requests.running), len(self._requests.waiting)

    # -- loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        while not self._stopping:
            if not self._requests:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.iteration()
            except Exception:  # one broken iteration must not end the service
                log.exception("iteration failed")
                await asyncio.sleep(self.config.verifier_backoff_seconds)
        await self.appends.drain()  # the lease may be released once nothing is in flight

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def iteration(self) -> None:
        await self._admit()
        now = time.monotonic()
        # waiting ones too: a request cancelled or expired in the queue ends now, even while nothing is admitted
        for live in list(self._requests):
            if live.stop_reason is None and live.deadline is not None and now > live.deadline:
                live.stop_reason = "cancelled"
            if live.finished is not None:  # its finish did not reach Redis: retried before anything else
                await self._finish(live, live.finished.reason)
            elif live.stop_reason is not None:
                await self._finish(live, live.stop_reason)
        m = self.metrics
        m.queue_depth.set(len(self._requests.waiting))
        m.running.set(len(self._requests.running))
        batch = self._requests.batch()
        if not batch:
            # nothing fits now: look again shortly (other managers' requests finish, KV frees)
            if self._requests.waiting:
                await asyncio.sleep(IDLE_ADMIT_SECONDS)
            return
        self.iterations += 1
        started = time.perf_counter()
        try:
            report = await self.core.step(batch, self._commit, live=self._requests.running.__contains__)
        except VerifierUnavailable:
            return  # the executor waited its backoff; nothing was committed, the next iteration retries
        for request_id, why in report.verify.rejected.items():
            # its verification fails whenever it is asked, alone: it ends with that error, the others go on
            live = self._requests.get(request_id)
            if live is not None and live.finished is None:
                await self._finish(live, "error", error=why)
        m.iterations.inc()
        m.batch_size.observe(len(batch))
        m.speculate_seconds.observe(report.speculate_seconds)
        m.verify_seconds.observe(report.verify_seconds)
        m.iteration_seconds.observe(time.perf_counter() - started)
        adaptive = self.core.adaptive_built
        if adaptive is not None:
            self.planner_metrics.step(adaptive, report)
        gate = self.core.speculation_gate
        if gate is not None:
            largest = str(1 << bucket(len(batch)))
            for arm, rate in zip(("on", "off"), gate.rates(len(batch)), strict=True):
                m.speculation_gate_rate.labels(largest, arm).set(rate)

    async def _admit(self) -> None:
        """Preempt and admit for this iteration (:func:`~specinfer.core.kv_budget.schedule`, as the
        in-process engine does). A preempted request's caches are released on the verifier and the
        workers and it waits at the head of the queue with its output (its stream pauses);
        re-admitted, its whole context goes out again and the caches are rebuilt from it."""
        running, waiting = self._requests.demand(self._step_rows)
        committed = {live.request_id: live.committed_len for live in self._requests}
        cfg = self.config
        placed = await self.placement.plan(
            running, waiting, committed, cfg.kv_budgets, cfg.max_batch, cfg.max_prefill_tokens
        )
        if placed is None:
            # no verifier to place requests on (the iteration waits for one: VerifierUnavailable), or stepping back
            return
        plan, replicas, before = placed
        back = self._requests.admit(plan)
        if back:
            self.metrics.preemptions.inc(len(back))
            log.info(
                "preempted for lack of KV blocks",
                extra={"request_ids": list(plan.preempted), "kv_blocks_used": list(plan.blocks_used)},
            )
            for live in back:
                self.core.forget(live.request_id)
            await self._release(plan.preempted)
        await self.placement.place(plan, replicas, before)
        if self.config.kv_budgets:  # the blocks of requests that finished are free only once their release is through
            await asyncio.gather(*self._releases)

    def _step_rows(self, live: Live) -> StepRows:
        # adaptive trees obey the planner's limits (it may come later, when SSMs join); without one they verify the
        # root alone
        adaptive = self.core.adaptive_built
        limits = adaptive.config if adaptive is not None else ROOT_ONLY
        return step_rows(live.request, live.committed_len, len(self.config.ssm_names), limits)

    async def _commit(self, live: Live, outcome: StepOutcome) -> None:
        """Commit a verified step to ``live`` in memory, so that the next step builds on it while Redis appends it
        (:mod:`.appends`): its tokens are published once the append returns; a finishing step waits for it."""
        if not await self._settled(live):  # the previous step's append, sent one verification ago
            return
        delta = ""
        released = live.text.text if live.text is not None else ""
        if live.text is not None:
            delta, stopped = live.text.update(live.output + list(outcome.tokens))
            if stopped:
                outcome = outcome.stopped_at(live.text.stop_cut(live.output, outcome.tokens))
        tokens, stats = outcome.tokens, outcome.stats
        offset = len(live.output)
        top = live.request.logprobs
        if top is not None and (outcome.logprobs is None or len(outcome.logprobs) != len(tokens)):
            # a verifier that does not know the field (an older release): the request cannot have what it asked
            if live.text is not None:
                live.text.text = released
            await self._finish(live, "error", error="the LLM verifier returned no logprobs (is it older?)")
            return
        logprobs = outcome.logprobs or ()
        event = StreamEvent(offset, tokens, delta, logprobs=logprobs)
        reason = outcome.finish_reason
        # the offset makes a retried append idempotent; a finishing step's tokens are published with the finish
        self.appends.start(live, Append(tokens, stats, offset, logprobs, top or 0, event if reason is None else None))
        live.commit(outcome)
        m = self.metrics
        m.llm_steps.inc()
        m.generated_tokens.inc(len(tokens))
        m.accepted_tokens.observe(stats.accepted)
        m.tree_size.observe(stats.tree_size)
        if reason is not None:
            await self._finish(live, reason, event)

    async def _settled(self, live: Live) -> bool:
        """Wait for ``live``'s append in flight; False, the request dropped, where the store says it is not ours. Any
        other error is raised: the iteration fails, and the append is retried (:meth:`.appends.Appends.settle`)."""
        try:
            await self.appends.settle(live)
        except NOT_OURS as exc:
            self._lose(live, exc)
            return False
        return True

    async def _finish(self, live: Live, reason: str, last: StreamEvent | None = None, error: str = "") -> None:
        """End ``live`` with ``reason``; ``last``: its final step's tokens, published with the finish. When
        Redis does not take the finish, the request stays active with ``finished`` (and ``final``) set, and
        the next iteration calls this again (the first reason stays). A request the store says is not ours
        any more is dropped instead (:meth:`_lose`)."""
        if live.finished is None:
            live.finished = Finish(reason, live.usage(), error)
            self.metrics.requests.labels(reason).inc()
            self.core.forget(live.request_id)
            text = (last.text if last else "") + (
                live.text.flush(live.output) if live.text is not None and reason != "stop" else ""
            )
            live.final = StreamEvent(
                last.offset if last else len(live.output),
                last.tokens if last else (),
                text,
                live.finished,
                last.logprobs if last else (),
            )
        if not await self._settled(live):  # its tokens are durable before it is finished
            return
        try:
            await self.store.finish(
                live.request_id,
                live.finished.reason,
                live.finished.error or None,
                owner=self.config.owner,
                lease_token=self.config.lease_token,
            )
        except NOT_OURS as exc:
            self._lose(live, exc)
            return
        self._requests.remove(live)
        assert live.final is not None
        live.publish(live.final)
        task = asyncio.get_running_loop().create_task(self._release((live.request_id,)))
        self._releases.add(task)  # referenced until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._releases.discard)

    def _lose(self, live: Live, why: Exception) -> None:
        """Drop a request the store says is not ours any more (another replica adopted it while our lease
        had lapsed, or a later incarnation of our owner claimed it; or it finished or expired meanwhile):
        nothing more of it is committed or published here, its subscribers follow it in Redis. Its caches
        on the workers and the verifier are left alone: its new owner uses them."""
        rid = live.request_id
        self._requests.remove(live)
        self.appends.forget(rid)
        self.core.forget(rid)
        self.verifier.forget((rid,))
        if self.workers is not None:
            self.workers.forget((rid,))
        live.moved = True
        live.publish(MOVED)
        self.metrics.taken_over.inc()
        log.warning(
            "request taken over by another replica; dropped here", extra={"request_id": rid, "reason": str(why)}
        )

    async def _release(self, request_ids: Sequence[str]) -> None:
        await self.verifier.release(request_ids)  # a replica that fails the call keeps a cache: only memory
        if self.workers is not None:
            try:
                await self.workers.release(request_ids)
            except (
                grpc.aio.AioRpcError
            ) as exc:  # a cache that lingers is only memory; the owner frees it on its own restart
                log.info("release failed", extra={"request_ids": list(request_ids), "code": str(exc.code())})
