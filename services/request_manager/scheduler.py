"""The request manager's serving loop: continuous batching over remote SSM workers and verifier.

Each iteration admits waiting requests (up to ``max_batch`` running and, where the verifier and
workers report KV budgets, while their KV blocks hold them: :func:`~specinfer.core.kv_budget.schedule`,
the in-process engine's rule, which may also preempt the newest running ones), drops cancelled or
expired ones, asks every SSM (on its sticky worker) for draft trees, merges them per request,
has the verifier check every tree (one call per verifier replica, concurrently: each request is placed
on one replica, :class:`~specinfer.core.kv_budget.Replicas`), and commits: tokens are persisted in Redis
*before* they are published to the client streams (fenced by this replica's owner ID and lease token:
a request another replica took over is dropped here, see :mod:`.ownership`). The bookkeeping of an iteration (which jobs,
which random streams, what to commit) is :mod:`specinfer.core.iteration`, shared with the
in-process engine; the scheduler drives it through remote calls. Requests with adaptive
speculation get their trees sized each iteration by the :class:`~specinfer.request_manager.adaptive.AdaptivePlanner`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from specinfer.core import DraftTree
from specinfer.core.adaptive import Choice
from specinfer.core.errors import ResourceExhausted
from specinfer.core.iteration import draft_specs, verify_specs
from specinfer.core.kv_budget import KVBudget, StepRows, step_rows
from specinfer.core.planner import PlannerConfig
from specinfer.request_manager.adaptive import AdaptivePlanner
from specinfer.request_manager.live import MOVED, Finish, Live, StreamEvent
from specinfer.request_manager.placement import Placement
from specinfer.request_manager.remote import SsmWorkers, Verdict, Verifiers, VerifierUnavailable
from specinfer.request_manager.store import RequestStore
from specinfer.request_manager.store_errors import OwnershipError, RequestFinishedError, RequestNotFoundError
from specinfer.serving.metrics import SchedulerMetrics

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
    max_prefill_tokens: int = 0  # most step rows admitted in one iteration, past the first (core.kv_budget.schedule; 0: no cap)


# the store's answers to a fenced write: the request is not this replica's to drive any more
NOT_OURS = (OwnershipError, RequestFinishedError, RequestNotFoundError)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        store: RequestStore,
        workers: SsmWorkers | None,
        verifier: Verifiers,
        metrics: SchedulerMetrics,
        planner: AdaptivePlanner | None = None,
    ) -> None:
        """``planner``: sizes the trees of adaptive requests (None: they verify their root alone, as without SSMs)."""
        self.config = config
        self.planner = planner
        self.store = store
        self.workers = workers
        self.verifier = verifier
        self.metrics = metrics
        self._waiting: deque[Live] = deque()
        self._active: dict[str, Live] = {}  # in admission order, oldest first
        self._releases: set[asyncio.Task] = set()  # releases of finished requests still in flight
        self.placement = Placement(verifier, config.verifier_backoff_seconds)
        self._wake = asyncio.Event()
        self._stopping = False
        self.iterations = 0
        self.verifier_failures = 0  # failed verifier calls in a row
        # called with False when a verifier call fails after one that answered, with True when it
        # answers again (the request manager's health follows it)
        self.on_verifier_change: Callable[[bool], object] | None = None

    # -- requests -----------------------------------------------------------------------

    @property
    def verifier_reachable(self) -> bool:
        """False from a failed verifier call until one answers (requests in flight wait meanwhile)."""
        return self.verifier_failures == 0

    def get(self, request_id: str) -> Live | None:
        live = self._active.get(request_id)
        if live is None:
            live = next((w for w in self._waiting if w.request_id == request_id), None)
        return live

    def is_queued(self, request_id: str) -> bool:
        return any(w.request_id == request_id for w in self._waiting)

    def check_room(self) -> None:
        """Raises :class:`QueueFull` when no new request can wait."""
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue {self.config.max_queue})")

    async def submit(self, live: Live) -> None:
        """Enqueue a new (already persisted) request; raises :class:`QueueFull` when the queue is full."""
        self.check_room()
        self._waiting.append(live)
        self.metrics.admitted.inc()
        self.metrics.prompt_tokens.inc(len(live.request.prompt_tokens))
        self._wake.set()

    def resume(self, live: Live) -> bool:
        """Enqueue a request recovered or adopted from Redis (no queue bound: it was admitted before);
        False, and nothing changes, when a request with its ID runs here already."""
        if self.get(live.request_id) is not None:
            return False
        self._waiting.append(live)
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
        return len(self._active), len(self._waiting)

    # -- loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        while not self._stopping:
            if not self._active and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.iteration()
            except Exception:  # one broken iteration must not end the service
                log.exception("iteration failed")
                await asyncio.sleep(self.config.verifier_backoff_seconds)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def iteration(self) -> None:
        await self._admit()
        now = time.monotonic()
        # waiting ones too: a request cancelled or expired in the queue ends now, even while nothing is admitted
        for live in [*self._active.values(), *self._waiting]:
            if live.stop_reason is None and live.deadline is not None and now > live.deadline:
                live.stop_reason = "cancelled"
            if live.finished is not None:  # its finish did not reach Redis: retried before anything else
                await self._finish(live, live.finished.reason)
            elif live.stop_reason is not None:
                await self._finish(live, live.stop_reason)
        m = self.metrics
        m.queue_depth.set(len(self._waiting))
        m.running.set(len(self._active))
        batch = list(self._active.values())
        if not batch:
            if self._waiting:  # nothing fits now: look again shortly (other managers' requests finish, KV frees)
                await asyncio.sleep(IDLE_ADMIT_SECONDS)
            return
        self.iterations += 1
        started = time.perf_counter()
        choices = self.planner.plan(batch) if self.planner is not None else {}
        drafted = await self._speculate(batch, choices)
        if choices:
            drafted = self.planner.select(batch, drafted)
        calls = verify_specs(batch, {rid: [tree for _, tree in pairs] for rid, pairs in drafted.items()})
        speculated = time.perf_counter()
        try:
            round_ = await self.verifier.verify(calls)
        except VerifierUnavailable as exc:
            # no replica answers (down or restarting): requests wait (nothing was committed), caches are
            # rebuilt from the committed tokens when one is back (the contexts go out whole)
            self.verifier_failures += 1
            wait = min(self.config.verifier_backoff_max_seconds, self.config.verifier_backoff_seconds * 2 ** (self.verifier_failures - 1))
            log.warning("verifier call failed; retrying", extra={"error": str(exc), "retry_in_s": wait})
            m.verifier_failures.inc()
            if self.verifier_failures == 1 and self.on_verifier_change is not None:
                self.on_verifier_change(False)
            await asyncio.sleep(wait)
            return
        verified = time.perf_counter()
        if round_.refused:
            self.placement.refused()
        if round_.failed:  # a replica failed: the others' requests go on, its own retry on another replica
            m.verifier_failures.inc()
        if self.verifier_failures:
            log.info("verifier answers again", extra={"failed_calls": self.verifier_failures})
            self.verifier_failures = 0
            if self.on_verifier_change is not None:
                self.on_verifier_change(True)
        verdicts = round_.verdicts
        for address, replica_calls, seconds in round_.timings:
            if self.planner is not None:
                self.planner.observe_verify(replica_calls, seconds)
            m.verifier_requests.labels(address).inc(len(replica_calls))
        for live, call in zip(batch, calls, strict=True):
            # not finished meanwhile (the planner forgot those), and verified (its replica did not fail)
            if live.request_id in self._active and live.request_id in verdicts:
                verdict = verdicts[live.request_id]
                if self.planner is not None:
                    self.planner.observe_step(live.request_id, drafted[live.request_id], verdict.accepted_tokens)
                await self._commit(live, call.draft, verdict)
        m.iterations.inc()
        m.batch_size.observe(len(batch))
        m.speculate_seconds.observe(speculated - started)
        m.verify_seconds.observe(verified - speculated)
        m.iteration_seconds.observe(time.perf_counter() - started)
        if self.planner is not None:
            self.planner.end_iteration(time.perf_counter() - started, verified - speculated)

    async def _admit(self) -> None:
        """Preempt and admit for this iteration (:func:`~specinfer.core.kv_budget.schedule`, as the
        in-process engine does). A preempted request's caches are released on the verifier and the
        workers and it waits at the head of the queue with its output (its stream pauses);
        re-admitted, its whole context goes out again and the caches are rebuilt from it."""
        running = [(rid, self._step_rows(live)) for rid, live in self._active.items()]
        waiting = [(live.request_id, self._step_rows(live)) for live in self._waiting]
        committed = {live.request_id: len(live.committed) for live in (*self._waiting, *self._active.values())}
        cfg = self.config
        placed = await self.placement.plan(running, waiting, committed, cfg.kv_budgets, cfg.max_batch, cfg.max_prefill_tokens)
        if placed is None:
            return  # no verifier to place requests on (the iteration waits for one: VerifierUnavailable), or stepping back
        plan, replicas, before = placed
        back = [self._active.pop(rid) for rid in plan.preempted]
        if back:
            self._waiting.extendleft(reversed(back))
            self.metrics.preemptions.inc(len(back))
            log.info("preempted for lack of KV blocks", extra={"request_ids": list(plan.preempted), "kv_blocks_used": list(plan.blocks_used)})
            if self.planner is not None:
                for live in back:
                    self.planner.forget(live.request_id)
            await self._release(plan.preempted)
        for rid in plan.admitted:
            live = self._waiting.popleft()  # schedule admits a prefix of the queue
            assert live.request_id == rid
            self._active[rid] = live
        moved = [rid for rid, r in plan.placement.items() if rid in self.verifier.placement and before.get(rid) != r]
        if moved:  # their replica has no room for them now: their caches go, and are rebuilt on the new one
            await self.verifier.release(moved)
        self.verifier.place({rid: replicas[r] for rid, r in plan.placement.items()})
        if self.config.kv_budgets:  # the blocks of requests that finished are free only once their release is through
            await asyncio.gather(*self._releases)

    def _step_rows(self, live: Live) -> StepRows:
        # adaptive trees obey the planner's limits (it may come later, when SSMs join); without one they verify the root alone
        limits = self.planner.config if self.planner is not None else ROOT_ONLY
        return step_rows(live.request, len(live.committed), len(self.config.ssm_names), limits)

    async def _speculate(self, batch: Sequence[Live], choices: Mapping[str, Choice]) -> dict[str, list[tuple[int, DraftTree]]]:
        """Every SSM drafts for the requests that name it (static) or that the plan gave it
        (adaptive): their (SSM index, tree) pairs by request ID, in SSM order."""
        drafted: dict[str, list[tuple[int, DraftTree]]] = {lv.request_id: [] for lv in batch}
        tasks, indices = [], []
        for index, name in enumerate(self.config.ssm_names):
            calls = draft_specs(batch, index, choices)
            if calls and self.workers is not None:
                tasks.append(self.workers.speculate(name, calls))
                indices.append(index)
        for index, result in zip(indices, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
            name = self.config.ssm_names[index]
            if isinstance(result, BaseException):
                # a failed SSM costs speed, not answers: its requests verify smaller trees
                log.warning("speculation failed", extra={"ssm": name, "error": repr(result)})
                self.metrics.ssm_failures.labels(name).inc()
                continue
            if self.planner is not None:
                self.planner.observe_passes(index, result.passes)
            for rid, tree in result.trees.items():
                drafted[rid].append((index, tree))
        return drafted

    async def _commit(self, live: Live, draft: DraftTree, verdict: Verdict) -> None:
        outcome = live.outcome(draft, verdict.accepted_tokens, verdict.bonus_token, self.config.eos_token_id, verdict.prefix_hits)
        delta = ""
        released = live.text.text if live.text is not None else ""
        if live.text is not None:
            delta, stopped = live.text.update(live.output + list(outcome.tokens))
            if stopped:
                outcome = outcome.stopped_at(live.text.stop_cut(live.output, outcome.tokens))
        tokens, stats = outcome.tokens, outcome.stats
        offset = len(live.output)
        # durable before anyone sees it; the offset makes a retried append idempotent
        try:
            appended = await self.store.append_tokens(
                live.request_id, tokens, stats, owner=self.config.owner, offset=offset, lease_token=self.config.lease_token
            )
        except NOT_OURS as exc:
            self._lose(live, exc)
            return
        except BaseException:
            # nothing of the step is committed or published: a later iteration redoes it (the same
            # tokens, appended at the same offset), and releases its text then
            if live.text is not None:
                live.text.text = released
            raise
        if appended.cancel_requested:  # by a replica that does not run it: stopped at the next iteration boundary
            live.stop_reason = live.stop_reason or "cancelled"
        live.commit(outcome)
        m = self.metrics
        m.llm_steps.inc()
        m.generated_tokens.inc(len(tokens))
        m.accepted_tokens.observe(stats.accepted)
        m.tree_size.observe(stats.tree_size)
        if outcome.finish_reason is None:
            live.publish(StreamEvent(offset, tokens, delta))
        else:
            await self._finish(live, outcome.finish_reason, StreamEvent(offset, tokens, delta))

    async def _finish(self, live: Live, reason: str, last: StreamEvent | None = None, error: str = "") -> None:
        """End ``live`` with ``reason``; ``last``: its final step's tokens, published with the finish. When
        Redis does not take the finish, the request stays active with ``finished`` (and ``final``) set, and
        the next iteration calls this again (the first reason stays). A request the store says is not ours
        any more is dropped instead (:meth:`_lose`)."""
        if live.finished is None:
            live.finished = Finish(reason, live.usage(), error)
            self.metrics.requests.labels(reason).inc()
            if self.planner is not None:
                self.planner.forget(live.request_id)
            text = (last.text if last else "") + (live.text.flush(live.output) if live.text is not None and reason != "stop" else "")
            live.final = StreamEvent(last.offset if last else len(live.output), last.tokens if last else (), text, live.finished)
        try:
            await self.store.finish(
                live.request_id, live.finished.reason, live.finished.error or None, owner=self.config.owner, lease_token=self.config.lease_token
            )
        except NOT_OURS as exc:
            self._lose(live, exc)
            return
        self._active.pop(live.request_id, None)
        if live in self._waiting:
            self._waiting.remove(live)
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
        self._active.pop(rid, None)
        if live in self._waiting:
            self._waiting.remove(live)
        if self.planner is not None:
            self.planner.forget(rid)
        self.verifier.forget((rid,))
        if self.workers is not None:
            self.workers.forget((rid,))
        live.moved = True
        live.publish(MOVED)
        self.metrics.taken_over.inc()
        log.warning("request taken over by another replica; dropped here", extra={"request_id": rid, "reason": str(why)})

    async def _release(self, request_ids: Sequence[str]) -> None:
        await self.verifier.release(request_ids)  # a replica that fails the call keeps a cache: only memory
        if self.workers is not None:
            try:
                await self.workers.release(request_ids)
            except grpc.aio.AioRpcError as exc:  # a cache that lingers is only memory; the owner frees it on its own restart
                log.info("release failed", extra={"request_ids": list(request_ids), "code": str(exc.code())})
