"""Logit processing and draft sampling."""

from __future__ import annotations

import numpy as np
import pytest

from specinfer.core import SamplingParams, draw_without_replacement, process_logits, sparsify, top_k_tokens
from specinfer.core.sampling import sample


def test_greedy_is_one_hot_argmax():
    p = process_logits(np.array([[0.1, 3.0, 2.0], [5.0, 5.0, 1.0]]), SamplingParams())
    assert np.array_equal(p, [[0, 1, 0], [1, 0, 0]])


def test_temperature_top_k_top_p():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0)), [0.5, 0.25, 0.15, 0.1])
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0, top_k=2)), [2 / 3, 1 / 3, 0, 0])
    # top_p keeps the smallest prefix reaching the mass: 0.5 + 0.25 >= 0.7
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)), [2 / 3, 1 / 3, 0, 0])
    assert np.allclose(
        process_logits(logits, SamplingParams(temperature=1.0, top_p=0.76)), np.array([0.5, 0.25, 0.15, 0]) / 0.9
    )
    hot = process_logits(logits, SamplingParams(temperature=2.0))
    assert np.allclose(hot, np.sqrt([0.5, 0.25, 0.15, 0.1]) / np.sqrt([0.5, 0.25, 0.15, 0.1]).sum())


def test_sample_draws_what_numpy_choice_draws():
    """``sample`` is numpy's ``Generator.choice`` with weights, without its checks: the same index and the
    same stream after it, for every seed (seeded outputs do not change with the shortcut)."""
    cases = np.random.default_rng(7)
    for _ in range(3000):
        weights = cases.random(int(cases.integers(1, 40))) ** 3  # unnormalised, some near zero
        weights[cases.integers(0, weights.size, size=int(cases.integers(0, 3)))] = 0.0
        if weights.sum() == 0:
            continue
        seed = int(cases.integers(0, 1 << 62))
        ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
        assert sample(weights, ours) == int(theirs.choice(weights.size, p=weights / weights.sum()))
        assert ours.random() == theirs.random()


@pytest.mark.slow
def test_sparsify_and_draw_without_replacement_distribution():
    probs = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    q = sparsify(probs, 3)
    assert q.tokens.tolist() == [0, 1, 2] and np.isclose(q.probs.sum(), 1.0)
    rng = np.random.default_rng(0)
    firsts, seconds = np.zeros(5), np.zeros(5)
    n = 20000
    for _ in range(n):
        a, b = draw_without_replacement(q, 2, rng)
        assert a != b
        firsts[a] += 1
        seconds[b] += 1
    assert np.allclose(firsts[:3] / n, q.probs, atol=0.015)
    qp = q.probs
    expected_second = [sum(qp[i] * qp[j] / (1 - qp[i]) for i in range(3) if i != j) for j in range(3)]
    assert np.allclose(seconds[:3] / n, expected_second, atol=0.015)


def test_top_k_tokens_orders_best_first():
    assert top_k_tokens(np.array([0.1, 0.9, 0.5, 0.9]), 3) == [1, 3, 2]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    from specinfer.core import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
