"""KV budgets: which requests run an iteration when KV memory, not the batch size, is the limit.

Terms:

- *KV budget* of one model: ``blocks`` KV blocks of ``block_size`` token rows (a *KV block* as in
  :mod:`specinfer.kernels.metadata`). A contiguous KV slot per request is the case of one block per
  request: ``block_size`` is the slot's rows and ``blocks`` the number of slots.
- *Step rows* of a request: the KV rows it may hold in every model during its next step, its
  committed tokens (prompt and output so far) plus the most tree nodes the step may add
  (:func:`step_rows`). It needs ``ceil(step rows / block_size)`` blocks of each budget.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specinfer.core.drafts import merged_tree_nodes
from specinfer.core.requests import GenerationRequest


@dataclass(frozen=True)
class KVBudget:
    """One model's KV memory: ``blocks`` KV blocks of ``block_size`` token rows (see the module docstring)."""

    block_size: int
    blocks: int

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.blocks < 0:
            raise ValueError(f"invalid KV budget {self}")

    def blocks_for(self, rows: int) -> int:
        """KV blocks that hold ``rows`` token rows."""
        return -(-rows // self.block_size)

    def holds(self, rows: int) -> bool:
        """Whether the whole budget holds ``rows`` token rows (of one request alone)."""
        return self.blocks_for(rows) <= self.blocks


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


def step_rows(request: GenerationRequest, committed: int, num_ssms: int, adaptive_max_nodes: int) -> int:
    """The most KV rows ``request`` may hold in any model during its next step, with ``committed``
    tokens (prompt and output so far) behind it: those, plus its tree's most nodes. A static tree of
    several SSMs is merged (:func:`~specinfer.core.drafts.merged_tree_nodes`); an adaptive one has at
    most ``adaptive_max_nodes`` (the planner's limit); without speculation the tree is the root."""
    spec = request.speculation
    if spec is None or num_ssms == 0:
        nodes = 1
    elif spec.expansion is None:
        nodes = adaptive_max_nodes
    else:
        nodes = merged_tree_nodes(spec.expansion, len(spec.ssms))
    return committed + nodes


def schedule(budgets: Sequence[KVBudget], running: Sequence[tuple[str, int]], waiting: Sequence[tuple[str, int]], max_batch: int) -> Schedule:
    """Decide an iteration's requests (module docstring). ``running``: (request ID, step rows) of the
    running requests, oldest first; ``waiting``: the same of the waiting ones, in queue order;
    ``max_batch``: most requests an iteration runs. With no budgets, only ``max_batch`` limits.

    Raises ValueError when the oldest running request does not fit alone (a request the driver
    should have refused)."""
    used = [0] * len(budgets)

    def fits(rows: int) -> bool:
        return all(u + b.blocks_for(rows) <= b.blocks for u, b in zip(used, budgets, strict=True))

    def take(rows: int) -> None:
        for i, b in enumerate(budgets):
            used[i] += b.blocks_for(rows)

    kept: list[str] = []
    for request_id, rows in running:
        if len(kept) >= max_batch or not fits(rows):
            break
        take(rows)
        kept.append(request_id)
    if running and not kept:
        raise ValueError(f"request {running[0][0]!r} needs {running[0][1]} KV rows, more than a KV budget holds ({list(budgets)})")
    preempted = tuple(request_id for request_id, _ in running[len(kept) :])
    admitted: list[str] = []
    if not preempted:  # else the queue's head is the first preempted request, which did not fit just now
        for request_id, rows in waiting:
            if len(kept) + len(admitted) >= max_batch or not fits(rows):
                break
            take(rows)
            admitted.append(request_id)
    return Schedule(tuple(kept + admitted), preempted, tuple(admitted), tuple(used))
