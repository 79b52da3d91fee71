"""The in-process executor of the engine core: the SSMs and the LLM called directly.

Its methods never suspend, so the in-process engine runs :meth:`specinfer.core.engine_core.EngineCore.step`
to the end with :func:`~specinfer.core.engine_core.run_to_end`, without an event loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial

from specinfer.core.constraints import Grammars
from specinfer.core.engine_core import DraftRound, Verdict, VerifyRound
from specinfer.core.grammar_states import DraftGrammars
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.models.drafting import draft_trees
from specinfer.models.interface import CausalLM
from specinfer.models.verification import verify_trees


class LocalExecutor:
    """Drafts with ``ssms`` one after another (they share this process's cores) and verifies with ``llm``.
    ``grammars``: the LLM tokenizer's (None: none), which mask constrained requests' drafts (the SSMs' and the
    LLM's draft head's) through one :class:`DraftGrammars`: the SSMs draft in the LLM's token IDs, a
    cross-tokenizer one through its wrapper (:mod:`specinfer.models.cross_vocab`)."""

    def __init__(self, llm: CausalLM, ssms: Sequence[CausalLM], grammars: Grammars | None = None) -> None:
        self.llm = llm
        self.ssms = list(ssms)
        self.draft_grammars = DraftGrammars(grammars) if grammars is not None else None

    def forget(self, request_id: str) -> None:
        """A request's caches were released: its drafting grammar state goes too."""
        if self.draft_grammars is not None:
            self.draft_grammars.forget(request_id)

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound:
        passes: list[tuple[int, int, float]] = []
        trees = {}
        for ssm_index, specs in jobs.items():
            on_pass = partial(_record, passes, ssm_index)
            drafted = draft_trees(self.ssms[ssm_index], specs, on_pass, self.draft_grammars)
            trees[ssm_index] = {s.request_id: tree for s, tree in zip(specs, drafted, strict=True)}
        return DraftRound(trees, tuple(passes))

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound:
        started = time.perf_counter()
        results = verify_trees(self.llm, jobs, self.draft_grammars)
        seconds = time.perf_counter() - started
        verdicts = {
            j.request_id: Verdict(
                r.accepted_tokens, r.bonus_token, self.llm.prefix_hits(j.request_id), r.next_tree, r.logprobs
            )
            for j, r in zip(jobs, results, strict=True)
        }
        return VerifyRound(verdicts, timings=(("local", tuple(jobs), seconds),))


def _record(passes: list[tuple[int, int, float]], ssm_index: int, frontier_tokens: int, seconds: float) -> None:
    passes.append((ssm_index, frontier_tokens, seconds))
