"""The in-process executor of the engine core: the SSMs and the LLM called directly.

Its methods never suspend, so the in-process engine runs :meth:`specinfer.core.engine_core.EngineCore.step`
to the end with :func:`~specinfer.core.engine_core.run_to_end`, without an event loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial

from specinfer.core.engine_core import DraftRound, Verdict, VerifyRound
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.models.drafting import draft_trees
from specinfer.models.interface import CausalLM
from specinfer.models.verification import verify_trees


class LocalExecutor:
    """Drafts with ``ssms`` one after another (they share this process's cores) and verifies with ``llm``."""

    def __init__(self, llm: CausalLM, ssms: Sequence[CausalLM]) -> None:
        self.llm = llm
        self.ssms = list(ssms)

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound:
        passes: list[tuple[int, int, float]] = []
        trees = {}
        for ssm_index, specs in jobs.items():
            on_pass = partial(_record, passes, ssm_index)
            trees[ssm_index] = {
                s.request_id: tree
                for s, tree in zip(specs, draft_trees(self.ssms[ssm_index], specs, on_pass), strict=True)
            }
        return DraftRound(trees, tuple(passes))

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound:
        started = time.perf_counter()
        results = verify_trees(self.llm, jobs)
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
