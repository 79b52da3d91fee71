"""The engine core: one continuous-batching iteration, written once, behind both drivers.

A *driver* keeps the queue of requests and runs iterations over its batch of :class:`Running`
requests: the in-process engine (:class:`specinfer.engine.SpeculativeEngine`) and the request
manager's scheduler. Both hand the batch to :meth:`EngineCore.step`, which runs

    plan -> draft -> select -> verify -> observe -> commit

over an :class:`Executor` (where the models run: in process, or SSM workers and verifier replicas
over gRPC) and the driver's *commit* callback (what committing means: append to the result, or
persist in Redis and publish). Admission and preemption are :func:`admit`, applied to the plan of
:func:`specinfer.core.kv_budget.schedule` (the engine) or of the request manager's placement.

The core owns adaptive speculation's state (:class:`~specinfer.core.adaptive.AdaptiveSpeculation`):
it plans the adaptive requests' trees, cuts them before verification, and feeds the cost and
acceptance models with what each step measured. Drivers only read it (metrics).

The core does no I/O itself. :meth:`EngineCore.step` is a coroutine so that a remote executor can
await its calls; an executor whose methods never suspend (the in-process one) runs it to the end
with :func:`run_to_end`, without an event loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from specinfer.core.adaptive import HEAD_DRAFTER, SUFFIX_DRAFTER, AdaptiveSpeculation, Choice
from specinfer.core.drafts import DraftTree
from specinfer.core.head_gate import HeadGate
from specinfer.core.iteration import (
    DraftSpec,
    HeadDraft,
    Running,
    StepOutcome,
    VerifySpec,
    adaptive_contexts,
    draft_specs,
    select_drafts,
    static_shape,
    verify_shape,
    verify_specs,
)
from specinfer.core.kv_budget import Schedule
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import TokenLogprob
from specinfer.core.suffix import SuffixConfig, TokenHistory

# Suffix drafts: matches of at least two tokens (a lone repeated token proposes too much that the LLM
# rejects); the planner's limits bound the rest per request
SUFFIX_CONFIG = SuffixConfig(min_match=2)
T = TypeVar("T")
R = TypeVar("R", bound=Running)


@dataclass(frozen=True)
class Verdict:
    """What verification decided for one request: accepted tree tokens and the bonus token;
    ``prefix_hits``: context tokens the LLM's forward took from its prefix cache; ``next_tree``: the
    verifier's draft head's tree for the next step (rooted at the bonus token), if the job asked for one;
    ``logprobs``: those of the accepted tokens and the bonus token, if the job asked for them."""

    accepted_tokens: tuple[int, ...]
    bonus_token: int
    prefix_hits: int = 0
    next_tree: DraftTree | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class DraftRound:
    """What the SSMs drafted in one iteration: ``trees[ssm][request_id]``, and every SSM pass as
    (SSM index, frontier tokens, seconds): the SSMs' own compute time, which the cost model learns.
    An SSM whose call failed is absent: its requests verify smaller trees (speed, not answers)."""

    trees: dict[int, dict[str, DraftTree]]
    passes: tuple[tuple[int, int, float], ...] = ()


@dataclass(frozen=True)
class VerifyRound:
    """What one verification round gave: ``verdicts`` by request ID; ``failed``, requests not
    verified this round (they retry next iteration); ``timings``, each verify call that answered:
    who ran it (a replica's address, or ``"local"``), its jobs and its seconds (a remote call's
    round trip: the network is part of what a step costs); ``refused``, replicas that refused
    their call for lack of KV blocks."""

    verdicts: dict[str, Verdict]
    failed: tuple[str, ...] = ()
    timings: tuple[tuple[str, tuple[VerifySpec, ...], float], ...] = ()
    refused: tuple[str, ...] = ()


class Executor(Protocol):
    """Where the models run. ``draft`` gets each SSM's jobs by SSM index (in SSM order) and returns
    what they drafted; ``verify`` verifies every job in one round (it may raise when nothing could
    be verified: the step then commits nothing and the driver retries it)."""

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound: ...

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound: ...


Commit = Callable[[R, StepOutcome], Awaitable[None]]
Drafts = dict[str, list[tuple[int, DraftTree]]]  # a request's trees by request ID, as (drafter, tree) pairs


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`EngineCore.step` did, for the driver's metrics. ``planned_nodes``: the
    planned tree size of each adaptive request (1: its root alone); ``speculate_seconds``: planning,
    drafting and selection; ``verify_seconds``: the verification round."""

    batch_size: int
    planned_nodes: tuple[int, ...]
    verify: VerifyRound
    speculate_seconds: float
    verify_seconds: float


