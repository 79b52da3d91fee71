"""Suffix drafts (:mod:`specinfer.core.suffix`): model-free trees from a request's own committed text.

Each adaptive greedy or coupled request that allows it and whose text repeats gets a suffix tree within the
planner's limits, less the nodes its plan gave an SSM (the cut that follows keeps what pays). Microseconds a
request: no model runs.
"""

from __future__ import annotations

from specinfer.core.drafter import NO_PROPOSAL, Drafter, DrafterKey, DraftStep, Models, Proposal
from specinfer.core.drafts import DraftTree
from specinfer.core.iteration import Running
from specinfer.core.suffix import SuffixConfig, TokenHistory

# Matches of at least two tokens (a lone repeated token proposes too much that the LLM rejects); the planner's
# limits bound the rest per request
SUFFIX_CONFIG = SuffixConfig(min_match=2)


class SuffixDrafter(Drafter):
    """Suffix trees (see the module docstring), from each request's history kept up to date between steps."""

    name = "suffix"

    def __init__(self, models: Models) -> None:
        self._histories: dict[str, TokenHistory] = {}  # committed tokens of requests that draft suffix trees

    async def propose(self, step: DraftStep) -> Proposal:
        if step.adaptive is None:
            return NO_PROPOSAL
        limits = step.adaptive.config
        trees: dict[str, list[tuple[DrafterKey, DraftTree]]] = {}
        for r in step.batch:
            speculation = r.request.speculation
            if speculation is None or not (speculation.adaptive and speculation.suffix and r.request.sampling.prunable):
                continue
            choice = step.choices.get(r.request_id)
            nodes = limits.max_nodes - (choice.budget.nodes if choice is not None else 1)
            depth = min(limits.max_depth, r.remaining - 1)
            if nodes <= 0 or depth <= 0:
                continue
            tree = self._history(r).suffix_tree(
                SUFFIX_CONFIG.within(nodes, depth), with_q=not r.request.sampling.greedy
            )
            if len(tree.tree) > 1:
                trees[r.request_id] = [(self.name, tree)]
        return Proposal(trees)

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

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
