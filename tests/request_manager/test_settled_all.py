"""settled_all: gather(..., return_exceptions=True) of the manager's per-worker, per-replica and per-SSM calls, a lone
call awaited in place: the same results, exceptions and cancellations as gather."""

from __future__ import annotations

import asyncio

import pytest

from specinfer.request_manager.cluster.failover import settled_all


async def value(x: int) -> int:
    await asyncio.sleep(0)
    return x


async def fails(message: str) -> int:
    await asyncio.sleep(0)
    raise ValueError(message)


async def cancelled_inside() -> int:
    """A call whose own awaitable is cancelled (as a gRPC call cancelled by its channel), not the task awaiting it."""
    inner = asyncio.get_running_loop().create_future()
    inner.cancel()
    return await inner


def kinds(parts: list) -> list:
    """Each part's value, or its exception's type."""
    return [type(x) if isinstance(x, BaseException) else x for x in parts]


def test_results_and_exceptions_come_back_in_order_as_gather_gives_them():
    async def run() -> None:
        for make in (lambda: value(3), lambda: fails("no"), cancelled_inside):  # one call
            assert kinds(await settled_all([make()])) == kinds(await asyncio.gather(make(), return_exceptions=True))
        several = lambda: [fails("a"), cancelled_inside(), value(5)]  # noqa: E731
        got, want = await settled_all(several()), await asyncio.gather(*several(), return_exceptions=True)
        assert kinds(got) == kinds(want) == [ValueError, asyncio.CancelledError, 5]

    asyncio.run(run())


def test_a_lone_call_runs_in_the_awaiting_task():
    async def run() -> None:
        outer = asyncio.current_task()

        async def where() -> bool:
            return asyncio.current_task() is outer

        assert await settled_all([where()]) == [True]
        assert await settled_all([where(), where()]) == [False, False]  # gather's tasks

    asyncio.run(run())


def test_cancelling_the_awaiting_task_cancels_the_lone_call_and_propagates():
    async def run() -> None:
        started, finished = asyncio.Event(), []

        async def slow() -> int:
            started.set()
            try:
                await asyncio.sleep(10)
            finally:
                finished.append(True)
            return 1

        task = asyncio.create_task(settled_all([slow()]))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True]

    asyncio.run(run())
