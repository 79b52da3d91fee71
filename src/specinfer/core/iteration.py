"""The jobs and bookkeeping of one iteration of the step loop (docs/architecture.md, "The step loop"),
which the engine core (:class:`specinfer.core.engine_core.EngineCore`) runs for both drivers: a
:class:`Running` request; its draft jobs (:func:`draft_specs`, one per request whose speculation names
the SSM); the cut of drafted trees (:func:`select_drafts`) and their merge into one verify job per
request (:func:`verify_specs`); a verdict turned into the tokens to commit, the finish reason and the
step's :class:`StepStats` (:meth:`Running.outcome`, applied by :meth:`Running.commit`).

Random streams: every job draws from its own generator, ``step_rng(seed, step, stream)`` (the
request's seed, its verify steps so far, the job's role: :data:`VERIFY_STREAM` or
:func:`draft_stream`), so a seeded request gives the same output in process and through the
services, whichever worker drafts or verifies a step.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specinfer.core.adaptive import AdaptiveSpeculation, Choice, Context, Drafted
from specinfer.core.constraints import Constraint
from specinfer.core.costs import VerifyShape
from specinfer.core.drafts import DraftTree, ExpansionConfig, merged_tree_nodes
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.merge import combine_drafts
from specinfer.core.requests import GenerationRequest, StepStats, TokenLogprob
from specinfer.core.sampling import SamplingParams

VERIFY_STREAM = 0  # the verifier's stream; SSM i drafts on draft_stream(i)
HEAD_STREAM = 1 << 20  # the verifier's draft head draws the next step's tree on this stream (beyond any SSM's)


def draft_stream(ssm_index: int) -> int:
    """The random stream SSM ``ssm_index`` (its place in the driver's SSM order) drafts on."""
    return 1 + ssm_index


def step_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """The generator of one role (``stream``) in verify step ``step`` of a request."""
    return np.random.default_rng([seed, step, stream])


def request_seed(sampling: SamplingParams) -> int:
    """The request's own seed, or a fresh random one: every request has one for its streams."""
    return sampling.seed if sampling.seed is not None else secrets.randbits(63)


@dataclass(frozen=True)
class DraftSpec:
    """One SSM draft job: grow a tree rooted at ``context_tokens``' successor ``root_token``.

    ``context_tokens``: committed tokens without the root. ``draft_support``: most tokens in a sparse
    draft distribution under sampling. The tree is static (``expansion``) or grown best first
    within ``budget`` (:class:`~specinfer.core.dynamic_trees.BestFirstTreeBuilder`). The job draws from
    ``step_rng(seed, step, stream)``. ``constraint``: the request's (structured outputs; None: anything): the
    drafter proposes no token it forbids (:class:`~specinfer.core.grammar_states.DraftGrammars`).
    """

    request_id: str
    context_tokens: Sequence[int]
    root_token: int
    expansion: ExpansionConfig | None  # a static tree, or None with a ``budget``
    sampling: SamplingParams
    draft_support: int
    seed: int
    step: int
    stream: int
    budget: TreeBudget | None = None  # a dynamic tree's budget (adaptive speculation)
    output_start: int = 0  # where the output begins in the committed tokens (context and root): for penalties
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if (self.expansion is None) == (self.budget is None):
            raise ValueError("a draft job has either a static expansion or a dynamic tree budget")

    def rng(self) -> np.random.Generator:
        """A fresh generator of this job's stream (one per job: each draw advances it)."""
        return step_rng(self.seed, self.step, self.stream)


@dataclass(frozen=True)
class HeadDraft:
    """What a verify job asks of the verifier's draft head (:mod:`specinfer.models.head_drafter`): once the
    step is verified, the next step's tree from the bonus token, grown best first within ``budget``, with at
    most ``draft_support`` tokens per distribution under sampling, drawn on ``step_rng(seed, step + 1,
    HEAD_STREAM)`` (the next step's stream: the tree belongs to it), masked by ``constraint`` (the request's; None:
    unconstrained) as an SSM's drafts are. ``budget`` None: no tree, the head only *keeps up*: it takes the step's
    features, so that the pairs of the tokens committed while it was not asked are there when it next drafts (a
    head attending to a context with its last tokens missing drafts far worse)."""

    budget: TreeBudget | None
    draft_support: int
    constraint: Constraint | None = None


@dataclass(frozen=True)
class VerifySpec:
    """One verify job: check ``draft`` (rooted at the last committed token) after ``context_tokens``
    (the committed tokens without it), drawing from ``step_rng(seed, step, VERIFY_STREAM)``;
    ``head``: also draft the next step's tree with the verifier's draft head, or keep it up (None: neither);
    ``masks``: the tokens the request's grammar allows after each node (:mod:`specinfer.core.constraints`; None:
    any)."""

    request_id: str
    context_tokens: Sequence[int]
    draft: DraftTree
    sampling: SamplingParams
    seed: int
    step: int
    head: HeadDraft | None = None
    logprobs: int | None = None  # report the committed tokens' logprobs with this many alternatives (None: not)
    output_start: int = 0  # where the output begins in the committed tokens (context and root): the penalties' count
    masks: np.ndarray | None = None  # [n_nodes, ceil(vocab / 32)] int32, xgrammar's bit layout

    def rng(self) -> np.random.Generator:
        return step_rng(self.seed, self.step, VERIFY_STREAM)

    def head_spec(self, committed: Sequence[int], bonus_token: int) -> DraftSpec | None:
        """The head's draft job once this step committed ``committed`` (context, root and accepted tokens)
        and ``bonus_token`` (None: no head tree asked)."""
        if self.head is None or self.head.budget is None:
            return None
        return DraftSpec(
            self.request_id,
            committed,
            bonus_token,
            None,
            self.sampling,
            self.head.draft_support,
            self.seed,
            self.step + 1,
            HEAD_STREAM,
            self.head.budget,
            self.output_start,
            self.head.constraint,
        )


def commit_tokens(
    new_tokens: Sequence[int], remaining: int, eos_token_id: int | None, stop_token_ids: frozenset[int]
) -> tuple[tuple[int, ...], str | None]:
    """The prefix of a step's tokens (accepted + bonus) to commit, and the finish reason if the
    request ends with them: ``eos`` / ``stop`` include the stopping token, ``length`` cuts at
    ``remaining`` tokens."""
    out = []
    for token in new_tokens:
        out.append(token)
        if token == eos_token_id:
            return tuple(out), "eos"
        if token in stop_token_ids:
            return tuple(out), "stop"
        if len(out) >= remaining:
            return tuple(out), "length"
    return tuple(out), None


@dataclass(frozen=True)
class StepOutcome:
    """What one verify step appends to a request: ``tokens``, ``finish_reason`` (None: the
    request goes on) and the step's ``stats``."""

    tokens: tuple[int, ...]
    finish_reason: str | None
    stats: StepStats
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asked

    def stopped_at(self, count: int) -> StepOutcome:
        """The step cut after ``count`` tokens by a stop condition the core does not see (a stop string)."""
        logprobs = self.logprobs[:count] if self.logprobs is not None else None
        return StepOutcome(self.tokens[:count], "stop", replace(self.stats, committed=count), logprobs)


@dataclass(eq=False)
class Running:
    """A request between iterations: its ``seed``, committed ``output`` and step totals ``stats``
    (``stats.llm_steps`` also numbers the next step's random streams)."""

    request: GenerationRequest
    seed: int
    output: list[int] = field(default_factory=list, kw_only=True)
    stats: StepStats = field(default=StepStats(llm_steps=0), kw_only=True)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def committed(self) -> list[int]:
        """Prompt and output: the last one roots the next tree, the rest is its context (a new list: where
        only its length or last token is needed, :attr:`committed_len` and :attr:`last_token` build none)."""
        return [*self.request.prompt_tokens, *self.output]

    @property
    def committed_len(self) -> int:
        return len(self.request.prompt_tokens) + len(self.output)

    @property
    def last_token(self) -> int:
        """The last committed token: the next tree's root."""
        return self.output[-1] if self.output else self.request.prompt_tokens[-1]

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.output)

    def outcome(
        self,
        draft: DraftTree,
        accepted_tokens: Sequence[int],
        bonus_token: int,
        eos_token_id: int | None,
        prefix_hits: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> StepOutcome:
        """The step that verified ``draft`` (accepting ``accepted_tokens``, then ``bonus_token``);
        ``eos_token_id`` ends the request unless it ignores EOS; ``prefix_hits``: context tokens the
        LLM's forward took from its prefix cache (:meth:`specinfer.models.interface.CausalLM.prefix_hits`);
        ``logprobs``: those of ``accepted_tokens`` and ``bonus_token`` (kept for the committed ones).
        Only the first step's count as cached prompt tokens: a later step reuses blocks only when it
        rebuilds a cache (after a preemption), whose context holds output too."""
        req = self.request
        eos = None if req.ignore_eos else eos_token_id
        tokens, reason = commit_tokens(
            (*accepted_tokens, bonus_token), self.remaining, eos, frozenset(req.stop_token_ids)
        )
        cached = prefix_hits if self.stats.llm_steps == 0 else 0
        return StepOutcome(
            tokens,
            reason,
            StepStats(
                accepted=len(accepted_tokens), tree_size=len(draft.tree), committed=len(tokens), cached_prompt=cached
            ),
            tuple(logprobs[: len(tokens)]) if logprobs is not None else None,
        )

    def commit(self, outcome: StepOutcome) -> None:
        self.output.extend(outcome.tokens)
        self.stats += outcome.stats


def draft_specs(
    batch: Sequence[Running], ssm_index: int, choices: Mapping[str, Choice] | None = None
) -> list[DraftSpec]:
    """SSM ``ssm_index``'s draft jobs this iteration, in batch order: one per request whose static
    speculation names it and that has tokens left to draft (see ``SpeculationConfig.expansion_for``),
    and one per adaptive request whose planned ``choices`` picked it."""
    specs = []
    for r in batch:
        speculation = r.request.speculation
        if speculation is None:
            continue
        expansion = speculation.expansion_for(ssm_index, r.remaining)
        choice = (choices or {}).get(r.request_id) if speculation.adaptive else None
        budget = choice.budget if choice is not None and choice.ssm == ssm_index else None
        if expansion is not None or budget is not None:
            context = r.committed
            step = r.stats.llm_steps
            specs.append(
                DraftSpec(
                    r.request_id,
                    context[:-1],
                    context[-1],
                    expansion,
                    r.request.sampling,
                    speculation.draft_support,
                    r.seed,
                    step,
                    draft_stream(ssm_index),
                    budget,
                    len(r.request.prompt_tokens),
                    r.request.constraint,
                )
            )
    return specs


def adaptive_contexts(batch: Sequence[Running]) -> list[Context]:
    """What the planner needs of the batch's adaptive requests, in batch order."""
    return [
        Context(r.request_id, r.committed_len, r.remaining, r.request.speculation.ssms)
        for r in batch
        if r.request.speculation is not None and r.request.speculation.adaptive
    ]


def prompt_shape(batch: Sequence[Running]) -> VerifyShape:
    """The rows and context work of the prompts this step's verify call computes (a request's first step: its context
    before the root, each token attending to those before it), whole: the prefix cache's hits are known once the call
    answered (:func:`specinfer.core.planner.beside_prompts` prices nodes on top of them)."""
    tokens = work = 0
    for r in batch:
        if r.stats.llm_steps == 0:
            p = r.committed_len - 1
            tokens += p
            work += p * (p - 1) // 2
    return VerifyShape(tokens, work)


def static_shape(batch: Sequence[Running]) -> VerifyShape:
    """Verify tokens and context work of the batch's other requests (static trees at full size, or roots)."""
    tokens = work = 0
    for r in batch:
        speculation = r.request.speculation
        if speculation is not None and speculation.adaptive:
            continue
        nodes = 1
        if speculation is not None:
            expansion = speculation.expansion_for(speculation.ssms[0], r.remaining)
            nodes = 1 if expansion is None else merged_tree_nodes(expansion, len(speculation.ssms))
        tokens += nodes
        work += nodes * r.committed_len
    return VerifyShape(tokens, work)


def select_drafts(
    batch: Sequence[Running],
    drafted: Mapping[str, Sequence[tuple[int, DraftTree]]],
    adaptive: AdaptiveSpeculation,
    spent_seconds: float,
) -> dict[str, list[tuple[int, DraftTree]]]:
    """``drafted`` (by request ID: (drafter, tree) pairs, in drafter order) with the trees of adaptive
    requests whose verification allows it (greedy and coupled: :attr:`SamplingParams.prunable`) cut to
    the nodes worth verifying (:meth:`AdaptiveSpeculation.select`); the others' trees count as a fixed
    part of the verify call. Requests verified by multi-step speculative sampling keep their trees
    whole: a cut chosen after the draws could depend on the drawn tokens (see :meth:`DraftTree.subtree`).
    Each of the others is expected to commit one token (at least its bonus token; its acceptance is
    not modelled here)."""
    candidates: list[Drafted] = []
    tokens = work = others = 0
    for r in batch:
        pairs = drafted.get(r.request_id, ())
        context = r.committed_len
        speculation = r.request.speculation
        if (
            speculation is not None
            and speculation.adaptive
            and r.request.sampling.prunable
            and pairs
            and all(t.scores for _, t in pairs)
        ):
            candidates.append(Drafted(r.request_id, context, tuple(pairs)))
            continue
        nodes = len(combine_drafts(r.last_token, [tree for _, tree in pairs]).tree) if pairs else 1
        tokens += nodes
        work += nodes * context
        others += 1
    if not candidates:
        return dict(drafted)
    fixed = VerifyShape(tokens, work)
    return {**drafted, **adaptive.select(candidates, fixed, float(others), spent_seconds, prompt_shape(batch))}


def verify_specs(batch: Sequence[Running], drafted: Mapping[str, Sequence[DraftTree]]) -> list[VerifySpec]:
    """The verify job of every request in ``batch``, in order: the trees ``drafted`` for it (by
    request ID, in SSM order) merged, or its root alone when none was."""
    specs = []
    for r in batch:
        context = r.committed
        draft = combine_drafts(context[-1], drafted.get(r.request_id, ()))
        specs.append(
            VerifySpec(
                r.request_id,
                context[:-1],
                draft,
                r.request.sampling,
                r.seed,
                r.stats.llm_steps,
                logprobs=r.request.logprobs,
                output_start=len(r.request.prompt_tokens),
            )
        )
    return specs
