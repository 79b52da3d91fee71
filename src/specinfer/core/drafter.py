"""The drafter seam: what the engine core asks of each kind of draft.

A *drafter* proposes draft trees for a batch's requests within the planner's budgets, hears each verdict, and
forgets a request that leaves the batch. The kinds are modules of :mod:`specinfer.core.drafters`, registered
there by name (its :data:`~specinfer.core.drafters.DRAFTERS`, in the order their trees merge): the SSMs over the
executor, suffix drafts from a request's own text, the verifier's draft head. The engine core
(:class:`~specinfer.core.engine_core.EngineCore`) and the adaptive planner iterate over them and know none.

A drafter's trees carry a *drafter key* (:data:`DrafterKey`), which the acceptance statistics, the edge
calibration and the cut before verification (:meth:`~specinfer.core.adaptive.AdaptiveSpeculation.select`)
are kept by: an SSM's index (the planner plans SSMs by the index requests name them with), or the drafter's
name.

No I/O beyond the executor's calls; a drafter's state is per request (what :meth:`Drafter.forget` drops) or
its own measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specinfer.core.drafts import DraftTree

if TYPE_CHECKING:  # the engine core and the planner import this module
    from specinfer.core.adaptive import AdaptiveSpeculation, Choice, Context
    from specinfer.core.engine_core import Executor, Verdict
    from specinfer.core.iteration import Running, StepOutcome, VerifySpec

DrafterKey = int | str  # who drafted a tree: an SSM's index, or a drafter's name
Drafts = dict[str, list[tuple[DrafterKey, DraftTree]]]  # a step's trees by request ID, as (drafter key, tree) pairs


@dataclass(frozen=True)
class Models:
    """What the driver drafts with: its ``executor`` (SSMs and verifier), and ``head``: whether its verifier has a
    draft head (:mod:`specinfer.models.head_drafter`)."""

    executor: Executor
    head: bool


@dataclass(frozen=True)
class DraftStep:
    """One step as the drafters see it: the ``batch``, the plan's ``choices`` for its adaptive requests, and
    ``adaptive``, the state that planned them (None: the batch has no adaptive request, or the core has no
    adaptive state). ``learning``: the adaptive state where one exists (built earlier), which learns the model
    calls' costs whether or not this step plans. ``num_ssms``: the SSMs the executor drafts with."""

    batch: Sequence[Running]
    choices: Mapping[str, Choice]
    adaptive: AdaptiveSpeculation | None
    learning: AdaptiveSpeculation | None
    num_ssms: int


@dataclass(frozen=True)
class Proposal:
    """A drafter's trees for a step, by request ID as (drafter key, tree) pairs, and the model seconds it spent
    (what the cut before verification counts as spent already); ``predicted``: the cost model's seconds for those
    model calls, read before they taught it (0 where nothing was predicted)."""

    trees: Mapping[str, Sequence[tuple[DrafterKey, DraftTree]]]
    seconds: float = 0.0
    predicted: float = 0.0


NO_PROPOSAL = Proposal({})


class Drafter(Protocol):
    """One kind of draft (see the module docstring). A step calls, in this order: :meth:`narrow` (adaptive steps),
    :meth:`propose`, :meth:`verifying` (after the cut), :meth:`observe` for each verified live request (before its
    commit), :meth:`stepped`. All but :meth:`propose` default to doing nothing: a drafter subclassing this
    protocol keeps those it does not need."""

    name: str  # its registration key (and the key of its trees, unless it drafts for several models)

    def narrow(
        self, batch: Sequence[Running], contexts: Sequence[Context], adaptive: AdaptiveSpeculation
    ) -> Sequence[Context]:
        """The planner's view of the adaptive requests, narrowed by what this drafter has at hand."""
        return contexts

    async def propose(self, step: DraftStep) -> Proposal:
        """This step's trees (within the plan's budgets where the drafter is planned)."""
        ...

    def verifying(
        self,
        batch: Sequence[Running],
        drafted: Drafts,
        jobs: Sequence[VerifySpec],
        adaptive: AdaptiveSpeculation | None,
    ) -> Sequence[VerifySpec]:
        """The verify jobs, with what this drafter asks of verification; ``drafted``: the trees the cut kept."""
        return jobs

    def observe(self, r: Running, job: VerifySpec, verdict: Verdict, outcome: StepOutcome) -> None:
        """A live request's verdict, before its outcome is committed (the commit may forget the request)."""

    def stepped(self, batch_size: int, committed_tokens: int, seconds: float, measured: bool) -> None:
        """The step's end: its committed tokens and seconds (``measured``: no verify call prefilled a prompt)."""

    def forget(self, request_id: str) -> None:
        """The request left the batch (finished, preempted, moved): its state goes."""