class EngineCore:
    """See the module docstring. ``num_ssms``: the SSMs the executor drafts with (indices
    ``0..num_ssms-1``); ``eos_token_id``: ends a request unless it ignores EOS. ``adaptive``:
    adaptive speculation's state, or a function that builds it when the first adaptive request
    runs (e.g. a calibration), or None: adaptive requests verify their root alone. ``head``: the
    executor's verifier has a draft head: adaptive requests that allow it ask each verification for the
    next step's head tree (:class:`~specinfer.core.iteration.HeadDraft`), which the next step merges with
    its other drafts as :data:`~specinfer.core.adaptive.HEAD_DRAFTER`'s."""

    def __init__(
        self,
        executor: Executor,
        num_ssms: int,
        eos_token_id: int | None,
        adaptive: AdaptiveSpeculation | Callable[[], AdaptiveSpeculation] | None = None,
        head: bool = False,
    ) -> None:
        self.executor = executor
        self.head = head
        # a request's head tree for its next step, with the committed length it was drafted for
        self._head_trees: dict[str, tuple[int, DraftTree]] = {}
        # a request's head tree as the last cut before verification kept it: (nodes, depth), which sizes
        # the next one (a head draft costs a pass per depth over its frontier, verified or not)
        self._head_kept: dict[str, tuple[int, int]] = {}
        self._head_gate: HeadGate | None = None  # built with the adaptive state (its config is the planner's)
        self.num_ssms = num_ssms
        self.eos_token_id = eos_token_id
        self._adaptive = adaptive if isinstance(adaptive, AdaptiveSpeculation) else None
        self._build = None if isinstance(adaptive, AdaptiveSpeculation) else adaptive
        self._histories: dict[str, TokenHistory] = {}  # committed tokens of requests that draft suffix trees

    @property
    def adaptive(self) -> AdaptiveSpeculation | None:
        """Adaptive speculation's state; built on first use where the core was given a builder."""
        if self._adaptive is None and self._build is not None:
            self._adaptive = self._build()
        return self._adaptive

    @property
    def adaptive_built(self) -> AdaptiveSpeculation | None:
        """Adaptive speculation's state if it exists yet (never builds it)."""
        return self._adaptive

    @property
    def head_gate(self) -> HeadGate | None:
        """When steps ask the draft head for next trees; None until a step could ask it."""
        return self._head_gate

    def add_ssms(self, num_ssms: int, adaptive: AdaptiveSpeculation | None) -> None:
        """The executor now drafts with ``num_ssms`` SSMs (a driver's SSM set only grows: SSM i keeps
        index i), planned by ``adaptive`` (built for all of them)."""
        if num_ssms < self.num_ssms:
            raise ValueError(f"SSMs only join: {num_ssms} < {self.num_ssms}")
        self.num_ssms = num_ssms
        self._adaptive, self._build = adaptive, None

    def forget(self, request_id: str) -> None:
        """A request left the batch (finished, preempted, moved): its per-request state goes."""
        if self._adaptive is not None:
            self._adaptive.forget(request_id)
        self._histories.pop(request_id, None)
        self._head_trees.pop(request_id, None)
        self._head_kept.pop(request_id, None)

    async def step(self, batch: Sequence[R], commit: Commit, live: Callable[[str], bool] | None = None) -> StepReport:
        """One iteration over ``batch``: draft, verify, and ``commit`` each verified request's outcome
        (in batch order). ``live``: whether a request is still the driver's to commit after the
        verification round (one cancelled or taken over meanwhile is skipped); default all."""
        started = time.perf_counter()
        contexts = adaptive_contexts(batch)
        adaptive = self.adaptive if contexts else None
        if adaptive is not None and self._head_trees and adaptive.head_outdrafts_ssms():
            # a request with its head tree at hand drafts no SSM tree this step: the head's proposals have
            # been accepted at least as well as any SSM's, and its tree is drafted already (SSM passes are not)
            ready = {r.request_id for r in batch if self._head_tree_for(r) is not None}
            contexts = [dataclasses.replace(c, ssms=()) if c.request_id in ready else c for c in contexts]
        choices = adaptive.plan(contexts, static_shape(batch)) if adaptive is not None else {}
        planned = tuple(choices[c.request_id].budget.nodes if c.request_id in choices else 1 for c in contexts)
        drafted, draft_seconds = await self._draft(batch, choices)
        if adaptive is not None:
            self._draft_suffixes(batch, choices, drafted, adaptive.config)
            self._take_head_trees(batch, drafted)
            drafted = select_drafts(batch, drafted, adaptive, draft_seconds)
            self._note_head_cut(drafted)
        jobs = verify_specs(batch, {rid: [tree for _, tree in pairs] for rid, pairs in drafted.items()})
        gate = self._gate(batch, adaptive)
        head_on = gate is not None and gate.decide(len(batch))
        if head_on:
            jobs = [self._ask_head(r, job, adaptive) for r, job in zip(batch, jobs, strict=True)]
        verify_started = time.perf_counter()
        verified = await self.executor.verify(jobs)
        verify_seconds = time.perf_counter() - verify_started
        shapes = [verify_shape(calls) for _, calls, _ in verified.timings]  # None: a call that prefilled a prompt
        if self._adaptive is not None:
            for shape, (_, _, seconds) in zip(shapes, verified.timings, strict=True):
                self._adaptive.observe_verify(shape, seconds)
        committed_tokens = 0
        for r, job in zip(batch, jobs, strict=True):
            verdict = verified.verdicts.get(r.request_id)
            if verdict is None or (live is not None and not live(r.request_id)):
                continue
            if self._adaptive is not None and drafted[r.request_id]:
                self._adaptive.observe_step(r.request_id, dict(drafted[r.request_id]), verdict.accepted_tokens)
            outcome = r.outcome(
                job.draft,
                verdict.accepted_tokens,
                verdict.bonus_token,
                self.eos_token_id,
                verdict.prefix_hits,
                verdict.logprobs,
            )
            if verdict.next_tree is not None and outcome.finish_reason is None:
                # valid while the request's committed tokens end where the head drafted from
                committed = len(job.context_tokens) + 1 + len(verdict.accepted_tokens) + 1
                self._head_trees[r.request_id] = (committed, verdict.next_tree)
            committed_tokens += len(outcome.tokens)
            await commit(r, outcome)
        if gate is not None and shapes and None not in shapes:
            gate.observe(len(batch), head_on, committed_tokens, time.perf_counter() - started)
        if self._adaptive is not None:
            # what the iteration took beyond the model calls (planning, verification maths, network, commits)
            self._adaptive.observe_overhead(time.perf_counter() - started - verify_seconds - draft_seconds)
        return StepReport(len(batch), planned, verified, verify_started - started, verify_seconds)

    async def _draft(self, batch: Sequence[Running], choices: Mapping[str, Choice]) -> tuple[Drafts, float]:
        """Every SSM's trees for the requests that name it (static) or that the plan gave it
        (adaptive): (SSM index, tree) pairs by request ID, in SSM order; and the SSM seconds spent."""
        drafted: Drafts = {r.request_id: [] for r in batch}
        jobs = {i: specs for i in range(self.num_ssms) if (specs := draft_specs(batch, i, choices))}
        if not jobs:
            return drafted, 0.0
        round_ = await self.executor.draft(jobs)
        seconds = 0.0
        for ssm, tokens, secs in round_.passes:
            seconds += secs
            if self._adaptive is not None:
                self._adaptive.observe_draft(ssm, tokens, secs)
        for ssm in sorted(round_.trees):
            for rid, tree in round_.trees[ssm].items():
                if rid in drafted:
                    drafted[rid].append((ssm, tree))
        return drafted, seconds

    def _draft_suffixes(
        self,
        batch: Sequence[Running],
        choices: Mapping[str, Choice],
        drafted: dict[str, list[tuple[int, DraftTree]]],
        limits: PlannerConfig,
    ) -> None:
        """Add a suffix tree (:mod:`specinfer.core.suffix`) to the drafts of each adaptive greedy or coupled
        request that allows it and whose text repeats: within the planner's limits, less the nodes its
        plan gave an SSM (the cut that follows keeps what pays). Microseconds a request: no model runs."""
        for r in batch:
            speculation = r.request.speculation
            if speculation is None or not (speculation.adaptive and speculation.suffix and r.request.sampling.prunable):
                continue
            choice = choices.get(r.request_id)
            nodes = limits.max_nodes - (choice.budget.nodes if choice is not None else 1)
            depth = min(limits.max_depth, r.remaining - 1)
            if nodes <= 0 or depth <= 0:
                continue
            tree = self._history(r).suffix_tree(
                SUFFIX_CONFIG.within(nodes, depth), with_q=not r.request.sampling.greedy
            )
            if len(tree.tree) > 1:
                drafted[r.request_id].append((SUFFIX_DRAFTER, tree))

    def _head_tree_for(self, r: Running) -> DraftTree | None:
        """The head tree the request's last verification drafted for this step, if its committed tokens are
        those it was drafted after (a stop string may have cut them)."""
        stored = self._head_trees.get(r.request_id)
        if stored is None:
            return None
        length, tree = stored
        if r.committed_len == length and tree.tree.tokens[0] == r.last_token and len(tree.tree) > 1:
            return tree
        return None

    def _take_head_trees(self, batch: Sequence[Running], drafted: Drafts) -> None:
        """Add to each request's drafts its head tree for this step (:meth:`_head_tree_for`); the stored
        trees go either way."""
        for r in batch:
            tree = self._head_tree_for(r)
            self._head_trees.pop(r.request_id, None)
            if tree is not None:
                drafted[r.request_id].append((HEAD_DRAFTER, tree))

    def _gate(self, batch: Sequence[Running], adaptive: AdaptiveSpeculation | None) -> HeadGate | None:
        """The head gate, where this step may ask the head for next trees: the verifier has one and a
        request of the batch drafts adaptively with it (None: this step has nothing to decide)."""
        if adaptive is None or not self.head:
            return None
        for r in batch:
            speculation = r.request.speculation
            if speculation is not None and speculation.adaptive and speculation.head:
                if self._head_gate is None:
                    self._head_gate = HeadGate(adaptive.config.head_gate)
                return self._head_gate
        return None

    def _note_head_cut(self, drafted: Drafts) -> None:
        for rid, pairs in drafted.items():
            for drafter, tree in pairs:
                if drafter == HEAD_DRAFTER:
                    self._head_kept[rid] = (len(tree.tree), int(tree.tree.depths.max()))

    def _ask_head(self, r: Running, job: VerifySpec, adaptive: AdaptiveSpeculation) -> VerifySpec:
        """``job``, asking the verifier's head for the next step's tree where the request allows it."""
        speculation = r.request.speculation
        if speculation is None or not (speculation.adaptive and speculation.head):
            return job
        budget = adaptive.head_budget(r.remaining, self._head_kept.get(r.request_id))
        return job if budget is None else replace(job, head=HeadDraft(budget, speculation.draft_support))

    def _history(self, r: Running) -> TokenHistory:
        """The request's committed tokens as a suffix index, brought up to date (rebuilt if they shrank: a
        request resumed elsewhere and back)."""
        history = self._histories.get(r.request_id)
        prompt = len(r.request.prompt_tokens)
        if history is None or len(history) < prompt or len(history) > prompt + len(r.output):
            history = self._histories[r.request_id] = TokenHistory(r.committed)
        elif len(history) < prompt + len(r.output):
            history.extend(r.output[len(history) - prompt :])
        return history


def admit(active: MutableMapping[str, R], waiting: deque[R], plan: Schedule) -> list[R]:
    """Apply an admission plan: the preempted requests leave ``active`` for the head of ``waiting``
    (in their order, keeping their output), then the admitted prefix of ``waiting`` joins ``active``.
    Returns the preempted ones (their caches must be released)."""
    back = [active.pop(rid) for rid in plan.preempted]
    waiting.extendleft(reversed(back))
    for rid in plan.admitted:
        request = waiting.popleft()  # schedule admits a prefix of the queue
        if request.request_id != rid:
            raise AssertionError(f"admitted {rid!r} is not at the head of the queue ({request.request_id!r})")
        active[rid] = request
    return back


def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (its awaits all complete at once: an in-process
    executor's) to its result, without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended: run_to_end is only for executors that complete at once")
