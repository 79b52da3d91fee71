"""KV budgets: which requests run an iteration when KV memory, not the batch size, is the limit.

Terms:

- *KV budget* of one model: ``blocks`` KV blocks of ``block_size`` token rows (a *KV block* as in
  :mod:`specinfer.kernels.metadata`). A contiguous KV slot per request is the case of one block per
  request: ``block_size`` is the slot's rows and ``blocks`` the number of slots.
- *Step rows* of a request (:class:`StepRows`, :func:`step_rows`): the KV rows it may hold during its
  next step, its committed tokens (prompt and output so far) plus the nodes the step adds: in the
  LLM's cache the tree it verifies, in an SSM's cache every node that SSM expands while drafting
  (more than the tree for a dynamic tree). It needs ``ceil(rows / block_size)`` blocks of a budget.

:func:`schedule` is the admission rule of both drivers, the in-process engine and the request
manager. It is first come, first served on KV:

- Running requests keep their place, oldest first, as long as all of them up to that one fit.
  The first that does not fit, and every newer one, is *preempted*: its caches are released and it
  waits again at the head of the queue. When blocks are free it is re-admitted, and its caches are
  rebuilt from its committed tokens, the way a lost cache is (:mod:`specinfer.models.interface`).
  So nothing it generated is lost and its output is unchanged.
- Waiting requests (preempted ones first) are then admitted in order while every budget has their
  blocks and the batch has room, stopping at the first that does not fit, so a long request is not
  passed over forever by short ones.

The oldest running request always fits as long as each request fits every budget alone at its
longest (drivers check that when a request arrives), so an admitted request never fails for lack
of KV.

*Replicas* (:class:`Replicas`): the LLM may run as several verifier replicas, each with its own KV
budget, and a request holds its LLM cache on exactly one of them, its *placement*. A request keeps
its replica while it fits there (its cache lives there); one not placed yet (new, or its replica
failed) goes to the replica with the most free blocks once it is in (the fewest rows where replicas
report no budget), and a running one that no longer fits on its own moves to such a replica rather
than being preempted (a move rebuilds its cache there, as a preemption would). The other budgets
(the SSMs' caches) hold every request, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specinfer.core.drafts import merged_tree_nodes
from specinfer.core.errors import InvalidArgument
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import GenerationRequest


def blocks_for(rows: int, block_size: int) -> int:
    """KV blocks of ``block_size`` rows that hold ``rows`` token rows (logical positions)."""
    return -(-rows // block_size)


@dataclass(frozen=True)
class StepRows:
    """The most KV rows a request may hold during its next step: ``verify`` in the LLM's cache,
    ``draft`` in an SSM's (see :func:`step_rows`)."""

    verify: int
    draft: int


@dataclass(frozen=True)
class KVBudget:
    """One model's KV memory: ``blocks`` KV blocks of ``block_size`` token rows (see the module
    docstring). ``drafts``: an SSM's cache, which holds a request's :attr:`StepRows.draft` rows; else
    the LLM's, which holds its :attr:`StepRows.verify` rows."""

    block_size: int
    blocks: int
    drafts: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.blocks < 0:
            raise ValueError(f"invalid KV budget {self}")

    def blocks_for(self, rows: int) -> int:
        """KV blocks of this budget that hold ``rows`` token rows."""
        return blocks_for(rows, self.block_size)

    def needs(self, rows: StepRows) -> int:
        """KV blocks of this budget a request with ``rows`` takes."""
        return self.blocks_for(rows.draft if self.drafts else rows.verify)

    def holds(self, rows: StepRows) -> bool:
        """Whether the whole budget holds a request with ``rows`` alone."""
        return self.needs(rows) <= self.blocks


@dataclass(frozen=True)
class PrefixCacheStats:
    """A backend's prefix cache so far (:mod:`specinfer.models.native.paged_pool`): ``queried_tokens``,
    context tokens its requests' caches lacked when they were looked up in it (a new request's context,
    a rebuild after preemption); ``hit_tokens``, those of them it held, which were not computed."""

    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True)
