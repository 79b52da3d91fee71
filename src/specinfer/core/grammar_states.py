"""The engine core's grammar states: one per constrained request of its batch (:mod:`specinfer.core.constraints`).

Before verification each constrained job's tree is walked under its request's grammar (:meth:`GrammarStates.constrain`):
under greedy and coupled verification the nodes the grammar forbids are pruned (any subtree is verified exactly
there) and the job carries the mask after every node; under multi-step speculative sampling the tree stays whole
(a cut chosen after the draws would bias the residuals), and a forbidden node, whose token has probability 0 under
the masked distribution, is always rejected (its row is left unmasked: it is never reached). After the commit the
state consumes the committed tokens (:meth:`GrammarStates.advance`). A state is rebuilt from the request's output
whenever it is missing (a new, resumed, preempted or adopted request), so the grammar is never a second source of
truth beside the committed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from specinfer.core.constraints import Grammars, GrammarState
from specinfer.core.iteration import Running, VerifySpec


class GrammarStates:
    """``grammars``: the tokenizer's compiled grammars (None: this driver has no tokenizer, so takes no
    constrained request)."""

    def __init__(self, grammars: Grammars | None) -> None:
        self.grammars = grammars
        self._states: dict[str, GrammarState] = {}

    def _state(self, r: Running) -> GrammarState:
        state = self._states.get(r.request_id)
        if state is None:
            if self.grammars is None:
                raise RuntimeError(f"request {r.request_id} has a constraint but this engine has no grammars")
            assert r.request.constraint is not None
            state = self._states[r.request_id] = self.grammars.state(r.request.constraint, r.output)
        return state

    def constrain(self, batch: Sequence[Running], jobs: Sequence[VerifySpec]) -> list[VerifySpec]:
        """``jobs`` (one per request of ``batch``, in order) with the constrained ones pruned and masked."""
        out = []
        for r, job in zip(batch, jobs, strict=True):
            if r.request.constraint is None:
                out.append(job)
                continue
            tree = job.draft.tree
            walked = self._state(r).tree(tree.tokens, tree.parents)
            if job.sampling.prunable:
                kept = walked.kept
                draft = job.draft if len(kept) == len(tree) else job.draft.subtree(kept)
                out.append(replace(job, draft=draft, masks=walked.masks[list(kept)]))
            else:
                reachable = np.array(walked.reachable)[:, None]  # [n, 1]
                out.append(replace(job, masks=np.where(reachable, walked.masks, np.int32(-1))))
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
