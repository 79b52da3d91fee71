"""In-process tree-based speculative generation for a batch of requests.

Each :meth:`SpeculativeEngine.step` is one iteration of the step loop (docs/architecture.md, "The step
loop") over the running requests: the engine core's (:meth:`specinfer.core.engine_core.EngineCore.step`),
which the request manager's scheduler runs too, over the engine's models in process
(:class:`~specinfer.engine.local.LocalExecutor`). The engine keeps the queue
(:class:`~specinfer.core.admission.Admission`) and commits into each request's result. Requests can be
added between steps; KV caches live in the backends and follow the committed tokens automatically (see
:mod:`specinfer.models.interface`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from specinfer.core import InvalidArgument
from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
from specinfer.core.adaptive import AdaptiveSpeculation
from specinfer.core.admission import Admission
from specinfer.core.constraints import Grammars
from specinfer.core.costs import StepCosts
from specinfer.core.drafters.head import VerifierHeadDrafter
from specinfer.core.engine_core import EngineCore, run_to_end
from specinfer.core.errors import check_token_ids
from specinfer.core.grammar_states import GrammarSpeculation
from specinfer.core.head_gate import HeadGate
from specinfer.core.iteration import Running, StepOutcome, request_seed
from specinfer.core.kv_budget import Overfull, StepRows, check_fits_alone, schedule, step_rows
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import GenerationRequest, GenerationResult
from specinfer.engine.calibrate import calibrate_costs, probe_costs
from specinfer.engine.calibration_cache import CostEntry
from specinfer.engine.local import LocalExecutor
from specinfer.models.head_drafter import WithHead
from specinfer.models.interface import CausalLM


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: most requests per iteration; ``eos_token_id``: ends a request unless it
    sets ``ignore_eos`` (None: the model has no EOS); ``planner``: adaptive speculation's limits;
    ``slot_priors``: each SSM's prior slot acceptance (e.g. from its tuning file; empty: a default);
    ``grammar``: what constrained requests' trees get (pruning, certain tokens:
    :mod:`specinfer.core.grammar_states`)."""

    max_batch: int = 64
    # most tokens of requests admitted in one iteration, past the first (core.kv_budget.schedule; 0: no cap)
    max_prefill_tokens: int = 2048
    eos_token_id: int | None = None
    planner: PlannerConfig = PlannerConfig()
    slot_priors: tuple[tuple[float, ...], ...] = ()
    grammar: GrammarSpeculation = GrammarSpeculation()


class _Active(Running):
    """A running request and the result its steps extend."""

    def __init__(self, request: GenerationRequest) -> None:
        super().__init__(request, request_seed(request.sampling))
        # the result holds the running output itself: it shows each step's tokens as they come
        self.result = GenerationResult(request.request_id, request.prompt_tokens, self.output)