class Schedule:
    """What :func:`schedule` decided. ``run``: the iteration's requests, oldest first (kept running
    ones, then admitted ones); ``preempted``: running requests to put back at the head of the queue,
    oldest first; ``admitted``: waiting requests that join, in queue order; ``blocks_used``: per budget,
    the blocks ``run`` needs."""

    run: tuple[str, ...]
    preempted: tuple[str, ...]
    admitted: tuple[str, ...]
    blocks_used: tuple[int, ...]
    placement: Mapping[str, int] = field(
        default_factory=dict
    )  # with replicas: each request of ``run`` -> its replica's index
    replica_blocks_used: tuple[int, ...] = ()  # with replicas: per replica, the blocks its requests of ``run`` need


@dataclass(frozen=True)
class Overfull:
    """What :func:`schedule` decides when the oldest running request fits in none of the budgets even
    alone. In process that is a request its driver should have refused (:func:`check_fits_alone`);
    across request managers, what the others hold leaves ours too little: every request of ours steps
    back (``specinfer.request_manager.scheduling.placement``). ``holds``: the budgets, for the message."""

    request_id: str
    rows: StepRows
    holds: str

    def __str__(self) -> str:
        return f"request {self.request_id!r} needs {self.rows} KV rows, more than a KV budget holds ({self.holds})"


@dataclass(frozen=True)
class Replicas:
    """The LLM's verifier replicas (module docstring): ``budgets``, each replica's KV budget (None:
    it reports none, and only the rows placed on it are balanced); ``placement``, request ID -> the
    index of the replica holding its cache (a request missing is not placed: new, or its replica is gone)."""

    budgets: tuple[KVBudget | None, ...]
    placement: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.budgets:
            raise ValueError("no replica to place requests on")


def replica_takes(budget: KVBudget | None, rows: StepRows) -> int:
    """What a request with ``rows`` takes on a verifier replica with ``budget``: blocks, or verify rows
    where the replica reports no budget (the unit :func:`replica_for` balances it in)."""
    return budget.needs(rows) if budget is not None else rows.verify


def replica_for(
    replicas: Replicas, used: Sequence[int], request_id: str, rows: StepRows, must_fit: bool = True
) -> int | None:
    """The replica (index into ``replicas.budgets``) ``request_id`` with ``rows`` runs on if it joins now,
    while ``used[r]`` is what the requests placed before it take on replica r (:func:`replica_takes`): its
    home (``replicas.placement``) while it fits there, else the one with the most room left once it is in
    (the lowest index on a tie); None when none has room. ``must_fit`` False: the one with the most room
    even when none has room (for a call that must go somewhere; the replica may refuse it).

    The placement rule of :func:`schedule`, and of the request manager's requests no schedule placed
    (``specinfer.request_manager.cluster.placement_map``)."""
    budgets = replicas.budgets

    def room(r: int) -> int:  # what r has left once the request is in (rows placed, negated, without a budget)
        b = budgets[r]
        return b.blocks - used[r] - b.needs(rows) if b is not None else -used[r] - rows.verify

    def fits_on(r: int) -> bool:
        b = budgets[r]
        return not must_fit or b is None or used[r] + b.needs(rows) <= b.blocks

    home = replicas.placement.get(request_id)
    if home is not None and 0 <= home < len(budgets) and fits_on(home):
        return home
    candidates = [r for r in range(len(budgets)) if fits_on(r)]
    return max(candidates, key=lambda r: (room(r), -r)) if candidates else None


def step_rows(request: GenerationRequest, committed: int, num_ssms: int, planner: PlannerConfig) -> StepRows:
    """The most KV rows ``request`` may hold during its next step with ``committed`` tokens (prompt
    and output so far) behind it.

    - No speculation (or no SSM): the root alone.
    - A static tree: the LLM verifies the trees of its SSMs merged
      (:func:`~specinfer.core.drafts.merged_tree_nodes`); each SSM expands the nodes of its own tree.
    - An adaptive tree: the LLM verifies at most ``planner.max_nodes`` nodes. The SSM expands more:
      each of its at most ``planner.max_depth`` passes expands the newest depth's nodes of the tree
      so far (at most ``max_nodes - 1`` after the root's pass), and slots drafted later may push them
      out of the tree, while the SSM's cache keeps every node it ran on.
    """
    spec = request.speculation
    if spec is None or num_ssms == 0:
        return StepRows(committed + 1, committed + 1)
    if spec.expansion is None:
        return StepRows(committed + planner.max_nodes, committed + 1 + planner.max_depth * (planner.max_nodes - 1))
    return StepRows(committed + merged_tree_nodes(spec.expansion, len(spec.ssms)), committed + spec.expansion.max_nodes)


