"""The engine core: one continuous-batching iteration, written once, behind both drivers.

A *driver* keeps the queue of requests and runs iterations over its batch of :class:`Running`
requests: the in-process engine (:class:`specinfer.engine.SpeculativeEngine`) and the request
manager's scheduler. Both hand the batch to :meth:`EngineCore.step`, which runs

    plan -> draft -> select -> verify -> observe -> commit

over an :class:`Executor` (where the models run: in process, or SSM workers and verifier replicas
over gRPC) and the driver's *commit* callback (what committing means: append to the result, or
persist in Redis and publish). The loop itself is described once, in docs/architecture.md ("The step
loop"); admission and preemption between steps are :mod:`specinfer.core.admission`'s.

The core owns adaptive speculation's state (:class:`~specinfer.core.adaptive.AdaptiveSpeculation`):
it plans the adaptive requests' trees, cuts them before verification, and feeds the cost and
acceptance models with what each step measured. Drivers only read it (metrics). Who drafts is the
drafters' (:mod:`specinfer.core.drafter`; the kinds: :mod:`specinfer.core.drafters`): the core asks
each registered drafter in turn and knows none of them.

The core does no I/O itself. :meth:`EngineCore.step` is a coroutine so that a remote executor can
await its calls; an executor whose methods never suspend (the in-process one) runs it to the end
with :func:`run_to_end`, without an event loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from specinfer.core.adaptive import AdaptiveSpeculation, Choice
from specinfer.core.call_shapes import call_shape, prefills
from specinfer.core.constraints import Grammars
from specinfer.core.drafter import Drafter, Drafts, DraftStep, Models
from specinfer.core.drafters import DRAFTERS
from specinfer.core.drafts import DraftTree
from specinfer.core.grammar_states import DEFAULT_GRAMMAR_SPECULATION, GrammarSpeculation, GrammarStates
from specinfer.core.head_gate import HeadGate
from specinfer.core.iteration import (
    DraftSpec,
    Running,
    StepOutcome,
    VerifySpec,
    adaptive_contexts,
    prompt_shape,
    select_drafts,
    static_shape,
    verify_specs,
)
from specinfer.core.kv_budget import step_rows
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import TokenLogprob

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
    their call for lack of KV blocks; ``rejected``, requests whose verification failed on its own, asked alone (a bad
    job, or a verifier bug their inputs meet), each with why: retried, they would fail again, so their driver ends
    them with that error."""

    verdicts: dict[str, Verdict]
    failed: tuple[str, ...] = ()
    timings: tuple[tuple[str, tuple[VerifySpec, ...], float], ...] = ()
    refused: tuple[str, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)


class Executor(Protocol):
    """Where the models run. ``draft`` gets each SSM's jobs by SSM index (in SSM order) and returns
    what they drafted; ``verify`` verifies every job in one round (it may raise when nothing could
    be verified: the step then commits nothing and the driver retries it)."""

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound: ...

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound: ...


