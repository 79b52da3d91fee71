"""Adaptive speculation (``SpeculationConfig(expansion=None)``) through the in-process engine, on tiny models.

Greedy output must equal transformers' greedy decoding whatever the planner decides; fixed step
costs make the planner's decisions deterministic: where speculation always pays, dynamic trees
are really drafted and verified; where it never pays, no SSM runs at all.
"""

from __future__ import annotations

import pytest
import torch

from specinfer.core import ExpansionConfig
from specinfer.core.costs import CostTable, StepCosts, VerifyShape
from specinfer.core.planner import PlannerConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import load_backend
from specinfer.models.reference import ReferenceBackend
from specinfer.models.tiny import tiny_llama, truncated_copy

VOCAB = 97
NEW_TOKENS = 24
PLANNER = PlannerConfig(max_nodes=8, max_depth=4)
AUTO = SpeculationConfig(None)


def fixed_costs(verify_per_token: float, draft: dict[int, float]) -> StepCosts:
    """A frozen cost model: it ignores the engine's timings, so the plans do not depend on the machine."""
    buckets = (1, 2, 4, 8, 16, 32, 64)
    verify = CostTable({b: 1.0 + verify_per_token * (b - 1) for b in buckets})
    return StepCosts(
        verify, 0.0, {ssm: CostTable({b: seconds for b in buckets}) for ssm, seconds in draft.items()}, frozen=True
    )


def speculation_pays(ssms: int = 2) -> StepCosts:
    """Extra verify tokens and SSM passes are almost free: the planner speculates whenever it can."""
    return fixed_costs(1e-4, {i: 1e-4 for i in range(ssms)})


def speculation_never_pays(ssms: int = 2) -> StepCosts:
    """Every extra verify token costs a whole step, every SSM pass another: no tree can pay."""
    return fixed_costs(1.0, {i: 1.0 for i in range(ssms)})


class CountingLM:
    """A real backend that counts its forward passes and the nodes sent to them."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0
        self.nodes = 0
        self.sizes: list[tuple[int, int]] = []  # (requests, nodes) of each call

    def forward_tree(self, batch):
        self.calls += 1
        self.nodes += sum(len(item.tokens) for item in batch)
        self.sizes.append((len(batch), sum(len(item.tokens) for item in batch)))
        return self.inner.forward_tree(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def models():
    llm = tiny_llama(VOCAB, 32, 3, 4, 2, seed=5)
    return llm, truncated_copy(llm, 1), truncated_copy(llm, 2)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()) for n in (3, 11, 6, 17, 1, 8)]


@pytest.fixture(scope="module")
def expected(models, prompts):
    """transformers' greedy continuation of every prompt (argmax of a full forward, fp32)."""
    llm = models[0]
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = list(p)
            for _ in range(NEW_TOKENS):
                seq.append(int(llm(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p) :])
    return out


@pytest.fixture(scope="module", params=["reference", "native"])
def backends(request, models, tmp_path_factory):
    """A factory of fresh (LLM, [SSM, SSM]) backends of the given kind."""
    if request.param == "reference":
        return lambda: (ReferenceBackend(models[0]), [ReferenceBackend(m) for m in models[1:]])
    root = tmp_path_factory.mktemp("adaptive")
    paths = []
    for name, model in zip(("llm", "ssm", "ssm2"), models, strict=True):
        model.save_pretrained(root / name)
        paths.append(root / name)
    return lambda: tuple(
        (lambda ms: (ms[0], ms[1:]))(
            [load_backend(p, "model", "float32", backend="native", kv_cache_bytes=1 << 24) for p in paths]
        )
    )


def _engine(backends, costs, counting: bool = False, slot_priors=()) -> SpeculativeEngine:
    llm, ssms = backends()
    if counting:
        ssms = [CountingLM(s) for s in ssms]
    return SpeculativeEngine(llm, ssms, EngineConfig(max_batch=16, planner=PLANNER, slot_priors=slot_priors), costs)


