"""The KV admission rule (specinfer.core.kv_budget): which requests run, which are preempted, which
join, when KV blocks are the limit. Unit cases, then hypothesis properties over random budgets and
queues checked against a direct reading of the rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core.drafts import ExpansionConfig
from specinfer.core.kv_budget import KVBudget, Overfull, Replicas, StepRows, schedule, step_rows
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import GenerationRequest, SpeculationConfig


def R(rows: int, draft: int | None = None) -> StepRows:
    """Step rows: ``rows`` in the LLM's cache, ``draft`` (default the same) in an SSM's."""
    return StepRows(rows, rows if draft is None else draft)


def test_blocks_round_up():
    b = KVBudget(block_size=16, blocks=10)
    assert [b.blocks_for(r) for r in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        KVBudget(0, 4)


def test_admits_in_order_while_blocks_last():
    budget = KVBudget(4, 10)  # 40 rows
    s = schedule(
        [budget], [], [("a", R(12)), ("b", R(16)), ("c", R(8)), ("d", R(4))], max_batch=8
    )  # 3 + 4 + 2 + 1 blocks
    assert s.run == s.admitted == ("a", "b", "c", "d") and s.preempted == () and s.blocks_used == (10,)
    s = schedule(
        [budget], [], [("a", R(12)), ("b", R(16)), ("c", R(8)), ("d", R(5))], max_batch=8
    )  # d needs 2: 11 > 10
    assert s.run == ("a", "b", "c") and s.blocks_used == (9,)
    assert schedule([budget], [], [("a", R(12)), ("b", R(16)), ("c", R(8))], max_batch=2).run == ("a", "b")


def test_first_come_first_served_a_long_request_is_not_passed_over():
    s = schedule([KVBudget(4, 10)], [("a", R(20))], [("long", R(24)), ("short", R(4))], max_batch=8)
    assert s.run == ("a",) and s.admitted == ()  # 5 + 6 > 10: the short one waits behind the long one


def test_growing_requests_preempt_the_newest():
    budget = KVBudget(4, 10)
    s = schedule(
        [budget], [("old", R(16)), ("mid", R(12)), ("new", R(8))], [("waiting", R(4))], max_batch=8
    )  # 4 + 3 + 2 + 1
    assert s.run == ("old", "mid", "new", "waiting") and s.admitted == ("waiting",) and s.blocks_used == (10,)
    s = schedule(
        [budget], [("old", R(20)), ("mid", R(16)), ("new", R(8))], [("waiting", R(4))], max_batch=8
    )  # 5 + 4, then new needs 2
    assert s.run == ("old", "mid") and s.preempted == ("new",) and s.admitted == () and s.blocks_used == (9,)
    s = schedule(
        [budget], [("old", R(24)), ("mid", R(24)), ("new", R(1))], [], max_batch=8
    )  # 6, then mid needs 6: new goes too
    assert s.run == ("old",) and s.preempted == ("mid", "new")


def test_every_budget_must_hold_the_request():
    small_blocks, few_slots = KVBudget(4, 100), KVBudget(2048, 2)  # e.g. a paged LLM and an SSM with 2 slots
    s = schedule([small_blocks, few_slots], [("a", R(10))], [("b", R(10)), ("c", R(10))], max_batch=8)
    assert s.run == ("a", "b") and s.blocks_used == (6, 2)


def test_max_batch_and_no_budgets():
    assert schedule([], [("a", R(10**9))], [("b", R(1)), ("c", R(1))], max_batch=2).run == ("a", "b")


def test_oldest_must_fit_alone():
    s = schedule([KVBudget(4, 2)], [("a", R(9))], [], max_batch=4)
    assert isinstance(s, Overfull) and s.request_id == "a" and "'a'" in str(s)


def test_step_rows_by_speculation():
    prompt = (1, 2, 3)
    plain = GenerationRequest("a", prompt, 8)
    adaptive = GenerationRequest("b", prompt, 8, speculation=SpeculationConfig(None, ssms=(0,)))
    static = GenerationRequest("c", prompt, 8, speculation=SpeculationConfig(ExpansionConfig((1, 1, 3)), ssms=(0, 1)))
    planner = PlannerConfig(max_nodes=32, max_depth=8)
    assert step_rows(plain, 10, 2, planner) == StepRows(11, 11)
    # the LLM verifies at most 32 nodes; the SSM may expand 1 + 8 passes x 31 nodes
    assert step_rows(adaptive, 10, 2, planner) == StepRows(42, 10 + 1 + 8 * 31)
    # the LLM verifies two SSMs' <1,1,3> trees merged; each SSM expands its own
    assert step_rows(static, 10, 2, planner) == StepRows(10 + 1 + 2 * 5, 10 + 6)
    assert step_rows(adaptive, 10, 0, planner) == StepRows(11, 11)  # no SSM: no tree


def test_admission_per_iteration_is_capped_past_the_first():
    queue = [("a", R(300)), ("b", R(300)), ("c", R(300)), ("d", R(5000))]
    assert schedule([], [], queue, max_batch=8, max_admit_rows=700).admitted == ("a", "b")
    assert schedule([], [("r", R(10))], queue[3:], max_batch=8, max_admit_rows=700).admitted == (
        "d",
    )  # the first always fits the cap
    assert schedule([], [], queue, max_batch=8).admitted == ("a", "b", "c", "d")  # 0: no cap


def test_a_draft_budget_counts_draft_rows():
    llm, ssm = KVBudget(16, 10), KVBudget(16, 10, drafts=True)
    rows = StepRows(verify=40, draft=100)
    assert (llm.needs(rows), ssm.needs(rows)) == (3, 7)
    s = schedule([llm, ssm], [], [("a", rows), ("b", rows)], max_batch=8)
    assert s.run == ("a",) and s.blocks_used == (3, 7)  # b would need 14 of the SSM's 10 blocks


budgets_st = st.lists(st.builds(KVBudget, st.integers(1, 16), st.integers(0, 64), st.booleans()), max_size=3)
rows_st = st.builds(lambda v, extra: StepRows(v, v + extra), st.integers(1, 200), st.integers(0, 100))
queue_st = st.lists(rows_st, max_size=12)


@settings(max_examples=300, deadline=None)
@given(budgets_st, queue_st, queue_st, st.integers(1, 10), st.sampled_from([0, 50, 300]))
def test_schedule_follows_the_rule(budgets, running_rows, waiting_rows, max_batch, cap):
    running = [(f"r{i}", rows) for i, rows in enumerate(running_rows)][:max_batch]
    waiting = [(f"w{i}", rows) for i, rows in enumerate(waiting_rows)]
    if running and not all(b.holds(running[0][1]) for b in budgets):
        assert isinstance(schedule(budgets, running, waiting, max_batch, cap), Overfull)
        return
    s = schedule(budgets, running, waiting, max_batch, cap)
    rows = dict(running + waiting)

    def used(ids):
        return tuple(sum(b.needs(rows[r]) for r in ids) for b in budgets)

    def fits(ids):
        return all(u <= b.blocks for u, b in zip(used(ids), budgets, strict=True)) and len(ids) <= max_batch

    # kept running requests are a prefix (oldest first), preempted ones the rest, in order
    k = len(s.run) - len(s.admitted)
    assert s.run[:k] == tuple(r for r, _ in running[:k]) and s.preempted == tuple(r for r, _ in running[k:])
    # admitted requests are a prefix of the queue, and only when nothing was preempted
    assert s.admitted == tuple(r for r, _ in waiting[: len(s.admitted)])
    assert not (s.preempted and s.admitted)
    # what runs fits every budget, and the blocks are counted right
    assert fits(s.run) and s.blocks_used == used(s.run)
    # the admitted requests' rows stay within the cap, past the first
    admitted_rows = [rows[r].verify for r in s.admitted]
    assert not cap or len(admitted_rows) <= 1 or sum(admitted_rows) <= cap
    # maximal: the next request in line (the first preempted, else the next waiting) would not fit
    # (KV, batch or, for a waiting one after others were admitted, the cap)
    line = [r for r, _ in running[k:]] or [r for r, _ in waiting[len(s.admitted) :]]
    if line:
        capped = bool(cap and s.admitted and sum(admitted_rows) + rows[line[0]].verify > cap)
        assert capped or not fits((*s.run, line[0]))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(4, 40), st.lists(st.integers(1, 30), min_size=1, max_size=8))
def test_requests_that_grow_all_finish_in_order_of_arrival(block_size, extra_blocks, lengths):
    """Simulate the drivers: each iteration every running request grows by a token until it reaches
    its length; preempted requests go back to the head of the queue. With a budget that holds the
    longest request alone, everything finishes, and requests start for the first time in arrival order."""
    longest = max(lengths) + 1
    budget = KVBudget(block_size, -(-longest // block_size) + extra_blocks // block_size)
    grown = dict.fromkeys(range(len(lengths)), 0)
    waiting, running, started, finished = list(range(len(lengths))), [], [], []
    for _ in range(10_000):
        if not waiting and not running:
            break
        s = schedule(
            [budget],
            [(str(r), R(grown[r] + 1)) for r in running],
            [(str(w), R(grown[w] + 1)) for w in waiting],
            max_batch=4,
        )
        preempted = [int(r) for r in s.preempted]
        admitted = [int(r) for r in s.admitted]
        running = [int(r) for r in s.run]
        waiting = preempted + [w for w in waiting if w not in admitted]
        started += [r for r in admitted if r not in started]
        for r in list(running):
            grown[r] += 1
            if grown[r] == lengths[r]:
                running.remove(r)
                finished.append(r)
    assert sorted(finished) == list(range(len(lengths)))
    assert started == sorted(started)


def test_replicas_place_new_requests_on_the_most_free_and_keep_running_ones_home():
    two = Replicas((KVBudget(4, 10), KVBudget(4, 6)))  # 40 and 24 rows
    s = schedule([], [], [("a", R(12)), ("b", R(12)), ("c", R(8)), ("d", R(4))], 8, replicas=two)
    # blocks left once in: a 7 vs 3 -> 0; b 4 vs 3 -> 0; c 2 vs 4 -> 1; d 3 vs 3, a tie -> the lower index
    assert s.placement == {"a": 0, "b": 0, "c": 1, "d": 0} and s.replica_blocks_used == (7, 2)
    # sticky: a running request stays on its replica while it fits there, even when the other has more room
    s = schedule([], [("a", R(12)), ("b", R(4))], [], 8, replicas=Replicas(two.budgets, {"a": 1, "b": 1}))
    assert s.placement == {"a": 1, "b": 1} and s.replica_blocks_used == (0, 4)
    # one that outgrew its replica moves to one with room instead of being preempted
    s = schedule(
        [], [("a", R(28)), ("b", R(8))], [], 8, replicas=Replicas(two.budgets, {"a": 1, "b": 1})
    )  # 7 blocks > 6
    assert s.run == ("a", "b") and s.preempted == () and s.placement == {"a": 0, "b": 1}
    # no replica has room: preempted; a request placed on a replica that is gone (index past the end) is placed anew
    s = schedule(
        [], [("a", R(36)), ("b", R(24)), ("c", R(8))], [], 8, replicas=Replicas(two.budgets, {"a": 0, "b": 1, "c": 5})
    )
    assert s.run == ("a", "b") and s.preempted == ("c",)
    # replicas that report no budget: the rows placed are balanced
    s = schedule([], [], [("a", R(30)), ("b", R(10)), ("c", R(10)), ("d", R(5))], 8, replicas=Replicas((None, None)))
    assert s.placement == {"a": 0, "b": 1, "c": 1, "d": 1} and s.replica_blocks_used == (30, 25)
    # the other budgets (SSM caches) still hold every request
    s = schedule([KVBudget(4, 5, drafts=True)], [], [("a", R(12)), ("b", R(12))], 8, replicas=two)
    assert s.run == ("a",) and s.blocks_used == (3,)
    with pytest.raises(ValueError):
        Replicas(())


replica_budgets_st = st.lists(
    st.one_of(st.none(), st.builds(KVBudget, st.integers(1, 16), st.integers(0, 64))), min_size=1, max_size=3
)


@settings(max_examples=300, deadline=None)
@given(replica_budgets_st, queue_st, queue_st, st.integers(1, 10), st.data())
def test_schedule_places_every_request_within_its_replica(replica_budgets, running_rows, waiting_rows, max_batch, data):
    running = [(f"r{i}", rows) for i, rows in enumerate(running_rows)][:max_batch]
    waiting = [(f"w{i}", rows) for i, rows in enumerate(waiting_rows)]
    homes = {rid: data.draw(st.integers(-1, len(replica_budgets)), label=rid) for rid, _ in running}
    replicas = Replicas(tuple(replica_budgets), {rid: r for rid, r in homes.items() if r >= 0})

    def holds(b: KVBudget | None, rows: StepRows) -> bool:
        return b is None or b.holds(rows)

    if running and not any(holds(b, running[0][1]) for b in replica_budgets):
        assert isinstance(schedule([], running, waiting, max_batch, replicas=replicas), Overfull)
        return
    s = schedule([], running, waiting, max_batch, replicas=replicas)
    rows = dict(running + waiting)
    assert set(s.placement) == set(s.run) and all(0 <= r < len(replica_budgets) for r in s.placement.values())
    for r, b in enumerate(replica_budgets):  # every replica holds the requests placed on it
        on = [rid for rid in s.run if s.placement[rid] == r]
        assert s.replica_blocks_used[r] == sum(b.needs(rows[rid]) if b is not None else rows[rid].verify for rid in on)
        assert b is None or s.replica_blocks_used[r] <= b.blocks
    for rid, home in homes.items():  # a running request stays home whenever it fits there with the older ones
        if rid in s.placement and 0 <= home < len(replica_budgets) and replica_budgets[home] is None:
            assert s.placement[rid] == home
    # maximal: the next request in line fits on no replica next to what runs (unless the batch is full)
    k = len(s.run) - len(s.admitted)
    line = [r for r, _ in running[k:]] or [r for r, _ in waiting[len(s.admitted) :]]
    if line and len(s.run) < max_batch:
        nxt = rows[line[0]]
        assert not any(
            b is None or s.replica_blocks_used[r] + b.needs(nxt) <= b.blocks for r, b in enumerate(replica_budgets)
        )
