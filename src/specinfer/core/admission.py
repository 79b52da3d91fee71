"""A driver's requests between iterations: the running batch and the queue, written once for both drivers
(the in-process engine and the request manager's scheduler; the step loop: docs/architecture.md, "The step
loop").

*Running* requests are in the batch, in admission order (oldest first); *waiting* ones are in the queue, in
the order they will be admitted: new ones at the tail, preempted ones back at the head. Each iteration the
driver plans admission (:func:`~specinfer.core.kv_budget.schedule`, or the request manager's placement)
over :meth:`Admission.demand` and applies the plan with :meth:`Admission.admit`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from typing import Generic, TypeVar

from specinfer.core.iteration import Running
from specinfer.core.kv_budget import Schedule, StepRows

R = TypeVar("R", bound=Running)
Demand = list[tuple[str, StepRows]]  # (request ID, its step rows), in batch or queue order


class Admission(Generic[R]):
    """The running requests (``running``, by request ID) and the waiting ones (``waiting``); see the module
    docstring. Drivers read both; they change them only through these methods."""

    def __init__(self) -> None:
        self.running: dict[str, R] = {}  # in admission order, oldest first
        self.waiting: deque[R] = deque()

    def __len__(self) -> int:
        """Requests running or waiting."""
        return len(self.running) + len(self.waiting)

    def __iter__(self) -> Iterator[R]:
        """The running requests, then the waiting ones."""
        yield from self.running.values()
        yield from self.waiting

    def batch(self) -> list[R]:
        """The running requests, oldest first: an iteration's batch."""
        return list(self.running.values())

    def enqueue(self, request: R) -> None:
        """``request`` waits at the tail of the queue."""
        self.waiting.append(request)

    def get(self, request_id: str) -> R | None:
        """The running or waiting request with ``request_id``, or None."""
        found = self.running.get(request_id)
        if found is None:
            found = next((w for w in self.waiting if w.request_id == request_id), None)
        return found

    def is_queued(self, request_id: str) -> bool:
        return any(w.request_id == request_id for w in self.waiting)

    def remove(self, request: R) -> None:
        """``request`` leaves the batch or the queue (finished, cancelled, moved); nothing if it is in neither."""
        self.running.pop(request.request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)

    def demand(self, step_rows: Callable[[R], StepRows]) -> tuple[Demand, Demand]:
        """What an admission plan is made of: the running requests' and the waiting ones' step rows."""
        return (
            [(rid, step_rows(r)) for rid, r in self.running.items()],
            [(w.request_id, step_rows(w)) for w in self.waiting],
        )

    def admit(self, plan: Schedule) -> list[R]:
        """Apply ``plan`` (:func:`admit`): the preempted requests go back to the
        head of the queue, the admitted prefix of the queue joins the batch. Returns the preempted ones (the
        driver releases their caches)."""
        return admit(self.running, self.waiting, plan)


def admit(active: MutableMapping[str, R], waiting: deque[R], plan: Schedule) -> list[R]:
    """Apply an admission plan: the preempted requests leave ``active`` for the head of ``waiting``
    (in their order, keeping their output), then the admitted prefix of ``waiting`` joins ``active``.
    Returns the preempted ones (their caches must be released)."""
    back = [active.pop(rid) for rid in plan.preempted]
    waiting.extendleft(reversed(back))
    for rid in plan.admitted:
        request = waiting.popleft()  # schedule admits a prefix of the queue
        if request.request_id != rid:
            raise AssertionError(f"admitted {rid!r} is not at the head of the queue ({request.request_id!r})")
        active[rid] = request
    return back
