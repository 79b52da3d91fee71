"""In-process tree-based speculative generation for a batch of requests.

Each :meth:`SpeculativeEngine.step` runs one iteration for every active request:

1. *speculate*: every SSM a request names grows its draft tree depth by depth (all requests
   drafting with that SSM in one batched forward per depth); trees of several SSMs are merged;
2. *verify*: one batched LLM forward over every node of every tree, then greedy verification
   or multi-step speculative sampling per request;
3. *commit*: accepted tokens plus the bonus token are appended, stop conditions checked.

Requests can be added between steps (continuous batching); KV caches live in the backends and
follow the committed tokens automatically (see :mod:`specinfer.models.interface`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core import DraftTree, InvalidArgument, TokenTree, combine_drafts
from specinfer.core.errors import check_token_ids
from specinfer.core.requests import GenerationRequest, GenerationResult, StepStats, commit_tokens
from specinfer.engine.steps import DraftJob, VerifyJob, draft_trees, verify_trees
from specinfer.models.interface import CausalLM


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch``: most requests per iteration; ``eos_token_id``: ends a request unless it
    sets ``ignore_eos`` (None: the model has no EOS)."""

    max_batch: int = 64
    eos_token_id: int | None = None


VERIFY_STREAM = 0  # random stream IDs within a step: 0 verifies, 1 + i drafts with SSM i


def step_rng(seed: int, step: int, stream: int) -> np.random.Generator:
    """The random stream of one role in one verify step of a request.

    Derived from (request seed, step, role) alone, so the same seed gives the same output in
    process and through the services, whichever worker drafts or verifies a step.
    """
    return np.random.default_rng([seed, step, stream])


class _Active:
    """Mutable state of one running request."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.committed = list(request.prompt_tokens)
        self.result = GenerationResult(request.request_id, request.prompt_tokens)
        seed = request.sampling.seed
        self.seed = int(np.random.SeedSequence().entropy % (1 << 63)) if seed is None else seed

    def rng(self, stream: int) -> np.random.Generator:
        return step_rng(self.seed, len(self.result.steps), stream)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.result.output_tokens)


class SpeculativeEngine:
    """One LLM and any number of SSMs; see the module docstring."""

    def __init__(self, llm: CausalLM, ssms: Sequence[CausalLM], config: EngineConfig) -> None:
        for i, ssm in enumerate(ssms):
            if ssm.vocab_size != llm.vocab_size:
                raise InvalidArgument(f"ssms[{i}]", f"vocabulary size {ssm.vocab_size} differs from the LLM's {llm.vocab_size}")
        self.llm = llm
        self.ssms = list(ssms)
        self.config = config
        self._active: dict[str, _Active] = {}
        self._waiting: list[_Active] = []
        # a request holds a KV cache in every model until it finishes: admit no more than all hold
        limits = [m.max_requests for m in (llm, *ssms) if m.max_requests is not None]
        self._capacity = min([config.max_batch, *limits])

    # -- request lifecycle ------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        vocab = self.llm.vocab_size
        check_token_ids("prompt_tokens", request.prompt_tokens, vocab)
        check_token_ids("stop_token_ids", request.stop_token_ids, vocab)
        limit = self.llm.max_positions
        if len(request.prompt_tokens) + request.max_new_tokens > limit:
            raise InvalidArgument(
                "max_new_tokens", f"prompt ({len(request.prompt_tokens)}) + max_new_tokens ({request.max_new_tokens}) exceeds the model's {limit} positions"
            )
        spec = request.speculation
        if spec is not None:
            unknown = [s for s in spec.ssms if not 0 <= s < len(self.ssms)]
            if unknown:
                raise InvalidArgument("speculation.ssms", f"unknown SSM index {unknown[0]} (the engine has {len(self.ssms)})")

    def add(self, request: GenerationRequest) -> None:
        self.validate(request)
        if request.request_id in self._active or any(w.request.request_id == request.request_id for w in self._waiting):
            raise InvalidArgument("request_id", f"{request.request_id!r} is already running")
        self._waiting.append(_Active(request))

    def cancel(self, request_id: str) -> GenerationResult | None:
        state = self._active.pop(request_id, None)
        if state is None:
            for w in self._waiting:
                if w.request.request_id == request_id:
                    self._waiting.remove(w)
                    state = w
        if state is None:
            return None
        state.result.finish_reason = "cancelled"
        self._release(request_id)
        return state.result

    def running(self) -> list[GenerationResult]:
        """Results of the requests admitted and not finished; live objects that each step extends
        (e.g. to time when tokens are committed)."""
        return [s.result for s in self._active.values()]

    @property
    def has_work(self) -> bool:
        return bool(self._active or self._waiting)

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
        return [done[r.request_id] for r in requests]

    # -- one iteration ------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """One speculate/verify/commit iteration; returns the requests that finished."""
        while self._waiting and len(self._active) < self._capacity:
            w = self._waiting.pop(0)
            self._active[w.request.request_id] = w
        states = list(self._active.values())
        if not states:
            return []
        drafts = self._speculate(states)
        jobs = [VerifyJob(s.request.request_id, s.committed[:-1], d, s.request.sampling, s.rng(VERIFY_STREAM)) for s, d in zip(states, drafts, strict=True)]
        finished = []
        for state, draft, result in zip(states, drafts, verify_trees(self.llm, jobs), strict=True):
            if self._commit(state, draft.tree, result):
                finished.append(state.result)
                del self._active[state.request.request_id]
                self._release(state.request.request_id)
        return finished

    def _speculate(self, states: list[_Active]) -> list[DraftTree]:
        """Every SSM drafts for the requests that name it; several trees per request merge."""
        per_request: list[list[DraftTree]] = [[] for _ in states]
        for ssm_index, ssm in enumerate(self.ssms):
            jobs, owners = [], []
            for i, s in enumerate(states):
                spec = s.request.speculation
                expansion = spec.expansion_for(ssm_index, s.remaining) if spec else None
                if expansion is not None:
                    rng = s.rng(1 + ssm_index)
                    jobs.append(DraftJob(s.request.request_id, s.committed[:-1], s.committed[-1], expansion, s.request.sampling, spec.draft_support, rng))
                    owners.append(i)
            for i, tree in zip(owners, draft_trees(ssm, jobs) if jobs else [], strict=True):
                per_request[i].append(tree)
        return [combine_drafts(s.committed[-1], trees) for s, trees in zip(states, per_request, strict=True)]

    def _commit(self, state: _Active, tree: TokenTree, result) -> bool:
        """Append the step's tokens; True when the request is finished."""
        req = state.request
        eos = None if req.ignore_eos else self.config.eos_token_id
        tokens, reason = commit_tokens(result.new_tokens, state.remaining, eos, frozenset(req.stop_token_ids))
        state.committed.extend(tokens)
        state.result.output_tokens.extend(tokens)
        state.result.steps.append(StepStats(len(tree), result.num_accepted, result.bonus_token, len(tokens)))
        state.result.finish_reason = reason
        return reason is not None

    def _release(self, request_id: str) -> None:
        self.llm.release(request_id)
        for ssm in self.ssms:
            ssm.release(request_id)