def test_adaptive_greedy_equals_transformers_when_speculation_pays(backends, prompts, expected):
    engine = _engine(backends, speculation_pays(), counting=True)
    results = engine.generate(
        [GenerationRequest(f"a{i}", p, NEW_TOKENS, speculation=AUTO, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.output_tokens == exp, f"prompt {i} differs"
        assert sum(s.committed for s in res.steps) == NEW_TOKENS
        assert all(s.tree_size <= PLANNER.max_nodes for s in res.steps)
    steps = [s for r in results for s in r.steps]
    assert sum(s.tree_size > 2 for s in steps) > len(steps) // 2, "dynamic trees were drafted"
    assert sum(s.accepted for s in steps) > 0 and NEW_TOKENS * len(prompts) / len(steps) > 1.5, "and accepted"
    assert engine.ssms[0].calls > 0  # the default SSM set is (0,)
    assert engine.ssms[1].calls == 0
    assert not engine.llm.cached_requests()
    totals = engine.adaptive.totals
    assert totals.speculative_steps > 0 and totals.drafted > 0 and totals.position_accepted[0] > 0


def test_adaptive_never_speculating_is_incremental_decoding(backends, prompts, expected):
    engine = _engine(backends, speculation_never_pays(), counting=True)
    spec = SpeculationConfig(None, ssms=(0, 1))
    results = engine.generate(
        [GenerationRequest(f"n{i}", p, NEW_TOKENS, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    for res, exp in zip(results, expected, strict=True):
        assert res.output_tokens == exp
        assert all(s.tree_size == 1 for s in res.steps)
        assert len(res.steps) == NEW_TOKENS
    assert engine.ssms[0].calls == engine.ssms[1].calls == 0, "no SSM forward when speculation does not pay"


def test_mixed_batch_of_adaptive_static_and_plain_requests(backends, prompts, expected):
    engine = _engine(backends, speculation_pays(), counting=True)
    specs = [
        AUTO,
        SpeculationConfig(ExpansionConfig((2, 1, 1))),
        None,
        SpeculationConfig(None, ssms=(0, 1)),
        SpeculationConfig(None, ssms=(1,)),
        None,
    ]
    requests = [
        GenerationRequest(f"m{i}", p, NEW_TOKENS, speculation=s, ignore_eos=True)
        for i, (p, s) in enumerate(zip(prompts, specs, strict=True))
    ]
    engine.add(requests[0])
    engine.add(requests[1])
    done = {}
    for step in range(500):
        if step == 2:  # continuous batching: the rest join mid-way
            for r in requests[2:]:
                engine.add(r)
        for res in engine.step():
            done[res.request_id] = res
        if not engine.has_work:
            break
    for r, exp in zip(requests, expected, strict=True):
        assert done[r.request_id].output_tokens == exp, f"{r.request_id} ({r.speculation}) differs"
    for i in (2, 5):
        assert all(s.tree_size == 1 for s in done[f"m{i}"].steps)
    assert any(s.tree_size == 7 for s in done["m1"].steps)  # the static tree at full size
    for i in (0, 3, 4):
        assert any(s.tree_size > 1 for s in done[f"m{i}"].steps)
    assert engine.ssms[1].calls > 0, "a request allowing only SSM 1 drafts with it"


@pytest.mark.parametrize("cheap", [0, 1])
def test_planner_picks_the_ssm_that_pays(backends, prompts, expected, cheap):
    """Two SSMs allowed, one of them far too slow to pay: only the other drafts."""
    draft = {cheap: 1e-4, 1 - cheap: 1e3}
    engine = _engine(backends, fixed_costs(1e-4, draft), counting=True)
    spec = SpeculationConfig(None, ssms=(0, 1))
    results = engine.generate(
        [
            GenerationRequest(f"p{i}", p, NEW_TOKENS, speculation=spec, ignore_eos=True)
            for i, p in enumerate(prompts[:3])
        ]
    )
    for res, exp in zip(results, expected[:3], strict=True):
        assert res.output_tokens == exp
    assert engine.ssms[cheap].calls > 0 and engine.ssms[1 - cheap].calls == 0
    assert any(s.tree_size > 1 for r in results for s in r.steps)


@pytest.mark.parametrize("prior", ["default", "unsure"])
@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_no_drafting_past_the_token_budget(backends, prompts, expected, max_new, prior):
    """The bonus token always comes: a request with n tokens to go drafts at most n - 1 deep, so
    max_new_tokens 1 never drafts and 2 drafts one depth (one SSM pass) per step at most. An unsure
    prior makes the first plans bushy: more nodes than tokens to go."""
    priors = ((0.3, 0.25, 0.2, 0.15), (0.3, 0.25, 0.2, 0.15)) if prior == "unsure" else ()
    engine = _engine(backends, speculation_pays(), counting=True, slot_priors=priors)
    for i, p in enumerate(prompts):
        before = engine.ssms[0].calls
        res = engine.generate([GenerationRequest(f"b{i}", p, max_new, speculation=AUTO, ignore_eos=True)])[0]
        calls = engine.ssms[0].calls - before
        assert res.output_tokens == expected[i][:max_new]
        # at most one step has n tokens to go for each n: passes <= sum over steps of (remaining - 1)
        remaining, passes = max_new, 0
        for s in res.steps:
            passes += remaining - 1
            remaining -= s.committed
        assert calls <= passes
        if max_new == 1:
            assert calls == 0 and res.steps[0].tree_size == 1
        if max_new == 2:
            assert calls <= 1
    if max_new > 1:
        assert engine.ssms[0].calls > 0, "the requests did speculate"


def test_calibration_times_every_bucket_in_rounds_and_releases_its_requests(backends):
    """Start-up calibration: every bucket up to the limit, each call carrying exactly its n nodes
    (spread over at most CALIBRATION_REQUESTS requests), a warm-up round plus the timed rounds, and
    no synthetic request left in any cache afterwards."""
    from specinfer.core.costs import BUCKETS
    from specinfer.engine.calibrate import CALIBRATION_REQUESTS, calibrate_costs, time_sizes

    llm, ssms = backends()
    counted = CountingLM(llm)
    sizes = [1, 3, 6, 12]
    seconds = time_sizes(counted, sizes, repeats=2)
    assert sorted(seconds) == sizes and all(s > 0 for s in seconds.values())
    assert [n for _, n in counted.sizes] == sizes * 3, "one warm-up round and two timed rounds, sizes interleaved"
    assert [r for r, _ in counted.sizes] == [min(n, CALIBRATION_REQUESTS) for n in sizes] * 3
    assert not llm.cached_requests()

    messages = []
    costs = calibrate_costs(llm, ssms, max_verify_tokens=16, max_frontier_tokens=8, repeats=1, progress=messages.append)
    assert list(costs.verify_table.as_dict()) == [b for b in BUCKETS if b <= 16]
    assert sorted(costs.drafts) == [0, 1] and all(
        list(t.as_dict()) == [b for b in BUCKETS if b <= 8] for t in costs.drafts.values()
    )
    assert any("verify: 1 tokens" in m for m in messages)
    for model in (llm, *ssms):
        assert not model.cached_requests()


def test_calibration_fits_a_kv_pool_of_one_request(tmp_path, models):
    """A model whose KV pool holds one request (a batch-1 deployment) still calibrates, the
    per-context cost included (its short- and long-context calls then take turns)."""
    from specinfer.engine.calibrate import calibrate_costs

    models[0].save_pretrained(tmp_path / "llm")
    slots = load_backend(tmp_path / "llm", "llm", "float32", backend="native", kv_cache_bytes=1 << 24).max_requests
    llm = load_backend(
        tmp_path / "llm", "llm", "float32", backend="native", kv_cache_bytes=(1 << 24) // slots
    )  # room for one slot
    assert llm.max_requests == 1
    costs = calibrate_costs(llm, (), max_verify_tokens=8, repeats=1, progress=lambda msg: None)
    assert costs.verify_seconds(VerifyShape(8, 0)) > 0 and costs.per_context >= 0
    assert not llm.cached_requests()
