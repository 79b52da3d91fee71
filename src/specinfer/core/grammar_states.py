"""The engine core's grammar states: one per constrained request of its batch (:mod:`specinfer.core.constraints`).

Before verification each constrained job's tree is walked under its request's grammar (:meth:`GrammarStates.constrain`):
under greedy and coupled verification the nodes the grammar forbids are pruned (any subtree is verified exactly
there) and the job carries the mask after every node; under multi-step speculative sampling the tree stays whole
(a cut chosen after the draws would bias the residuals), and a forbidden node, whose token has probability 0 under
the masked distribution, is always rejected (its row is left unmasked: it is never reached). After the commit the
state consumes the committed tokens (:meth:`GrammarStates.advance`). Below each leaf of the reachable tree, the
grammar's certain tokens (:func:`~specinfer.core.constraints.certain_chains`) are appended as a chain of nodes
that no drafter proposed and that verification accepts whenever their leaf is accepted, within the rows the
request's step may hold (:func:`~specinfer.core.kv_budget.step_rows`). A state is rebuilt from the request's output
whenever it is missing (a new, resumed, preempted or adopted request), so the grammar is never a second source of
truth beside the committed tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specinfer.core.constraints import Grammars, GrammarState
from specinfer.core.errors import InvalidArgument
from specinfer.core.iteration import DraftSpec, Running, VerifySpec

CERTAIN_TOKENS = 16  # most certain tokens in one chain: a JSON schema's fixed keys and punctuation are shorter


@dataclass(frozen=True)
class GrammarSpeculation:
    """How trees are drafted and verified under a grammar. ``prune``: drop the nodes the grammar forbids (greedy and
    coupled verification; False keeps them, never reached, as under MSS: what the pruning saves, measured);
    ``certain_tokens``: most certain tokens appended below one leaf (0: none); ``mask_drafts``: the in-process
    drafters draft no token the grammar forbids (:class:`DraftGrammars`; False: they draft unmasked and the
    forbidden nodes are pruned or rejected after drafting: what the masks save, measured)."""

    prune: bool = True
    certain_tokens: int = CERTAIN_TOKENS
    mask_drafts: bool = True

    def __post_init__(self) -> None:
        if self.certain_tokens < 0:
            raise InvalidArgument("certain_tokens", f"must be at least 0, got {self.certain_tokens}")


DEFAULT_GRAMMAR_SPECULATION = GrammarSpeculation()


class GrammarStates:
    """``grammars``: the tokenizer's compiled grammars (None: this driver has no tokenizer, so takes no
    constrained request); ``config``: what the trees get under a grammar."""

    def __init__(self, grammars: Grammars | None, config: GrammarSpeculation = DEFAULT_GRAMMAR_SPECULATION) -> None:
        self.grammars = grammars
        self.config = config
        self._states: dict[str, GrammarState] = {}
        self.steps = 0  # steps that walked a constrained request's tree
        self.seconds = 0.0  # what those walks took (masks and certain tokens), all requests of a step together

    def _state(self, r: Running) -> GrammarState:
        state = self._states.get(r.request_id)
        if state is None:
            if self.grammars is None:
                raise RuntimeError(f"request {r.request_id} has a constraint but this engine has no grammars")
            assert r.request.constraint is not None
            state = self._states[r.request_id] = self.grammars.state(r.request.constraint, r.output)
        return state

    def constrain(self, batch: Sequence[Running], jobs: Sequence[VerifySpec], rows: Sequence[int]) -> list[VerifySpec]:
        """``jobs`` (one per request of ``batch``, in order) with the constrained ones pruned, extended by their
        certain tokens and masked; ``rows[i]``: the most nodes job i's tree may have (its step's KV rows)."""
        started = time.perf_counter()
        out = []
        for r, job, most in zip(batch, jobs, rows, strict=True):
            if r.request.constraint is None:
                out.append(job)
                continue
            state = self._state(r)
            draft, tree = job.draft, job.draft.tree
            walked = state.tree(tree.tokens, tree.parents)
            if job.sampling.prunable and self.config.prune:
                kept = list(walked.kept)
                masks = walked.masks[kept]  # [k, W]
            else:  # forbidden nodes stay, unmasked: never reached (their parents' rows give them probability 0)
                kept = list(range(len(tree)))
                masks = np.where(np.array(walked.reachable)[:, None], walked.masks, np.int32(-1))  # [n, W]
            chains = {}
            if self.config.certain_tokens:
                room, depth = most - len(kept), r.remaining - 1
                chains = state.chains(tree.tokens, tree.parents, walked, room, depth, self.config.certain_tokens)
            if len(kept) < len(tree):
                draft = draft.subtree(kept)
            if chains:
                index = {old: new for new, old in enumerate(kept)}
                draft = draft.with_chains({index[u]: chain for u, (chain, _) in chains.items()})
                masks = np.concatenate([masks, *(m for _, m in chains.values())])
            out.append(replace(job, draft=draft, masks=masks))
        if any(r.request.constraint is not None for r in batch):
            self.steps += 1
            self.seconds += time.perf_counter() - started
        return out

    def advance(self, r: Running, tokens: Sequence[int], finished: bool) -> None:
        """Request ``r`` commits ``tokens`` (and ends with them where ``finished``)."""
        if r.request.constraint is None:
            return
        if finished:
            self._states.pop(r.request_id, None)
        else:
            self._state(r).advance(tokens)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


class DraftGrammars:
    """A drafter's grammar states (an SSM worker's, the in-process executor's, a verifier's draft head's): one per
    constrained request it drafts for, so that no draft node is a token the request's grammar forbids after its path
    (:func:`specinfer.models.drafting.draft_trees` masks each pass's rows with :meth:`masks` of the :meth:`states`).
    A state remembers the output it consumed; a job whose committed output extends it advances it by the new tokens,
    any other (a new, resumed, preempted or rolled back request) rebuilds it from the job's output, so the drafter
    never holds a second truth beside the committed tokens. :meth:`forget` drops a request's state when its caches
    are released. ``grammars``: compiled for the token IDs the drafter drafts in (the LLM's)."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._states: dict[str, tuple[GrammarState, list[int]]] = {}
        self.seconds = 0.0  # what the masks took, all passes together

    def _state(self, job: DraftSpec) -> GrammarState:
        assert job.constraint is not None
        output = [*job.context_tokens, job.root_token][job.output_start :]
        held = self._states.get(job.request_id)
        if held is not None and held[0].constraint == job.constraint and output[: len(held[1])] == held[1]:
            state, seen = held
            state.advance(output[len(seen) :])
        else:
            state = self.grammars.state(job.constraint, output)
        self._states[job.request_id] = (state, output)
        return state

    def states(self, jobs: Sequence[DraftSpec]) -> dict[int, GrammarState]:
        """The grammar state after each constrained job's committed output, by job index (once per draft call)."""
        started = time.perf_counter()
        out = {}
        for i, job in enumerate(jobs):
            if job.constraint is None:
                continue
            try:
                out[i] = self._state(job)
            except RuntimeError as e:  # a committed output the grammar refuses: the job is wrong, not the drafter
                self._states.pop(job.request_id, None)
                raise InvalidArgument("constraint", f"the committed output breaks the grammar: {e}") from None
        self.seconds += time.perf_counter() - started
        return out

    def masks(self, state: GrammarState, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """The tokens ``state``'s grammar allows after each of ``paths`` (frontier nodes' paths below the job's
        root).  # [len(paths), W] int32"""
        started = time.perf_counter()
        out = state.after(paths)
        self.seconds += time.perf_counter() - started
        return out

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._states)