Commit = Callable[[R, StepOutcome], Awaitable[None]]


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`EngineCore.step` did, for the driver's metrics. ``planned_nodes``: the
    planned tree size of each adaptive request (1: its root alone); ``speculate_seconds``: planning,
    drafting and selection; ``verify_seconds``: the verification round; ``verify_predictions``: per verify call (the
    prompts it prefilled priced too: :func:`~specinfer.core.call_shapes.call_shape`), the cost model's seconds for it
    before it ran, and the seconds it took; ``step_prediction``: the same for the whole step (its verify calls, draft
    passes and the overhead outside the models, each as the cost model predicted it before the step taught it), None
    where there is no cost model."""

    batch_size: int
    planned_nodes: tuple[int, ...]
    verify: VerifyRound
    speculate_seconds: float
    verify_seconds: float
    verify_predictions: tuple[tuple[float, float], ...] = ()
    step_prediction: tuple[float, float] | None = None


class EngineCore:
    """See the module docstring. ``num_ssms``: the SSMs the executor drafts with (indices
    ``0..num_ssms-1``); ``eos_token_id``: ends a request unless it ignores EOS. ``adaptive``:
    adaptive speculation's state, or a function that builds it when the first adaptive request
    runs (e.g. a calibration), or None: adaptive requests verify their root alone. ``head``: the
    executor's verifier has a draft head (:mod:`specinfer.core.drafters.head`). ``drafters``: every
    registered kind of draft (:data:`~specinfer.core.drafters.DRAFTERS`), by name, in merge order. ``grammars``:
    the tokenizer's grammars, for requests with a constraint (:mod:`specinfer.core.grammar_states`), and
    ``grammar_speculation`` what their trees get."""

    def __init__(
        self,
        executor: Executor,
        num_ssms: int,
        eos_token_id: int | None,
        adaptive: AdaptiveSpeculation | Callable[[], AdaptiveSpeculation] | None = None,
        head: bool = False,
        grammars: Grammars | None = None,
        grammar_speculation: GrammarSpeculation = DEFAULT_GRAMMAR_SPECULATION,
    ) -> None:
        self.executor = executor
        self.num_ssms = num_ssms
        self.eos_token_id = eos_token_id
        self._adaptive = adaptive if isinstance(adaptive, AdaptiveSpeculation) else None
        self._build = None if isinstance(adaptive, AdaptiveSpeculation) else adaptive
        models = Models(executor, head)
        # whether steps speculate for adaptive requests at all, measured (PlannerConfig.speculation_gate); built
        # with the adaptive state
        self.speculation_gate: HeadGate | None = None
        self.drafters: dict[str, Drafter] = {name: kind(models) for name, kind in DRAFTERS.items()}
        self.grammars = GrammarStates(grammars, grammar_speculation)

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
        for drafter in self.drafters.values():
            drafter.forget(request_id)
        self.grammars.forget(request_id)

    async def step(self, batch: Sequence[R], commit: Commit, live: Callable[[str], bool] | None = None) -> StepReport:
        """One iteration over ``batch``: draft, verify, and ``commit`` each verified request's outcome
        (in batch order). ``live``: whether a request is still the driver's to commit after the
        verification round (one cancelled or taken over meanwhile is skipped); default all."""
        started = time.perf_counter()
        contexts = adaptive_contexts(batch)
        adaptive = self.adaptive if contexts else None
        gate = self._gate(adaptive)
        speculate = gate.decide(len(batch)) if gate is not None else True
        if not speculate:  # this block of steps measures the adaptive requests without speculation: roots alone
            adaptive = None
        choices: dict[str, Choice] = {}
        if adaptive is not None:
            narrowed = contexts
            for drafter in self.drafters.values():
                narrowed = drafter.narrow(batch, narrowed, adaptive)
            choices = adaptive.plan(narrowed, static_shape(batch), prompt_shape(batch))
        planned = tuple(choices[c.request_id].budget.nodes if c.request_id in choices else 1 for c in contexts)
        drafted, draft_seconds, draft_predicted = await self._propose(
            DraftStep(batch, choices, adaptive, self._adaptive, self.num_ssms)
        )
        if adaptive is not None:
            drafted = select_drafts(batch, drafted, adaptive, draft_seconds)
        jobs: Sequence[VerifySpec] = verify_specs(
            batch, {rid: [tree for _, tree in pairs] for rid, pairs in drafted.items()}
        )
        for drafter in self.drafters.values():
            jobs = drafter.verifying(batch, drafted, jobs, adaptive)
        jobs = self.grammars.constrain(batch, jobs, self._tree_rows(batch))
        verify_started = time.perf_counter()
        verified = await self.executor.verify(jobs)
        verify_seconds = time.perf_counter() - verify_started
        cached = {rid: v.prefix_hits for rid, v in verified.verdicts.items() if v.prefix_hits}
        predictions: list[tuple[float, float]] = []
        if self._adaptive is not None:
            for _, calls, seconds in verified.timings:
                shape = call_shape(calls, cached)  # what the model said before it learns from this call
                predictions.append((self._adaptive.costs.verify_seconds(shape), seconds))
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
            for drafter in self.drafters.values():
                drafter.observe(r, job, verdict, outcome)
            committed_tokens += len(outcome.tokens)
            self.grammars.advance(r, outcome.tokens, outcome.finish_reason is not None)
            await commit(r, outcome)
        measured = bool(verified.timings) and not any(prefills(calls) for _, calls, _ in verified.timings)
        seconds = time.perf_counter() - started
        for drafter in self.drafters.values():
            drafter.stepped(len(batch), committed_tokens, seconds, measured)
        if gate is not None:
            # the whole step, prompts prefilled in it included: each request brings one prompt whichever arm runs, so
            # per committed token both arms pay for prompts alike, except where speculation makes them dearer (more
            # requests finish a step, so more prompts share a call, whose rows cost more as it grows), which is its
            # cost. Scored less the prompts' priced seconds, speculation measured 155 against 130 tokens/s at 16
            # streams, and 93 against 94.5 whole (BENCHMARKS.md).
            gate.observe(len(batch), speculate, committed_tokens, seconds)
        step_prediction = None
        if self._adaptive is not None:
            predicted = sum(p for p, _ in predictions) + draft_predicted + self._adaptive.costs.overhead
            step_prediction = (predicted, seconds)  # prompts prefilled included: the model prices them
            # what the iteration took beyond the model calls (planning, verification maths, network, commits)
            self._adaptive.observe_overhead(time.perf_counter() - started - verify_seconds - draft_seconds)
        return StepReport(
            len(batch), planned, verified, verify_started - started, verify_seconds, tuple(predictions), step_prediction
        )

    def _gate(self, adaptive: AdaptiveSpeculation | None) -> HeadGate | None:
        """The speculation gate, where this step has adaptive requests to decide for (None: nothing to decide, or a
        frozen cost model, whose plans are meant to be reproducible: a gate's measurements would make them not)."""
        if adaptive is None or adaptive.costs.frozen:
            return None
        if self.speculation_gate is None:
            self.speculation_gate = HeadGate(adaptive.config.speculation_gate)
        return self.speculation_gate

    def _tree_rows(self, batch: Sequence[Running]) -> list[int]:
        """The most nodes each request's tree may have this step: the KV rows the drivers admitted it for
        (:func:`~specinfer.core.kv_budget.step_rows`), which the grammar's certain tokens stay within."""
        planner = self._adaptive.config if self._adaptive is not None else PlannerConfig()
        return [step_rows(r.request, 0, self.num_ssms, planner).verify for r in batch]

    async def _propose(self, step: DraftStep) -> tuple[Drafts, float, float]:
        """Every drafter's trees for the batch's requests: (drafter key, tree) pairs by request ID, in drafter
        order; the model seconds the drafters spent, and the cost model's prediction of them."""
        drafted: Drafts = {r.request_id: [] for r in step.batch}
        seconds = predicted = 0.0
        for drafter in self.drafters.values():
            proposal = await drafter.propose(step)
            seconds += proposal.seconds
            predicted += proposal.predicted
            for rid, pairs in proposal.trees.items():
                if rid in drafted:
                    drafted[rid].extend(pairs)
        return drafted, seconds, predicted


def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (its awaits all complete at once: an in-process
    executor's) to its result, without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended: run_to_end is only for executors that complete at once")