def check_fits_alone(
    request: GenerationRequest, budgets: Sequence[KVBudget], num_ssms: int, planner: PlannerConfig
) -> None:
    """Refuse ``request`` (InvalidArgument naming ``max_new_tokens``) unless, alone and at its longest
    (prompt, every new token and its largest tree), it fits every budget: a driver could never run
    it, and :func:`schedule` relies on the oldest running request fitting."""
    rows = step_rows(request, len(request.prompt_tokens) + request.max_new_tokens, num_ssms, planner)
    for budget in budgets:
        if not budget.holds(rows):
            cache = "an SSM's" if budget.drafts else "the LLM's"
            raise InvalidArgument(
                "max_new_tokens",
                f"prompt + max_new_tokens + tree take {budget.needs(rows)} KV blocks; "
                f"{cache} KV cache holds {budget.blocks} of {budget.block_size} rows",
            )


def schedule(
    budgets: Sequence[KVBudget],
    running: Sequence[tuple[str, StepRows]],
    waiting: Sequence[tuple[str, StepRows]],
    max_batch: int,
    max_admit_rows: int = 0,
    replicas: Replicas | None = None,
) -> Schedule | Overfull:
    """Decide an iteration's requests (module docstring). ``running``: (request ID, step rows) of the
    running requests, oldest first; ``waiting``: the same of the waiting ones, in queue order;
    ``max_batch``: most requests an iteration runs. With no budgets, only ``max_batch`` limits.
    ``max_admit_rows``: most verify rows the requests admitted in one iteration may hold together,
    past the first one admitted (0: no cap). Their prompts are prefilled in the iteration's one
    forward pass, and on a CPU a pass of tens of thousands of tokens runs slower per token than
    several smaller ones (BENCHMARKS.md, "Paged KV cache"), while running requests wait for it.
    ``replicas``: the LLM's verifier replicas, each request placed on one (module docstring); the
    result's ``placement`` says where each request of ``run`` is.

    :class:`Overfull` when the oldest running request does not fit alone."""
    used = [0] * len(budgets)
    replica_budgets = replicas.budgets if replicas is not None else ()
    replica_used = [0] * len(replica_budgets)  # blocks, or rows where the replica reports no budget
    placement: dict[str, int] = {}

    def fits(request_id: str, rows: StepRows) -> bool:
        if not all(u + b.needs(rows) <= b.blocks for u, b in zip(used, budgets, strict=True)):
            return False
        return replicas is None or replica_for(replicas, replica_used, request_id, rows) is not None

    def take(request_id: str, rows: StepRows) -> None:
        for i, b in enumerate(budgets):
            used[i] += b.needs(rows)
        if replicas is not None:
            r = replica_for(replicas, replica_used, request_id, rows)
            assert r is not None
            replica_used[r] += replica_takes(replica_budgets[r], rows)
            placement[request_id] = r

    kept: list[str] = []
    for request_id, rows in running:
        if len(kept) >= max_batch or not fits(request_id, rows):
            break
        take(request_id, rows)
        kept.append(request_id)
    if running and not kept:
        return Overfull(running[0][0], running[0][1], f"{list(budgets)}, replicas {list(replica_budgets)}")
    preempted = tuple(request_id for request_id, _ in running[len(kept) :])
    admitted: list[str] = []
    if not preempted:  # else the queue's head is the first preempted request, which did not fit just now
        admitted_rows = 0
        for request_id, rows in waiting:
            if len(kept) + len(admitted) >= max_batch or not fits(request_id, rows):
                break
            if admitted and max_admit_rows and admitted_rows + rows.verify > max_admit_rows:
                break
            take(request_id, rows)
            admitted.append(request_id)
            admitted_rows += rows.verify
    return Schedule(tuple(kept + admitted), preempted, tuple(admitted), tuple(used), placement, tuple(replica_used))