class SpeculativeEngine:
    """One LLM and any number of SSMs; see the module docstring."""

    def __init__(
        self,
        llm: CausalLM,
        ssms: Sequence[CausalLM],
        config: EngineConfig,
        costs: StepCosts | None = None,
        cost_entry: CostEntry | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``costs``: the step cost model for adaptive speculation; None: built when the first
        adaptive request runs. With ``cost_entry`` (``specinfer generate``) it is read from that
        cache entry, else probed in about a second (:func:`~specinfer.engine.calibrate.probe_costs`);
        either way the real steps refine it and :meth:`save_costs` (which :meth:`generate` calls)
        writes it back, so the next run starts from what this one learned. Without ``cost_entry``
        it is the full calibration (:func:`~specinfer.engine.calibrate.calibrate_costs`: tens of
        seconds for a 1B model on a CPU; benchmarks time it before their clock starts). ``grammars``: the LLM's
        tokenizer's grammars (:mod:`specinfer.core.constraints`), for requests with a constraint (None: refused)."""
        for i, ssm in enumerate(ssms):
            if ssm.vocab_size != llm.vocab_size:
                raise InvalidArgument(
                    f"ssms[{i}]", f"vocabulary size {ssm.vocab_size} differs from the LLM's {llm.vocab_size}"
                )
        self.llm = llm
        self.ssms = list(ssms)
        self.config = config
        self._requests: Admission[_Active] = Admission()
        self._ids: set[str] = set()  # request IDs running or waiting: add() checks a batch of thousands in O(1) each
        # A request holds a KV cache in every model until it finishes. Models that size their cache
        # in KV blocks admit and preempt by blocks (core.kv_budget); others bound the batch by how
        # many requests their caches hold.
        self._budgets = [llm.kv_budget] if llm.kv_budget is not None else []
        # an SSM's cache holds what it expands while drafting (StepRows.draft)
        self._budgets += [dataclasses.replace(s.kv_budget, drafts=True) for s in ssms if s.kv_budget is not None]
        limits = [m.max_requests for m in (llm, *ssms) if m.kv_budget is None and m.max_requests is not None]
        self._capacity = min([config.max_batch, *limits])
        self.preemptions = 0  # running requests put back in the queue for lack of KV blocks
        self._costs = costs
        self._cost_entry = cost_entry
        self._executor = LocalExecutor(llm, self.ssms, grammars if config.grammar.mask_drafts else None)
        self._core = EngineCore(
            self._executor,
            len(self.ssms),
            config.eos_token_id,
            self._build_adaptive,
            head=isinstance(llm, WithHead),  # an LLM with a draft head drafts the next trees as it verifies
            grammars=grammars,
            grammar_speculation=config.grammar,
        )

    @property
    def adaptive(self) -> AdaptiveSpeculation:
        """Adaptive speculation's state (cost and acceptance models), calibrated on first use."""
        adaptive = self._core.adaptive
        assert adaptive is not None  # the core was given a builder
        return adaptive

    @property
    def grammar_time(self) -> tuple[int, float]:
        """The steps that walked a constrained request's tree under its grammar, and the seconds those walks took
        (masks and certain tokens, :mod:`specinfer.core.grammar_states`)."""
        return self._core.grammars.steps, self._core.grammars.seconds

    @property
    def draft_mask_seconds(self) -> float:
        """What masking the drafts of constrained requests took in the drafters (SSMs and head), all passes
        together (:class:`~specinfer.core.grammar_states.DraftGrammars`; 0 when drafts are not masked)."""
        grammars = self._executor.draft_grammars
        return grammars.seconds if grammars is not None else 0.0

    @property
    def head_gate(self) -> HeadGate | None:
        """When steps ask the draft head for next trees (:mod:`specinfer.core.head_gate`); None before the
        first adaptive step that may draft with a head."""
        head = self._core.drafters[VerifierHeadDrafter.name]
        return head.gate if isinstance(head, VerifierHeadDrafter) else None

    def _build_adaptive(self) -> AdaptiveSpeculation:
        costs = self._costs or self._initial_costs()
        priors = {
            i: (self.config.slot_priors[i] if i < len(self.config.slot_priors) else DEFAULT_SLOT_PRIOR)
            for i in range(len(self.ssms))
        }
        return AdaptiveSpeculation(costs, self.config.planner, priors)

    def _initial_costs(self) -> StepCosts:
        if self._cost_entry is None:
            return calibrate_costs(self.llm, self.ssms, max_verify_tokens=min(64, self.config.planner.max_nodes * 2))
        return self._cost_entry.load_costs() or probe_costs(self.llm, self.ssms)

    def save_costs(self) -> None:
        """Write the cost model, as the steps so far refined it, to the engine's cost entry (nothing
        without one, or before any adaptive step built the model)."""
        adaptive = self._core.adaptive_built
        if self._cost_entry is not None and adaptive is not None:
            self._cost_entry.save_costs(adaptive.costs)

    # -- request lifecycle ------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        vocab = self.llm.vocab_size
        check_token_ids("prompt_tokens", request.prompt_tokens, vocab)
        check_token_ids("stop_token_ids", request.stop_token_ids, vocab)
        limit = self.llm.max_positions
        if len(request.prompt_tokens) + request.max_new_tokens > limit:
            raise InvalidArgument(
                "max_new_tokens",
                f"prompt ({len(request.prompt_tokens)}) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the model's {limit} positions",
            )
        spec = request.speculation
        if spec is not None:
            unknown = [s for s in spec.ssms if not 0 <= s < len(self.ssms)]
            if unknown:
                raise InvalidArgument(
                    "speculation.ssms", f"unknown SSM index {unknown[0]} (the engine has {len(self.ssms)})"
                )
        check_fits_alone(request, self._budgets, len(self.ssms), self.config.planner)
        if request.constraint is not None:
            if self._core.grammars.grammars is None:
                raise InvalidArgument(request.constraint.kind, "needs the LLM's tokenizer, which this engine lacks")
            self._core.grammars.grammars.check(request.constraint)

    def _step_rows(self, state: _Active) -> StepRows:
        return step_rows(state.request, state.committed_len, len(self.ssms), self.config.planner)

    def add(self, request: GenerationRequest) -> None:
        self.validate(request)
        if request.request_id in self._ids:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already running")
        self._ids.add(request.request_id)
        self._requests.enqueue(_Active(request))

    def cancel(self, request_id: str) -> GenerationResult | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        self._requests.remove(state)
        self._ids.discard(request_id)
        state.result.finish_reason = "cancelled"
        self._release(request_id)
        return state.result

    def running(self) -> list[GenerationResult]:
        """Results of the requests admitted and not finished; live objects that each step extends
        (e.g. to time when tokens are committed)."""
        return [s.result for s in self._requests.running.values()]

    @property
    def admitted(self) -> int:
        """Requests running or waiting to run."""
        return len(self._requests)

    @property
    def has_work(self) -> bool:
        return len(self._requests) > 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results in input order."""
        for r in requests:
            self.validate(r)
        for r in requests:
            self.add(r)
        done: dict[str, GenerationResult] = {}
        while self.has_work:
            for result in self.step():
                done[result.request_id] = result
        self.save_costs()
        return [done[r.request_id] for r in requests]

    # -- one iteration ------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """One iteration of the step loop (docs/architecture.md); returns the requests that finished."""
        self._admit()
        states = self._requests.batch()
        if not states:
            return []
        finished: list[GenerationResult] = []
        run_to_end(self._core.step(states, partial(self._commit, finished)))
        return finished

    async def _commit(self, finished: list[GenerationResult], state: _Active, outcome: StepOutcome) -> None:
        state.commit(outcome)
        state.result.steps.append(outcome.stats)
        if outcome.logprobs is not None:
            state.result.logprobs.extend(outcome.logprobs)
        state.result.finish_reason = outcome.finish_reason
        if outcome.finish_reason is not None:
            finished.append(state.result)
            self._requests.remove(state)
            self._ids.discard(state.request_id)
            self._release(state.request_id)

    def _admit(self) -> None:
        """Preempt and admit for this iteration (:func:`~specinfer.core.kv_budget.schedule`): a
        preempted request's caches are released and it waits at the head of the queue with its
        output; re-admitted, its caches are rebuilt from its committed tokens."""
        running, waiting = self._requests.demand(self._step_rows)
        plan = schedule(self._budgets, running, waiting, self._capacity, self.config.max_prefill_tokens)
        if isinstance(plan, Overfull):  # check_fits_alone refused such requests when they arrived
            raise AssertionError(str(plan))
        back = self._requests.admit(plan)
        for state in back:
            self._release(state.request_id)
        self.preemptions += len(back)

    def _release(self, request_id: str) -> None:
        self.llm.release(request_id)
        self._core.forget(request_id)
        self._executor.forget(request_id)
        for ssm in self.ssms:
            ssm.release(request_id)
