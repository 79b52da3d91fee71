"""Which requests run each iteration, and on which verifier replica: :class:`Placement` plans it.

It applies :func:`~specinfer.core.kv_budget.schedule` (the in-process engine's rule) over the live
replicas' budgets, less what other request managers hold there, and records the plan (where each
request runs, what our requests hold on each replica once the iteration's verify call has run) in
the verifier's :class:`~specinfer.request_manager.cluster.placement_map.PlacementMap`, the one owner
of placements and KV block counts, which it also asks for the budgets and the placement before it.

*Stepping back.* Other request managers may hold so much of the replicas that even our oldest request
fits in none of what they leave (each fits a replica alone), or a replica may refuse our step for lack
of blocks (:meth:`Placement.refused`): two managers whose requests grow into the same blocks would wait
for each other forever. So every request of ours waits (its blocks go to theirs) and comes back after a
random pause, with fresh counts, so that two managers stepping back at once do not return together.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence

from specinfer.core.kv_budget import KVBudget, Replicas, Schedule, StepRows, schedule
from specinfer.request_manager.cluster.placement_map import PlacementMap
from specinfer.request_manager.cluster.remote import Verifiers

log = logging.getLogger("specinfer.request_manager")
# seconds before a verifier replica's free KV block count is asked again (when no verify call told it)
FREE_BLOCKS_MAX_AGE = 1.0


class Placement:
    """Admission and placement over the verifier replicas (see the module docstring). ``backoff_seconds``
    scales the random pause of a step back."""

    def __init__(self, verifier: Verifiers, backoff_seconds: float) -> None:
        self.verifier = verifier
        self.backoff_seconds = backoff_seconds
        self._step_back = False  # a replica refused a step for lack of KV blocks: the next plan steps back
        self._paused_until = 0.0  # time.monotonic() before which nothing is admitted (stepping back for other managers)

    @property
    def map(self) -> PlacementMap:
        """The verifier's placements and KV block counts, which the plans are recorded in."""
        return self.verifier.placement_map

    def refused(self) -> None:
        """A replica refused this manager's step for lack of KV blocks: the next plan steps back."""
        self._step_back = True

    async def plan(
        self,
        running: Sequence[tuple[str, StepRows]],
        waiting: Sequence[tuple[str, StepRows]],
        committed: Mapping[str, int],
        kv_budgets: Sequence[KVBudget],
        max_batch: int,
        max_prefill_tokens: int,
    ) -> tuple[Schedule, list[str], dict[str, int]] | None:
        """This iteration's schedule of ``running`` and ``waiting`` requests (oldest first; ``committed``:
        each one's committed tokens) with the live replicas it places them on and the placement before it
        (request -> replica index); None while no replica is live or while stepping back."""
        replicas = self.verifier.live()
        if not replicas or time.monotonic() < self._paused_until:
            return None
        before = self.map.indices(replicas)
        await self.verifier.refresh_free(FREE_BLOCKS_MAX_AGE)
        budgets = self.map.budgets(replicas)
        plan = None  # a replica refused our last step for lack of KV blocks: step back
        if not self._step_back:
            plan = schedule(
                kv_budgets, running, waiting, max_batch, max_prefill_tokens, Replicas(tuple(budgets), before)
            )
        # None, or Overfull: our oldest request fits in none of what the other managers leave
        if not isinstance(plan, Schedule):
            plan = Schedule((), tuple(rid for rid, _ in running), (), (), {}, (0,) * len(replicas))
            self._paused_until = time.monotonic() + random.uniform(0.5, 1.5) * self.backoff_seconds
            log.warning(
                "every running request waits: other request managers hold the verifiers' KV blocks",
                extra={"requests": len(running)},
            )
        self._step_back = False
        self.map.hold(plan, replicas, budgets, committed)
        return plan, replicas, before

    async def place(self, plan: Schedule, replicas: Sequence[str], before: Mapping[str, int]) -> None:
        """Place the requests of ``plan`` (with the ``replicas`` and the placement ``before`` it, as
        :meth:`plan` returned them). A placed request the plan moves (its replica has no room for it now)
        has its cache there released first; it is rebuilt on the new one."""
        moved = [rid for rid, r in plan.placement.items() if self.map.where(rid) is not None and before.get(rid) != r]
        if moved:
            await self.verifier.release(moved)
        self.map.place({rid: replicas[r] for rid, r in plan.placement.items()})
