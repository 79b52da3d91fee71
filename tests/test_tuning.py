"""The tree-configuration tuner: its arithmetic, its prediction against the real engine, its CLI."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.acceptance import nondecreasing
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import load_backend
from specinfer.tuning import PAPER_EXPANSION, TUNING_FILE, resolve_expansion
from specinfer.tuning.measure import greedy_continuations, ssm_ranks
from specinfer.tuning.model import (
    CostModel,
    configs,
    frontier_sizes,
    hit_table,
    mean_tokens_per_step,
    num_nodes,
    search,
    tokens_per_step,
    walk,
)

ranks_st = st.lists(st.integers(0, 5), min_size=1, max_size=60).map(lambda xs: np.array(xs, dtype=np.int64))
widths_st = st.lists(st.integers(1, 4), min_size=1, max_size=6)


@given(ranks_st, widths_st)
def test_walk_consumes_every_token_and_each_step_commits_at_most_depth_plus_one(ranks, widths):
    tokens, steps = walk(ranks, widths)
    assert tokens == len(ranks)
    assert -(-len(ranks) // (len(widths) + 1)) <= steps <= len(ranks)


@given(ranks_st, widths_st, widths_st)
def test_wider_trees_never_take_more_steps(ranks, a, b):
    depth = min(len(a), len(b))
    wide = [max(x, y) for x, y in zip(a[:depth], b[:depth], strict=True)]
    assert walk(ranks, wide)[1] <= walk(ranks, a[:depth])[1]


def test_walk_by_hand():
    # <1,1>: step 1 accepts ranks 0,0 and the bonus covers position 2; step 2 at t=3 accepts
    # nothing (rank 2), its bonus covers position 3; step 3 accepts position 4
    assert walk(np.array([0, 0, 5, 2, 0]), [1, 1]) == (5, 3)
    assert walk(np.array([0, 0, 5, 2, 0]), [1, 3]) == (5, 3)
    assert walk(np.array([0, 0, 5, 2, 0]), [1, 1, 6]) == (5, 2)  # depth 3 takes rank 5 under width 6
    assert walk(np.array([1, 0, 0]), [1, 1]) == (3, 2)
    assert walk(np.array([1, 0, 0]), [2, 1]) == (3, 1)


@settings(max_examples=50)
@given(st.lists(ranks_st, min_size=1, max_size=4), widths_st)
def test_fast_estimate_matches_the_mean_over_start_positions(rank_lists, widths):
    depth, width = len(widths), 4
    hits = hit_table(rank_lists, depth, width)
    expected = []
    for ranks in rank_lists:
        for t in range(len(ranks)):
            d = 0
            while d < depth and t + d < len(ranks) and ranks[t + d] < widths[d]:
                d += 1
            expected.append(d)
    assert mean_tokens_per_step(hits, widths) == pytest.approx(1 + np.mean(expected))


def test_config_enumeration_respects_the_budget():
    found = list(configs(max_depth=4, max_width=3, max_nodes=12))
    assert len(found) == len(set(found))
    assert all(num_nodes(w) <= 12 and 1 <= len(w) <= 4 and max(w) <= 3 for w in found)
    brute = [w for d in range(1, 5) for w in np.ndindex(*(3,) * d)]
    assert len(found) == sum(num_nodes([x + 1 for x in w]) <= 12 for w in brute)
    assert (
        num_nodes(ExpansionConfig.parse(PAPER_EXPANSION).widths)
        == ExpansionConfig.parse(PAPER_EXPANSION).max_nodes
        == 21
    )
    assert frontier_sizes((1, 1, 3, 1)) == [1, 1, 1, 3]


@given(st.lists(st.floats(0, 10), min_size=1, max_size=30))
def test_nondecreasing_fit(values):
    fit = nondecreasing(values)
    assert len(fit) == len(values)
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(fit))
    assert sum(fit) == pytest.approx(sum(values))  # pooling keeps block means
    if values == sorted(values):
        assert fit == pytest.approx(values)


def test_nondecreasing_by_hand():
    assert nondecreasing([0.33, 0.58, 0.52, 0.74, 0.75]) == pytest.approx([0.33, 0.55, 0.55, 0.74, 0.75])


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel(verify={1: 1.0, 3: 2.0}, draft={1: 0.1, 2: 0.2}, overhead=0.5)
    assert cost.step_seconds(()) == pytest.approx(1.5)
    # <1,1>: 3 nodes -> 2.0; SSM passes over frontiers [1, 1] -> 0.2
    assert cost.step_seconds((1, 1)) == pytest.approx(2.0 + 0.2 + 0.5)
    assert CostModel._interp({1: 1.0, 3: 2.0}, 2) == pytest.approx(1.5)
    assert CostModel._interp({1: 1.0, 3: 2.0}, 5) == pytest.approx(3.0)


def test_search_prefers_cheap_trees_when_verification_grows_with_size():
    rng = np.random.default_rng(0)
    ranks = [rng.choice(4, size=200, p=[0.7, 0.15, 0.1, 0.05]) for _ in range(5)]
    flat = CostModel(verify={1: 1.0, 256: 1.0}, draft={1: 0.0, 256: 0.0})
    steep = CostModel(verify={1: 1.0, 256: 50.0}, draft={1: 0.0, 256: 0.0})
    best_flat = search(ranks, flat, 6, 3, 64)
    best_steep = search(ranks, steep, 6, 3, 64)
    assert best_flat == sorted(best_flat, key=lambda c: -c.tokens_per_second)
    assert num_nodes(best_flat[0].widths) > num_nodes(best_steep[0].widths)
    assert best_flat[0].tokens_per_step >= best_steep[0].tokens_per_step


def test_predicted_tokens_per_step_equal_the_engine(model_pair):
    """The tuner's exact walk predicts the engine's greedy tokens per step on a real pair."""
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native")
    ssm = load_backend(model_pair.ssm, "ssm", "float32", backend="native")
    prompts = [tuple(p) for p in model_pair.prompts[:4]]
    new_tokens = 24
    continuations = greedy_continuations(llm, ssm, prompts, new_tokens)
    ranks = [ssm_ranks(ssm, p, c) for p, c in zip(prompts, continuations, strict=True)]
    assert all(len(r) == new_tokens for r in ranks)
    for text in ("1,1,1,1", PAPER_EXPANSION, "2,2,1", "3,1,2"):
        widths = ExpansionConfig.parse(text).widths
        engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=4))
        spec = SpeculationConfig(ExpansionConfig(widths))
        reqs = [
            GenerationRequest(f"{text}-{i}", p, new_tokens, SamplingParams(), spec, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        results = engine.generate(reqs)
        assert [r.output_tokens for r in results] == continuations
        steps = sum(len(r.steps) for r in results)
        assert tokens_per_step(ranks, widths) == pytest.approx(len(prompts) * new_tokens / steps), text


def test_resolve_expansion(tmp_path):
    assert resolve_expansion("2,2,1") == "2,2,1"
    assert resolve_expansion("tuned", [tmp_path]) == PAPER_EXPANSION
    (tmp_path / TUNING_FILE).write_text(json.dumps({"pick": {"expansion": "1,2,1"}}))
    assert resolve_expansion("tuned", [tmp_path]) == "1,2,1"
    assert resolve_expansion(f"@{tmp_path / TUNING_FILE}") == "1,2,1"
    with pytest.raises(InvalidArgument) as err:
        resolve_expansion(f"@{tmp_path / 'missing.json'}")
    assert err.value.field == "expansion"


def test_tune_cli_writes_a_pick_and_installs_it(model_pair, tmp_path):
    ssm = tmp_path / "ssm"
    shutil.copytree(model_pair.ssm, ssm)  # --install writes into the SSM folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": "def f(x):\n    return x"[: 8 + i]}) + "\n" for i in range(4)))
    out = tmp_path / "tuning.json"
    cmd = [
        sys.executable,
        "-m",
        "specinfer.cli",
        "tune",
        "--llm",
        str(model_pair.llm),
        "--ssm",
        str(ssm),
        "--prompts",
        str(prompts),
    ]
    cmd += [
        "--count",
        "3",
        "--offset",
        "0",
        "--new-tokens",
        "12",
        "--max-depth",
        "4",
        "--max-width",
        "2",
        "--max-nodes",
        "12",
        "--reps",
        "1",
        "--threads",
        "1",
    ]
    proc = subprocess.run([*cmd, "--out", str(out), "--install"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    pick = result["pick"]
    assert num_nodes(ExpansionConfig.parse(pick["expansion"]).widths) <= 12
    assert pick["tokens_per_second"] >= max(c["tokens_per_second"] for c in result["top"]) - 1e-9
    assert set(result["cost"]["verify_seconds"]) >= {"1", "12"}
    assert resolve_expansion("tuned", [ssm]) == pick["expansion"]
    bad = subprocess.run([*cmd, "--max-nodes", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "max-nodes" in bad.stderr
