"""The engine core's pieces that need no model: applying an admission plan, and running a coroutine
that never suspends. Its step is exercised through both drivers by the engine and service tests."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from specinfer.core.engine_core import admit, run_to_end
from specinfer.core.iteration import Running
from specinfer.core.kv_budget import Schedule
from specinfer.core.requests import GenerationRequest


def _running(rid: str) -> Running:
    return Running(GenerationRequest(rid, (1, 2), 4), seed=0)


def test_admit_requeues_the_preempted_at_the_head_then_admits_a_prefix() -> None:
    a, b, c, d = (_running(x) for x in "abcd")
    active = {"a": a, "b": b}
    waiting = deque([c, d])
    back = admit(active, waiting, Schedule(run=("a", "b", "c"), preempted=("b",), admitted=("b", "c"), blocks_used=()))
    assert back == [b]
    assert list(active) == ["a", "b", "c"] and list(waiting) == [d]


def test_admit_refuses_a_plan_that_skips_the_head_of_the_queue() -> None:
    active: dict[str, Running] = {}
    waiting = deque([_running("a"), _running("b")])
    with pytest.raises(AssertionError, match="not at the head"):
        admit(active, waiting, Schedule(run=("b",), preempted=(), admitted=("b",), blocks_used=()))


def test_run_to_end_returns_what_a_coroutine_without_suspension_returns() -> None:
    async def add(x: int) -> int:
        async def inner() -> int:
            return x + 1

        return await inner()

    assert run_to_end(add(1)) == 2


def test_run_to_end_refuses_a_coroutine_that_suspends() -> None:
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="suspended"):
        run_to_end(waits())
