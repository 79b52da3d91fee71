"""The placement owner (:class:`PlacementMap`) on its own, and the iteration's plan recorded in it
(:class:`Placement`, over a stand-in for the verifier pool: no replica is called)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from specinfer.core.kv_budget import KVBudget, Replicas, StepRows, schedule
from specinfer.request_manager.cluster.placement_map import PlacementMap
from specinfer.request_manager.scheduling.placement import Placement


def rows(n: int) -> StepRows:
    return StepRows(n, n)


def three_replicas() -> PlacementMap:
    """a: 10 blocks of 16 rows, all free; b: the same, 4 free (6 are another manager's); c: no budget."""
    m = PlacementMap()
    m.join("a", KVBudget(16, 10), free=10)
    m.join("b", KVBudget(16, 10), free=4)
    m.join("c", None, free=0)
    return m


def test_budgets_leave_out_what_other_managers_hold_and_count_our_held_blocks():
    m = three_replicas()
    replicas = ["a", "b", "c"]
    budgets = m.budgets(replicas)
    assert budgets == [KVBudget(16, 10), KVBudget(16, 4), None]
    plan = schedule((), [], [("r1", rows(40)), ("r2", rows(20))], 4, 0, Replicas(tuple(budgets), m.indices(replicas)))
    assert plan.placement == {"r1": 0, "r2": 0}  # the most room once in: a
    m.hold(plan, replicas, budgets, {"r1": 33, "r2": 3})  # after the step: 3 + 1 blocks of ours on a
    m.place({rid: replicas[r] for rid, r in plan.placement.items()})
    assert m.where("r1") == "a" and m.indices(["c", "a"]) == {"r1": 1, "r2": 1}
    m.heard_free("a", 6)  # 10 - our 4: nobody else there
    assert m.budgets(replicas)[0] == KVBudget(16, 10)
    m.heard_free("a", 4)  # 2 more used: another manager's
    assert m.budgets(replicas)[0] == KVBudget(16, 8)


def test_a_request_no_plan_placed_goes_where_the_plan_rule_puts_it_and_stays():
    m = three_replicas()
    m.heard_free("b", 9)
    replicas = ["a", "b", "c"]
    budgets = m.budgets(replicas)
    plan = schedule((), [], [("r1", rows(64))], 4, 0, Replicas(tuple(budgets), {}))
    m.hold(plan, replicas, budgets, {"r1": 60})
    m.place({"r1": "a"})
    # room once its 3 blocks (48 rows) are in: a 10 - 4 (r1's step) - 3 = 3, b 9 - 3 = 6
    assert m.home("cal-1", rows(48), replicas) == "b"
    assert m.home("cal-1", rows(48), ["b", "c"]) == "b"  # placed: stays while b is live
    assert m.home("cal-2", rows(48), replicas) == "a"  # b's room went to cal-1: a (3) before b (3), by index
    assert m.home("r1", rows(1000), replicas) == "a"  # home, however big
    assert m.home("huge", rows(10_000), replicas) in replicas  # no room anywhere: the call still goes somewhere
    assert m.home("x", rows(1), []) is None and m.where("x") is None


def test_a_replica_taken_out_or_gone_loses_its_requests_and_its_counts():
    m = three_replicas()
    m.place({"r1": "a", "r2": "a", "r3": "b"})
    assert m.unplace_from("a") == 2  # taken out: its requests are placed anew, its counts stay
    assert m.where("r1") is None and m.where("r3") == "b" and m.counts_free("a")
    assert m.home("r1", rows(16), ["b", "c"]) == "b"
    assert m.leave("b") == 2  # gone: r1 and r3 with it
    assert m.where("r3") is None and not m.counts_free("b") and m.budgets(["b"]) == [None]
    m.unplace(["nobody"])
    assert m.indices(["a", "b", "c"]) == {}


def test_only_replicas_with_a_budget_have_free_counts_to_refresh():
    m = three_replicas()
    assert not m.counts_free("c")
    assert m.stale(["a", "b", "c"], -1.0) == ["a", "b"]
    assert m.stale(["a", "b", "c"], 60.0) == []


class Pool:
    """The verifier pool as :class:`Placement` sees it: live replicas, free counts, releases."""

    def __init__(self, placement_map: PlacementMap, live: Sequence[str]) -> None:
        self.placement_map = placement_map
        self._live = list(live)
        self.released: list[list[str]] = []

    def live(self) -> list[str]:
        return list(self._live)

    async def refresh_free(self, max_age: float) -> None:
        pass

    async def release(self, request_ids: Sequence[str]) -> None:
        self.released.append(list(request_ids))
        self.placement_map.unplace(request_ids)


def test_a_plan_that_moves_a_request_releases_it_on_its_old_replica_then_places_it():
    m = PlacementMap()
    m.join("a", KVBudget(16, 10), free=10)
    m.join("b", KVBudget(16, 10), free=6)  # 4 blocks are another manager's
    pool = Pool(m, ["a", "b"])
    placement = Placement(pool, 0.5)  # type: ignore[arg-type]  # the pool's part of Verifiers

    async def body() -> None:
        placed = await placement.plan([], [("r1", rows(32)), ("r2", rows(32))], {"r1": 30, "r2": 30}, (), 4, 0)
        assert placed is not None
        await placement.place(*placed)
        assert (m.where("r1"), m.where("r2"), pool.released) == ("a", "a", [])
        m.heard_free("a", 0)  # another manager took all of a but our 4 blocks: r2 no longer fits there
        placed = await placement.plan([("r1", rows(40)), ("r2", rows(40))], [], {"r1": 38, "r2": 38}, (), 4, 0)
        assert placed is not None and placed[0].placement == {"r1": 0, "r2": 1}
        await placement.place(*placed)
        assert (m.where("r1"), m.where("r2"), pool.released) == ("a", "b", [["r2"]])

    asyncio.run(body())
