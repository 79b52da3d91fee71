"""A driver's running batch and waiting queue (:class:`specinfer.core.admission.Admission`), which both
drivers keep through it: admission plans are made of its demand and applied to it."""

from __future__ import annotations

from specinfer.core.admission import Admission
from specinfer.core.iteration import Running
from specinfer.core.kv_budget import Schedule, StepRows
from specinfer.core.requests import GenerationRequest


def _running(rid: str, prompt: int = 2) -> Running:
    return Running(GenerationRequest(rid, tuple(range(1, prompt + 1)), 4), seed=0)


def _rows(r: Running) -> StepRows:
    return StepRows(r.committed_len, r.committed_len + 1)


def test_a_plan_from_the_demand_preempts_to_the_head_and_admits_a_prefix() -> None:
    requests: Admission[Running] = Admission()
    a, b, c, d = (_running(x, prompt=n) for x, n in zip("abcd", (1, 2, 3, 4), strict=True))
    for r in (a, b, c, d):
        requests.enqueue(r)
    requests.admit(Schedule(run=("a", "b"), preempted=(), admitted=("a", "b"), blocks_used=()))
    running, waiting = requests.demand(_rows)
    assert running == [("a", _rows(a)), ("b", _rows(b))] and waiting == [("c", _rows(c)), ("d", _rows(d))]
    back = requests.admit(Schedule(run=("a", "c"), preempted=("b",), admitted=("b",), blocks_used=()))
    assert back == [b]  # preempted, then readmitted from the head of the queue: the newest of the batch
    assert requests.batch() == [a, b] and list(requests.waiting) == [c, d]
    assert list(requests) == [a, b, c, d] and len(requests) == 4


def test_lookup_and_removal_span_the_batch_and_the_queue() -> None:
    requests: Admission[Running] = Admission()
    a, b = _running("a"), _running("b")
    requests.enqueue(a)
    requests.enqueue(b)
    requests.admit(Schedule(run=("a",), preempted=(), admitted=("a",), blocks_used=()))
    assert requests.get("a") is a and requests.get("b") is b and requests.get("x") is None
    assert requests.is_queued("b") and not requests.is_queued("a")
    requests.remove(a)
    requests.remove(b)
    requests.remove(b)  # gone already: nothing happens
    assert len(requests) == 0 and not requests and requests.batch() == []
