"""The head gate (:mod:`specinfer.core.head_gate`): per batch-size bucket it measures steps with and without
the draft head, keeps the arm with more committed tokens per second, explores the other now and then, and
never scores a block's first step; and in the engine, a head whose drafting costs more than it returns is
switched off while greedy output stays exact."""

from __future__ import annotations

import pytest

from specinfer.core.head_gate import HeadGate, HeadGateConfig, bucket


def run(gate: HeadGate, batch: int, steps: int, rate_on: float, rate_off: float) -> list[bool]:
    """``steps`` steps of ``batch`` requests, each committing ``batch`` tokens in the time its arm's rate gives."""
    arms = []
    for _ in range(steps):
        on = gate.decide(batch)
        gate.observe(batch, on, batch, batch / (rate_on if on else rate_off))
        arms.append(on)
    return arms


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_measures_on_then_off_then_keeps_the_faster_and_explores():
    cfg = HeadGateConfig(block=4, explore_every=5)
    gate = HeadGate(cfg)
    arms = run(gate, 1, 4 * 13, rate_on=10.0, rate_off=5.0)
    blocks = [arms[i] for i in range(0, len(arms), 4)]
    assert all(arms[i] == arms[i - i % 4] for i in range(len(arms)))  # an arm holds for its block
    assert blocks[:3] == [True, True, False]  # measured first: on (two blocks at batch 1), then off
    # then on, except every 5th decided block, which explores off again
    assert blocks[3:] == [True, True, True, True, False, True, True, True, True, False]
    on, off = gate.rates(1)
    assert on == pytest.approx(10.0) and off == pytest.approx(5.0)


def test_switches_off_where_the_head_does_not_pay_and_per_bucket():
    gate = HeadGate(HeadGateConfig(block=4, explore_every=100))
    big = run(gate, 16, 40, rate_on=30.0, rate_off=40.0)  # above first_on_max_batch: measured off first
    assert big[:12] == [False] * 8 + [True] * 4 and big[12:] == [False] * 28
    small = run(gate, 1, 40, rate_on=12.0, rate_off=8.0)  # another bucket, measured on its own: on first
    assert small[:12] == [True] * 8 + [False] * 4 and small[12:] == [True] * 28
    late = HeadGate(HeadGateConfig(block=4, explore_every=100))
    assert run(late, 16, 40, rate_on=50.0, rate_off=40.0)[12:] == [True] * 28  # where the head pays at 16: on


def test_a_blocks_first_step_is_not_scored():
    """Its tokens come from the trees the step before drafted, under the other arm."""
    gate = HeadGate(HeadGateConfig(block=3))
    assert gate.decide(1)
    gate.observe(1, True, 1000, 1.0)  # the first step: ignored
    assert gate.rates(1) == (0.0, 0.0)
    assert gate.decide(1)
    gate.observe(1, True, 5, 1.0)
    assert gate.rates(1) == (pytest.approx(5.0), 0.0)


def test_a_change_of_bucket_starts_a_block():
    gate = HeadGate(HeadGateConfig(block=4))
    run(gate, 1, 2, 10.0, 5.0)
    assert gate.decide(4)  # a new bucket (at most first_on_max_batch: on first), from a fresh block
    gate.observe(4, True, 1000, 1.0)  # its first step: not scored
    assert gate.rates(4) == (0.0, 0.0)


def test_measure_off_always_asks():
    gate = HeadGate(HeadGateConfig(measure=False))
    assert run(gate, 16, 30, rate_on=1.0, rate_off=100.0) == [True] * 30


def test_invalid_config():
    with pytest.raises(ValueError):
        HeadGateConfig(block=1)
    with pytest.raises(ValueError):
        HeadGateConfig(memory=0.0)


def test_a_new_bucket_measures_first_what_the_nearest_smaller_bucket_prefers():
    gate = HeadGate(HeadGateConfig(block=4, explore_every=100))
    run(gate, 1, 12, rate_on=20.0, rate_off=10.0)  # batch 1: the head wins
    assert run(gate, 16, 12, rate_on=10.0, rate_off=20.0) == [True] * 8 + [False] * 4  # so 9-16 tries it first
    gate = HeadGate(HeadGateConfig(block=4, explore_every=100))
    run(gate, 2, 12, rate_on=10.0, rate_off=20.0)  # batch 2: the head loses
    assert run(gate, 4, 8, rate_on=10.0, rate_off=20.0) == [False] * 8  # so 3-4 measures without it first


def test_a_narrow_win_at_a_smaller_bucket_measures_a_larger_one_without_the_head_first():
    """With ``first_on_margin``, on must have won at the smaller bucket by the margin to be measured first above it:
    speculation's return shrinks as the batch grows, and the losing arm measured first costs two blocks."""
    config = HeadGateConfig(block=4, explore_every=100, first_on_margin=0.1)
    gate = HeadGate(config)
    run(gate, 8, 12, rate_on=21.0, rate_off=20.0)  # batch 8: on wins by 5 %
    assert run(gate, 16, 12, rate_on=10.0, rate_off=20.0) == [False] * 8 + [True] * 4  # so 9-16 measures off first
    gate = HeadGate(config)
    run(gate, 8, 12, rate_on=24.0, rate_off=20.0)  # by 20 %
    assert run(gate, 16, 8, rate_on=24.0, rate_off=20.0) == [True] * 8
    with pytest.raises(ValueError):
        HeadGateConfig(first_on_margin=-0.1)
