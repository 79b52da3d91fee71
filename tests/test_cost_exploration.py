"""A cost model seeded wrong recovers (issue 37, item 5): a start-up calibration taken while other processes
loaded makes every tree look five times as expensive as a root alone, so the planner never speculates and
no real step ever measures a tree to correct it. Every ``PlannerConfig.explore_costs`` iterations the plan
is made on the optimistic copy of the model (:meth:`specinfer.core.costs.StepCosts.optimistic`): sizes no
real call measured, up to twice the largest measured, cost what the measured size below costs; a real step
then measures one, and a call faster than its bucket says corrects it at once. Simulated against a known
true cost (a flat verify, as a GPU or a CPU with AMX has), with a negative control: without exploration the
skewed table steers the whole run."""

from __future__ import annotations

import numpy as np

from specinfer.core.adaptive import AdaptiveSpeculation, Context
from specinfer.core.costs import CostTable, StepCosts, VerifyShape
from specinfer.core.planner import PlannerConfig

CONTEXT = 100


def true_verify(tokens: int) -> float:
    return 0.100 + 0.0005 * tokens


def skewed() -> StepCosts:
    """Measured under load: every tree five times a root's cost (the root itself right)."""
    verify = CostTable({1: true_verify(1), **{b: 5 * true_verify(b) for b in (2, 4, 8, 16, 32, 64)}})
    return StepCosts(verify, 0.0, {0: CostTable({1: 0.002, 32: 0.003})})


def run(config: PlannerConfig, steps: int) -> tuple[list[int], AdaptiveSpeculation]:
    """``steps`` iterations of one request, each verifying the planned tree's nodes at their true cost."""
    adaptive = AdaptiveSpeculation(skewed(), config, {0: (0.6, 0.2, 0.05)})
    planned = []
    for _ in range(steps):
        choices = adaptive.plan([Context("a", CONTEXT, 10_000, (0,))])
        nodes = choices["a"].budget.nodes if "a" in choices else 1
        planned.append(nodes)
        if "a" in choices:
            depth = choices["a"].budget.depth
            adaptive.observe_draft(0, 2, 0.002)
            adaptive.observe_verify(VerifyShape(nodes, nodes * (CONTEXT + 1)), true_verify(nodes) + 0.0 * depth)
        else:
            adaptive.observe_verify(VerifyShape(1, CONTEXT + 1), true_verify(1))
    return planned, adaptive


def test_a_skewed_calibration_steers_the_run_without_exploration():
    planned, _ = run(PlannerConfig(explore_costs=0), 64)
    assert planned == [1] * 64


def test_the_planner_recovers_from_a_skewed_calibration_within_a_few_dozen_steps():
    planned, adaptive = run(PlannerConfig(), 64)
    assert planned[:7] == [1] * 7  # the skewed table rules trees out at first
    late = planned[40:]
    assert min(late) >= 8, planned  # by step 40 every plan speculates with real trees
    # the buckets the run measured now say what steps take (within 10 %)
    table = adaptive.costs.verify_table
    measured = table.buckets[table.measured()]
    assert len(measured) >= 4
    for b in measured:
        assert np.isclose(table(b), true_verify(int(b)), rtol=0.1), (b, table(b))


def test_the_optimistic_copy_lowers_only_unmeasured_buckets_one_doubling_past_the_measured():
    table = CostTable({1: 1.0, 2: 3.0, 4: 3.0, 8: 3.0})
    assert np.array_equal(table.optimistic().seconds, table.seconds)  # nothing measured: the seed
    table.observe(1, 1.0)
    copy = table.optimistic()
    assert copy.measured().tolist() == table.measured().tolist() == [True] + [False] * 5  # buckets 1, 2, 3, 4, 6, 8
    assert copy(2) == 1.0 and copy(4) == table(4)  # bucket 2 lowered; 4 is past twice the largest measured
    assert table(2) == 3.0  # the model itself is unchanged
    copy.observe(2, 1.0)
    assert not table.measured()[1]


def test_a_fresh_bucket_follows_real_calls_at_once_and_a_stall_is_clipped_and_averaged_out():
    table = CostTable({1: 1.0, 2: 3.0})
    table.observe(2, 2.0)  # faster than the seed's 3.0 on a bucket no call measured: taken at once
    assert np.isclose(table.seconds[1], 2.0)
    slower = CostTable({1: 1.0, 2: 1.0})
    slower.observe(2, 1.7)  # slower than the seed (an optimistic calibration, an extrapolation): taken at once too
    assert np.isclose(slower.seconds[1], 1.7)
    stalled = CostTable({1: 1.0, 2: 1.0})
    stalled.observe(2, 100.0)  # a stall: clipped to twice the prediction
    assert np.isclose(stalled.seconds[1], 2.0)
    for _ in range(3):
        stalled.observe(2, 1.0)  # then the running mean of the calls that measured it
    assert np.isclose(stalled.seconds[1], 1.25)
