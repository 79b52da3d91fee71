"""bench/common.py's reading of a Prometheus histogram between two scrapes: the quantile Prometheus'
``histogram_quantile`` would give (linear within the bucket holding it), of the observations made between them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import histogram_quantile  # bench/ is no package: its folder on the path

NAME = "specinfer_cost_model_verify_error_ratio"


def _buckets(counts: dict[str, float]) -> dict[str, float]:
    return {f"{NAME}_bucket{{le={le}}}": c for le, c in counts.items()} | {f"{NAME}_count{{}}": max(counts.values())}


def test_the_median_of_the_observations_between_two_scrapes():
    before = _buckets({"0.1": 4, "0.2": 4, "+Inf": 4})  # four observations before the row: not the row's
    after = _buckets({"0.1": 6, "0.2": 12, "+Inf": 12})  # the row: 2 at or under 0.1, 6 in (0.1, 0.2]
    assert histogram_quantile(before, after, NAME, 0.5) == pytest.approx(0.1 + 0.1 * (4 - 2) / 6)
    assert histogram_quantile(before, after, NAME, 0.25) == pytest.approx(0.1 * 2 / 2)


def test_no_observation_is_none_and_the_last_bucket_gives_its_lower_bound():
    scrape = _buckets({"0.1": 3, "+Inf": 3})
    assert histogram_quantile(scrape, scrape, NAME, 0.5) is None
    assert histogram_quantile({}, _buckets({"0.1": 0, "+Inf": 5}), NAME, 0.5) == 0.1
